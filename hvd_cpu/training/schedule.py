"""The learning rate of each step: Horovod's scaling with the global batch, its warm-up, and
the plateau factor. Arithmetic only, so every rank computes the same lr from the same state."""

from __future__ import annotations


def scaled_lr(lr: float, world_size: int, scale_lr: bool, global_batch_steps: bool) -> float:
    """The lr after warm-up. Gradient averaging makes one step of the global batch: Horovod
    scales the lr with it. A local SGD step sees one rank's batch, so its lr stays as given."""
    return lr * world_size if scale_lr and global_batch_steps else lr


def scheduled_lr(lr: float, peak: float, step: int, warmup_steps: int, factor: float) -> float:
    """The lr of optimizer step `step`: Horovod's warm-up, linear from `lr` to `peak` over
    `warmup_steps` (a large lr from the first step can diverge), then `peak`; times the
    plateau factor throughout."""
    if step < warmup_steps:
        peak = lr + (peak - lr) * step / warmup_steps
    return peak * factor
