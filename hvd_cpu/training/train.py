"""The training loop that runs on every rank: epochs, validation, early stopping, learning
rate schedule, checkpoints.

All state that changes during training is the model, the optimizer and one `LoopState`;
checkpoints save exactly these three, and `--resume` (or, under --elastic, the last commit in
memory) restores them and broadcasts them from rank 0.
"""

from __future__ import annotations

import math
import os
import resource
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hvd_cpu.config.options import TrainConfig
from hvd_cpu.data.features import FeatureTransform
from hvd_cpu.data.loader import (
    LocalShardSampler,
    ResumableSampler,
    ShardedBatches,
    global_sampler,
)
from hvd_cpu.errors import InputError, RunFailed
from hvd_cpu.model.losses import Loss
from hvd_cpu.model.networks import parameter_digest
from hvd_cpu.model.optim import adam
from hvd_cpu.output.model_files import CHECKPOINT, MODEL, Checkpoint, ModelFile
from hvd_cpu.output.records import EpochMetrics, Progress, Records, say
from hvd_cpu.runtime import horovod as dist
from hvd_cpu.runtime.direct_allreduce import FlatGradients
from hvd_cpu.training.prepare import Prepared, checked_output, prepare

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
    epoch_rows: int = 0  # rows of the current epoch trained by all ranks (--elastic resumes here)
    history: list[dict[str, Any]] = field(default_factory=list)

    def validated(self, val_loss: float, epoch: int, plateau_patience: int | None) -> None:
        """Count the epochs without a better validation loss: early stopping ends the run
        after --patience of them, and the lr halves after each --plateau-patience. Every rank
        sees the same allreduced loss, so every rank makes the same decisions."""
        if val_loss < self.best_val_loss:
            self.best_val_loss, self.best_epoch = val_loss, epoch
            self.since_best = self.since_lr_change = 0
            return
        self.since_best += 1
        self.since_lr_change += 1
        if plateau_patience is not None and self.since_lr_change >= plateau_patience:
            self.lr_factor /= 2
            self.since_lr_change = 0

    def finished(self, epochs: int, patience: int | None) -> bool:
        """All `epochs` run, or `patience` of them since the best validation loss."""
        stopped = patience is not None and self.since_best >= patience
        return stopped or self.epoch >= epochs


def scaled_lr(lr: float, world_size: int, scale_lr: bool, local_sgd: bool) -> float:
    """The lr after warm-up. Gradient averaging makes one step of the global batch: Horovod
    scales the lr with it. A local SGD step sees one rank's batch, so its lr stays as given."""
    return lr * world_size if scale_lr and not local_sgd else lr


def scheduled_lr(lr: float, peak: float, step: int, warmup_steps: int, factor: float) -> float:
    """The lr of optimizer step `step`: Horovod's warm-up, linear from `lr` to `peak` over
    `warmup_steps` (a large lr from the first step can diverge), then `peak`; times the
    plateau factor throughout."""
    if step < warmup_steps:
        peak = lr + (peak - lr) * step / warmup_steps
    return peak * factor


@dataclass
class TrainResult:
    """The trained model (identical on every rank) and every epoch's metrics."""

    model: nn.Module
    transform: FeatureTransform
    history: list[dict[str, Any]]


