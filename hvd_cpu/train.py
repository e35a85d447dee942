"""The training loop that runs on every rank: prepare, broadcast, epochs, save.

The Trainer holds all state that changes during training (model, optimizer, epoch), so
checkpoints and Horovod's elastic mode can capture and restore it in one place.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from hvd_cpu import dist
from hvd_cpu.checkpoint import save_model
from hvd_cpu.config import DEMO_FEATURES, DEMO_ROWS, TrainConfig
from hvd_cpu.data.demo import make_demo_frame
from hvd_cpu.data.features import Arrays, to_arrays
from hvd_cpu.data.frames import read_frame
from hvd_cpu.data.loader import ShardedBatches
from hvd_cpu.errors import InputError
from hvd_cpu.models import Network, parameter_digest
from hvd_cpu.records import EpochMetrics, Records


@dataclass
class TrainResult:
    """The trained model (identical on every rank) and rank 0's view of each epoch."""

    model: nn.Module
    history: list[EpochMetrics] = field(default_factory=list)


class Trainer:
    """One rank's model, optimizer and shard; `run_epoch` trains on the shard once."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        batches: ShardedBatches,
        loss_fn: nn.Module,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.batches = batches
        self.loss_fn = loss_fn
        self.epoch = 0  # the last finished epoch

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad()  # Horovod's wrapper takes no arguments
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.optimizer.step()  # gradients are averaged over all ranks here
        return loss.detach()

    def run_epoch(self) -> EpochMetrics:
        """Train on this rank's shard; the loss is averaged over all ranks' samples."""
        epoch = self.epoch + 1
        self.batches.set_epoch(epoch)
        self.model.train()
        # Summed as tensors so the loop never waits on .item(); float64 so long epochs stay exact.
        loss_sum = torch.zeros((), dtype=torch.float64)
        samples = 0
        start = time.perf_counter()
        for x, y in self.batches:
            loss_sum += self._run_batch(x, y) * len(x)
            samples += len(x)
        seconds = time.perf_counter() - start
        totals = dist.sum_over_ranks(
            torch.stack([loss_sum, torch.tensor(samples, dtype=torch.float64)]), "epoch_loss"
        )
        self.epoch = epoch
        return EpochMetrics(
            epoch=epoch,
            train_loss=float(totals[0] / totals[1]),
            samples=int(totals[1]),
            seconds=seconds,
        )


def load_arrays(config: TrainConfig) -> Arrays:
    """The whole frame as arrays: every rank holds all rows, the sampler picks its shard."""
    if config.data is None:
        frame = make_demo_frame(DEMO_ROWS, DEMO_FEATURES, seed=config.seed)
    else:
        frame = read_frame(config.data)
    return to_arrays(frame, config.target)


def prepare(config: TrainConfig, world: dist.World, lr: float) -> tuple[Arrays, Records | None]:
    """Read and check the input on every rank; only if all ranks succeed does rank 0 open
    its output. Raises the same InputError on every rank otherwise."""
    error = None
    try:
        arrays = load_arrays(config)
    except InputError as exc:
        error = str(exc)
    dist.agree_on_error(error)
    records = None
    error = None
    if world.is_root:
        try:
            records = Records(config.output, world.size, lr)
        except OSError as exc:
            error = (
                f"cannot write to output folder {config.output}: {exc.strerror}; "
                "choose another --output"
            )
    dist.agree_on_error(error)
    return arrays, records


def train(config: TrainConfig) -> TrainResult:
    """Train the default model on the configured frame; call on every rank of the job."""
    world = dist.init(config.threads)
    lr = config.lr * (world.size if config.scale_lr else 1)
    arrays, records = prepare(config, world, lr)

    torch.manual_seed(config.seed)
    model = Network(arrays.x.shape[1], outputs=arrays.y.shape[1])
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    dist.broadcast_training_state(model, optimizer)
    batches = ShardedBatches(
        arrays, config.batch_size, world.rank, world.size, config.shuffle, config.seed
    )
    trainer = Trainer(model, dist.wrap_optimizer(optimizer, model), batches, nn.MSELoss())

    result = TrainResult(model)
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
            "shard_rows": len(batches.sampler),
            "param_sha256": parameter_digest(model),
        }
    )
    if records:
        records.ranks(reports)
        save_model(model, config.output / "model.pt")
    return result
