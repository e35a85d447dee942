"""How the ranks stay in step: one class per strategy behind one interface (as Horovod's
optimizer classes are), chosen once by `choose`. A new strategy is one new subclass.

- `HorovodAveraging` (the default): Horovod's DistributedOptimizer averages every gradient
  each step, on its background thread, as backward produces them (either controller).
- `DirectAveraging` (--allreduce direct): the gradients live in one flat buffer (each
  parameter's .grad is a view into it), averaged by one collective from the training thread:
  no copies, none of Horovod's per-step cycle (MPI controller only; runtime/mpi.py says why).
- `LocalSGD` (--sync-every K > 1): each rank steps on its own batches; the parameters are
  averaged every K steps and at the end of each epoch: K times fewer waits.

A strategy that steps without Horovod's cycle also answers False in config's
`steps_use_horovod` (which slows that cycle down before any strategy exists).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from hvd_cpu.config.options import TrainConfig
from hvd_cpu.errors import InputError
from hvd_cpu.runtime import horovod
from hvd_cpu.runtime.collectives import Collectives


class GradientSync(ABC):
    """One rank's optimizer and the way its steps stay in step with the other ranks'."""

    # A step is one step of the global batch (batch size x ranks): the lr scales with it.
    global_batch_steps = True
    # How the run's summary says the ranks stayed in step.
    described = "gradients averaged by hvd.DistributedOptimizer"

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer  # what is stepped, checkpointed and broadcast

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()  # Horovod's wrapper takes no arguments

    @abstractmethod
    def step(self, steps_taken: int) -> float:
        """After backward: synchronise and step (the `steps_taken`-th step, counting this
        one); returns the seconds spent waiting for the other ranks."""

    def end_epoch(self) -> float:
        """After an epoch's last step: what every rank must share before it validates and
        saves; returns the seconds spent waiting."""
        return 0.0


class HorovodAveraging(GradientSync):
    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        super().__init__(horovod.wrap_optimizer(optimizer, model))

    def step(self, steps_taken: int) -> float:
        return horovod.averaged_step(self.optimizer)


class DirectAveraging(GradientSync):
    described = "gradients averaged by one MPI allreduce per step (direct)"

    def __init__(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, collectives: Collectives
    ) -> None:
        super().__init__(optimizer)
        params = [p for p in model.parameters() if p.requires_grad]
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
        self.collectives = collectives

    def zero_grad(self) -> None:
        self.flat.zero_()  # never None: the gradients are views of the buffer

    def step(self, steps_taken: int) -> float:
        start = time.perf_counter()
        self.collectives.average_(self.flat, "gradients")
        waited = time.perf_counter() - start
        self.optimizer.step()
        return waited


class LocalSGD(GradientSync):
    global_batch_steps = False  # a step sees one rank's batch: its lr stays as given

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        collectives: Collectives,
        every: int,
    ) -> None:
        super().__init__(optimizer)
        self.model, self.collectives, self.every = model, collectives, every
        self.described = f"parameters averaged every {every} steps"

    def step(self, steps_taken: int) -> float:
        self.optimizer.step()
        return self._average_parameters() if steps_taken % self.every == 0 else 0.0

    def end_epoch(self) -> float:
        return self._average_parameters()  # every rank validates and saves the same model

    def _average_parameters(self) -> float:
        """Every rank's parameters replaced by their mean, as one collective."""
        start = time.perf_counter()
        parameters = list(self.model.parameters())
        flat = torch.nn.utils.parameters_to_vector(parameters).detach()
        self.collectives.average_(flat, "average_parameters")
        with torch.no_grad():
            for parameter, mean in zip(
                parameters, flat.split([p.numel() for p in parameters]), strict=True
            ):
                parameter.copy_(mean.view_as(parameter))
        return time.perf_counter() - start


def choose(
    config: TrainConfig,
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    world: horovod.World,
) -> GradientSync:
    """The strategy the options ask for. A job of one takes Horovod's whatever they say: with
    nobody to wait for, its average is the gradient itself."""
    if world.size > 1 and config.sync_every > 1:
        return LocalSGD(optimizer, model, world.collectives, config.sync_every)
    if world.size > 1 and config.allreduce == "direct":
        if not world.collectives.in_calling_thread:
            raise InputError(
                "--allreduce direct needs the MPI controller: launch with horovodrun --mpi "
                "or mpirun, or leave out --allreduce direct"
            )
        return DirectAveraging(optimizer, model, world.collectives)
    return HorovodAveraging(optimizer, model)
