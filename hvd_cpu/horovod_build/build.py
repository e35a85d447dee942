"""Build Horovod 0.28.1, patched, for the torch of this environment; cache the wheel; install it.

Horovod's last release does not build against current PyTorch, new Pythons, new compilers or
a CUDA build of torch without a GPU toolkit; the patches beside this file fix each (their names
say what). A wheel is built once per Horovod version, torch version, Python, MPI and patch set
(its cache key) and kept in the cache folder, so a second install takes seconds. Nothing is
installed or cached until a whole wheel exists: a failed or interrupted build leaves nothing
that a later run would trust.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

from hvd_cpu.horovod_build.patching import PatchError, apply
from hvd_cpu.horovod_build.pypi_mpi import environment_mpi, install_mpi
from hvd_cpu.horovod_build.toolchain import (
    OPEN_MPI_LINE,
    InstallError,
    Mpi,
    Say,
    Torch,
    check_python,
    check_python_headers,
    find_build_tools,
    find_compiler,
    find_mpi,
    find_torch,
    last_line,
)

HOROVOD_VERSION = "0.28.1"
SDIST_SHA256 = "92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0"
PATCHES = Path(__file__).parent / "patches"
RECORD_FILE = "hvd_cpu_build.py"  # written into the built horovod package: what it was built for
BUILD_FREE_BYTES = 2 << 30  # the build tree with its objects, and the wheel
# Both controllers' tensor operations stay their own (Gloo's under the MPI controller crash);
# HOROVOD_CPU_ONLY (the cpu-only-with-cuda-torch patch) builds no GPU code against CUDA torch,
# and without NVTX a CUDA toolkit on the machine adds no CUDA headers or profiling hooks.
BUILD_FLAGS = {
    "HOROVOD_WITH_PYTORCH": "1",
    "HOROVOD_WITH_GLOO": "1",
    "HOROVOD_WITHOUT_TENSORFLOW": "1",
    "HOROVOD_WITHOUT_MXNET": "1",
    "HOROVOD_CPU_ONLY": "1",
    "HOROVOD_WITHOUT_NVTX": "1",
}


def default_cache() -> Path:
    """HVD_CPU_CACHE, else the XDG cache folder."""
    if os.environ.get("HVD_CPU_CACHE"):
        return Path(os.environ["HVD_CPU_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hvd-cpu"


def patch_files() -> list[Path]:
    return sorted(PATCHES.glob(f"horovod-{HOROVOD_VERSION}-*.patch"))


@dataclass(frozen=True)
class Plan:
    """What to build: for which torch, Python and MPI, with which patches and flags."""

    torch: Torch
    python: str  # the ABI tag, cp311
    mpi: Mpi | None

    @property
    def flags(self) -> dict[str, str]:
        return BUILD_FLAGS | (
            {"HOROVOD_WITH_MPI": "1"} if self.mpi else {"HOROVOD_WITHOUT_MPI": "1"}
        )

    @property
    def recipe(self) -> str:
        """A digest of the patches and flags: a change to either is a new build."""
        digest = hashlib.sha256(json.dumps(sorted(self.flags.items())).encode())
        for patch in patch_files():
            digest.update(patch.name.encode() + b"\0" + patch.read_bytes())
        return digest.hexdigest()[:12]

    @property
    def key(self) -> str:
        mpi = self.mpi.tag if self.mpi else "gloo-only"
        return (
            f"horovod-{HOROVOD_VERSION}-torch{self.torch.version}-{self.python}-{mpi}-{self.recipe}"
        )

    def record(self) -> dict[str, object]:
        return {
            "key": self.key,
            "horovod": HOROVOD_VERSION,
            "torch": self.torch.version,
            "python": self.python,
            "mpi": str(self.mpi) if self.mpi else None,
            "patches": [p.name for p in patch_files()],
        }

    def controllers(self) -> str:
        return f"PyTorch, Gloo and MPI ({self.mpi})" if self.mpi else "PyTorch and Gloo (no MPI)"


def plan(mpi: bool = True) -> tuple[Plan, str]:
    """The build this environment needs as it is, and why it has no MPI (empty if it has): the
    Open MPI from PyPI in this environment, else the machine's. Installs nothing."""
    check_python()
    if not mpi:
        found, why_not = None, "MPI left out (--without-mpi or HVD_CPU_WITHOUT_MPI=1)"
    elif found := environment_mpi():
        why_not = ""
    else:
        found, why_not = find_mpi()
    python = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return Plan(find_torch(), python, found), why_not


def installed_record() -> dict[str, object] | None:
    """What the Horovod in this environment says it was built for (None: not ours, or none)."""
    spec = importlib.util.find_spec("horovod")
    if spec is None or not spec.submodule_search_locations:
        return None
    record = Path(next(iter(spec.submodule_search_locations))) / RECORD_FILE
    try:
        text = record.read_text()
        return ast.literal_eval(text.split("BUILD = ", 1)[1])
    except (OSError, IndexError, ValueError, SyntaxError):
        return None


