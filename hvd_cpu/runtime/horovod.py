"""Every direct Horovod call of hvd-cpu, so the rest of the code never imports Horovod.

Horovod has two controllers, and which one a job uses is decided by how it was started:
`horovodrun --gloo` (or a plain process) runs Gloo over TCP; `horovodrun --mpi`, `mpirun`,
`srun --mpi=pmix` or a user's own mpi4py program run MPI, whose shared-memory transport is
what makes several ranks on one host pay.

In sections: joining and leaving the job (`init`, `World`); launching ranks from Python
(`launch`); the collectives the rest of hvd-cpu calls, which Horovod carries under Gloo; under
MPI, hvd-cpu's own mpi4py communicator, which carries them instead; Horovod's elastic mode.
The data code sees only the `Collectives` it is given; the training code calls the functions
here whatever the controller, but --allreduce direct (direct_allreduce.py, on `World.comm`)
and --elastic (train.Job, prepare.prepare, data.loader.ResumableSampler) are modes with code
of their own there. Cores and threads are in cores.py, how a rank's process ends in
lifecycle.py.
"""

from __future__ import annotations

import copy
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import horovod
import horovod.torch as hvd
import numpy as np
import torch
from horovod.common.elastic import State, notification_manager
from horovod.common.exceptions import HostsUpdatedInterrupt

from hvd_cpu.config.options import CONTROLLER_NAMES
from hvd_cpu.errors import InputError, RunFailed
from hvd_cpu.runtime.cores import default_threads
from hvd_cpu.runtime.lifecycle import arrange_ending

# How a Gloo-only build (made where no Open MPI was installed) gets MPI.
WITH_MPI = (
    "install Open MPI (Debian/Ubuntu: openmpi-bin libopenmpi-dev) and rerun hvd-cpu install-horovod"
)
# Set by an MPI launcher (mpirun, horovodrun --mpi, srun --mpi=pmix), not by horovodrun --gloo.
MPI_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE")
# Horovod's background thread runs a collective with every other rank each cycle, busy or not.
# When no step needs it (--allreduce direct, local SGD over MPI) a long cycle keeps it from
# taking the training thread's core a thousand times a second.
IDLE_CYCLE_MS = "100"
T = TypeVar("T")
# Raised by a collective when another rank has gone (crashed, killed, host lost).
PeerLost = hvd.HorovodInternalError


