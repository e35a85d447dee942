"""One job writes an output folder at a time.

Rank 0 holds an exclusive lock (flock) on the folder itself while its job runs. The kernel
drops it when the process ends, however it ends (kill -9 included), so a lock never outlives
its job and never blocks the next one. Beside it, OUTPUT/.hvd-cpu-job.json names the holder
(host, pid, start) for the line that refuses a second job; it goes when the job ends, and one
left by a killed job is only a name: the lock decides.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path

from hvd_cpu.atomic import atomic_write
from hvd_cpu.errors import InputError
from hvd_cpu.runtime.lifecycle import off_exit, on_exit

HOLDER = ".hvd-cpu-job.json"


class HeldFolder:
    """An output folder this process holds for its job, until `release`."""

    def __init__(self, output: Path, descriptor: int, made: list[Path]) -> None:
        self.output, self.descriptor, self.made = output, descriptor, made
        self.releasing = threading.Lock()

    def release(self) -> None:
        """The job is over (or ending): its name goes, then folders made only for it that
        stayed empty, then the lock. Once only, whichever thread comes first: the main
        thread's run ends while a thread that ends the process (the watchdog) lets go too."""
        with self.releasing:
            if self.descriptor < 0:
                return
            off_exit(self.release)
            with contextlib.suppress(OSError):
                (self.output / HOLDER).unlink()
            for folder in self.made:  # the deepest first
                with contextlib.suppress(OSError):
                    folder.rmdir()
            os.close(self.descriptor)
            self.descriptor = -1


def hold(output: Path) -> HeldFolder:
    """Take `output` for this job (made if missing), or refuse with one line naming the job
    that has it; --overwrite and --resume take a folder from a finished job, not a running one.
    Released by the caller, or when the process ends."""
    output = output.absolute()
    made = [parent for parent in (output, *output.parents) if not parent.exists()]
    output.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(output, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise InputError(
            f"{output} is being written by another job ({_holder(output)}); wait for it to "
            "end, or choose another --output (--overwrite does not take a running job's folder)"
        ) from None
    held = HeldFolder(output, descriptor, made)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": started}
    text = (json.dumps(holder) + "\n").encode()
    atomic_write(output / HOLDER, lambda file: file.write(text))
    on_exit(held.release)
    return held


def _holder(output: Path) -> str:
    try:
        holder = json.loads((output / HOLDER).read_text())
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a job that is starting"
