"""The held-out rows: each rank evaluates its share, and the loss (and accuracy) is averaged
over all ranks' rows, so every rank sees the same numbers and makes the same decisions."""

from __future__ import annotations

import torch
from torch import nn

from hvd_cpu.model.losses import Loss
from hvd_cpu.model.networks import EVAL_ROWS, outputs
from hvd_cpu.runtime.collectives import Collectives


class Validation:
    """This rank's held-out rows; `evaluate` averages loss (and accuracy) over all ranks'."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor) -> None:
        self.x, self.y = x, y  # all of this rank's encoded rows; `rows` picks the held-out ones
        self.held_out = self.rows = rows

    def reshard(self, rank: int, size: int) -> None:
        """--elastic: every rank holds all held-out rows and evaluates its share of them."""
        self.rows = self.held_out[rank::size]

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, loss_fn: Loss, classification: bool, collectives: Collectives
    ) -> tuple[float, float | None]:
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, rows, correct
        batches = self.rows.split(EVAL_ROWS)
        inputs = (self.x.index_select(0, batch) for batch in batches)
        for batch, out in zip(batches, outputs(model, inputs), strict=True):
            y = self.y.index_select(0, batch)
            correct = (out.argmax(1) == y).sum() if classification else 0
            totals += torch.tensor([float(loss_fn(out, y)) * len(y), len(y), float(correct)])
        loss_sum, rows, correct = collectives.sum(totals, "validation").tolist()
        return loss_sum / rows, (correct / rows if classification else None)
