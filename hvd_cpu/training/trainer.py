"""One rank's model, optimizer, shard and loop state, and the epoch it trains.

All state that changes during training is the model, the optimizer and one `LoopState`;
a checkpoint saves these three (with the fitted features and the options, to resume), and
`--resume` (or, under --elastic, the last commit in memory) restores them from rank 0.
"""

from __future__ import annotations

import os
import resource
import socket
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from hvd_cpu.config.options import Task, TrainConfig
from hvd_cpu.data.features import FeatureTransform
from hvd_cpu.data.loader import OwnRowsSampler, ShardedBatches, ShardSampler
from hvd_cpu.model.losses import Loss
from hvd_cpu.model.networks import parameter_digest
from hvd_cpu.model.optim import adam
from hvd_cpu.output.console import Progress
from hvd_cpu.output.model_files import Checkpoint
from hvd_cpu.runtime import startup
from hvd_cpu.runtime.world import World
from hvd_cpu.training import sync
from hvd_cpu.training.precision import Precision
from hvd_cpu.training.prepare import Prepared
from hvd_cpu.training.schedule import scaled_lr, scheduled_lr
from hvd_cpu.training.state import EpochMetrics, LoopState
from hvd_cpu.training.validation import Validation


class Trainer:
    """One rank's part of the job; how it stays in step with the others is its
    `gradient_sync`."""

    def __init__(
        self,
        config: TrainConfig,
        model: nn.Module,
        loss_fn: Loss,
        batches: ShardedBatches,
        validation: Validation | None,
        world: World,
        precision: Precision,
    ) -> None:
        self.config = config
        self.model = model
        self.precision = precision
        self.gradient_sync = sync.choose(config, adam(model.parameters(), config.lr), model, world)
        self.optimizer = self.gradient_sync.optimizer
        self.batches = batches
        self.validation = validation
        self.classification = config.task == Task.CLASSIFICATION
        self.loss_fn = loss_fn
        self.state = LoopState(precision=precision.name)
        # This rank's sums of the epoch running: loss, samples, correct; seconds waited; start.
        self.epoch_sums = torch.zeros(3, dtype=torch.float64)
        self.epoch_waited = 0.0
        self.epoch_start = time.perf_counter()
        self._schedule_for(world)

    def _schedule_for(self, world: World) -> None:
        """The lr schedule for `world`'s size, and this rank's place in it (again whenever
        --elastic resizes)."""
        config = self.config
        self.world = world
        self.peak_lr = scaled_lr(
            config.lr, world.size, config.scale_lr, self.gradient_sync.global_batch_steps
        )
        self.warmup_steps = config.warmup_epochs * len(self.batches)

    def resize(self, world: World) -> None:
        """--elastic: go on with the ranks there are now; the rest of the epoch's rows are
        shared out among them, and the lr follows the global batch."""
        self.batches.sampler.reshard(world.rank, world.size)
        if self.validation:
            self.validation.reshard(world.rank, world.size)
        self.gradient_sync.resize(world)
        self._schedule_for(world)

    def lr(self) -> float:
        state = self.state
        return scheduled_lr(
            self.config.lr, self.peak_lr, state.step, self.warmup_steps, state.lr_factor
        )

    def _run_batch(
        self, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One step; returns the batch's summed loss, its count of correct predictions and the
        seconds spent waiting for the other ranks."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr()
        self.gradient_sync.zero_grad()
        with self.precision.autocast():
            out = self.model(x)
            loss = self.loss_fn(out, y)
        loss.backward()
        # A wait for the others, whatever averages (counted: this rank came this far).
        step = self.gradient_sync.step
        waited = self.world.collectives.wait_for_others(step, self.state.step + 1)
        self.state.step += 1
        correct = (out.argmax(1) == y).sum() if self.classification else torch.zeros(())
        return loss.detach().float() * len(x), correct, waited

    def epoch_trained(self) -> bool:
        """Whether the ranks have trained every row of this epoch (--elastic counts them)."""
        return self.state.epoch_rows >= len(self.batches.sampler.dataset)

    def run_epoch(
        self, progress: Progress | None, after_step: Callable[[], None] | None = None
    ) -> EpochMetrics:
        """Train on this rank's shard once, then validate; metrics are over all ranks' rows
        (under --elastic, those trained since the epoch last went on with other ranks)."""
        state = self.state
        epoch = state.epoch + 1
        lr = self.lr()
        # Derived, not carried: a resumed run draws the same random numbers (dropout...).
        torch.manual_seed(self.config.seed * 1_000_003 + epoch)
        if not state.epoch_rows:
            state.epoch_ranks = self.world.size
        self.batches.set_epoch(epoch, state.epoch_rows, state.epoch_ranks == self.world.size)
        self.model.train()
        # Summed as tensors, float64 so long epochs stay exact: the loop waits on no .item()
        # (but for the progress bar's running loss, shown on a terminal only).
        self.epoch_sums = torch.zeros(3, dtype=torch.float64)
        self.epoch_waited, self.epoch_start = 0.0, time.perf_counter()
        for x, y in self.batches:
            loss_sum, correct, batch_waited = self._run_batch(x, y)
            self.epoch_sums += torch.stack(
                [loss_sum.double(), torch.tensor(len(x)), correct.double()]
            )
            self.epoch_waited += batch_waited
            state.epoch_rows += self.config.batch_size * self.world.size
            if progress:
                progress.update(len(x), float(loss_sum) / len(x))
            if after_step:
                after_step()
        self.epoch_waited += self.gradient_sync.end_epoch()
        loss_sum, samples, correct, waited, seconds = self._epoch_so_far("epoch_totals")
        metrics = EpochMetrics(
            epoch=epoch,
            train_loss=loss_sum / samples,
            samples=int(samples),
            seconds=seconds,
            lr=lr,
            world_size=self.world.size,
            train_accuracy=correct / samples if self.classification else None,
            wait_seconds=waited / self.world.size,
        )
        if self.validation:
            metrics.val_loss, metrics.val_accuracy = self.validation.evaluate(
                self.model, self.loss_fn, self.classification, self.world.collectives
            )
            state.validated(metrics.val_loss, epoch, self.config.plateau_patience)
        state.epoch, state.epoch_rows, state.epoch_carried = epoch, 0, []
        state.history.append(metrics.record())
        return metrics

    def _epoch_so_far(self, name: str) -> list[float]:
        """Every rank: the epoch's loss, samples, correct and seconds waited, summed over the
        ranks (a collective named `name`), and its seconds; parts before a stop included."""
        mine = torch.cat([self.epoch_sums, torch.tensor([self.epoch_waited], dtype=torch.float64)])
        sums = self.world.collectives.sum(mine, name).tolist()
        sums.append(time.perf_counter() - self.epoch_start)
        return [a + b for a, b in zip(self.state.epoch_carried or [0.0] * 5, sums, strict=True)]

    def carry_epoch(self) -> None:
        """Every rank, at an agreed stop inside an epoch: the epoch's sums so far go into
        LoopState (what the checkpoint holds), so the epoch, resumed, reports the loss, samples
        and time of all of it, as a run never stopped does."""
        self.state.epoch_carried = self._epoch_so_far("epoch_carried")

    def done(self) -> bool:
        return self.state.finished(self.config.epochs, self.config.patience)

    def snapshot(self) -> dict[str, Any]:
        """The state that changes while training (what an elastic commit keeps)."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "loop": asdict(self.state),
        }

    def checkpoint(self, transform: FeatureTransform) -> Checkpoint:
        """What --resume needs: the snapshot, the fitted features and the options."""
        return Checkpoint(
            **self.snapshot(), features=transform.to_dict(), config=self.config.to_dict()
        )

    def load(self, model: dict[str, Any], optimizer: dict[str, Any], loop: dict[str, Any]) -> None:
        """Take the state of a snapshot (or checkpoint) on this rank."""
        self.model.load_state_dict(model)
        self.optimizer.load_state_dict(optimizer)
        self.state = LoopState(**loop)

    def take_root_state(self) -> None:
        """Every rank takes rank 0's parameters, optimizer state and loop state.

        The optimizer state goes as one object: Horovod's broadcast_optimizer_state would first
        take a zero-gradient step on a fresh optimizer, which shifts Adam's bias correction.
        """
        collectives = self.world.collectives
        collectives.broadcast_(self.model.state_dict())
        optimizer = collectives.broadcast_object(
            self.optimizer.state_dict() if self.world.is_root else None, "optimizer_state"
        )
        self.optimizer.load_state_dict(optimizer)
        self.state = LoopState(**collectives.broadcast_object(asdict(self.state), "loop_state"))

    def restore(self, saved: Checkpoint | None) -> None:
        """Rank 0 loads `saved` (if resuming); then every rank takes rank 0's state."""
        if saved is not None:
            self.load(saved.model, saved.optimizer, saved.loop)
        self.take_root_state()
        self.state.precision = self.precision.name  # --precision may differ from the resumed


def build_trainer(
    config: TrainConfig,
    world: World,
    prepared: Prepared,
    model: nn.Module,
    precision: Precision | None = None,
) -> Trainer:
    """A Trainer of `model` over this rank's shard of `prepared`, in `precision` (default:
    the one prepared chose)."""
    rows, rank, size, seed = len(prepared.train_rows), world.rank, world.size, config.seed
    sampler: ShardSampler
    if config.shard_read:  # its own rows, padded to the longest rank's
        sampler = OwnRowsSampler(rows, rank, size, config.shuffle, seed, prepared.train_length)
    else:
        sampler = ShardSampler(rows, rank, size, config.shuffle, seed)
    batches = ShardedBatches(prepared.arrays, prepared.train_rows, config.batch_size, sampler)
    validation = None
    if prepared.has_validation:
        arrays = prepared.arrays
        x, y = torch.from_numpy(arrays.x), torch.from_numpy(arrays.y)
        validation = Validation(x, y, prepared.val_rows)
    return Trainer(
        config, model, prepared.loss_fn, batches, validation, world,
        precision or prepared.precision,
    )  # fmt: skip


def rank_report(world: World, trainer: Trainer, first_step_unix: float) -> dict[str, Any]:
    """This rank's entry in ranks.json: where it ran, on how much, at what cost, and a digest
    of its parameters (every rank must end with the same model)."""
    return {
        "rank": world.rank,
        "local_rank": world.local_rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "threads": world.threads,
        "controller": world.controller,
        "transport": world.transport,
        "sync": trainer.gradient_sync.described,
        "precision": trainer.precision.described,
        "shard_rows": len(trainer.batches.sampler),
        "rows_read": len(trainer.batches.x),  # encoded here: all rows, or its own (--shard-read)
        "epochs_run": trainer.state.epoch,
        "first_step_unix": round(first_step_unix, 3),
        "start_seconds": startup.seconds_since_start(),  # from the process's start, by phase
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "param_sha256": parameter_digest(trainer.model),
    }
