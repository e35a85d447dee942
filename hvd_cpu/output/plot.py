"""The loss curves of a training run, as a PNG next to its metrics."""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure  # no pyplot: no display or GUI backend needed

from hvd_cpu.atomic import atomic_write
from hvd_cpu.errors import InputError


def plot_losses(output: Path) -> Path:
    """Write OUTPUT/loss.png from OUTPUT/metrics.jsonl: training and validation loss."""
    path = output / "metrics.jsonl"
    if not path.is_file() or not path.read_text().strip():
        raise InputError(f"no metrics in {output}; plot a folder that hvd-cpu train wrote to")
    try:
        history = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        epochs = [h["epoch"] for h in history]
    except (ValueError, TypeError, KeyError) as exc:
        raise InputError(
            f"{path} is not metrics written by hvd-cpu train ({type(exc).__name__}: {exc}); "
            "plot a folder that hvd-cpu train wrote to"
        ) from exc
    figure = Figure(figsize=(7, 4), dpi=100)
    axes = figure.subplots()
    axes.plot(epochs, [h["train_loss"] for h in history], marker="o", label="training")
    if all("val_loss" in h for h in history):
        axes.plot(epochs, [h["val_loss"] for h in history], marker="o", label="validation")
    axes.set_xlabel("epoch")
    axes.set_ylabel("loss")
    axes.set_yscale("log")
    axes.set_title(f"{output} ({history[-1]['world_size']} rank(s))")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    png = output / "loss.png"
    atomic_write(png, lambda handle: figure.savefig(handle, format="png"))
    return png
