"""The training loop that runs on every rank: epochs, validation, early stopping, learning
rate schedule, checkpoints.

All state that changes during training is the model, the optimizer and one `LoopState`;
checkpoints save exactly these three, and `--resume` (or, later, Horovod's elastic mode)
restores them and broadcasts them from rank 0.
"""

from __future__ import annotations

import math
import os
import resource
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hvd_cpu import checkpoint, dist
from hvd_cpu.config import TrainConfig
from hvd_cpu.data.features import FeatureTransform
from hvd_cpu.data.loader import LocalShardSampler, ShardedBatches, global_sampler
from hvd_cpu.direct_allreduce import FlatGradients
from hvd_cpu.errors import InputError, RunFailed
from hvd_cpu.models import parameter_digest, portable_spec
from hvd_cpu.optim import adam
from hvd_cpu.prepare import Prepared, prepare
from hvd_cpu.records import EpochMetrics, Progress, Records

EVAL_BATCH = 8192  # rows per forward pass when evaluating: no gradients, so bigger is cheaper


@dataclass
class LoopState:
    """Where the loop is, beyond the model and optimizer: what a checkpoint must restore."""

    epoch: int = 0  # the last finished epoch
    step: int = 0  # optimizer steps taken (drives the warm-up)
    lr_factor: float = 1.0  # lowered by reduce-on-plateau
    best_val_loss: float = math.inf
    best_epoch: int = 0
    since_best: int = 0  # epochs since the validation loss last improved
    since_lr_change: int = 0  # epochs without progress since the lr last changed
    history: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class TrainResult:
    """The trained model (identical on every rank) and every epoch's metrics."""

    model: nn.Module
    transform: FeatureTransform
    history: list[dict[str, Any]]


class Validation:
    """This rank's held-out rows; `evaluate` averages loss (and accuracy) over all ranks'."""

    def __init__(self, prepared: Prepared) -> None:
        self.x = torch.from_numpy(prepared.arrays.x)
        self.y = torch.from_numpy(prepared.arrays.y)
        self.rows = prepared.val_rows

    def evaluate(
        self, model: nn.Module, loss_fn: nn.Module, classification: bool
    ) -> tuple[float, float | None]:
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, rows, correct
        model.eval()
        with torch.no_grad():
            for batch in self.rows.split(EVAL_BATCH):
                x, y = self.x.index_select(0, batch), self.y.index_select(0, batch)
                out = model(x)
                correct = (out.argmax(1) == y).sum() if classification else 0
                totals += torch.tensor([float(loss_fn(out, y)) * len(x), len(x), float(correct)])
        loss_sum, rows, correct = dist.sum_over_ranks(totals, "validation").tolist()
        return loss_sum / rows, (correct / rows if classification else None)