class Validation:
    """This rank's held-out rows; `evaluate` averages loss (and accuracy) over all ranks'."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor) -> None:
        self.x, self.y = x, y  # all of this rank's encoded rows; `rows` picks the held-out ones
        self.held_out = self.rows = rows

    def reshard(self, rank: int, size: int) -> None:
        """--elastic: every rank holds all held-out rows and evaluates its share of them."""
        self.rows = self.held_out[rank::size]

    def evaluate(
        self, model: nn.Module, loss_fn: Loss, classification: bool
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
        loss_fn: Loss,
        batches: ShardedBatches,
        validation: Validation | None,
        world: dist.World,
    ) -> None:
        world_size = world.size
        self.config = config
        self.model = model
        self.elastic = config.elastic
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
        self.loss_fn = loss_fn
        self.state = LoopState()
        self._scale_to(world_size)

    def _scale_to(self, world_size: int) -> None:
        """The lr schedule for `world_size` ranks (again whenever --elastic resizes)."""
        config = self.config
        self.world_size = world_size
        self.peak_lr = scaled_lr(config.lr, world_size, config.scale_lr, self.local_sgd)
        self.warmup_steps = config.warmup_epochs * len(self.batches)

    def resize(self, world: dist.World) -> None:
        """--elastic: go on with the ranks there are now; the rest of the epoch's rows are
        shared out among them, and the lr follows the global batch."""
        self.batches.sampler.reshard(world.rank, world.size)
        if self.validation:
            self.validation.reshard(world.rank, world.size)
        self._scale_to(world.size)

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
        self.batches.set_epoch(epoch)
        if self.elastic:
            self.batches.sampler.skip = state.epoch_rows
        self.model.train()
        # Summed as tensors so the loop never waits on .item(); float64 so long epochs stay exact.
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, samples, correct
        waited = 0.0
        start = time.perf_counter()
        for x, y in self.batches:
            loss_sum, correct, batch_waited = self._run_batch(x, y)
            totals += torch.stack([loss_sum.double(), torch.tensor(len(x)), correct.double()])
            waited += batch_waited
            state.epoch_rows += self.config.batch_size * self.world_size
            if progress:
                progress.update(len(x), float(loss_sum) / len(x))
            if after_step:
                after_step()
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
            state.validated(metrics.val_loss, epoch, self.config.plateau_patience)
        state.epoch, state.epoch_rows = epoch, 0
        state.history.append(metrics.record())
        return metrics

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
        """Everything --resume needs."""
        return Checkpoint(
            **self.snapshot(), features=transform.to_dict(), config=self.config.to_dict()
        )

    def load(self, model: dict[str, Any], optimizer: dict[str, Any], loop: dict[str, Any]) -> None:
        """Take the state of a snapshot (or checkpoint) on this rank."""
        self.model.load_state_dict(model)
        self.optimizer.load_state_dict(optimizer)
        self.state = LoopState(**loop)

    def sync(self) -> None:
        """Every rank takes rank 0's state."""
        dist.broadcast_training_state(self.model, self.optimizer)
        self.state = LoopState(**dist.broadcast_object(asdict(self.state), "loop_state"))

    def restore(self, saved: Checkpoint | None) -> None:
        """Rank 0 loads `saved` (if resuming); then every rank takes rank 0's state."""
        if saved is not None:
            self.load(saved.model, saved.optimizer, saved.loop)
        self.sync()


def write_epoch(
    records: Records, metrics: EpochMetrics, saving: Trainer | None, transform: FeatureTransform
) -> None:
    """Rank 0, after an epoch: its line and metrics, and the checkpoint of `saving`, if any."""
    records.epoch(metrics)
    if saving:
        saving.checkpoint(transform).save(records.output / CHECKPOINT)


def written_by_root(
    world: dist.World, write: Callable[[], None], output: Path, saved: int | None
) -> None:
    """Rank 0 writes; then every rank learns whether that worked, so a full disk (or a tracking
    server that cannot start a run) ends all of them with one line (and no peer is left
    waiting in the next collective)."""
    failure = None
    if world.is_root:
        try:
            write()
        except RunFailed as exc:
            failure = str(exc)
        except OSError as exc:
            kept = f"{CHECKPOINT} there holds epoch {saved}" if saved else "no checkpoint was kept"
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
        f"{config.output / CHECKPOINT} holds epoch {saved_epoch}"
        if saved_epoch
        else "no checkpoint of this run was written"
    )
    raise InputError(
        f"training diverged in epoch {metrics.epoch} (train loss {metrics.train_loss:g}); "
        f"{kept}; lower --lr (now {metrics.lr:g}), add --warmup-epochs, or "
        "--standardize-target for a target with large values"
    )


