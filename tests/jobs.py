"""Running hvd-cpu for real (as a plain process, under horovodrun or mpirun, or live while a
test acts on it) and reading what a run wrote."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from hvd_cpu.model.networks import Network

BIN = Path(sys.executable).parent
# Minutes of real jobs: launch/test.sh runs them after the main suite
# (pytest -m "not slow and not container").
SLOW = pytest.mark.slow
# A Debian root file system or an image of our own: debootstrap, chroot, buildah and podman.
needs_root_and_apt = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("apt-get"),
    reason="building a Debian root or image here needs root and apt-get (debootstrap, buildah)",
)
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="a mount namespace of its own (unshare --mount) needs root"
)
REPO = Path(__file__).resolve().parent.parent
# Launchers prefix each line a rank prints: horovodrun over Gloo with "[rank]<stdout>:", Open
# MPI's --tag-output (mpirun, horovodrun --mpi) with "[job,rank]<stdout>:"; after a timestamp
# when asked (--prefix-output-with-timestamp, --timestamp-output). Open MPI 5 adds a space.
RANK_PREFIX = re.compile(
    r"^(?P<time>.*?)\[(?:\d+,)?(?P<rank>\d+)\]<(?:stdout|stderr)>: ?(?P<text>.*)$"
)
# The same tag anywhere in a line: Open MPI tags each chunk it forwards from a rank's stream,
# and a chunk may end mid-line (seen as a job ends, after a rank printed epochs by the
# hundred): the next tagged chunk, of any stream, follows on the same line.
RANK_TAG = re.compile(r"\[(?:\d+,)?(?P<rank>\d+)\]<(?P<stream>stdout|stderr)>: ?")


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def rank_lines(self, rank: int | None = None) -> list[tuple[int, str]]:
        """(rank, text) of every line a rank printed, from the launchers' tags; a line that
        came in chunks is put together from its stream's chunks."""
        found = []
        cut: dict[tuple[int, str], str] = {}  # a stream's line so far, cut before its end
        for line in (self.stdout + self.stderr).splitlines():
            tags = list(RANK_TAG.finditer(line))
            for i, tag in enumerate(tags):
                stream = (int(tag["rank"]), tag["stream"])
                if i + 1 < len(tags):  # another chunk follows on this line: this one was cut
                    cut[stream] = cut.get(stream, "") + line[tag.end() : tags[i + 1].start()]
                elif rank is None or stream[0] == rank:
                    found.append((stream[0], cut.pop(stream, "") + line[tag.end() :]))
        return found


def run(
    args: list[str], timeout: float = 300, cwd: Path | None = None, env: dict | None = None
) -> Run:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **(env or {})}
    start = time.monotonic()
    done = subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd, check=False
    )
    return Run(done.returncode, done.stdout, done.stderr, time.monotonic() - start)


def hvd_cpu(*args: str, timeout: float = 300) -> Run:
    """`hvd-cpu ARGS` as a plain process (a job of one)."""
    return run([str(BIN / "hvd-cpu"), *args], timeout=timeout)


def horovodrun(
    np: int,
    *args: str,
    launcher: tuple[str, ...] = (),
    timeout: float = 300,
    controller: str = "gloo",
    env: dict[str, str] | None = None,
) -> Run:
    """`horovodrun --CONTROLLER -np NP [LAUNCHER OPTIONS] hvd-cpu ARGS` on this host; Gloo
    unless asked, the card's shape (plain horovodrun would pick MPI, which is built in)."""
    return run([*horovodrun_command(np, controller, launcher), *args], timeout=timeout, env=env)


def skip_without_mpi() -> None:
    """Skip the calling test where this Horovod has no MPI controller (a Gloo-only build, made
    where Open MPI was not installed) or no mpirun is on the PATH."""
    import horovod.torch as hvd

    if not hvd.mpi_built() or shutil.which("mpirun") is None:
        pytest.skip("this Horovod has no MPI (built where Open MPI was not installed)")


def horovodrun_command(
    np: int,
    controller: str = "gloo",
    launcher: tuple[str, ...] = (),
    program: tuple[str, ...] = (str(BIN / "hvd-cpu"),),
) -> list[str]:
    """The command line of `horovodrun(...)`, up to the program's own arguments (hvd-cpu's,
    unless another `program` is named)."""
    if controller == "mpi":
        skip_without_mpi()
    command = [str(BIN / "horovodrun"), f"--{controller}", "-np", str(np), "--disable-cache"]
    return [*command, *launcher, *program]


def mpirun(np: int, *args: str, timeout: float = 300) -> Run:
    """`mpirun -np NP hvd-cpu ARGS`, as a cluster user would start it (as root here)."""
    return run([*mpirun_command(np), str(BIN / "hvd-cpu"), *args], timeout=timeout)


def mpirun_command(np: int) -> list[str]:
    """The command line of `mpirun(...)`, up to the program."""
    skip_without_mpi()
    command = ["mpirun", "--allow-run-as-root", "--tag-output", "-np", str(np)]
    return [*command, "--oversubscribe", "-mca", "pml", "ob1", "-mca", "btl", "^openib"]


