"""What one training run holds while it runs, owned by that run and let go when it ends,
however it ends: its heartbeats (runtime/watchdog.py, which also tell the others when this
rank fails: runtime/failure.py) and its output folder (output/lock.py);
in a process that goes on after the run, also the signal handling and Horovod's environment
that joining set (runtime/lifecycle.py, runtime/join.py). Two runs in a row in one process (a
notebook, a test, a user's MPI program) each start from nothing."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hvd_cpu.errors import InputError, Preempted, RunFailed
from hvd_cpu.output import lock
from hvd_cpu.output.lock import HeldFolder
from hvd_cpu.runtime import failure, horovod
from hvd_cpu.runtime.lifecycle import named_elsewhere_if, off_exit, on_exit, quiet_signals_off
from hvd_cpu.runtime.watchdog import Watchdog
from hvd_cpu.runtime.world import World


class RunScope:
    """A context manager: `watch` the ranks, `hold` the output folder; both end with it."""

    def __init__(self, process_goes_on: bool = False) -> None:
        self.watchdog: Watchdog | None = None
        self.folder: HeldFolder | None = None
        self.process_goes_on = process_goes_on
        # A launched rank's process ends with its run, and its quiet end on a launcher's
        # SIGTERM must outlast the run (the error line, leaving together).
        self.environ = dict(os.environ) if process_goes_on else None

    def __enter__(self) -> RunScope:
        on_exit(self.close)  # an exit that skips the `with` (exit_now) still lets go
        # A signal's end is quiet when this rank stood stopped and was named, or another
        # rank named the stall (lifecycle asks while the run's watch is on).
        named_elsewhere_if(self._named_elsewhere)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def watch(self, world: World, stall_seconds: float, elastic: bool) -> None:
        """Start this rank's watchdog (a collective: every rank calls it), after stopping the
        one over an earlier set of ranks (--elastic); nothing for a job of one or a bound of
        0."""
        self.stop_watching()
        if world.size > 1 and stall_seconds > 0:
            self.watchdog = Watchdog(world, stall_seconds, elastic).start()

    def stop_watching(self) -> None:
        """The ranks are about to change (--elastic), or this rank is done: it is not stalled."""
        watchdog, self.watchdog = self.watchdog, None
        if watchdog is not None:
            watchdog.stop()

    @contextmanager
    def failures_end_the_job(
        self, world_now: Callable[[], World], then: Callable[[], str]
    ) -> Iterator[None]:
        """Around a run's work: a rank that fails on its own (the user's code, a bug, memory,
        sys.exit) says so and ends the job at once (runtime/failure.py: the others cannot
        know, and would wait for it in their next collective); `then` says what becomes of
        the job. A lost peer is explained first (a stall named by one rank; a rank whose
        collective failed because another said why the job ends exits quietly); bad input
        and faults every rank met together go on to the command's one line. `world_now`:
        the ranks there are now (--elastic changes them)."""
        try:
            yield
        except horovod.PeerLost:
            watchdog = self.watchdog
            if watchdog is not None:  # peers silent first: end as the stall, named once
                watchdog.end_as_stall()
            raise
        except (InputError, RunFailed, Preempted):
            raise  # met by every rank together (collectives.agree_on_error), said by rank 0
        except BaseException as exc:
            world, watchdog = world_now(), self.watchdog
            if world.size > 1:
                tell = watchdog.tell_failed if watchdog else lambda: None
                failure.fail(exc, world.rank, then(), tell, self.process_goes_on)
            raise

    def hold(self, output: Path) -> None:
        """Rank 0: the output folder is this run's until it ends (output/lock.py)."""
        if self.folder is None:
            self.folder = lock.hold(output)

    def close(self) -> None:
        """Let go of all that the run holds. Safe from two threads at once: the run's own end, and
        a thread that ends the process meanwhile (the watchdog naming a stall)."""
        self.stop_watching()
        folder, self.folder = self.folder, None
        if folder is not None:
            folder.release()
        environ, self.environ = self.environ, None
        if environ is not None:
            quiet_signals_off()
            for name in set(os.environ) - set(environ):
                del os.environ[name]
            os.environ.update(environ)
        off_exit(self.close)

    def _named_elsewhere(self) -> bool:
        watchdog = self.watchdog
        return watchdog is not None and (watchdog.stood_stopped() or watchdog.told_named())