def rank_report(world: dist.World, trainer: Trainer, first_step_unix: float) -> dict[str, Any]:
    """This rank's entry in ranks.json: where it ran, on how much, at what cost, and a digest
    of its parameters (every rank must end with the same model)."""
    return {
        "rank": world.rank,
        "local_rank": world.local_rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "threads": world.threads,
        "controller": world.controller,
        "shard_rows": len(trainer.batches.sampler),
        "rows_read": len(trainer.batches.x),  # encoded here: all rows, or its own (--shard-read)
        "epochs_run": trainer.state.epoch,
        "first_step_unix": round(first_step_unix, 3),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "param_sha256": parameter_digest(trainer.model),
    }


def build_trainer(
    config: TrainConfig, world: dist.World, prepared: Prepared, model: nn.Module
) -> Trainer:
    """A Trainer over this rank's shard of `prepared`; call on every rank (collectives)."""
    rows = len(prepared.train_rows)
    if config.shard_read:
        sampler = LocalShardSampler(
            rows, prepared.train_length, world.rank, config.shuffle, config.seed
        )
    elif config.elastic:
        sampler = ResumableSampler(rows, world.rank, world.size, config.shuffle, config.seed)
    else:
        sampler = global_sampler(rows, world.rank, world.size, config.shuffle, config.seed)
    batches = ShardedBatches(prepared.arrays, prepared.train_rows, config.batch_size, sampler)
    if config.elastic:  # every rank holds all held-out rows; no collective before the loop
        has_validation = len(prepared.val_rows) > 0
    else:
        has_validation = dist.sum_over_ranks(torch.tensor([len(prepared.val_rows)]), "val_rows") > 0
    validation = None
    if has_validation:
        arrays = prepared.arrays
        x, y = torch.from_numpy(arrays.x), torch.from_numpy(arrays.y)
        validation = Validation(x, y, prepared.val_rows)
    return Trainer(config, model, prepared.loss_fn, batches, validation, world)


