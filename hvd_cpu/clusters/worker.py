"""What a cluster's worker (a Spark task, a Ray actor) does with its rank: starts it as a
process of its own (clusters/rank.py) on the worker's rows, its output relayed to the driver,
and says how it ended. Horovod, its signal handling and a failing rank's exit stay out of the
worker's own process, which the engine reuses for later work.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pandas as pd
import psutil

from hvd_cpu.clusters.relay import Link
from hvd_cpu.runtime.failure import FAILURES, failure_record_in

FOLDER_PREFIX = "hvd-cpu-rank-"  # then the worker's pid: a rank's folder, in the temporary one


class RankEnd(NamedTuple):
    """How a rank's process ended: its rank, exit code, clusters/rank.py's outcome (pickled)
    and the failure the rank left (runtime/failure.py's record), each None when there is none."""

    rank: int
    code: int
    outcome: bytes | None
    failure: bytes | None


def run_rank(
    rank: int, job: bytes, own: list[pd.DataFrame], env: dict[str, str], link: Link | None
) -> RankEnd:
    """Run rank `rank` of `job` (config and the user's code, pickled) on the rows `own` holds
    in a process with `env` (Horovod's, from runtime/horovod.py's gloo_environment) and wait
    for it. The rows are written for it and let go: `own` is emptied, so that no caller's frame
    keeps them while the rank trains. Its output goes through `link`, or (None) to this
    process's own stdout and stderr."""
    _sweep_orphans(Path(tempfile.gettempdir()))
    with tempfile.TemporaryDirectory(prefix=f"{FOLDER_PREFIX}{os.getpid()}-") as folder:
        (Path(folder) / "job.pkl").write_bytes(job)
        own.pop().to_pickle(Path(folder) / "rows.pkl")
        code = _start(folder, env, link)
        outcome = Path(folder) / "outcome.pkl"
        return RankEnd(
            rank,
            code,
            outcome.read_bytes() if outcome.exists() else None,
            failure_record_in(Path(folder)),
        )


def _sweep_orphans(temporary: Path) -> None:
    """Remove the folders of workers killed under their ranks (Ray kills a lost worker's
    children with it, Spark a lost executor's Python workers), which nobody else removes. A
    folder names its worker's pid: one whose worker has ended, or started since it last
    changed (its pid given to another process), is an orphan."""
    for folder in temporary.glob(f"{FOLDER_PREFIX}*-*"):
        pid = folder.name.removeprefix(FOLDER_PREFIX).partition("-")[0]
        if not pid.isdigit():
            continue
        try:
            orphaned = psutil.Process(int(pid)).create_time() > folder.stat().st_mtime
        except psutil.NoSuchProcess:
            orphaned = True
        except (psutil.Error, OSError):  # another user's, or gone meanwhile
            continue
        if orphaned:
            shutil.rmtree(folder, ignore_errors=True)


def _start(folder: str, env: dict[str, str], link: Link | None) -> int:
    """The rank's process, its output relayed; its exit code."""
    env = {**os.environ, **env, FAILURES: folder, "PYTHONUNBUFFERED": "1"}
    piped = subprocess.PIPE if link else None
    with subprocess.Popen(
        [sys.executable, "-m", "hvd_cpu.clusters.rank", folder],
        stdin=subprocess.DEVNULL,
        stdout=piped,
        stderr=piped,
        env=env,
    ) as process:
        copies = link.relay(process) if link else []
        code = process.wait()
        for copy in copies:
            copy.join()
    return code


def import_check(names: tuple[str, ...]) -> Callable[..., tuple[str, list[str]]]:
    """A function that says which Python runs it and what of `names` that Python cannot import
    (with why). Nested, so that Spark and Ray ship it by value: a worker whose Python lacks
    hvd-cpu runs it too."""

    def check(*_: Any) -> tuple[str, list[str]]:
        import importlib
        import sys as system

        missing = []
        for name in names:
            try:
                importlib.import_module(name)
            except Exception as exc:
                missing.append(f"{name} ({type(exc).__name__}: {exc})")
        return system.executable, missing

    return check


def address_towards(host: str) -> str:
    """This machine's address on the network towards `host` (the driver), where the other
    workers reach it too (an engine's own name for a worker's host may resolve nowhere else)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # a datagram socket's connect sends nothing: it routes
        return probe.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The network interface holding `address`."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.address == address for entry in addresses):
            return name
    return None
