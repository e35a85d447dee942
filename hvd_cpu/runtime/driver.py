"""Launching a job from a Python process (fit()): Horovod's launcher, the driver, runs in a
child process of its own, never in the caller's.

Horovod's launcher takes over the calling process's SIGINT and SIGTERM handlers for good and
turns an interrupt into a worker failure; in a Jupyter kernel that would break every later
interrupt. In a child, the caller keeps its handlers: its KeyboardInterrupt stops the driver,
which stops every rank (checkpoints stay as written), and is raised again. The ranks' output
comes back through the caller's own sys.stdout and sys.stderr (a notebook cell, not the
terminal that started Jupyter).

    run(func, args, ...)                      in the caller
    python -m hvd_cpu.runtime.driver JOB OUT  the child: launch.launch, the outcome to OUT
"""

from __future__ import annotations

import codecs
import contextlib
import math
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
import psutil

from hvd_cpu.errors import RunFailed
from hvd_cpu.runtime.failure import FAILURES, failure_left_in
from hvd_cpu.runtime.lifecycle import end_with_parent

# Seconds the driver gets to stop its ranks after an interrupt before they are killed.
STOP_SECONDS = 15
# How often the caller's `watch` runs while the job does.
POLL_SECONDS = 0.5


def run(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    np: int,
    hosts: str | None,
    controller: str,
    watch: Callable[[], None] | None = None,
) -> list[Any]:
    """`func(*args)` on `np` new ranks (launch.launch, in a child process); every rank's
    result in rank order. Bad input raises InputError with the ranks' message, a rank that
    failed its exception (runtime/failure.py; else RunFailed), an interrupt
    KeyboardInterrupt once every rank is gone."""
    with tempfile.TemporaryDirectory(prefix="hvd-cpu-driver-") as folder:
        job, outcome = Path(folder) / "job.pkl", Path(folder) / "outcome.pkl"
        job.write_bytes(cloudpickle.dumps((func, args, np, hosts, controller)))
        with subprocess.Popen(
            [sys.executable, "-m", "hvd_cpu.runtime.driver", str(job), str(outcome)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            # A rank that fails leaves its exception in the folder (runtime/failure.py).
            env={**os.environ, "PYTHONUNBUFFERED": "1", FAILURES: folder},
            start_new_session=True,  # a terminal's Ctrl-C reaches the caller only
        ) as process:
            try:
                _relay(process, watch or (lambda: None))
            except BaseException:  # KeyboardInterrupt above all: no rank outlives the caller
                _stop(process)
                raise
        failed = failure_left_in(Path(folder))
        if failed is not None:
            raise failed  # the exception a rank raised, caused by its traceback there
        if not outcome.exists():
            raise RunFailed(f"the launcher ended with exit code {process.returncode}; see above")
        kind, value = cloudpickle.loads(outcome.read_bytes())
    if kind == "error":
        raise value
    if kind == "failed":
        raise RunFailed(value)
    return value


def _relay(
    process: subprocess.Popen[bytes], watch: Callable[[], None], until: float = math.inf
) -> None:
    """Copy the child's output to this process's streams as it comes, until it ends (or the
    monotonic clock reaches `until`)."""
    streams = {process.stdout: sys.stdout, process.stderr: sys.stderr}
    decoders = {pipe: codecs.getincrementaldecoder("utf-8")("replace") for pipe in streams}
    with selectors.DefaultSelector() as selector:
        for pipe in streams:
            selector.register(pipe, selectors.EVENT_READ)
        while selector.get_map() and time.monotonic() < until:
            for key, _ in selector.select(POLL_SECONDS):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                stream = streams[key.fileobj]
                stream.write(decoders[key.fileobj].decode(chunk, final=not chunk))
                stream.flush()
            watch()
    process.wait(max(until - time.monotonic(), 0) if until < math.inf else None)
    watch()


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Stop the driver as horovodrun is stopped (SIGINT: it ends its ranks), showing what
    they still say; then kill whatever is still there, the driver's ranks included."""
    try:
        family = psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        family = []
    try:
        process.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            _relay(process, lambda: None, until=time.monotonic() + STOP_SECONDS)
    finally:  # also after a second Ctrl-C
        if process.poll() is None:
            process.kill()
        _, alive = psutil.wait_procs(family, timeout=STOP_SECONDS)
        for survivor in alive:
            survivor.kill()


def main(job: str, outcome: str) -> None:
    """The child: launch the job, write ("result", results), ("error", InputError or
    Preempted) or ("failed", what failed) to `outcome`."""
    from hvd_cpu.runtime import launch

    end_with_parent()  # a kernel restarted or a script killed takes its job with it
    func, args, np, hosts, controller = cloudpickle.loads(Path(job).read_bytes())
    try:
        result: tuple[str, Any] = ("result", launch.launch(func, args, np, hosts, controller))
    except launch.SAID as exc:
        result = ("error", exc)
    except Exception as exc:  # Horovod's WorkerFailed, a launcher that could not start
        code = getattr(exc, "exit_code", None)
        said = f"a rank failed (exit code {code})" if code is not None else f"{exc}".strip()
        result = ("failed", f"the job ended: {said or type(exc).__name__}; its output is above")
    Path(outcome).write_bytes(cloudpickle.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