class Job:
    """One training run as every rank sees it: the epochs, rank 0's records and the results.

    A plain run starts once and runs its epochs. Under --elastic the same steps run inside
    Horovod's elastic loop, again each time ranks come or go, from the state all ranks just
    took from rank 0: `capture`, `apply` and `sync` are what that loop keeps and shares.
    """

    def __init__(self, config: TrainConfig, prepared: Prepared, trainer: Trainer) -> None:
        self.config, self.prepared, self.trainer = config, prepared, trainer
        self.records: Records | None = None
        self.saved_epoch: int | None = None  # the epoch checkpoint.pt holds, once written
        self.started = False  # the output is checked and the run's first records written
        self.first_step_unix = 0.0  # launch to here is the start-up cost (ranks.json)

    def start(self, world: dist.World, resumed: Checkpoint | None) -> None:
        """Every rank takes rank 0's starting point (`resumed`, if any); rank 0 opens its
        records."""
        self.trainer.restore(resumed)
        self.saved_epoch = self.trainer.state.epoch if resumed else None
        self.started = True
        notes = self.prepared.transform.report.lines()
        self._write_root(world, partial(self._open_records, world, notes))

    def _open_records(self, world: dist.World, notes: list[str]) -> None:
        """Rank 0: (re)start its records from the loop's history; rank 0 may be new, and the
        last commit may be older than the last epoch written."""
        if self.records is None:
            self.records = Records(self.config, world.size, world.controller)
        self.records.world_size = world.size
        self.records.start(notes, self.trainer.state.history)

    def _write_root(self, world: dist.World, write: Callable[[], None]) -> None:
        """Rank 0 writes and every rank agrees it worked, so every epoch also starts on all
        ranks together (rank 0's writing is not counted as the others' waiting)."""
        written_by_root(world, write, self.config.output, self.saved_epoch)

    def run(
        self,
        world: dist.World,
        after_step: Callable[[], None] | None = None,
        after_epoch: Callable[[], None] | None = None,
    ) -> None:
        """The epochs left, then the results."""
        trainer, config = self.trainer, self.config
        self.first_step_unix = self.first_step_unix or time.time()
        while not trainer.done():
            epoch = trainer.state.epoch + 1
            progress = self.records.progress(epoch, len(trainer.batches)) if world.is_root else None
            metrics = trainer.run_epoch(progress, after_step)
            if progress:
                progress.close()
            check_finite(metrics, config, self.saved_epoch)
            save = trainer.done() or metrics.epoch % config.checkpoint_every == 0
            saving = trainer if save else None
            self._write_root(
                world, partial(write_epoch, self.records, metrics, saving, self.prepared.transform)
            )
            if save:
                self.saved_epoch = metrics.epoch
            if after_epoch:
                after_epoch()
        self._finish(world)

    def _finish(self, world: dist.World) -> None:
        trainer, model, transform = self.trainer, self.trainer.model, self.prepared.transform
        reports = dist.gather(rank_report(world, trainer, self.first_step_unix), "rank_reports")

        def write_results() -> None:
            records = self.records
            records.ranks(reports)
            records.features(transform.to_dict())
            ModelFile.export(self.config, model, transform).save(self.config.output / MODEL)
            records.summary(trainer.state)
            records.close(failed=False)

        self._write_root(world, write_results)

    def close(self, failed: bool) -> None:
        """Rank 0 ends its tracking; a job that fails marks its MLflow run failed."""
        if self.records:
            self.records.close(failed)

    # --elastic

    def capture(self) -> dict[str, Any]:
        # Not saved_epoch: it tells what is on disk, which a rollback does not undo.
        return {**self.trainer.snapshot(), "started": self.started}

    def apply(self, saved: dict[str, Any]) -> None:
        self.trainer.load(saved["model"], saved["optimizer"], saved["loop"])
        self.started = saved["started"]

    def sync(self) -> None:
        self.trainer.sync()
        job = dist.broadcast_object((self.started, self.saved_epoch), "job_state")
        self.started, self.saved_epoch = job

    def run_elastic(self, state: dist.ElasticState) -> None:
        """One pass of the elastic loop, on the ranks there are now."""
        world = dist.elastic_world(self.config.threads)
        before = self.trainer.world_size
        self.trainer.resize(world)
        if not self.started:
            self.start(world, checked_output(self.config, world))
            state.commit()
        else:
            self._write_root(world, partial(self._going_on, world, before))
        trainer, every = self.trainer, self.config.commit_every

        def after_step() -> None:
            if trainer.state.step % every == 0:
                state.commit()

        self.run(world, after_step, state.commit)

    def _going_on(self, world: dist.World, before: int) -> None:
        """Rank 0 says how the job goes on after ranks came or went."""
        self._open_records(world, [])
        loop = self.trainer.state
        say(
            f"hvd-cpu: {before} -> {world.size} ranks; going on from the last commit "
            f"(epoch {loop.epoch + 1}, step {loop.step}, {loop.epoch_rows} rows into it)",
            sys.stderr,
        )


def train(config: TrainConfig, comm: Any = None) -> TrainResult:
    """Train as configured; call on every rank of the job (a plain process is a job of one,
    the processes of `comm`, an mpi4py communicator, are one job over MPI)."""
    if config.elastic and not dist.elastic_launched():
        raise InputError(
            "--elastic needs horovodrun's elastic mode: start it with launch/elastic.sh (or "
            "horovodrun --gloo --min-np N --host-discovery-script FILE), or leave out --elastic"
        )
    world = dist.init(config.threads, comm, config.horovod_steps)
    prepared = prepare(config, world)
    trainer = build_trainer(config, world, prepared, prepared.model)
    job = Job(config, prepared, trainer)
    try:
        if config.elastic:
            state = dist.ElasticState(job.capture, job.apply, job.sync)
            try:
                dist.run_elastic(state, partial(job.run_elastic, state), config.max_restarts)
            except RunFailed as failed:
                kept = f"{config.output / CHECKPOINT} holds epoch {job.saved_epoch}"
                raise RunFailed(
                    f"{failed}; {kept if job.saved_epoch else 'no checkpoint was written'}: "
                    "find what ends the ranks, then run again with --resume (or raise "
                    "--max-restarts)"
                ) from failed
        else:
            job.start(world, prepared.resumed)
            job.run(world)
    except BaseException:
        job.close(failed=True)
        raise
    return TrainResult(trainer.model, prepared.transform, trainer.state.history)
