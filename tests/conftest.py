"""Helpers that run hvd-cpu for real: as a plain process and under horovodrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent
# Launchers prefix each line a rank prints: horovodrun over Gloo with "[rank]<stdout>:", Open
# MPI's --tag-output (mpirun, horovodrun --mpi) with "[job,rank]<stdout>:"; after a timestamp
# when asked (--prefix-output-with-timestamp, --timestamp-output).
RANK_PREFIX = re.compile(
    r"^(?P<time>.*?)\[(?:\d+,)?(?P<rank>\d+)\]<(?:stdout|stderr)>:(?P<text>.*)$"
)


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def rank_lines(self, rank: int | None = None) -> list[tuple[int, str]]:
        """(rank, text) of every line a rank printed, from horovodrun's prefixes."""
        found = []
        for line in (self.stdout + self.stderr).splitlines():
            match = RANK_PREFIX.match(line)
            if match and (rank is None or int(match["rank"]) == rank):
                found.append((int(match["rank"]), match["text"]))
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
) -> Run:
    """`horovodrun --CONTROLLER -np NP [LAUNCHER OPTIONS] hvd-cpu ARGS` on this host; Gloo
    unless asked, the card's shape (plain horovodrun would pick MPI, which is built in)."""
    command = [str(BIN / "horovodrun"), f"--{controller}", "-np", str(np), "--disable-cache"]
    return run([*command, *launcher, str(BIN / "hvd-cpu"), *args], timeout=timeout)


def mpirun(np: int, *args: str, timeout: float = 300) -> Run:
    """`mpirun -np NP hvd-cpu ARGS`, as a cluster user would start it (as root here)."""
    command = ["mpirun", "--allow-run-as-root", "--tag-output", "-np", str(np)]
    command += ["--oversubscribe", "-mca", "pml", "ob1", "-mca", "btl", "^openib"]
    return run([*command, str(BIN / "hvd-cpu"), *args], timeout=timeout)


def demo_file(path: Path, rows: int, features: int = 8) -> Path:
    """A demo frame written by `hvd-cpu make-demo-data` itself."""
    made = hvd_cpu("make-demo-data", str(path), "--rows", str(rows), "--features", str(features))
    assert made.returncode == 0, made.stderr
    return path


@pytest.fixture(scope="session")
def demo_parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4096-row demo frame shared by the integration tests."""
    return demo_file(tmp_path_factory.mktemp("data") / "demo.parquet", rows=4096)


def messy_frame(rows: int = 400, seed: int = 0) -> pd.DataFrame:
    """What users bring: an id, strings with gaps, timestamps, booleans, NaN, a constant,
    an empty column, a category, and a target with a few holes. y depends on most of them."""
    rng = np.random.default_rng(seed)
    size = rng.normal(50, 20, rows)
    size[rng.random(rows) < 0.1] = np.nan
    city = rng.choice(np.array(["Oslo", "Lima", "Pune", None], dtype=object), rows)
    when = pd.Series(pd.Timestamp("2024-01-01") + pd.to_timedelta(rng.integers(0, 365, rows), "D"))
    when[rng.random(rows) < 0.05] = pd.NaT
    flag = rng.random(rows) < 0.3
    grade = pd.Categorical(rng.choice(["a", "b", "c"], rows))
    bump = pd.Series(city).map({"Oslo": 3.0, "Lima": -2.0, "Pune": 0.5}).fillna(0).to_numpy()
    target = 0.05 * np.nan_to_num(size, nan=50) + bump + 2.0 * flag + rng.normal(0, 0.3, rows)
    target[rng.random(rows) < 0.03] = np.nan
    return pd.DataFrame(
        {
            "id": np.arange(rows),
            "size": size,
            "city": city,
            "when": when,
            "flag": flag,
            "grade": grade,
            "constant": 7.0,
            "empty": np.nan,
            "target": target,
        }
    )


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
