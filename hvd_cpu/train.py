"""The training loop that runs on every rank: prepare, broadcast, epochs, save.

The Trainer holds all state that changes during training (model, optimizer, epoch), so
checkpoints and Horovod's elastic mode can capture and restore it in one place.
"""

from __future__ import annotations

import os
import resource
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import pandas as pd
import torch
from torch import nn

from hvd_cpu import dist
from hvd_cpu.checkpoint import save_model
from hvd_cpu.config import DEMO_FEATURES, DEMO_ROWS, TrainConfig
from hvd_cpu.data.demo import make_demo_frame
from hvd_cpu.data.features import Arrays, FeatureTransform, Selection, fit
from hvd_cpu.data.frames import format_of, read_frame, read_parquet_shard
from hvd_cpu.data.loader import LocalShardSampler, ShardedBatches, global_sampler
from hvd_cpu.errors import InputError
from hvd_cpu.models import Network, build_user_model, parameter_digest
from hvd_cpu.records import EpochMetrics, Records

T = TypeVar("T")


@dataclass
class TrainResult:
    """The trained model (identical on every rank) and rank 0's view of each epoch."""

    model: nn.Module
    transform: FeatureTransform
    history: list[EpochMetrics] = field(default_factory=list)


class Trainer:
    """One rank's model, optimizer and shard; `run_epoch` trains on the shard once."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        batches: ShardedBatches,
        classification: bool,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.batches = batches
        self.classification = classification
        self.loss_fn = nn.CrossEntropyLoss() if classification else nn.MSELoss()
        self.epoch = 0  # the last finished epoch

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step; returns the batch's summed loss and its count of correct predictions."""
        self.optimizer.zero_grad()  # Horovod's wrapper takes no arguments
        out = self.model(x)
        loss = self.loss_fn(out, y)
        loss.backward()
        self.optimizer.step()  # gradients are averaged over all ranks here
        correct = (out.argmax(1) == y).sum() if self.classification else torch.zeros(())
        return loss.detach() * len(x), correct

    def run_epoch(self) -> EpochMetrics:
        """Train on this rank's shard; loss and accuracy are averaged over all ranks' samples."""
        epoch = self.epoch + 1
        self.batches.set_epoch(epoch)
        self.model.train()
        # Summed as tensors so the loop never waits on .item(); float64 so long epochs stay exact.
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, samples, correct
        start = time.perf_counter()
        for x, y in self.batches:
            loss_sum, correct = self._run_batch(x, y)
            totals += torch.stack([loss_sum.double(), torch.tensor(len(x)), correct.double()])
        seconds = time.perf_counter() - start
        loss_sum, samples, correct = dist.sum_over_ranks(totals, "epoch_totals").tolist()
        self.epoch = epoch
        return EpochMetrics(
            epoch=epoch,
            train_loss=loss_sum / samples,
            samples=int(samples),
            seconds=seconds,
            train_accuracy=correct / samples if self.classification else None,
        )


@dataclass
class Prepared:
    """Everything the loop needs, checked on every rank before any rank starts training."""

    transform: FeatureTransform
    arrays: Arrays
    model: nn.Module
    shard_rows: int  # the longest shard of any rank, in rows
    records: Records | None


def agreed(step: Callable[[], T]) -> T:
    """Run a preparation step on every rank; if it fails with bad input on any rank, every
    rank raises the same InputError here, so no rank is left waiting in a collective."""
    error, value = None, None
    try:
        value = step()
    except InputError as exc:
        error = str(exc)
    dist.agree_on_error(error)
    return value  # type: ignore[return-value]


