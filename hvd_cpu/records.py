"""What rank 0 tells the user: epoch lines on stdout, metrics.jsonl and ranks.json on disk."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hvd_cpu.checkpoint import atomic_write


@dataclass(frozen=True)
class EpochMetrics:
    """One epoch, summed over all ranks."""

    epoch: int
    train_loss: float  # mean over every sample that every rank trained on
    samples: int
    seconds: float
    train_accuracy: float | None = None  # classification only

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("inf")


class Records:
    """Rank 0's outputs; other ranks do not create one, so they stay silent."""

    def __init__(self, output: Path, world_size: int, lr: float) -> None:
        self.output = output
        self.world_size = world_size
        self.lr = lr
        output.mkdir(parents=True, exist_ok=True)
        self.metrics_path = output / "metrics.jsonl"
        self.metrics_path.write_text("")

    def epoch(self, metrics: EpochMetrics) -> None:
        """Print the seed's epoch line and append the epoch to metrics.jsonl."""
        line = f"Epoch {metrics.epoch}: Train Loss: {metrics.train_loss:.4f}"
        if metrics.train_accuracy is not None:
            line += f", Train Accuracy: {metrics.train_accuracy:.4f}"
        print(line, flush=True)
        record = {
            **{k: v for k, v in asdict(metrics).items() if v is not None},
            "samples_per_s": round(metrics.samples_per_s, 1),
            "seconds": round(metrics.seconds, 4),
            "lr": self.lr,
            "world_size": self.world_size,
        }
        with self.metrics_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def notes(self, lines: list[str]) -> None:
        """What the data preparation changed (rows dropped, values filled, columns dropped)."""
        for line in lines:
            print(f"hvd-cpu: {line}", file=sys.stderr, flush=True)

    def features(self, transform: dict[str, Any]) -> None:
        """The fitted feature transformation, for predict and for the curious."""
        self._write_json("features.json", transform)

    def ranks(self, reports: list[dict[str, Any]]) -> None:
        """What each rank says about itself: host, threads, shard size, parameter digest."""
        if len({report["param_sha256"] for report in reports}) > 1:
            print(
                "hvd-cpu: warning: ranks ended with different parameters; see ranks.json",
                file=sys.stderr,
                flush=True,
            )
        self._write_json("ranks.json", reports)

    def _write_json(self, name: str, data: Any) -> None:
        text = json.dumps(data, indent=2) + "\n"
        atomic_write(self.output / name, lambda handle: handle.write(text.encode()))
