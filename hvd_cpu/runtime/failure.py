"""A rank that fails on its own ends the whole job at once, whatever launched it: an exception
in the user's model, loss or data on one rank, in the optimizer step, in rank 0's writing, a
MemoryError, `sys.exit` in the user's code.

What the user sees: the exception's traceback, from the failing rank only (their code, shown as
Python shows it), then one hvd-cpu line naming the rank, its host and the exception, exit code
1. The rank tells its peers first (runtime/watchdog.py's FAILED: they end at once, without a
word, whatever they wait in) and skips every graceful exit that can block: MPI's finalize
waits for peers that wait in a collective for this rank. From fit(), the exception itself is
raised in the caller (runtime/driver.py), with the failing rank's traceback as its cause.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import cloudpickle

from hvd_cpu.atomic import atomic_write
from hvd_cpu.errors import RunFailed
from hvd_cpu.lines import say
from hvd_cpu.runtime.lifecycle import ending, exit_now

# Set by fit()'s driver for its ranks: the folder where a failing rank leaves its exception.
FAILURES = "HVD_CPU_FAILURES"
# What becomes of a job without a checkpoint to go on from when one of its ranks fails.
RUN_AGAIN = "the job ends; fix it, then run it again"


class RankTraceback(Exception):
    """The traceback of an exception as the rank that failed raised it (fit()'s cause)."""


def fail(
    exc: BaseException,
    rank: int,
    then: str,
    tell_peers: Callable[[], None],
    process_goes_on: bool,
) -> None:
    """Say how this rank failed and what `then` happens, tell the peers, and end the process
    with 1; a process that goes on after the run (a user's MPI program) gets it raised
    instead, so it shows the traceback itself. Nothing when another thread is ending the
    process already (the watchdog naming a stall): this failure is its consequence."""
    if ending():
        exit_now(1)  # waits for that thread's end, its line and code
    shown = "".join(traceback.format_exception(exc))
    line = f"hvd-cpu: rank {rank} on {socket.gethostname()} failed: {described(exc)}; {then}"
    if not process_goes_on:
        sys.stderr.write(shown)
    say(line, sys.stderr)
    _leave_for_caller(exc, rank, shown, line)
    tell_peers()
    if not process_goes_on:
        exit_now(1)


def described(exc: BaseException) -> str:
    """The exception in a few words: its type and message."""
    if isinstance(exc, SystemExit):
        return f"its code called sys.exit({exc.code!r})"
    said = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {said}" if said else type(exc).__name__


def _leave_for_caller(exc: BaseException, rank: int, shown: str, line: str) -> None:
    """Under fit(): leave the exception where the caller looks (on this host; a rank on
    another host leaves nothing, and the caller raises RunFailed)."""
    folder = os.environ.get(FAILURES)
    if not folder or not Path(folder).is_dir():
        return
    try:
        record = cloudpickle.dumps((exc, shown, line))
    except Exception:  # an exception that does not pickle: its words do
        record = cloudpickle.dumps((None, shown, line))
    with contextlib.suppress(OSError):
        atomic_write(Path(folder) / f"failed-{rank}.pkl", lambda file: file.write(record))


def failure_left_in(folder: Path) -> BaseException | None:
    """The first failure a rank left in `folder`: its exception (RunFailed with its line when
    it was no Exception or did not pickle), caused by the rank's traceback."""
    record = failure_record_in(folder)
    return failure_from(record) if record else None


def failure_record_in(folder: Path) -> bytes | None:
    """The record of the first failure a rank left in `folder`, as failure_from reads it."""
    records = sorted(folder.glob("failed-*.pkl"), key=lambda path: path.stat().st_mtime)
    return records[0].read_bytes() if records else None


def failure_from(record: bytes) -> BaseException:
    """The exception of a failure record a rank left (RunFailed with its line when it was no
    Exception or did not pickle), caused by the rank's traceback."""
    exc, shown, line = cloudpickle.loads(record)
    if not isinstance(exc, Exception):
        exc = RunFailed(line.removeprefix("hvd-cpu: "))
    exc.__cause__ = RankTraceback(f"\n{shown}")  # shown as the rank printed it
    return exc
