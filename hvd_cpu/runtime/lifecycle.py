"""The life of one rank's process, whatever the launcher: who it is before Horovod starts,
how it ends (quietly, at once, with its parent). Nothing here imports Horovod or torch, so the
CLI can set it up before anything else."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

# Environment variables through which launchers tell a process its rank before init.
RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_quiet = False  # exit_quietly_on_signals has run
_ending = False  # exit_now has begun: a signal from now on changes nothing
_on_exit: list[Callable[[], None]] = []  # run however the process ends, but by SIGKILL


def on_exit(undo: Callable[[], None]) -> None:
    """Run `undo` when this process ends: normally, through exit_now (bad input, a signal, a
    lost peer) or at interpreter exit. What a SIGKILL leaves must be harmless on its own."""
    if not _on_exit:
        atexit.register(_run_on_exit)
    _on_exit.append(undo)


def _run_on_exit() -> None:
    while _on_exit:
        with contextlib.suppress(Exception):
            _on_exit.pop()()


def launch_rank_known() -> bool:
    """Whether a launcher started this process as one rank of a job."""
    return any(name in os.environ for name in RANK_VARIABLES)


def launch_rank() -> int:
    """This process's rank as the launcher announced it; usable before (or without) init."""
    for name in RANK_VARIABLES:
        if name in os.environ:
            return int(os.environ[name])
    return 0


def arrange_ending() -> None:
    """How a rank's process ends: quietly and at once on a signal, and, when a launcher
    started it, also when its parent dies (see exit_quietly_on_signals, end_with_parent)."""
    exit_quietly_on_signals()
    if launch_rank_known():
        end_with_parent()


def exit_quietly_on_signals() -> None:
    """End this process at once, with status 128 + signal, on SIGTERM or SIGINT; rank 0 (or
    a process nobody launched) says so in one line, the other ranks say nothing.

    horovodrun stops its ranks with SIGTERM when one rank fails, and when it gets Ctrl-C or
    SIGTERM itself. Dying by the signal makes each rank's shell print "Terminated", and a
    Python handler would wait while the main thread is blocked in a collective. Instead the
    C-level handler writes the signal number to a pipe (whichever thread the kernel picked),
    and a thread waiting on it exits.
    """
    global _quiet
    if _quiet:
        return
    _quiet = True
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)

    def exit_on_signal() -> None:
        while (signum := os.read(read_end, 1)[0]) not in (signal.SIGTERM, signal.SIGINT):
            pass
        if _ending:
            return  # the main thread is already ending the process, with its own line and code
        if launch_rank() == 0:
            who = "rank 0: " if launch_rank_known() else ""
            # One write: Open MPI's --tag-output would tag print()'s separate newline alone.
            sys.stderr.write(f"hvd-cpu: {who}stopped by {signal.Signals(signum).name}\n")
        exit_now(128 + signum)

    threading.Thread(target=exit_on_signal, name="exit-on-signal", daemon=True).start()


def exit_now(code: int) -> None:
    """Flush and end the process without interpreter teardown or Horovod's shutdown.

    Teardown waits on peers that may be gone and restores the default signal handlers, so a
    rank that is still tearing down when horovodrun sends SIGTERM dies noisily by the signal.
    """
    global _ending
    _ending = True
    _run_on_exit()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def end_with_parent() -> None:
    """Ask the kernel to send this process SIGTERM when its parent dies.

    When horovodrun dies, a remote rank's ssh session ends but the rank gets no hangup, and a
    rank that is not inside a collective would train on alone. With this it ends instead.
    """
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return  # not Linux, or refused: the launcher's own clean-up still applies
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
