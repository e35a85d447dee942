"""Joining the job: what every rank does first (`init`), and again under --elastic when the
ranks change (`elastic_world`); leaving it early, together (`leave_together`).

`init` sets Horovod's environment (its cycle, its Gloo timeout), starts it over the controller
the launcher chose, chooses the backend of the job's collectives (`_backend`, the one place a
backend is chosen: a new one is a subclass of runtime/collectives.py's interface, picked
there), gives the rank its share of cores and starts the heartbeats. The World it returns is
runtime/world.py's.
"""

from __future__ import annotations

import math
import os
import socket
import threading
from typing import Any

import torch

from hvd_cpu.errors import InputError
from hvd_cpu.runtime import horovod
from hvd_cpu.runtime.alone import Alone
from hvd_cpu.runtime.collectives import Collectives, Counted
from hvd_cpu.runtime.cores import default_threads
from hvd_cpu.runtime.lifecycle import arrange_ending
from hvd_cpu.runtime.mpi import (
    MpiCollectives,
    checked_communicator,
    finalize_mpi,
    yield_when_oversubscribed,
)
from hvd_cpu.runtime.world import SHARED_MEMORY, World

# How a Gloo-only build (asked for, or made where no Open MPI could be had) gets MPI.
WITH_MPI = (
    "rerun hvd-cpu install-horovod without --without-mpi (it takes the machine's Open MPI, "
    "else it installs Open MPI from PyPI)"
)
# Set by an MPI launcher (mpirun, horovodrun --mpi, srun --mpi=pmix), not by horovodrun --gloo.
MPI_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE")
# Horovod's background thread runs a collective with every other rank each cycle, busy or not.
# Our build's wake-on-wait patch starts a cycle at once when a caller waits on a collective, so
# every collective hvd-cpu makes (gradients, metrics, broadcasts) is done without waiting for
# the clock, and a long cycle keeps the thread from taking the training thread's core in
# between (docs/measurements.md: 100 ms against the default 1 ms).
CYCLE_MS = "100"
# Gloo's timeout, in seconds, for a job that waits for ever: about 116 days.
GLOO_FOREVER = 10**7


def init(
    threads: int | None = None,
    comm: Any = None,
    stall_seconds: float | None = None,
) -> World:
    """Join the job (a job of one without a launcher) and give this rank its share of cores.

    Under an MPI launcher, or on `comm` (an mpi4py communicator of a program of your own),
    Horovod runs its MPI controller; otherwise Gloo's. Without a thread budget every rank
    would start one thread per core, and N ranks on N cores would fight over N x N threads.
    `stall_seconds` (--stall-seconds: the run's watchdog ends a job with a silent rank; 0:
    it waits for ever) puts Gloo's own timeout beyond it.
    """
    arrange_ending()
    if stall_seconds is not None:
        # Gloo's own timeout would end a stalled job first, with a line that names nobody,
        # and a job told to wait for ever (--stall-seconds 0) after Gloo's 30 s.
        beyond = math.ceil(stall_seconds) + 30 if stall_seconds else GLOO_FOREVER
        os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(beyond))
    if horovod.wakes_on_wait():
        os.environ.setdefault("HOROVOD_CYCLE_TIME", CYCLE_MS)
    under_mpi = comm is not None or mpi_launched()
    if under_mpi:
        if not horovod.mpi_built():
            raise InputError(
                "started by an MPI launcher, but this Horovod was built without MPI; "
                f"{WITH_MPI}, or launch with horovodrun --gloo"
            )
        yield_when_oversubscribed()
        comm = checked_communicator(comm)
        horovod.start(comm)
    else:
        # A plain process is a job of one: Gloo's needs no launcher (MPI's would start a
        # singleton MPI runtime for nothing).
        os.environ.setdefault("HOROVOD_CONTROLLER", "gloo")
        os.environ.setdefault("HOROVOD_CPU_OPERATIONS", "gloo")
        horovod.start()
    transport = "" if under_mpi else horovod.gloo_transport()
    return _world(threads, horovod.place().local_size, _backend(comm, transport), transport)


def _backend(comm: Any, transport: str) -> Collectives:
    """The backend of the job's collectives, the one place that chooses it: a job of one
    exchanges nothing (each collective through Horovod's background thread would cost a
    hand-over to it and back, and a fit makes dozens); under MPI our own communicator's; under
    Gloo through shared memory Horovod's with its direct allreduce; else Horovod's. Each is
    counted (how far the rank has come, which its heartbeats carry)."""
    if horovod.place().size == 1:
        return Alone()
    if horovod.controller() == "mpi":
        return Counted(MpiCollectives(comm.Dup()))
    if transport == SHARED_MEMORY and horovod.direct_path_open():
        return Counted(horovod.SharedMemoryCollectives())
    return Counted(horovod.HorovodCollectives())


def _world(threads: int | None, ranks_here: int, collectives: Collectives, transport: str) -> World:
    """The World, with this rank's share of the machine's cores unless `threads` is fixed."""
    threads = threads or default_threads(ranks_here)
    torch.set_num_threads(threads)
    return World(*horovod.place(), threads, collectives, horovod.controller(), transport)


def may_average_directly(controller: str) -> bool:
    """Whether a job over `controller` can have a direct allreduce (--allreduce direct): MPI
    always; Gloo on our build, if its ranks share memory (known once the job runs)."""
    return controller == "mpi" or horovod.has_patch(horovod.SHARED_MEMORY_PATCH)


def mpi_launched() -> bool:
    """Whether an MPI launcher started this process (and not horovodrun's Gloo launcher)."""
    gloo = "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ
    return not gloo and any(name in os.environ for name in MPI_VARIABLES)


def elastic_launched() -> bool:
    """Whether horovodrun started this process in its elastic mode (--host-discovery-script)."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def elastic_world(threads: int | None) -> World:
    """This rank's place after an elastic (re)start, which may have changed it.

    Threads are shared out among the ranks on this machine, counted by its hostname: Horovod
    counts ranks per host *name*, and launch/discover-hosts.sh lists one machine under two.
    A collective, so call it inside the elastic loop only.
    """
    here = socket.gethostname()
    transport = horovod.gloo_transport()
    collectives = _backend(None, transport)
    ranks_here = collectives.gather(here, "machine_names").count(here)
    return _world(threads, ranks_here, collectives, transport)


def leave_together(timeout: float = 5.0) -> None:
    """Shut Horovod down with the other ranks before an early exit (bad input, seen by all).

    A rank that exits at once while a peer's background loop still talks to it makes that
    peer print Horovod's "Connection closed by peer" error. A normal exit avoids this through
    Horovod's atexit shutdown, which exit_now skips. Under MPI, MPI is finalized too, so that
    the launcher takes the exit as proper and the job's exit code is rank 0's. If a peer never
    joins, go after `timeout`.
    """

    def leave() -> None:
        horovod.stop()
        finalize_mpi()

    leaving = threading.Thread(target=leave, name="leave-together", daemon=True)
    leaving.start()
    leaving.join(timeout)