def install(
    cache: Path | None = None, mpi: bool = True, rebuild: bool = False, say: Say = print
) -> Plan:
    """Make this environment's Horovod the patched build for its torch (build it if no cached
    wheel fits) and check that it imports with the controllers it should have."""
    cache = cache or default_cache()
    wanted, why_no_mpi = plan(mpi)
    say(f"torch {wanted.torch.version} ({wanted.torch.build}), Python {sys.version.split()[0]}")
    not_installed = ""
    if mpi and wanted.mpi is None:
        pypi, not_installed = install_mpi()
        wanted = replace(wanted, mpi=pypi)
    say(_which_mpi(wanted.mpi, why_no_mpi, not_installed))
    if not rebuild and (installed_record() or {}).get("key") == wanted.key and _works(wanted):
        _check_mpi4py(wanted.mpi)
        say(f"Horovod {HOROVOD_VERSION} is up to date: {wanted.controllers()}")
        return wanted
    wheel = None if rebuild else cached_wheel(cache, wanted)
    if wheel is None:
        wheel = build(cache, wanted, say)
    say(f"installing {wheel}")
    # Replaced in one pip transaction (the old one stays if it fails), then its dependencies.
    _pip("install", "--force-reinstall", "--no-deps", str(wheel))
    _pip("install", str(wheel))
    if not _works(wanted):
        raise InstallError(
            f"Horovod from {wheel.parent} installed, but does not import with "
            f"{wanted.controllers()}; delete that folder and rerun"
        )
    _check_mpi4py(wanted.mpi)
    _fill_build_check_cache()
    say(f"Horovod {HOROVOD_VERSION} ready: {wanted.controllers()}")
    return wanted


def _which_mpi(mpi: Mpi | None, why_not_the_machine_s: str, not_installed: str) -> str:
    """One line: which Open MPI Horovod gets and why, or why none."""
    if mpi and not mpi.pypi_bin:
        return f"MPI: {mpi}, this machine's"
    if mpi and not why_not_the_machine_s:
        return f"MPI: {mpi}, in this environment ({Path(mpi.pypi_bin).parent})"
    if mpi:
        where = Path(mpi.pypi_bin).parent
        return f"MPI: {mpi}, installed into this environment ({where}): {why_not_the_machine_s}"
    gloo_only = (
        "Horovod has Gloo only (horovodrun --gloo), without horovodrun --mpi, mpirun and "
        "--allreduce direct"
    )
    if not not_installed:
        return f"{why_not_the_machine_s}: {gloo_only}"
    return (
        f"no MPI: {why_not_the_machine_s}, and {not_installed}; until then {gloo_only}: rerun "
        f"hvd-cpu install-horovod where PyPI can be reached, or install Open MPI ({OPEN_MPI_LINE})"
    )


def cached_wheel(cache: Path, wanted: Plan) -> Path | None:
    """The wheel built earlier for exactly this plan, if a whole one is there."""
    for wheel in (cache / "wheels" / wanted.key).glob("horovod-*.whl"):
        if zipfile.is_zipfile(wheel):
            return wheel
    return None


def build(cache: Path, wanted: Plan, say: Say) -> Path:
    """Download, patch and build the wheel, then store it in the cache."""
    _check_writable(cache)
    check_python_headers()
    compiler = find_compiler()
    tools = find_build_tools(cache / "tools", say)
    _pip("install", "setuptools", "wheel", "packaging")  # setup.py's own needs
    log = cache / "horovod-build.log"
    with tempfile.TemporaryDirectory(prefix="hvd-cpu-horovod-build-") as work:
        _check_free_space(Path(work))
        tree = _patched_source(_sdist(cache), Path(work), wanted)
        cached = (
            f", through {tools.ccache}: seconds for what it compiled before" if tools.ccache else ""
        )
        say(
            f"building Horovod {HOROVOD_VERSION} with {wanted.controllers()} for torch "
            f"{wanted.torch.version} (about 3 to 5 minutes on 2 cores{cached}); log: {log}"
        )
        env = os.environ | wanted.flags | tools.environment(Path(work)) | {"CXX": compiler}
        if wanted.mpi and wanted.mpi.pypi_bin:  # CMake's FindMPI takes the first mpicxx
            env["PATH"] = f"{wanted.mpi.pypi_bin}{os.pathsep}{env.get('PATH', '')}"
        with log.open("w") as out:
            done = subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                 "--disable-pip-version-check", "-w", str(Path(work) / "dist"), str(tree)],
                stdout=out, stderr=subprocess.STDOUT, env=env, check=False,
            )  # fmt: skip
        if done.returncode != 0:
            raise _build_failure(log)
        return _store(cache, wanted, next((Path(work) / "dist").glob("horovod-*.whl")))


