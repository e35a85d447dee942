"""How a job's ranks come together, one class per way (as training/sync.py has one class per
strategy), so that the rest of training/ asks its membership and branches on no mode.

- `Fixed`: the same ranks from the start to the end (horovodrun, mpirun, srun, fit()). They
  prepare together, rank 0 holds the output folder for the run, and the job runs once.
- `Elastic` (training/elastic.py): horovodrun's elastic mode, where ranks go and come. Each
  rank prepares alone, the output is checked once the ranks are together, and the job runs
  inside Horovod's elastic loop.

A new way (Spark's tasks) is one new subclass, chosen in train.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import torch

from hvd_cpu.config.options import TrainConfig
from hvd_cpu.output.model_files import Checkpoint
from hvd_cpu.runtime.lifecycle import stopping_gently
from hvd_cpu.runtime.world import World
from hvd_cpu.training.job import Job, job_ends
from hvd_cpu.training.prepare import Start, open_output_together
from hvd_cpu.training.scope import RunScope
from hvd_cpu.training.stopping import StopAgreed, StopCheck


class Membership(ABC):
    """A way the ranks come together; prepare() asks it what prepare.Joining says."""

    @abstractmethod
    def start(self, config: TrainConfig, world: World) -> Start:
        """Before preparing: check the output (or leave that for later) and say what to
        prepare from."""

    @abstractmethod
    def has_validation(self, held_out: int, world: World) -> bool:
        """Whether the job has held-out rows, given this rank's `held_out`."""

    @abstractmethod
    def run(self, job: Job, world: World, resumed: Checkpoint | None) -> None:
        """The job's epochs, from `resumed` (rank 0's), to its end."""

    @abstractmethod
    def after_failure(self, output: Path, job: Job | None) -> str:
        """What becomes of the job when one of its ranks fails on its own (said by that rank,
        runtime/failure.py), and what the user does next."""


class Fixed(Membership):
    def __init__(self, scope: RunScope | None = None) -> None:
        self.scope = scope  # the run's: it watches the ranks and holds the output (bench: none)

    def start(self, config: TrainConfig, world: World) -> Start:
        if self.scope:
            self.scope.watch(world, config.stall_seconds, elastic=False)
        resumed = open_output_together(config, world, self.scope)
        fitted = world.collectives.broadcast_object(resumed.features if resumed else None, "fitted")
        return Start(world, resumed, fitted)

    def has_validation(self, held_out: int, world: World) -> bool:
        return bool(world.collectives.sum(torch.tensor([held_out]), "val_rows") > 0)

    def run(self, job: Job, world: World, resumed: Checkpoint | None) -> None:
        job.start(world, resumed)
        with stopping_gently():  # a SIGTERM stops the ranks at one step, saved (preemption)
            try:
                job.run(world, after_step=StopCheck(job.trainer))
            except StopAgreed:
                raise job.stopped_here(world) from None

    def after_failure(self, output: Path, job: Job | None) -> str:
        saved = job.saved_epoch if job else None
        return job_ends(output, saved, "run the same command with --resume")
