"""How the ranks stay in step: one class per strategy behind one interface (as Horovod's
optimizer classes are), chosen once by `choose`. A new strategy is one new subclass.

- `HorovodAveraging` (the default): Horovod's DistributedOptimizer averages every gradient
  each step, on its background thread, as backward produces them (either controller).
- `DirectAveraging` (--allreduce direct, and auto's choice where there is one): the gradients
  live in one flat buffer per dtype (each parameter's .grad is a view into it), averaged by
  one collective from the training thread: no copies, no hooks, no hand-over to Horovod's
  cycle (MPI's, or Gloo's through shared memory: runtime/mpi.py and horovod.py say why).
- `LocalSGD` (--sync-every K > 1): each rank steps on its own batches; the parameters are
  averaged every K steps and at the end of each epoch: K times fewer waits.

Which averaging runs every step is decided in one place, `averaging` (--allreduce auto resolved
from what the World's backend can do), which the trainer and bench both call through `choose`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hvd_cpu.config.options import TrainConfig
from hvd_cpu.errors import InputError
from hvd_cpu.runtime import horovod
from hvd_cpu.runtime.collectives import Collectives
from hvd_cpu.runtime.world import World

# Parameter dtypes the direct allreduces cannot sum (numpy and Horovod's Gloo have no bfloat16;
# MPI no float16 sum).
HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Averaging:
    """How a job averages gradients every step (--allreduce, `auto` resolved: horovod or
    direct) and why: the summary and ranks.json say both."""

    allreduce: str
    why: str


def averaging(requested: str, world: World) -> Averaging:
    """What --allreduce means on `world`: `auto` is the fastest exact average measured here
    (docs/measurements.md), one allreduce per step from the training thread (direct) wherever
    the backend has one (MPI; Gloo through shared memory), also with more ranks than cores;
    otherwise Horovod's DistributedOptimizer."""
    if requested != "auto":
        return Averaging(requested, f"--allreduce {requested}")
    if world.averages_directly:
        over = "under MPI" if world.controller == "mpi" else "over Gloo's shared memory"
        return Averaging("direct", f"auto: the fastest {over}")
    return Averaging("horovod", f"auto: no direct allreduce (Gloo over {world.transport})")


class GradientSync(ABC):
    """One rank's optimizer and the way its steps stay in step with the other ranks'."""

    # A step is one step of the global batch (batch size x ranks): the lr scales with it.
    global_batch_steps = True
    # What the run's summary says the ranks did to stay in step; `why` says why (if chosen).
    what = "gradients averaged by hvd.DistributedOptimizer"

    # The strategies that average by themselves do it over these (Horovod's optimizer: None).
    collectives: Collectives | None = None

    def __init__(self, optimizer: Any, why: str = "") -> None:
        self.optimizer = optimizer  # what is stepped, checkpointed and broadcast
        self.why = why

    def resize(self, world: World) -> None:
        """--elastic: average over the ranks there are now (a job of one, alone: over the
        old ranks' collectives it would wait for ranks that are gone)."""
        if self.collectives is not None:
            self.collectives = world.collectives

    @property
    def described(self) -> str:
        """How the run's summary says the ranks stayed in step."""
        return f"{self.what} ({self.why})" if self.why else self.what

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
    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, why: str = "") -> None:
        super().__init__(horovod.wrap_optimizer(optimizer, model), why)

    def step(self, steps_taken: int) -> float:
        return horovod.averaged_step(self.optimizer)


class DirectAveraging(GradientSync):
    what = "gradients averaged by one allreduce per step"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        collectives: Collectives,
        why: str = "",
    ) -> None:
        super().__init__(optimizer, why)
        params = [p for p in model.parameters() if p.requires_grad]
        self.buffers: list[torch.Tensor] = []  # one per dtype, in the model's order
        for dtype in dict.fromkeys(p.dtype for p in params):
            group = [p for p in params if p.dtype == dtype]
            flat = torch.zeros(sum(p.numel() for p in group), dtype=dtype)
            offset = 0
            for p in group:
                # Backward accumulates into an existing .grad in place, so it writes here.
                p.grad = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            self.buffers.append(flat)
        self.collectives = collectives

    def zero_grad(self) -> None:
        for flat in self.buffers:
            flat.zero_()  # never None: the gradients are views of the buffers

    def step(self, steps_taken: int) -> float:
        start = time.perf_counter()
        for flat in self.buffers:
            if flat.dtype in HALF_DTYPES:  # summed as float32 (see HALF_DTYPES)
                flat.copy_(self.collectives.average_(flat.float(), "gradients"))
            else:
                self.collectives.average_(flat, "gradients")
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
        self.what = f"parameters averaged every {every} steps"

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
    world: World,
) -> GradientSync:
    """The strategy the options ask for. A job of one takes Horovod's whatever they say: with
    nobody to wait for, its average is the gradient itself."""
    if world.size == 1:
        return HorovodAveraging(optimizer, model)
    if config.sync_every > 1:
        return LocalSGD(optimizer, model, world.collectives, config.sync_every)
    chosen = averaging(config.allreduce, world)
    if chosen.allreduce == "horovod":
        return HorovodAveraging(optimizer, model, chosen.why)
    if not world.averages_directly:
        raise InputError(
            "--allreduce direct needs MPI or Gloo through shared memory, and this job runs "
            f"Gloo over {world.transport}: launch with horovodrun --mpi, or leave out "
            "--allreduce direct"
        )
    return DirectAveraging(optimizer, model, world.collectives, chosen.why)
