"""`--allreduce direct`: every gradient averaged by one MPI_Allreduce, called from the training
thread on the job's MPI communicator, beside Horovod (which still starts, broadcasts and
averages metrics).

Why it exists, measured on a 2-core VM (docs/measurements.md, "Horovod's own overhead"):
Horovod's DistributedOptimizer hands each gradient to a background thread that negotiates with
the other ranks and runs the allreduce on its next cycle. With one core per rank that machinery
costs about 0.7-1.5 ms per step over MPI, several times a small model's whole step, while MPI's
shared-memory transport moves the same 705 floats in microseconds. Here the gradients live in
one flat buffer (each parameter's .grad is a view into it), so the allreduce is one call with no
copies.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from hvd_cpu.errors import InputError


class FlatGradients:
    """The gradients of `parameters` as views into one buffer, averaged over `comm`'s ranks."""

    def __init__(self, parameters: Iterable[torch.nn.Parameter], comm: Any) -> None:
        from mpi4py import MPI

        params = [p for p in parameters if p.requires_grad]
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise InputError(
                f"--allreduce direct needs parameters of one dtype, the model has {dtypes}; "
                "use --allreduce horovod"
            )
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=dtypes.pop())
        offset = 0
        for p in params:
            # Backward accumulates into an existing .grad in place, so it writes here.
            p.grad = self.flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.buffer = self.flat.numpy()  # the same memory, as MPI sees it
        self.comm = comm
        self.sum = MPI.SUM
        self.in_place = MPI.IN_PLACE
        self.scale = 1.0 / comm.Get_size()  # as Horovod's Average: sum, then times 1/size

    def zero(self) -> None:
        """Before backward: gradients start from zero (never None: they are our views)."""
        self.flat.zero_()

    def average(self) -> float:
        """Replace every rank's gradients with their mean; returns the seconds it took."""
        start = time.perf_counter()
        self.comm.Allreduce(self.in_place, self.buffer, op=self.sum)
        self.flat.mul_(self.scale)
        return time.perf_counter() - start
