"""Every direct Horovod call of hvd-cpu, so the rest of the code never imports Horovod.

Keeping them in one place is what lets a second launcher (MPI) or Horovod's elastic mode
replace how ranks start and agree without touching the data or training code.
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import horovod
import horovod.torch as hvd
import numpy as np
import torch

from hvd_cpu.errors import InputError

# Environment variables through which launchers tell a process its rank before init.
RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
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

    @property
    def is_root(self) -> bool:
        return self.rank == 0


def launch_rank_known() -> bool:
    """Whether a launcher started this process as one rank of a job."""
    return any(name in os.environ for name in RANK_VARIABLES)


def launch_rank() -> int:
    """This process's rank as the launcher announced it; usable before (or without) init."""
    for name in RANK_VARIABLES:
        if name in os.environ:
            return int(os.environ[name])
    return 0


def usable_cores() -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup CPU quota (a
    container's --cpus) when one is set, in cgroup v2 or v1 form."""
    cores = len(os.sched_getaffinity(0))
    quota = _cgroup_cpu_quota()
    return min(cores, max(1, math.ceil(quota))) if quota else cores


def _cgroup_cpu_quota() -> float | None:
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def exit_quietly_on_signals() -> None:
    """End this process at once, with status 128 + signal, on SIGTERM or SIGINT.

    horovodrun stops the remaining ranks with SIGTERM when one rank fails. Dying by the
    signal makes each rank's shell print "Terminated", and a Python handler would wait while
    the main thread is blocked in a collective. Instead the C-level handler writes the signal
    number to a pipe (whichever thread the kernel picked), and a thread waiting on it exits.
    """
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)

    def exit_on_signal() -> None:
        while (signum := os.read(read_end, 1)[0]) not in (signal.SIGTERM, signal.SIGINT):
            pass
        exit_now(128 + signum)

    threading.Thread(target=exit_on_signal, name="exit-on-signal", daemon=True).start()


def exit_now(code: int) -> None:
    """Flush and end the process without interpreter teardown or Horovod's shutdown.

    Teardown waits on peers that may be gone and restores the default signal handlers, so a
    rank that is still tearing down when horovodrun sends SIGTERM dies noisily by the signal.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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


def _returning_input_errors(func: Callable[..., Any], *args: Any) -> Any:
    """Run on a launched rank: bad input comes back as a value, not as a worker failure."""
    try:
        return func(*args)
    except InputError as exc:
        return exc


def launch(
    func: Callable[..., Any], args: tuple[Any, ...], np: int, hosts: str | None
) -> list[Any]:
    """Run `func(*args)` on `np` new ranks over Gloo (Horovod's programmatic launcher, what
    horovodrun does for a command) and return every rank's result, in rank order.

    Bad input on the ranks raises the same InputError here, with the message the command
    line would print.
    """
    results = horovod.run(
        _returning_input_errors,
        args=(func, *args),
        np=np,
        hosts=hosts,
        use_gloo=True,
        disable_cache=True,
    )
    errors = [result for result in results if isinstance(result, InputError)]
    if errors:
        raise errors[0]
    return results


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


def init(threads: int | None = None) -> World:
    """Join the job (a job of one without a launcher) and give this rank its share of cores.

    Without a thread budget every rank would start one thread per core, and N ranks on N
    cores would fight over N x N threads.
    """
    exit_quietly_on_signals()
    if launch_rank_known():
        end_with_parent()
    hvd.init()
    threads = threads or max(1, usable_cores() // hvd.local_size())
    torch.set_num_threads(threads)
    return World(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), threads)


def agree_on_error(message: str | None) -> None:
    """Raise the same InputError on every rank if any rank found one, else return.

    Every rank calls this once after reading its input, so a problem seen by one rank only
    (a file missing on one host) ends all ranks instead of leaving them in a collective.
    """
    reports = hvd.allgather_object((socket.gethostname(), message), name="agree_on_error")
    failed = [(rank, host, text) for rank, (host, text) in enumerate(reports) if text]
    if failed:
        rank, host, text = failed[0]
        everywhere = len(failed) == len(reports)
        raise InputError(text if everywhere else f"on rank {rank} ({host}): {text}")


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
    hvd.allreduce_(flat, op=hvd.Average, name="average_parameters")
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
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer.load_state_dict(
        broadcast_object(optimizer.state_dict() if hvd.rank() == 0 else None, "optimizer_state")
    )


def broadcast_object(obj: Any, name: str) -> Any:
    """Rank 0's object on every rank (other ranks pass anything, typically None)."""
    return hvd.broadcast_object(obj, root_rank=0, name=name)


def sum_over_ranks(values: torch.Tensor, name: str) -> torch.Tensor:
    """Element-wise sum of a small tensor over all ranks (for metrics, not gradients)."""
    return hvd.allreduce(values, op=hvd.Sum, name=name)


def gather(obj: Any, name: str) -> list[Any]:
    """Every rank's object, in rank order, on every rank. `name` must be the same on every
    rank (Horovod matches collectives by name; its default, the object's type, may differ)."""
    return hvd.allgather_object(obj, name=name)


class Collectives:
    """The statistics collectives that data.features needs, over all ranks of the job."""

    def sum(self, values: np.ndarray) -> np.ndarray:
        tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64))
        return hvd.allreduce(tensor, op=hvd.Sum, name="statistics").numpy()

    def gather(self, obj: Any) -> list[Any]:
        return gather(obj, name="statistics")
