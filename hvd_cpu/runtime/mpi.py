"""Under MPI, hvd-cpu's own communicator beside Horovod's: the job's collectives called
directly from the training thread instead of through Horovod's background thread, and what
--allreduce direct averages gradients over.

Why (the numbers: docs/measurements.md): Horovod hands each collective to a background thread
that agrees on it with the other ranks' threads (a collective of its own) and then runs it;
hvd.DistributedOptimizer adds a Python hook per gradient. With one core per rank those
hand-overs cost as much as a small model's whole step, while MPI's shared-memory transport
moves its gradients in microseconds.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

import torch

from hvd_cpu.errors import InputError
from hvd_cpu.runtime.collectives import Collectives
from hvd_cpu.runtime.cores import usable_cores

# Open MPI's setting: a rank waiting for a message yields its core between polls.
YIELD_WHEN_IDLE = "OMPI_MCA_mpi_yield_when_idle"


def yield_when_oversubscribed() -> None:
    """Before MPI starts: when this host runs more ranks than it has cores, a rank waiting in
    MPI gives its core away instead of busy-polling for the message.

    Open MPI decides that itself only when it knows it is oversubscribed; horovodrun -np 4
    on a 2-core host tells it of 4 slots, and the two waiting ranks then spin on the cores
    the two computing ones need (docs/measurements.md, "More ranks than cores").
    """
    ranks_here = os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "")
    if ranks_here.isdigit() and int(ranks_here) > usable_cores():
        os.environ.setdefault(YIELD_WHEN_IDLE, "1")


def checked_communicator(comm: Any) -> Any:
    """The communicator the job runs on: `comm`, or all ranks MPI started; MPI initialised
    by mpi4py (which asks for MPI_THREAD_MULTIPLE) and checked for what Horovod needs."""
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


def finalize_mpi() -> None:
    """End MPI in a rank that leaves early with the others (bad input seen by all), if mpi4py
    started it: Open MPI counts a rank that exits without MPI_Finalize as "exiting improperly",
    even with code 0, and mpirun then ends with 1 or with rank 0's 2, whichever exits first.
    (Horovod finalizes the MPI it started itself in its shutdown.)"""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()


class MpiCollectives(Collectives):
    """The collectives over `comm`, a duplicate of the job's communicator: our messages never
    meet Horovod's or the caller's. MPI matches collectives by order, so names are unused."""

    in_calling_thread = True

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI

        self.comm = comm
        self.scale = 1.0 / comm.Get_size()  # as Horovod's Average: sum, then times 1/size
        self._sum, self._in_place = MPI.SUM, MPI.IN_PLACE

    def _sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        self.comm.Allreduce(self._in_place, tensor.detach().numpy(), op=self._sum)
        return tensor

    def sum(self, values: torch.Tensor, name: str) -> torch.Tensor:
        return self._sum_(values.clone())

    def average_(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return self._sum_(tensor).mul_(self.scale)

    def broadcast_(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for tensor in tensors.values():
            data = tensor.reshape(-1).contiguous()  # the tensor itself, unless it is strided
            self.comm.Bcast(data.view(torch.uint8).numpy(), root=0)
            if data.data_ptr() != tensor.data_ptr():
                tensor.copy_(data.view_as(tensor))

    def broadcast_object(self, obj: Any, name: str) -> Any:
        return self.comm.bcast(obj, root=0)

    def gather(self, obj: Any, name: str) -> list[Any]:
        return self.comm.allgather(obj)
