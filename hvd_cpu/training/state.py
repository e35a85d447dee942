"""What a training run is at any moment beyond its model and optimizer (`LoopState`, what a
checkpoint restores) and what one epoch measured over all ranks (`EpochMetrics`). A leaf: the
loop writes these, the output layer reads them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


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
    epoch_rows: int = 0  # rows of the current epoch trained by all ranks (a resume goes on here)
    epoch_ranks: int = 0  # how many ranks began the current epoch (its padding is theirs)
    # The current epoch's sums before an agreed stop, over all ranks: loss, samples, correct,
    # seconds waited, seconds (Trainer.carry_epoch), so a resumed epoch's metrics are whole.
    epoch_carried: list[float] = field(default_factory=list)
    precision: str = "fp32"  # what the steps run in: --precision auto resumes in it
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


@dataclass
class EpochMetrics:
    """One epoch, over all ranks."""

    epoch: int
    train_loss: float  # mean over every sample that every rank trained on
    samples: int
    seconds: float
    lr: float
    world_size: int
    train_accuracy: float | None = None  # classification only
    val_loss: float | None = None  # with --val-fraction > 0
    val_accuracy: float | None = None
    wait_seconds: float = 0.0  # of `seconds`, spent waiting for the other ranks (rank mean)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("inf")

    def record(self) -> dict[str, Any]:
        """The metrics.jsonl line: every field that applies, plus throughput."""
        fields = {k: v for k, v in asdict(self).items() if v is not None}
        return {
            **fields,
            "seconds": round(self.seconds, 4),
            "wait_seconds": round(self.wait_seconds, 4),
            "samples_per_s": round(self.samples_per_s, 1),
        }

    def line(self) -> str:
        """The seed's epoch line, with validation (and accuracy) when there is some."""
        text = f"Epoch {self.epoch}: Train Loss: {self.train_loss:.4f}"
        if self.train_accuracy is not None:
            text += f", Train Accuracy: {self.train_accuracy:.4f}"
        if self.val_loss is not None:
            text += f", Val Loss: {self.val_loss:.4f}"
        if self.val_accuracy is not None:
            text += f", Val Accuracy: {self.val_accuracy:.4f}"
        return text
