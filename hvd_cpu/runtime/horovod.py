"""Every direct Horovod call of hvd-cpu, so the rest of the code never imports Horovod:
Horovod's side of a job, each as small as it can be. Starting and stopping it, where this rank
stands, what this build can do; its collectives (the Horovod backends of runtime/collectives.py:
through its background thread, or under Gloo through shared memory from the calling thread);
its DistributedOptimizer; its launcher, and the Gloo rendezvous it holds for ranks that
others start (Spark's tasks); its elastic state. What to do with them is decided
elsewhere: joining the job and choosing the backend in join.py, launching in launch.py, the
elastic loop in elastic_loop.py.

Horovod has two controllers, and which one a job uses is decided by how it was started:
`horovodrun --gloo` (or a plain process) runs Gloo; `horovodrun --mpi`, `mpirun`, `srun
--mpi=pmix` or a user's own mpi4py program run MPI. Between the ranks of one host both move
bytes through shared memory, which is what makes several ranks on one host pay: MPI by
itself, Gloo through our build's gloo-shared-memory patch (TCP without it).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import horovod
import horovod.torch as hvd
import torch
from horovod.common.elastic import State, notification_manager
from horovod.common.exceptions import HostsUpdatedInterrupt

from hvd_cpu.runtime.collectives import Collectives
from hvd_cpu.runtime.secret import JOB_KEY
from hvd_cpu.runtime.world import SHARED_MEMORY

WAKE_ON_WAIT_PATCH = f"horovod-{horovod.__version__}-wake-on-wait.patch"
SHARED_MEMORY_PATCH = f"horovod-{horovod.__version__}-gloo-shared-memory.patch"
# Raised by a collective when another rank has gone (crashed, killed, host lost).
PeerLost = hvd.HorovodInternalError
# Raised in the elastic loop when hosts came or went.
HostsUpdated = HostsUpdatedInterrupt


# Starting, stopping, and where this rank stands


def start(comm: Any = None) -> None:
    """Start Horovod: on `comm` (an mpi4py communicator) under MPI, else as launched."""
    if comm is None:
        hvd.init()
    else:
        hvd.init(comm=comm)


def restart() -> None:
    """Start Horovod again with the ranks there are now (elastic mode, after a reset)."""
    hvd.shutdown()
    hvd.init()


def stop() -> None:
    """Shut Horovod down, if it runs."""
    if hvd.is_initialized():
        hvd.shutdown()


class Place(NamedTuple):
    """Where this process stands in the job (the World's first four fields)."""

    rank: int
    size: int
    local_rank: int
    local_size: int


def place() -> Place:
    return Place(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size())


def controller() -> str:
    """Which controller carries this job's collectives: "mpi" or "gloo"."""
    return "mpi" if hvd.mpi_enabled() else "gloo"


def mpi_built() -> bool:
    """Whether this Horovod was built with MPI (a Gloo-only build has none)."""
    return bool(hvd.mpi_built())


def build_info() -> dict[str, bool]:
    """What this Horovod build can do (horovodrun --check-build, as data)."""
    return {"pytorch": True, "gloo": bool(hvd.gloo_built()), "mpi": bool(hvd.mpi_built())}


def gloo_transport() -> str:
    """How Horovod's Gloo collectives move bytes between the ranks of a host: through shared
    memory (our build's gloo-shared-memory patch, where every host's ranks can share a segment
    in /dev/shm), or TCP, and why."""
    if not has_patch(SHARED_MEMORY_PATCH):
        why_not = "this Horovod has no gloo-shared-memory patch; hvd-cpu install-horovod builds it"
    else:
        why_not = hvd.gloo_shared_memory()
    return f"TCP ({why_not})" if why_not else SHARED_MEMORY


def direct_path_open() -> bool:
    """Whether hvd.direct_allreduce_ runs here: its own shared-memory path, which may be
    closed where Horovod's collectives go through shared memory (HOROVOD_CPU_OPERATIONS
    other than gloo)."""
    # A build before our shared-memory-agreement patch says only process set 0's.
    return getattr(hvd, "direct_allreduce_why_not", hvd.gloo_shared_memory)() == ""


def wakes_on_wait() -> bool:
    """Whether this Horovod is hvd-cpu's build with the wake-on-wait patch. Any other (one a
    user built or installed) keeps its cycle: at 100 ms, each collective would wait for it."""
    return has_patch(WAKE_ON_WAIT_PATCH)


def has_patch(name: str) -> bool:
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


# Launching ranks from Python


def run(
    func: Callable[..., Any], args: tuple[Any, ...], np: int, hosts: str | None, controller: str
) -> list[Any]:
    """Horovod's programmatic launcher: `func(*args)` on `np` new ranks, every result."""
    return horovod.run(
        func,
        args=args,
        np=np,
        hosts=hosts,
        use_gloo=controller == "gloo",
        use_mpi=controller == "mpi",
        disable_cache=True,
    )


# Elastic mode (horovodrun --host-discovery-script): ranks may go and come


class ElasticState(State):
    """What survives a lost rank: a copy in memory, taken at each commit, of what `capture`
    returns; after a failure `apply` puts it back; at each (re)start `rejoin` gives every rank
    its new place and rank 0's state (what Horovod's State calls sync).

    Horovod's TorchState would broadcast the optimizer with broadcast_optimizer_state, whose
    zero-gradient step on a joining rank's fresh optimizer shifts Adam's bias correction; this
    one leaves capture, apply and rejoin to the training code (training/elastic.py), and its
    broadcasts to `broadcast(obj, name)`: the world's, counted, so that the stall watch sees a
    rank waiting in a commit as waiting, not as stuck behind the others.
    """

    def __init__(
        self,
        capture: Callable[[], dict[str, Any]],
        apply: Callable[[dict[str, Any]], None],
        rejoin: Callable[[], None],
        broadcast: Callable[[Any, str], Any],
    ) -> None:
        super().__init__(
            bcast_object=lambda update: broadcast(update, "elastic_host_updates"),
            get_rank=hvd.rank,
        )
        self._capture, self._apply, self._rejoin = capture, apply, rejoin
        self._broadcast = broadcast
        self._saved: dict[str, Any] = {}
        self.failures = 0  # times the job lost a rank and went on (not undone by restore)

    def save(self) -> None:
        self._saved = copy.deepcopy(self._capture())

    def restore(self) -> None:
        self._apply(copy.deepcopy(self._saved))

    def sync(self) -> None:
        self._rejoin()
        self.failures = self._broadcast(self.failures, "elastic_failures")
        self.save()


def listen_for_host_updates(state: ElasticState) -> None:
    notification_manager.init()
    notification_manager.register_listener(state)


def stop_listening(state: ElasticState) -> None:
    notification_manager.remove_listener(state)


# Ranks started by others (Spark's tasks): the Gloo rendezvous horovodrun would hold


class Slot(NamedTuple):
    """One rank's place, as horovodrun lays ranks out over hosts."""

    host: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int


def _assignments(hosts: list[tuple[str, int]]) -> list[Any]:
    from horovod.runner.common.util.hosts import HostInfo, get_host_assignments

    ranks = sum(count for _, count in hosts)
    return get_host_assignments([HostInfo(host, count) for host, count in hosts], ranks)


def lay_out(hosts: list[tuple[str, int]]) -> list[Slot]:
    """Every rank's place for (host, ranks there) pairs, in rank order."""
    return [
        Slot(s.hostname, s.rank, s.local_rank, s.cross_rank, s.size, s.local_size, s.cross_size)
        for s in _assignments(hosts)
    ]


def serve_rendezvous(
    hosts: list[tuple[str, int]], key: bytes, address: str
) -> tuple[Callable[[], None], int]:
    """Start the rendezvous server the ranks of `hosts` meet at (Gloo's, as horovodrun starts
    it), listening on `address` only and answering only requests signed with the job's `key`
    (our build's signed-rendezvous patch); (how to stop it, its port)."""
    from horovod.runner.http.http_server import RendezvousServer

    server = RendezvousServer(key=key)
    port = server.start(address=address)
    server.init(_assignments(hosts))
    return server.stop, port


def gloo_environment(
    slot: Slot, server: str, port: int, interface: str | None, key: bytes
) -> dict[str, str]:
    """The environment horovodrun gives a Gloo rank at `slot` (its gloo_run), the rendezvous
    at server:port; `interface`: the network interface its peers reach it on; `key`: the job's
    secret, which its rendezvous requests are signed with."""
    env = {"RENDEZVOUS_ADDR": server, "RENDEZVOUS_PORT": port} | (
        {"IFACE": interface} if interface else {}
    )
    place = {"HOSTNAME": slot.host, "RANK": slot.rank, "SIZE": slot.size}
    place |= {"LOCAL_RANK": slot.local_rank, "LOCAL_SIZE": slot.local_size}
    place |= {"CROSS_RANK": slot.cross_rank, "CROSS_SIZE": slot.cross_size}
    return (
        {f"HOROVOD_GLOO_{name}": str(value) for name, value in env.items()}
        | {f"HOROVOD_{name}": str(value) for name, value in place.items()}
        | {"HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", JOB_KEY: key.hex()}
    )
