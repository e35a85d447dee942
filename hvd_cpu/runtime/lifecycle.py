"""The life of one rank's process, whatever the launcher: who it is before Horovod starts,
how it ends (quietly, at once, with its parent). Nothing here imports Horovod or torch, so the
CLI can set it up before anything else."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

from hvd_cpu.lines import say

# Environment variables through which launchers tell a process its rank before init.
RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# What exit_quietly_on_signals changed, to put back (quiet_signals_off); None: nothing yet.
_quiet: Callable[[], None] | None = None
_ending = False  # exit_now has begun: a signal from now on changes nothing
_exit_lock = threading.Lock()
_on_exit: list[Callable[[], None]] = []  # run however the process ends, but by SIGKILL
# A training run arms this while its steps run (training/stopping.py): a SIGTERM then asks it
# to stop at the next step all ranks agree on, with a checkpoint of that point (preemption:
# Kubernetes, SLURM, a spot machine), instead of ending the process at once.
_gentle_stop = False
_stop_asked = threading.Event()
# How long a stop asked for may take before the process ends without it (Kubernetes gives 30 s
# by default between SIGTERM and SIGKILL).
STOP_GRACE_SECONDS = 25.0
# Whether this process's end is already explained by a live rank (runtime/watchdog.py: it stood
# stopped and was named, or another rank named the stall): then a signal ends it without a
# word, with code 1.
_named_elsewhere: Callable[[], bool] = lambda: False  # noqa: E731


def on_exit(undo: Callable[[], None]) -> None:
    """Run `undo` when this process ends: normally, through exit_now (bad input, a signal, a
    lost peer) or at interpreter exit. What a SIGKILL leaves must be harmless on its own."""
    if not _on_exit:
        atexit.register(_run_on_exit)
    _on_exit.append(undo)


def off_exit(undo: Callable[[], None]) -> None:
    """`undo` is done already (its run ended): not again when the process ends."""
    with contextlib.suppress(ValueError):
        _on_exit.remove(undo)


def _run_on_exit() -> None:
    while _on_exit:
        with contextlib.suppress(Exception):
            _on_exit.pop()()


def named_elsewhere_if(check: Callable[[], bool]) -> None:
    """Let `check` say that this process is a failure another rank named: the launcher's
    signal then ends it with 1 (the job's code for it; srun takes the highest task's), quietly."""
    global _named_elsewhere
    _named_elsewhere = check


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
    started it, also when its parent dies, even stopped (see exit_quietly_on_signals,
    end_with_parent, guard_stopped)."""
    exit_quietly_on_signals()
    if launch_rank_known():
        end_with_parent()
        guard_stopped()


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
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    wakeup = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    handlers = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}

    def put_back() -> None:
        signal.set_wakeup_fd(wakeup)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        os.write(write_end, b"\0")  # no signal's number: the thread goes
        os.close(write_end)
        waiting.join()

    def exit_on_signal() -> None:
        while True:
            signum = os.read(read_end, 1)[0]
            if signum == 0:
                os.close(read_end)
                return
            if signum not in (signal.SIGTERM, signal.SIGINT):
                continue
            if _ending:
                return  # the main thread is already ending the process, with its line and code
            if _named_elsewhere():
                exit_now(1)
            if signum != signal.SIGTERM or not _gentle_stop:
                break
            if not _stop_asked.is_set():  # later ones (the launcher's after the user's) wait
                _stop_asked.set()
                threading.Thread(target=_end_unless_stopped, daemon=True).start()
        if launch_rank() == 0:
            who = "rank 0: " if launch_rank_known() else ""
            say(f"hvd-cpu: {who}stopped by {signal.Signals(signum).name}", sys.stderr)
        exit_now(128 + signum)

    waiting = threading.Thread(target=exit_on_signal, name="exit-on-signal", daemon=True)
    waiting.start()
    _quiet = put_back


def _end_unless_stopped() -> None:
    """A stop asked for that does not come within the grace (a rank stuck in its own code):
    the process ends as a SIGTERM would have ended it."""
    time.sleep(STOP_GRACE_SECONDS)
    if _stop_asked.is_set() and not _ending:
        if launch_rank() == 0:
            say(
                f"hvd-cpu: rank 0: stopped by SIGTERM; no step was agreed to stop at within "
                f"{STOP_GRACE_SECONDS:g} s, so no checkpoint of this point was written",
                sys.stderr,
            )
        exit_now(128 + signal.SIGTERM)


@contextlib.contextmanager
def stopping_gently() -> Iterator[None]:
    """While a run's steps run: a SIGTERM asks it to stop (`stop_asked`) rather than ending
    the process; a process without hvd-cpu's signal handling (a notebook's) is left alone."""
    global _gentle_stop
    _gentle_stop = _quiet is not None
    try:
        yield
    finally:
        _gentle_stop = False
        _stop_asked.clear()  # stopped, or the run ended before a step was agreed to stop at


def stop_asked() -> bool:
    """Whether a SIGTERM asked this rank's run to stop at the next step the ranks agree on."""
    return _stop_asked.is_set()


def quiet_signals_off() -> None:
    """Give the signals back as they were before exit_quietly_on_signals (a run in a process
    that goes on after it: a notebook's, a test's, a user's own MPI program's)."""
    global _quiet
    if _quiet is not None and not _ending:
        _quiet()
        _quiet = None


def exit_now(code: int) -> None:
    """Flush and end the process without interpreter teardown or Horovod's shutdown.

    Teardown waits on peers that may be gone and restores the default signal handlers, so a
    rank that is still tearing down when horovodrun sends SIGTERM dies noisily by the signal.
    The first caller's code wins: a thread that comes second waits for the end.
    """
    global _ending
    with _exit_lock:
        if _ending:  # another thread is ending the process, with its own line and code
            threading.Event().wait()
        _ending = True
    _run_on_exit()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def ending() -> bool:
    """Whether this process is already on its way out (its line said, its code chosen)."""
    return _ending


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


# Waits for the rank's parent to die; then, if the rank stands stopped (T: by a signal, t: by a
# debugger), kills it. $1 the rank, $2 its parent.
GUARD = """
while kill -0 "$1" 2>/dev/null; do
  if ! kill -0 "$2" 2>/dev/null; then
    read -r _ _ state _ < "/proc/$1/stat" && case $state in T|t) kill -9 "$1" ;; esac
    exit 0
  fi
  sleep 1
done
"""


def guard_stopped() -> None:
    """A small shell that kills this process if its parent dies while it stands stopped.

    A stopped process keeps the SIGTERM of end_with_parent pending for ever: a rank stopped on
    a host its launcher reached over ssh (horovodrun) outlives the job it stalled, since the
    launcher's clean-up there is only the end of the ssh session. Launchers that clean up
    themselves (mpirun, srun, horovodrun on its own host) kill it first.
    """
    if not os.path.exists(f"/proc/{os.getpid()}/stat"):
        return  # not Linux: the launcher's own clean-up still applies
    command = ["sh", "-c", GUARD, "hvd-cpu-guard", str(os.getpid()), str(os.getppid())]
    guard = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to the job's process group is not for it
    )
    on_exit(guard.kill)  # it would outlive this process by up to a second