def _sdist(cache: Path) -> Path:
    """Horovod's sdist, from the package index once, then from the cache; checked by hash."""
    folder = cache / "sdist"
    sdist = folder / f"horovod-{HOROVOD_VERSION}.tar.gz"
    if sdist.is_file() and _sha256(sdist) == SDIST_SHA256:
        return sdist
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as download:
        done = _pip(
            "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
            f"horovod=={HOROVOD_VERSION}", "-d", download, check=False,
        )  # fmt: skip
        fetched = Path(download) / sdist.name
        if done.returncode != 0 or not fetched.is_file():
            raise InstallError(
                f"could not download the horovod {HOROVOD_VERSION} sdist from the package "
                f"index ({last_line(done.stderr, 'no sdist')})"
            )
        if _sha256(fetched) != SDIST_SHA256:
            raise InstallError(
                f"the horovod {HOROVOD_VERSION} sdist from the package index is not the "
                f"published one (sha256 differs from {SDIST_SHA256}); check your index"
            )
        fetched.replace(sdist)
    return sdist


def _patched_source(sdist: Path, work: Path, wanted: Plan) -> Path:
    with tarfile.open(sdist) as archive:
        if hasattr(tarfile, "data_filter"):
            archive.extractall(work, filter="data")
        else:  # Python 3.11 before 3.11.4 (Debian 12's 3.11.2); the sdist's hash is checked
            archive.extractall(work)
    tree = work / f"horovod-{HOROVOD_VERSION}"
    for patch in patch_files():
        try:
            apply(patch.read_text(), tree)
        except PatchError as exc:
            raise InstallError(f"{patch.name} does not apply to the sdist: {exc}") from None
    (tree / "horovod" / RECORD_FILE).write_text(
        '"""Written by hvd-cpu\'s Horovod build: what this Horovod was built for."""\n'
        f"BUILD = {wanted.record()!r}\n"
    )
    return tree


def _store(cache: Path, wanted: Plan, wheel: Path) -> Path:
    """Move the wheel into its cache folder in one rename: the folder is whole or absent."""
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{wanted.key}.", dir=wheels))
    shutil.move(str(wheel), partial / wheel.name)
    final = wheels / wanted.key
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    return final / wheel.name


def _build_failure(log: Path) -> InstallError:
    text = log.read_text(errors="replace")
    if "No space left on device" in text:
        return InstallError(
            f"no space left on the device while building (log: {log}); free at least "
            f"{BUILD_FREE_BYTES >> 30} GB in {tempfile.gettempdir()} or set TMPDIR to a "
            "folder with room, then rerun"
        )
    tail = "\n".join(text.splitlines()[-20:])
    print(tail, file=sys.stderr)
    return InstallError(f"the Horovod build failed (last lines above); full log: {log}")


def _check_writable(cache: Path) -> None:
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=cache).close()
    except OSError as exc:
        raise InstallError(
            f"the build cache {cache} is not writable ({exc.strerror}); set HVD_CPU_CACHE "
            "(or --cache) to a folder you can write"
        ) from None


def _check_free_space(work: Path) -> None:
    free = shutil.disk_usage(work).free
    if free < BUILD_FREE_BYTES:
        raise InstallError(
            f"only {free / 2**30:.1f} GB free in {work.parent}, and the build needs about "
            f"{BUILD_FREE_BYTES >> 30} GB; free some or set TMPDIR to a folder with room"
        )


def _works(wanted: Plan) -> bool:
    """Horovod imports beside this torch, with the controllers the plan has."""
    probe = (
        "import horovod.torch as hvd; "
        f"assert hvd.gloo_built() and bool(hvd.mpi_built()) == {wanted.mpi is not None}"
    )
    return (
        subprocess.run([sys.executable, "-c", probe], capture_output=True, check=False).returncode
        == 0
    )


def _check_mpi4py(mpi: Mpi | None) -> None:
    """mpi4py must load the libmpi Horovod links: two MPI libraries in a rank do not work.
    Its wheel takes the environment's (PyPI's Open MPI) before the machine's."""
    if mpi is None:
        return
    probe = (
        "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
        "print(MPI.Get_library_version().splitlines()[0])"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    loaded = done.stdout.strip() or last_line(done.stderr, "mpi4py does not import")
    if not loaded.startswith(f"{mpi.flavor} v{mpi.version}"):
        raise InstallError(
            f"mpi4py here loads another MPI than Horovod's {mpi} ({loaded}); install mpi4py's "
            "wheel, which loads the right one: pip install --force-reinstall mpi4py"
        )


def _fill_build_check_cache() -> None:
    """horovodrun --check-build, once: it fills the answers the fast-build-check patch keeps,
    so that launches do not each fork two processes that import torch."""
    horovodrun = Path(sys.executable).parent / "horovodrun"
    subprocess.run([str(horovodrun), "--check-build"], capture_output=True, check=False)


def _pip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet", *args],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if check and done.returncode != 0:
        last = last_line(done.stderr, f"exit {done.returncode}")
        if "No space left" in done.stderr:
            last = "no space left on the device"
        raise InstallError(f"pip {args[0]} {' '.join(args[1:])} failed: {last}")
    return done


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