class Trainer:
    """One rank's model, optimizer, shard and loop state.

    Ranks stay in step in one of three ways: by default Horovod's DistributedOptimizer
    averages the gradients of every step; with --allreduce direct one MPI_Allreduce of a flat
    buffer does the same from this thread; with --sync-every K > 1 (local SGD) each rank steps
    on its own batches and the parameters are averaged every K steps and at each epoch's end.
    """

    def __init__(
        self,
        config: TrainConfig,
        model: nn.Module,
        batches: ShardedBatches,
        validation: Validation | None,
        world: dist.World,
    ) -> None:
        world_size = world.size
        self.config = config
        self.model = model
        self.local_sgd = config.sync_every > 1 and world_size > 1
        optimizer = adam(model.parameters(), config.lr)
        self.flat: FlatGradients | None = None
        if config.allreduce == "direct" and not self.local_sgd and world_size > 1:
            if world.comm is None:
                raise InputError(
                    "--allreduce direct needs the MPI controller: launch with horovodrun --mpi "
                    "or mpirun, or leave out --allreduce direct"
                )
            self.flat = FlatGradients(model.parameters(), world.comm)
        if self.local_sgd or self.flat:
            self.optimizer = optimizer
        else:
            self.optimizer = dist.wrap_optimizer(optimizer, model)
        self.batches = batches
        self.validation = validation
        self.classification = config.task == "classification"
        self.loss_fn = nn.CrossEntropyLoss() if self.classification else nn.MSELoss()
        self.world_size = world_size
        # Gradient averaging makes one step of the global batch: Horovod scales the lr with it.
        # A local SGD step sees one rank's batch, so its lr stays as given.
        self.peak_lr = config.lr * (world_size if config.scale_lr and not self.local_sgd else 1)
        self.warmup_steps = config.warmup_epochs * len(batches)
        self.state = LoopState()

    def lr(self) -> float:
        """Horovod's warm-up from lr to lr x size over --warmup-epochs, then the plateau factor."""
        lr = self.peak_lr
        if self.state.step < self.warmup_steps:
            lr = self.config.lr + (lr - self.config.lr) * self.state.step / self.warmup_steps
        return lr * self.state.lr_factor

    def _run_batch(
        self, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One step; returns the batch's summed loss, its count of correct predictions and the
        seconds spent waiting for the other ranks."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr()
        if self.flat:
            self.flat.zero()
        else:
            self.optimizer.zero_grad()  # Horovod's wrapper takes no arguments
        out = self.model(x)
        loss = self.loss_fn(out, y)
        loss.backward()
        if self.local_sgd:
            self.optimizer.step()
            waited = 0.0
            if (self.state.step + 1) % self.config.sync_every == 0:
                waited = dist.average_parameters(self.model)
        elif self.flat:
            waited = self.flat.average()
            self.optimizer.step()
        else:
            waited = dist.averaged_step(self.optimizer)
        self.state.step += 1
        correct = (out.argmax(1) == y).sum() if self.classification else torch.zeros(())
        return loss.detach() * len(x), correct, waited

    def run_epoch(self, progress: Progress | None) -> EpochMetrics:
        """Train on this rank's shard once, then validate; metrics are over all ranks' rows."""
        state = self.state
        epoch = state.epoch + 1
        lr = self.lr()
        # Derived, not carried: a resumed run draws the same random numbers (dropout...).
        torch.manual_seed(self.config.seed * 1_000_003 + epoch)
        self.batches.set_epoch(epoch)
        self.model.train()
        # Summed as tensors so the loop never waits on .item(); float64 so long epochs stay exact.
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, samples, correct
        waited = 0.0
        start = time.perf_counter()
        for x, y in self.batches:
            loss_sum, correct, batch_waited = self._run_batch(x, y)
            totals += torch.stack([loss_sum.double(), torch.tensor(len(x)), correct.double()])
            waited += batch_waited
            if progress:
                progress.update(len(x), float(loss_sum) / len(x))
        if self.local_sgd:  # every rank validates and checkpoints the same parameters
            waited += dist.average_parameters(self.model)
        seconds = time.perf_counter() - start
        totals = torch.cat([totals, torch.tensor([waited], dtype=torch.float64)])
        loss_sum, samples, correct, waited = dist.sum_over_ranks(totals, "epoch_totals").tolist()
        metrics = EpochMetrics(
            epoch=epoch,
            train_loss=loss_sum / samples,
            samples=int(samples),
            seconds=seconds,
            lr=lr,
            world_size=self.world_size,
            train_accuracy=correct / samples if self.classification else None,
            wait_seconds=waited / self.world_size,
        )
        if self.validation:
            metrics.val_loss, metrics.val_accuracy = self.validation.evaluate(
                self.model, self.loss_fn, self.classification
            )
            self._track(metrics.val_loss, epoch)
        state.epoch = epoch
        state.history.append(metrics.record())
        return metrics

    def _track(self, val_loss: float, epoch: int) -> None:
        """Early-stopping and plateau counters; every rank sees the same allreduced loss, so
        every rank makes the same decisions."""
        state = self.state
        if val_loss < state.best_val_loss:
            state.best_val_loss, state.best_epoch = val_loss, epoch
            state.since_best = state.since_lr_change = 0
            return
        state.since_best += 1
        state.since_lr_change += 1
        patience = self.config.plateau_patience
        if patience is not None and state.since_lr_change >= patience:
            state.lr_factor /= 2
            state.since_lr_change = 0

    def done(self) -> bool:
        patience = self.config.patience
        stopped = patience is not None and self.state.since_best >= patience
        return stopped or self.state.epoch >= self.config.epochs

    def checkpoint(self, transform: FeatureTransform) -> dict[str, Any]:
        """Everything --resume needs, as plain containers and tensors."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "loop": asdict(self.state),
            "features": transform.to_dict(),
            "config": self.config.to_dict(),
        }

    def restore(self, saved: dict[str, Any] | None) -> None:
        """Rank 0 loads `saved` (if resuming); then every rank takes rank 0's state."""
        if saved is not None:
            self.model.load_state_dict(saved["model"])
            self.optimizer.load_state_dict(saved["optimizer"])
            self.state = LoopState(**saved["loop"])
        dist.broadcast_training_state(self.model, self.optimizer)
        self.state = LoopState(**dist.broadcast_object(asdict(self.state), "loop_state"))


def write_epoch(
    records: Records, metrics: EpochMetrics, saving: Trainer | None, transform: FeatureTransform
) -> None:
    """Rank 0, after an epoch: its line and metrics, and the checkpoint of `saving`, if any."""
    records.epoch(metrics)
    if saving:
        checkpoint.save(saving.checkpoint(transform), records.output / checkpoint.CHECKPOINT)


def written_by_root(
    world: dist.World, write: Callable[[], None], output: Path, saved: int | None
) -> None:
    """Rank 0 writes; then every rank learns whether that worked, so a full disk ends all of
    them with one line (and no peer is left waiting in the next collective)."""
    failure = None
    if world.is_root:
        try:
            write()
        except OSError as exc:
            kept = f"checkpoint.pt there holds epoch {saved}" if saved else "no checkpoint was kept"
            failure = (
                f"could not write to {output}: {exc.strerror}; {kept}; "
                "free space (or choose another --output) and run again with --resume"
            )
    dist.agree_on_error(failure, RunFailed)


def check_finite(metrics: EpochMetrics, config: TrainConfig, saved_epoch: int | None) -> None:
    """Stop a diverging run before it checkpoints or exports parameters that are not finite.
    Every rank sees the same allreduced losses, so every rank stops here together."""
    losses = [metrics.train_loss, metrics.val_loss]
    if all(loss is None or math.isfinite(loss) for loss in losses):
        return
    kept = (
        f"{config.output / checkpoint.CHECKPOINT} holds epoch {saved_epoch}"
        if saved_epoch
        else "no checkpoint of this run was written"
    )
    raise InputError(
        f"training diverged in epoch {metrics.epoch} (train loss {metrics.train_loss:g}); "
        f"{kept}; lower --lr (now {metrics.lr:g}), add --warmup-epochs, or "
        "--standardize-target for a target with large values"
    )


def exported(config: TrainConfig, model: nn.Module, transform: FeatureTransform) -> dict[str, Any]:
    """model.pt: the weights and everything predict needs to rebuild the model and its inputs."""
    return {
        "format": checkpoint.MODEL_FORMAT,
        "state_dict": model.state_dict(),
        "features": transform.to_dict(),
        "architecture": {
            "model": config.model and portable_spec(config.model),
            "hidden": list(config.hidden),
            "activation": config.activation,
            "n_features": transform.n_features,
            "n_outputs": transform.n_outputs,
        },
        "config": config.to_dict(),
    }


def build_trainer(
    config: TrainConfig, world: dist.World, prepared: Prepared, model: nn.Module
) -> Trainer:
    """A Trainer over this rank's shard of `prepared`; call on every rank (collectives)."""
    if config.shard_read:
        sampler = LocalShardSampler(
            len(prepared.train_rows), prepared.train_length, world.rank, config.shuffle, config.seed
        )
    else:
        sampler = global_sampler(
            len(prepared.train_rows), world.rank, world.size, config.shuffle, config.seed
        )
    batches = ShardedBatches(prepared.arrays, prepared.train_rows, config.batch_size, sampler)
    has_validation = dist.sum_over_ranks(torch.tensor([len(prepared.val_rows)]), "val_rows") > 0
    validation = Validation(prepared) if has_validation else None
    return Trainer(config, model, batches, validation, world)


def train(config: TrainConfig, comm: Any = None) -> TrainResult:
    """Train as configured; call on every rank of the job (a plain process is a job of one,
    the processes of `comm`, an mpi4py communicator, are one job over MPI)."""
    world = dist.init(config.threads, comm, config.horovod_steps)
    prepared = prepare(config, world)
    model = prepared.model
    trainer = build_trainer(config, world, prepared, model)
    trainer.restore(prepared.resumed)

    records = Records(config, world.size, world.controller) if world.is_root else None
    saved_epoch = trainer.state.epoch if prepared.resumed else None
    # Every write of rank 0 ends with all ranks agreeing it worked, so every epoch also starts
    # on all ranks together (rank 0's writing is not counted as the others' waiting).
    notes = prepared.transform.report.lines()
    written_by_root(
        world, lambda: records.start(notes, trainer.state.history), config.output, saved_epoch
    )
    first_step_unix = time.time()  # launch to here is the start-up cost (ranks.json)
    while not trainer.done():
        epoch = trainer.state.epoch + 1
        progress = records.progress(epoch, len(trainer.batches)) if records else None
        metrics = trainer.run_epoch(progress)
        if progress:
            progress.close()
        check_finite(metrics, config, saved_epoch)
        save = trainer.done() or metrics.epoch % config.checkpoint_every == 0
        saving = trainer if save else None
        write = partial(write_epoch, records, metrics, saving, prepared.transform)
        written_by_root(world, write, config.output, saved_epoch)
        if save:
            saved_epoch = metrics.epoch

    reports = dist.gather(
        {
            "rank": world.rank,
            "local_rank": world.local_rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "threads": world.threads,
            "controller": world.controller,
            "shard_rows": len(trainer.batches.sampler),
            "epochs_run": trainer.state.epoch,
            "first_step_unix": round(first_step_unix, 3),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "param_sha256": parameter_digest(model),
        },
        name="rank_reports",
    )

    def write_results() -> None:
        records.ranks(reports)
        records.features(prepared.transform.to_dict())
        checkpoint.save(
            exported(config, model, prepared.transform), config.output / checkpoint.MODEL
        )
        records.summary(trainer.state)

    written_by_root(world, write_results, config.output, saved_epoch)
    return TrainResult(model, prepared.transform, trainer.state.history)