def read_rows(config: TrainConfig, world: dist.World) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the rows this rank trains from, its disjoint part of the rows for fitting statistics).

    By default every rank reads the whole frame and fits on a 1/size slice of it; with
    --shard-read a rank reads only its own row groups and fits on all of them.
    """
    if config.data is None:
        frame = make_demo_frame(DEMO_ROWS, DEMO_FEATURES, seed=config.seed)
    elif config.shard_read:
        if format_of(config.data, config.format) != "parquet":
            raise InputError("--shard-read reads parquet files only; convert the data to parquet")
        frame = read_parquet_shard(config.data, world.rank, world.size).frame
        return frame, frame
    else:
        frame = read_frame(config.data, config.format)
    if len(frame) < world.size:
        raise InputError(
            f"the data has {len(frame)} row(s), fewer than the {world.size} ranks; "
            "use fewer ranks (-np) or more rows"
        )
    rows = len(frame)
    part = frame.iloc[world.rank * rows // world.size : (world.rank + 1) * rows // world.size]
    return frame, part


def build_model(config: TrainConfig, transform: FeatureTransform) -> nn.Module:
    """The user's Module if --model names one, else the MLP; seeded, so every rank builds the
    same start (rank 0's parameters are broadcast anyway)."""
    torch.manual_seed(config.seed)
    if config.model:
        return build_user_model(config.model, transform.n_features, transform.n_outputs)
    return Network(transform.n_features, config.hidden, transform.n_outputs, config.activation)


def encode(config: TrainConfig, world: dist.World) -> tuple[FeatureTransform, Arrays]:
    """Read this rank's rows, fit the transformation over all ranks, and encode the rows.
    The DataFrame is dropped on return: the matrices are all that training needs."""
    frame, part = agreed(lambda: read_rows(config, world))
    selection = Selection(config.targets, config.features, config.drop)
    collectives = dist.Collectives()
    transform = agreed(
        lambda: fit(
            part,
            selection,
            config.task,
            config.max_categories,
            config.standardize_target,
            collectives,
        )
    )
    return transform, transform.arrays(frame)


def prepare(config: TrainConfig, world: dist.World, lr: float) -> Prepared:
    """Read, fit, encode and build on every rank, agreeing on bad input after each step."""
    transform, arrays = encode(config, world)
    shard_lengths = dist.gather(len(arrays), name="shard_rows")
    if config.shard_read and min(shard_lengths) == 0:
        rank = shard_lengths.index(0)
        raise InputError(f"rank {rank}'s row groups hold no row with a usable target")
    if not config.shard_read and len(arrays) < world.size:
        raise InputError(f"only {len(arrays)} row(s) have a usable target, fewer than the ranks")
    model = agreed(lambda: build_model(config, transform))

    def open_records() -> Records | None:
        if not world.is_root:
            return None
        try:
            return Records(config.output, world.size, lr)
        except OSError as exc:
            raise InputError(
                f"cannot write to output folder {config.output}: {exc.strerror}; "
                "choose another --output"
            ) from exc

    records = agreed(open_records)
    if records:
        records.notes(transform.report.lines())
    shard_rows = max(shard_lengths) if config.shard_read else len(arrays)
    return Prepared(transform, arrays, model, shard_rows, records)


def train(config: TrainConfig) -> TrainResult:
    """Train on the configured frame; call on every rank of the job."""
    world = dist.init(config.threads)
    lr = config.lr * (world.size if config.scale_lr else 1)
    prepared = prepare(config, world, lr)
    model = prepared.model

    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    dist.broadcast_training_state(model, optimizer)
    if config.shard_read:
        sampler = LocalShardSampler(
            len(prepared.arrays), prepared.shard_rows, world.rank, config.shuffle, config.seed
        )
    else:
        sampler = global_sampler(
            len(prepared.arrays), world.rank, world.size, config.shuffle, config.seed
        )
    batches = ShardedBatches(prepared.arrays, config.batch_size, sampler)
    classification = config.task == "classification"
    trainer = Trainer(model, dist.wrap_optimizer(optimizer, model), batches, classification)

    result = TrainResult(model, prepared.transform)
    records = prepared.records
    while trainer.epoch < config.epochs:
        metrics = trainer.run_epoch()
        result.history.append(metrics)
        if records:
            records.epoch(metrics)

    reports = dist.gather(
        {
            "rank": world.rank,
            "local_rank": world.local_rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "threads": world.threads,
            "shard_rows": len(sampler),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "param_sha256": parameter_digest(model),
        },
        name="rank_reports",
    )
    if records:
        records.ranks(reports)
        records.features(prepared.transform.to_dict())
        save_model(model, config.output / "model.pt")
    return result
