"""Every direct Horovod call of hvd-cpu, so the rest of the code never imports Horovod.

Horovod has two controllers, and which one a job uses is decided by how it was started:
`horovodrun --gloo` (or a plain process) runs Gloo; `horovodrun --mpi`, `mpirun`, `srun
--mpi=pmix` or a user's own mpi4py program run MPI. Between the ranks of one host both move
bytes through shared memory, which is what makes several ranks on one host pay: MPI by
itself, Gloo through our build's gloo-shared-memory patch (TCP without it).

In sections: joining and leaving the job (`init` makes this rank's World, runtime/world.py,
whose `collectives` one factory chooses, `_collectives`: a job of one's; under MPI our own
communicator's, runtime/mpi.py; Horovod's, under Gloo through shared memory with its direct
allreduce); launching ranks from Python (`launch`); Horovod's collectives and its
DistributedOptimizer (what the default gradient synchronisation of training/sync.py wraps);
Horovod's elastic mode. Cores and threads are in cores.py, how a rank's process ends in
lifecycle.py.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import horovod
import horovod.torch as hvd
import torch
from horovod.common.elastic import State, notification_manager
from horovod.common.exceptions import HostsUpdatedInterrupt

from hvd_cpu.config.options import CONTROLLER_NAMES
from hvd_cpu.errors import InputError, RunFailed
from hvd_cpu.runtime import watchdog
from hvd_cpu.runtime.collectives import Alone, Collectives
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
WAKE_ON_WAIT_PATCH = f"horovod-{horovod.__version__}-wake-on-wait.patch"
SHARED_MEMORY_PATCH = f"horovod-{horovod.__version__}-gloo-shared-memory.patch"
# Raised by a collective when another rank has gone (crashed, killed, host lost).
PeerLost = hvd.HorovodInternalError


# Joining and leaving the job


def init(
    threads: int | None = None,
    comm: Any = None,
    stall_seconds: float = 0.0,
) -> World:
    """Join the job (a job of one without a launcher) and give this rank its share of cores.

    Under an MPI launcher, or on `comm` (an mpi4py communicator of a program of your own),
    Horovod runs its MPI controller; otherwise Gloo's. Without a thread budget every rank
    would start one thread per core, and N ranks on N cores would fight over N x N threads.
    With `stall_seconds`, a rank silent that long ends the job (runtime/watchdog.py; under
    --elastic the watch starts in elastic_world).
    """
    arrange_ending()
    if stall_seconds:
        # Gloo's own timeout would end a stalled job first, with a line that names nobody.
        os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(math.ceil(stall_seconds) + 30))
    if wakes_on_wait():
        os.environ.setdefault("HOROVOD_CYCLE_TIME", CYCLE_MS)
    under_mpi = comm is not None or mpi_launched()
    if under_mpi:
        if not hvd.mpi_built():
            raise InputError(
                "started by an MPI launcher, but this Horovod was built without MPI; "
                f"{WITH_MPI}, or launch with horovodrun --gloo"
            )
        yield_when_oversubscribed()
        comm = checked_communicator(comm)
        hvd.init(comm=comm)
    else:
        # A plain process is a job of one: Gloo's needs no launcher (MPI's would start a
        # singleton MPI runtime for nothing).
        os.environ.setdefault("HOROVOD_CONTROLLER", "gloo")
        os.environ.setdefault("HOROVOD_CPU_OPERATIONS", "gloo")
        hvd.init()
    transport = "" if under_mpi else gloo_transport()
    world = _world(threads, hvd.local_size(), _collectives(comm, transport), transport)
    if not elastic_launched():
        watchdog.watch(world.rank, world.size, world.collectives, stall_seconds, elastic=False)
    return world


def _collectives(comm: Any, transport: str) -> Collectives:
    """The backend of the job's collectives, the one place that chooses it: a job of one
    exchanges nothing (each collective through Horovod's background thread would cost a
    hand-over to it and back, and a fit makes dozens); under MPI our own communicator's; under
    Gloo through shared memory Horovod's with its direct allreduce; else Horovod's."""
    if hvd.size() == 1:
        return Alone()
    if hvd.mpi_enabled():
        return MpiCollectives(comm.Dup())
    return SharedMemoryCollectives() if transport == SHARED_MEMORY else HorovodCollectives()


def _world(threads: int | None, ranks_here: int, collectives: Collectives, transport: str) -> World:
    """The World, with this rank's share of the machine's cores unless `threads` is fixed."""
    controller = "mpi" if hvd.mpi_enabled() else "gloo"
    threads = threads or default_threads(ranks_here)
    torch.set_num_threads(threads)
    return World(
        hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), threads, collectives,
        controller, transport,
    )  # fmt: skip


def may_average_directly(controller: str) -> bool:
    """Whether a job over `controller` can have a direct allreduce (--allreduce direct): MPI
    always; Gloo on our build, if its ranks share memory (known once the job runs)."""
    return controller == "mpi" or _has_patch(SHARED_MEMORY_PATCH)


def gloo_transport() -> str:
    """How Horovod's Gloo collectives move bytes between the ranks of a host: through shared
    memory (our build's gloo-shared-memory patch, where every host's ranks can share a segment
    in /dev/shm), or TCP, and why."""
    if not _has_patch(SHARED_MEMORY_PATCH):
        why_not = "this Horovod has no gloo-shared-memory patch; hvd-cpu install-horovod builds it"
    else:
        why_not = hvd.gloo_shared_memory()
    return f"TCP ({why_not})" if why_not else SHARED_MEMORY


def mpi_launched() -> bool:
    """Whether an MPI launcher started this process (and not horovodrun's Gloo launcher)."""
    gloo = "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ
    return not gloo and any(name in os.environ for name in MPI_VARIABLES)


def leave_together(timeout: float = 5.0) -> None:
    """Shut Horovod down with the other ranks before an early exit (bad input, seen by all).

    A rank that exits at once while a peer's background loop still talks to it makes that
    peer print Horovod's "Connection closed by peer" error. A normal exit avoids this through
    Horovod's atexit shutdown, which exit_now skips. Under MPI, MPI is finalized too, so that
    the launcher takes the exit as proper and the job's exit code is rank 0's. If a peer never
    joins, go after `timeout`.
    """

    def leave() -> None:
        if hvd.is_initialized():
            hvd.shutdown()
        finalize_mpi()

    leaving = threading.Thread(target=leave, name="leave-together", daemon=True)
    leaving.start()
    leaving.join(timeout)


def build_info() -> dict[str, bool]:
    """What this Horovod build can do (horovodrun --check-build, as data)."""
    return {"pytorch": True, "gloo": bool(hvd.gloo_built()), "mpi": bool(hvd.mpi_built())}


# Launching ranks from Python (what horovodrun does for a command)


def launch(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    np: int,
    hosts: str | None,
    controller: str = "gloo",
) -> list[Any]:
    """Run `func(*args)` on `np` new ranks over `controller` (Horovod's programmatic launcher,
    what horovodrun does for a command) and return every rank's result, in rank order.

    Bad input on the ranks raises the same InputError here, with the message the command
    line would print.
    """
    if controller not in CONTROLLER_NAMES:
        raise InputError(f"unknown controller {controller!r}: choose gloo or mpi")
    if controller == "mpi":
        check_mpi_launcher()
    results = horovod.run(
        _returning_input_errors,
        args=(func, *args),
        np=np,
        hosts=hosts,
        use_gloo=controller == "gloo",
        use_mpi=controller == "mpi",
        disable_cache=True,
    )
    errors = [result for result in results if isinstance(result, InputError)]
    if errors:
        raise errors[0]
    return results


def _returning_input_errors(func: Callable[..., Any], *args: Any) -> Any:
    """Run on a launched rank: bad input comes back as a value, not as a worker failure."""
    try:
        return func(*args)
    except InputError as exc:
        return exc


def check_mpi_launcher() -> None:
    """Before launching over MPI: this Horovod must have MPI, and mpirun must be there."""
    if not hvd.mpi_built():
        raise InputError(
            f"this Horovod was built without MPI; {WITH_MPI}, or use the Gloo controller "
            "(controller='gloo')"
        )
    # Open MPI from PyPI is in this Python's bin folder, on the PATH or not (a notebook's
    # kernel); Horovod's launcher takes it from there (the pypi-mpirun patch).
    if shutil.which("mpirun") is None and not (Path(sys.executable).parent / "mpirun").is_file():
        raise InputError(
            "mpirun not found on PATH; install Open MPI (Debian: apt-get install openmpi-bin) "
            "or use the Gloo controller (horovodrun --gloo, controller='gloo')"
        )


def wakes_on_wait() -> bool:
    """Whether this Horovod is hvd-cpu's build with the wake-on-wait patch. Any other (one a
    user built or installed) keeps its cycle: at 100 ms, each collective would wait for it."""
    return _has_patch(WAKE_ON_WAIT_PATCH)


def _has_patch(name: str) -> bool:
    """Whether this Horovod is hvd-cpu's build, with the patch `name`."""
    try:
        from horovod.hvd_cpu_build import BUILD  # written by hvd-cpu install-horovod
    except ImportError:
        return False
    return name in BUILD["patches"]


# Horovod's collectives and its DistributedOptimizer


class HorovodCollectives(Collectives):
    """The job's collectives through Horovod's background thread (all there is under Gloo)."""

    def sum(self, values: torch.Tensor, name: str) -> torch.Tensor:
        return hvd.allreduce(values, op=hvd.Sum, name=name)

    def average_(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return hvd.allreduce_(tensor, op=hvd.Average, name=name)

    def broadcast_(self, tensors: Mapping[str, torch.Tensor]) -> None:
        # Horovod refuses a strided tensor (a user's transposed parameter): it goes as a
        # contiguous copy, written back.
        strided = {name: t.contiguous() for name, t in tensors.items() if not t.is_contiguous()}
        hvd.broadcast_parameters({**tensors, **strided}, root_rank=0)
        for name, contiguous in strided.items():
            tensors[name].copy_(contiguous)

    def broadcast_object(self, obj: Any, name: str) -> Any:
        return hvd.broadcast_object(obj, root_rank=0, name=name)

    def gather(self, obj: Any, name: str) -> list[Any]:
        return hvd.allgather_object(obj, name=name)


class SharedMemoryCollectives(HorovodCollectives):
    """Under Gloo through shared memory: sums and averages from the calling thread, with no
    hand-over to Horovod's cycle (hvd.direct_allreduce_: shared memory within each host, TCP
    between one rank per host), which is what --allreduce direct averages gradients over;
    the rest through Horovod, whose Gloo collectives use shared memory too. Matched by order."""

    in_calling_thread = True

    def sum(self, values: torch.Tensor, name: str) -> torch.Tensor:
        summed = values.detach().clone(memory_format=torch.contiguous_format)
        return hvd.direct_allreduce_(summed, op=hvd.Sum)

    def average_(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return hvd.direct_allreduce_(tensor, op=hvd.Average)


def wrap_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> Any:
    """Average gradients over all ranks inside optimizer.step()."""
    return hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), op=hvd.Average
    )


def averaged_step(optimizer: Any) -> float:
    """Wait for this step's gradient allreduces (started by backward, one per parameter as its
    gradient is ready), then step; returns the seconds spent waiting for them."""
    start = time.perf_counter()
    optimizer.synchronize()
    waited = time.perf_counter() - start
    with optimizer.skip_synchronize():
        optimizer.step()
    return waited


# Elastic mode (horovodrun --host-discovery-script): ranks may go and come


def elastic_launched() -> bool:
    """Whether horovodrun started this process in its elastic mode (--host-discovery-script)."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def elastic_world(threads: int | None, stall_seconds: float) -> World:
    """This rank's place after an elastic (re)start, which may have changed it.

    Threads are shared out among the ranks on this machine, counted by its hostname: Horovod
    counts ranks per host *name*, and launch/discover-hosts.sh lists one machine under two.
    A collective, so call it inside the elastic loop only.
    """
    here = socket.gethostname()
    transport = gloo_transport()
    collectives = _collectives(None, transport)
    ranks_here = collectives.gather(here, "machine_names").count(here)
    world = _world(threads, ranks_here, collectives, transport)
    watchdog.watch(world.rank, world.size, collectives, stall_seconds, elastic=True)
    return world


class ElasticState(State):
    """What survives a lost rank: a copy in memory, taken at each commit, of what `capture`
    returns; after a failure `apply` puts it back; at each (re)start `rejoin` gives every rank
    its new place and rank 0's state (what Horovod's State calls sync).

    Horovod's TorchState would broadcast the optimizer with broadcast_optimizer_state, whose
    zero-gradient step on a joining rank's fresh optimizer shifts Adam's bias correction; this
    one leaves capture, apply and rejoin to the training code (training/elastic.py).
    """

    def __init__(
        self,
        capture: Callable[[], dict[str, Any]],
        apply: Callable[[dict[str, Any]], None],
        rejoin: Callable[[], None],
    ) -> None:
        super().__init__(bcast_object=_broadcast_host_updates, get_rank=hvd.rank)
        self._capture, self._apply, self._rejoin = capture, apply, rejoin
        self._saved: dict[str, Any] = {}
        self.failures = 0  # times the job lost a rank and went on (not undone by restore)

    def save(self) -> None:
        self._saved = copy.deepcopy(self._capture())

    def restore(self) -> None:
        self._apply(copy.deepcopy(self._saved))

    def sync(self) -> None:
        self._rejoin()
        self.failures = hvd.broadcast_object(self.failures, root_rank=0, name="elastic_failures")
        self.save()


def _broadcast_host_updates(update: Any) -> Any:
    return hvd.broadcast_object(update, root_rank=0, name="elastic_host_updates")


def run_elastic(state: ElasticState, body: Callable[[], Any], max_restarts: int) -> Any:
    """Run `body` until it returns, on whichever ranks there are: when a rank is lost, the
    survivors roll back to the last commit; when ranks join or go, Horovod starts again
    with the new set, every rank takes rank 0's state, and `body` runs again. After more
    than `max_restarts` lost ranks, RunFailed (as torchrun's --max-restarts).

    This is hvd.elastic.run with one change: it syncs after every reset. Horovod skips the
    sync when hosts were only removed, and when some ranks see that as a notice and others
    as a failed collective, those that sync wait forever for those that do not (#3494).
    """
    notification_manager.init()
    notification_manager.register_listener(state)
    try:
        while True:
            try:
                state.sync()
                return body()
            except PeerLost as lost:
                watchdog.stop()
                state.restore()
                state.failures += 1
                if state.failures > max_restarts:
                    raise RunFailed(
                        f"gave up after losing ranks {state.failures} time(s) "
                        f"(--max-restarts {max_restarts})"
                    ) from lost
            except HostsUpdatedInterrupt:
                pass
            watchdog.stop()  # the ranks change: the next pass watches the new ones
            hvd.shutdown()
            hvd.init()
            state.on_reset()
    finally:
        notification_manager.remove_listener(state)