def demo_file(path: Path, rows: int, features: int = 8) -> Path:
    """A demo frame written by `hvd-cpu make-demo-data` itself."""
    made = hvd_cpu("make-demo-data", str(path), "--rows", str(rows), "--features", str(features))
    assert made.returncode == 0, made.stderr
    return path


# A model whose forward pass takes SECONDS: of Python that holds the GIL but for its switch
# interval, as a user's model can (busy), or of sleep (a paced step that leaves the cores free).
SLOW_MODEL = """
import time

import torch


class Model(torch.nn.Module):
    def __init__(self, n_features, n_outputs):
        super().__init__()
        self.layer = torch.nn.Linear(n_features, n_outputs)

    def forward(self, x):
        end = time.monotonic() + {seconds}
        while time.monotonic() < end:
            {wait}
        return self.layer(x)
"""


def slow_model(folder: Path, seconds: float = 3, busy: bool = True) -> str:
    """--model for a model whose every forward pass takes `seconds`, busy or asleep."""
    wait = "pass" if busy else "time.sleep(end - time.monotonic())"
    path = folder / f"slow_model_{round(seconds * 1000)}ms_{'busy' if busy else 'asleep'}.py"
    path.write_text(SLOW_MODEL.format(seconds=seconds, wait=wait))
    return f"{path}:Model"


class LiveJob:
    """A job whose output is read while it runs, each line with the time it came."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None) -> None:
        env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **(env or {})}
        self.process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, pattern: str, timeout: float) -> float:
        """When a line matching `pattern` came; fails if the job ends or time runs out first."""
        deadline = time.monotonic() + timeout
        while True:
            for at, line in list(self.lines):
                if re.search(pattern, line):
                    return at
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"no line matching {pattern!r} in {timeout} s; {self.summary()}")
            time.sleep(0.05)

    def summary(self) -> str:
        """hvd-cpu's and the launcher's own lines, then the last few of everything."""
        start = self.lines[0][0] if self.lines else 0.0
        timed = [f"{at - start:6.1f} s  {line}" for at, line in self.lines]
        ours = [t for t in timed if re.search(r"hvd-cpu|Epoch|Process|error", t)]
        return "the job printed:\n" + "\n".join([*ours, "...", *timed[-15:]])

    def finish(self, timeout: float) -> int:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the job did not end within {timeout} s; {self.summary()}")
        self._reader.join(10)
        return self.process.returncode

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


def metrics(output: Path) -> list[dict]:
    """Every epoch's record in OUTPUT/metrics.jsonl."""
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


# What an epoch's record says of training (not of its timing).
RESULTS = ("epoch", "train_loss", "val_loss", "samples", "lr", "world_size")


def history(output: Path) -> list[dict]:
    """Each epoch's RESULTS in OUTPUT/metrics.jsonl."""
    return [{k: v for k, v in m.items() if k in RESULTS} for m in metrics(output)]


def assert_same_history(got: Path, want: Path) -> None:
    """Two runs' epochs alike: equal but for the train loss of an epoch stopped inside and
    resumed, whose parts are summed in another order (float64's last digits)."""
    resumed, whole = history(got), history(want)
    assert [{**h, "train_loss": 0} for h in resumed] == [{**h, "train_loss": 0} for h in whole]
    assert [h["train_loss"] for h in resumed] == pytest.approx(
        [h["train_loss"] for h in whole], rel=1e-12
    )


def ranks(output: Path) -> list[dict]:
    """OUTPUT/ranks.json: one entry per rank."""
    return json.loads((output / "ranks.json").read_text())


def weights(output: Path) -> dict[str, torch.Tensor]:
    """The exported model's parameters."""
    return torch.load(output / "model.pt", weights_only=True)["state_dict"]


def load_model(output: Path, features: int = 8) -> Network:
    """The exported seed MLP of a run on `features` columns."""
    model = Network(features)
    model.load_state_dict(weights(output))
    return model


def processes_naming(marker: Path | str, grace: float = 0.0) -> list[int]:
    """PIDs of the processes whose command line names `marker` (a run's output folder: its
    horovodrun, shells and ranks), once they are gone or `grace` seconds have passed."""
    deadline = time.monotonic() + grace
    while True:
        pids = [
            process.pid
            for process in psutil.process_iter(["cmdline"])
            if process.pid != os.getpid() and str(marker) in " ".join(process.info["cmdline"] or [])
        ]
        if not pids or time.monotonic() >= deadline:
            return pids
        time.sleep(0.05)


def ccache_counts(printed: str) -> dict[str, int]:
    """`ccache --print-stats`'s counters by name (each line a name, a tab, a count)."""
    pairs = (line.split("\t") for line in printed.splitlines() if "\t" in line)
    return {name: int(count) for name, count in pairs}


def slow_except(values: Iterable[Any], kept: Iterable[Any]) -> list[Any]:
    """Parameters for pytest.mark.parametrize: those in `kept` run in the main suite, the rest
    are marked slow (launch/test.sh runs them after it). Values may be tuples of arguments."""
    kept = list(kept)
    return [
        pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=() if v in kept else SLOW)
        for v in values
    ]
