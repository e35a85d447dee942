"""What rank 0 keeps of a run: epoch lines (or a progress bar), notes, the closing summary,
metrics.jsonl, ranks.json, features.json and config.toml on disk, and the trackers it feeds.
Other ranks never create Records."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from hvd_cpu.atomic import append, atomic_write
from hvd_cpu.config.files import RECORD, record
from hvd_cpu.config.options import TrainConfig
from hvd_cpu.lines import say
from hvd_cpu.output.console import Progress
from hvd_cpu.output.model_files import MODEL
from hvd_cpu.output.summary import Shape, summary_table, waiting_advice
from hvd_cpu.output.tracking import Tracking
from hvd_cpu.training.state import EpochMetrics, LoopState

FEATURES = "features.json"
METRICS = "metrics.jsonl"


class Records:
    """Rank 0's outputs for one training run."""

    def __init__(self, config: TrainConfig, shape: Shape) -> None:
        self.config = config
        self.output = config.output
        self.shape = shape
        self.metrics_path = self.output / METRICS
        self.show_progress = (
            config.progress if config.progress is not None else sys.stdout.isatty()
        ) and not config.quiet
        self.bar: Progress | None = None
        self.started = time.perf_counter()
        # Before the first epoch: a tracker that cannot start ends the job (RunFailed) here.
        params = {**config.to_dict(), "world_size": shape.size, "controller": shape.controller}
        self.tracking = Tracking(config, params)

    def start(self, notes: list[str], history: list[dict[str, Any]]) -> None:
        """Say what data preparation changed; metrics.jsonl restarts from the resumed history;
        config.toml holds the options that repeat the run."""
        for note in notes:
            say(f"hvd-cpu: {note}", sys.stderr)
        text = "".join(json.dumps(h) + "\n" for h in history)
        atomic_write(self.metrics_path, lambda handle: handle.write(text.encode()))
        record(self.config, self.output / RECORD)

    def progress(self, epoch: int, batches: int) -> Progress | None:
        if self.show_progress:
            self.bar = Progress(epoch, batches)
        return self.bar

    def epoch(self, metrics: EpochMetrics) -> None:
        """Close the bar, print the epoch line, append the epoch to metrics.jsonl."""
        if self.bar:
            self.bar.close()
            self.bar = None
        if not self.config.quiet:
            say(metrics.line())
        append(self.metrics_path, (json.dumps(metrics.record()) + "\n").encode())
        self.tracking.epoch(metrics)

    def close(self, failed: bool) -> None:
        """End the tracking: log the exported model and its features once training worked."""
        if not failed:
            self.tracking.finished([self.output / MODEL, self.output / FEATURES])
        self.tracking.close(failed)

    def summary(self, state: LoopState, synchronised: str, precision: str) -> None:
        """The closing table, and advice when the ranks mostly waited for each other."""
        if self.config.quiet or not state.history:
            return
        wall = time.perf_counter() - self.started
        say(summary_table(self.config, state, self.shape, synchronised, precision, wall))
        advice = waiting_advice(self.config, state, self.shape)
        if advice:
            say(advice, sys.stderr)

    def features(self, transform: dict[str, Any]) -> None:
        """The fitted feature transformation, for predict and for the curious."""
        self._write_json(FEATURES, transform)

    def ranks(self, reports: list[dict[str, Any]]) -> None:
        """What each rank says about itself: host, threads, shard size, parameter digest."""
        if len({report["param_sha256"] for report in reports}) > 1:
            say(
                "hvd-cpu: warning: ranks ended with different parameters; see ranks.json",
                sys.stderr,
            )
        self._write_json("ranks.json", reports)

    def _write_json(self, name: str, data: Any) -> None:
        text = json.dumps(data, indent=2) + "\n"
        atomic_write(self.output / name, lambda handle: handle.write(text.encode()))