@dataclass(frozen=True)
class World:
    """Where this process stands in the job."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    threads: int
    controller: str = "gloo"  # "mpi" or "gloo": who carries Horovod's collectives
    comm: Any = None  # MPI only: an mpi4py communicator of the job's ranks, for our own calls

    @property
    def is_root(self) -> bool:
        return self.rank == 0


# Joining and leaving the job


def init(threads: int | None = None, comm: Any = None, horovod_steps: bool = True) -> World:
    """Join the job (a job of one without a launcher) and give this rank its share of cores.

    Under an MPI launcher, or on `comm` (an mpi4py communicator of a program of your own),
    Horovod runs its MPI controller; otherwise Gloo's. Without a thread budget every rank
    would start one thread per core, and N ranks on N cores would fight over N x N threads.
    `horovod_steps=False` says no training step will use Horovod (see IDLE_CYCLE_MS).
    """
    global _job_comm
    arrange_ending()
    if comm is not None or mpi_launched():
        comm = _mpi_communicator(comm)
        if not horovod_steps:
            os.environ.setdefault("HOROVOD_CYCLE_TIME", IDLE_CYCLE_MS)
        hvd.init(comm=comm)
        comm = _job_comm = comm.Dup()  # our messages never meet Horovod's or the caller's
    else:
        # A plain process is a job of one: Gloo's needs no launcher (MPI's would start a
        # singleton MPI runtime for nothing).
        os.environ.setdefault("HOROVOD_CONTROLLER", "gloo")
        os.environ.setdefault("HOROVOD_CPU_OPERATIONS", "gloo")
        hvd.init()
    return _world(threads, hvd.local_size(), comm)


def _world(threads: int | None, ranks_here: int, comm: Any) -> World:
    """The World, with this rank's share of the machine's cores unless `threads` is fixed."""
    controller = "mpi" if hvd.mpi_enabled() else "gloo"
    threads = threads or default_threads(ranks_here)
    torch.set_num_threads(threads)
    return World(
        hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), threads, controller, comm
    )


def mpi_launched() -> bool:
    """Whether an MPI launcher started this process (and not horovodrun's Gloo launcher)."""
    gloo = "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ
    return not gloo and any(name in os.environ for name in MPI_VARIABLES)


def leave_together(timeout: float = 5.0) -> None:
    """Shut Horovod down with the other ranks before an early exit (bad input, seen by all).

    A rank that exits at once while a peer's background loop still talks to it makes that
    peer print Horovod's "Connection closed by peer" error. A normal exit avoids this through
    Horovod's atexit shutdown, which exit_now skips. If a peer never joins, go after `timeout`.
    """
    if hvd.is_initialized():
        leaving = threading.Thread(target=hvd.shutdown, name="leave-together", daemon=True)
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
    if shutil.which("mpirun") is None:
        raise InputError(
            "mpirun not found on PATH; install Open MPI (Debian: apt-get install openmpi-bin) "
            "or use the Gloo controller (horovodrun --gloo, controller='gloo')"
        )


# Collectives: under MPI over the job's own communicator (next section), else Horovod's


def agree_on_error(message: str | None, kind: type[Exception] = InputError) -> None:
    """Raise the same error (InputError, or `kind`) on every rank if any rank found one.

    Every rank calls this once after reading its input, so a problem seen by one rank only
    (a file missing on one host) ends all ranks instead of leaving them in a collective.
    """
    reports = gather((socket.gethostname(), message), name="agree_on_error")
    failed = [(rank, host, text) for rank, (host, text) in enumerate(reports) if text]
    if failed:
        rank, host, text = failed[0]
        everywhere = len(failed) == len(reports)
        raise kind(text if everywhere else f"on rank {rank} ({host}): {text}")


def agreed(step: Callable[[], T], world: World | None = None) -> T:
    """Run a step on every rank; bad input on any rank ends every rank here, together.
    A `world` of one (an elastic rank preparing alone) has nobody to agree with."""
    if world is not None and world.size == 1:
        return step()
    error, value = None, None
    try:
        value = step()
    except InputError as exc:
        error = str(exc)
    agree_on_error(error)
    return value  # type: ignore[return-value]


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


def average_parameters(model: torch.nn.Module) -> float:
    """Local SGD: replace every rank's parameters with their mean over all ranks, as one
    allreduce; returns the seconds it took."""
    start = time.perf_counter()
    parameters = list(model.parameters())
    flat = torch.nn.utils.parameters_to_vector(parameters)
    if _job_comm is None:
        hvd.allreduce_(flat, op=hvd.Average, name="average_parameters")
    else:
        _mpi_sum_(flat.detach()).mul_(1.0 / _job_comm.Get_size())
    with torch.no_grad():
        for parameter, mean in zip(
            parameters, flat.split([p.numel() for p in parameters]), strict=True
        ):
            parameter.copy_(mean.view_as(parameter))
    return time.perf_counter() - start


def broadcast_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Start every rank from rank 0's parameters and optimizer state.

    The optimizer state goes as one object: Horovod's broadcast_optimizer_state would first
    take a zero-gradient step on a fresh optimizer, which shifts Adam's bias correction.
    """
    if _job_comm is None:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    else:
        _mpi_broadcast_(model.state_dict().values())
    optimizer.load_state_dict(
        broadcast_object(optimizer.state_dict() if hvd.rank() == 0 else None, "optimizer_state")
    )


def broadcast_object(obj: Any, name: str) -> Any:
    """Rank 0's object on every rank (other ranks pass anything, typically None)."""
    if _job_comm is not None:
        return _job_comm.bcast(obj, root=0)
    return hvd.broadcast_object(obj, root_rank=0, name=name)


def sum_over_ranks(values: torch.Tensor, name: str) -> torch.Tensor:
    """Element-wise sum of a small tensor over all ranks (for metrics, not gradients)."""
    if _job_comm is not None:
        return _mpi_sum_(values.clone())
    return hvd.allreduce(values, op=hvd.Sum, name=name)


def gather(obj: Any, name: str) -> list[Any]:
    """Every rank's object, in rank order, on every rank. `name` must be the same on every
    rank (Horovod matches collectives by name; its default, the object's type, may differ)."""
    if _job_comm is not None:
        return _job_comm.allgather(obj)
    return hvd.allgather_object(obj, name=name)


class Collectives:
    """The statistics collectives that data.features needs, over all ranks of the job."""

    def sum(self, values: np.ndarray) -> np.ndarray:
        tensor = torch.from_numpy(np.array(values, dtype=np.float64))
        return sum_over_ranks(tensor, name="statistics").numpy()

    def gather(self, obj: Any) -> list[Any]:
        return gather(obj, name="statistics")


# Under MPI: hvd-cpu's own communicator, beside Horovod's

# Our own duplicate of the job's communicator, which hvd-cpu's collectives use directly
# (microseconds) instead of Horovod's cycle (milliseconds). None under Gloo.
_job_comm: Any = None


def _mpi_communicator(comm: Any) -> Any:
    """The communicator the job runs on: `comm`, or all ranks MPI started; MPI initialised
    by mpi4py (which asks for MPI_THREAD_MULTIPLE) and checked for what Horovod needs."""
    if not hvd.mpi_built():
        raise InputError(
            "started by an MPI launcher, but this Horovod was built without MPI; "
            f"{WITH_MPI}, or launch with horovodrun --gloo"
        )
    from mpi4py import MPI

    level = MPI.Query_thread()
    if level < MPI.THREAD_MULTIPLE:
        names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled"}
        raise InputError(
            f"MPI gives thread level {names.get(level, 'serialized')}, Horovod needs "
            "MPI_THREAD_MULTIPLE; initialise MPI with it (mpi4py.rc.thread_level = 'multiple') "
            "and use Open MPI's ob1 transport (mpirun --mca pml ob1), or launch with "
            "horovodrun --gloo"
        )
    return MPI.COMM_WORLD if comm is None else comm


def _mpi_sum_(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (contiguous, on the CPU) replaced in place by its sum over the job's ranks."""
    from mpi4py import MPI

    _job_comm.Allreduce(MPI.IN_PLACE, tensor.numpy(), op=MPI.SUM)
    return tensor


def _mpi_broadcast_(tensors: Iterable[torch.Tensor]) -> None:
    """Each of `tensors` (on the CPU) replaced in place by rank 0's."""
    for tensor in tensors:
        data = tensor.reshape(-1).contiguous()  # the tensor itself, unless it is strided
        _job_comm.Bcast(data.view(torch.uint8).numpy(), root=0)
        if data.data_ptr() != tensor.data_ptr():
            tensor.copy_(data.view_as(tensor))


# Elastic mode (horovodrun --host-discovery-script): ranks may go and come


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
    return _world(threads, gather(here, "machine_names").count(here), None)


class ElasticState(State):
    """What survives a lost rank: a copy in memory, taken at each commit, of what `capture`
    returns; after a failure `apply` puts it back, and `sync` gives every rank rank 0's.

    Horovod's TorchState would broadcast the optimizer with broadcast_optimizer_state, whose
    zero-gradient step on a joining rank's fresh optimizer shifts Adam's bias correction; this
    one leaves capture, apply and sync to the trainer (broadcast_training_state).
    """

    def __init__(
        self,
        capture: Callable[[], dict[str, Any]],
        apply: Callable[[dict[str, Any]], None],
        sync: Callable[[], None],
    ) -> None:
        super().__init__(bcast_object=_broadcast_host_updates, get_rank=hvd.rank)
        self._capture, self._apply, self._sync = capture, apply, sync
        self._saved: dict[str, Any] = {}
        self.failures = 0  # times the job lost a rank and went on (not undone by restore)

    def save(self) -> None:
        self._saved = copy.deepcopy(self._capture())

    def restore(self) -> None:
        self._apply(copy.deepcopy(self._saved))

    def sync(self) -> None:
        self._sync()
        self.failures = broadcast_object(self.failures, "elastic_failures")
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
                state.restore()
                state.failures += 1
                if state.failures > max_restarts:
                    raise RunFailed(
                        f"gave up after losing ranks {state.failures} time(s) "
                        f"(--max-restarts {max_restarts})"
                    ) from lost
            except HostsUpdatedInterrupt:
                pass
            hvd.shutdown()
            hvd.init()
            state.on_reset()
    finally:
        notification_manager.remove_listener(state)
