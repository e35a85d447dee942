"""What rank 0 tells the user: epoch lines or a progress bar, notes, a closing summary, and
metrics.jsonl, ranks.json and features.json on disk. Other ranks never create Records."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TextIO

from tqdm import tqdm

from hvd_cpu.config.files import RECORD, record
from hvd_cpu.config.options import CONTROLLER_NAMES, TrainConfig
from hvd_cpu.output.atomic import atomic_write
from hvd_cpu.output.model_files import MODEL
from hvd_cpu.output.tracking import Tracking

if TYPE_CHECKING:
    from hvd_cpu.training.train import LoopState

FEATURES = "features.json"
# Above this share of training time spent waiting, more processes are not paying for themselves.
WAITING_HINT = 0.5


def say(text: str, stream: TextIO | None = None) -> None:
    """Print `text` as one write of whole lines: with PYTHONUNBUFFERED, print() writes the
    newline separately, and Open MPI's --tag-output then tags it as a line of its own."""
    stream = stream or sys.stdout
    stream.write(text + "\n")
    stream.flush()


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


class Progress:
    """A per-epoch progress bar (rows/s, running loss) on a terminal."""

    def __init__(self, epoch: int, batches: int) -> None:
        self.bar = tqdm(
            total=batches,
            desc=f"Epoch {epoch}",
            unit="batch",
            leave=False,
            file=sys.stdout,
            dynamic_ncols=True,
        )
        self.rows = 0
        self.start = time.perf_counter()

    def update(self, rows: int, loss: float) -> None:
        self.rows += rows
        rate = self.rows / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{rate:,.0f} rows/s, loss {loss:.4f}", refresh=False)
        self.bar.update()

    def close(self) -> None:
        self.bar.close()


class Records:
    """Rank 0's outputs for one training run."""

    def __init__(self, config: TrainConfig, world_size: int, controller: str) -> None:
        self.config = config
        self.output = config.output
        self.world_size = world_size
        self.controller = controller
        self.metrics_path = self.output / "metrics.jsonl"
        self.show_progress = (
            config.progress if config.progress is not None else sys.stdout.isatty()
        ) and not config.quiet
        self.bar: Progress | None = None
        self.started = time.perf_counter()
        # Before the first epoch: a tracker that cannot start ends the job (RunFailed) here.
        params = {**config.to_dict(), "world_size": world_size, "controller": controller}
        self.tracking = Tracking(config, params)

    def start(self, notes: list[str], history: list[dict[str, Any]]) -> None:
        """Say what data preparation changed; metrics.jsonl restarts from the resumed history;
        config.toml holds the options that repeat the run."""
        for note in notes:
            say(f"hvd-cpu: {note}", sys.stderr)
        self.output.mkdir(parents=True, exist_ok=True)
        self.metrics_path.write_text("".join(json.dumps(h) + "\n" for h in history))
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
        with self.metrics_path.open("a") as handle:
            handle.write(json.dumps(metrics.record()) + "\n")
        self.tracking.epoch(metrics)

    def close(self, failed: bool) -> None:
        """End the tracking: log the exported model and its features once training worked."""
        if not failed:
            self.tracking.finished([self.output / MODEL, self.output / FEATURES])
        self.tracking.close(failed)

    def summary(self, state: LoopState) -> None:
        """The closing table: epochs, best validation, time, throughput."""
        if self.config.quiet or not state.history:
            return
        samples = sum(h["samples"] for h in state.history)
        seconds = sum(h["seconds"] for h in state.history)
        rows = [("epochs run", f"{state.epoch}")]
        if state.best_epoch:
            rows += [
                ("best epoch", f"{state.best_epoch}"),
                ("best validation loss", f"{state.best_val_loss:.4f}"),
            ]
        rows += [
            ("final train loss", f"{state.history[-1]['train_loss']:.4f}"),
            ("training time", f"{seconds:.1f} s (wall {time.perf_counter() - self.started:.1f} s)"),
            ("throughput", f"{samples / seconds:,.0f} samples/s over {self.world_size} rank(s)"),
        ]
        waiting = sum(h.get("wait_seconds", 0.0) for h in state.history) / seconds
        if self.world_size > 1:
            rows.append(("waiting for other ranks", f"{waiting:.0%} of training time"))
            rows.append(("controller", self._controller()))
        rows.append(("output", f"{self.output}"))
        width = max(len(name) for name, _ in rows)
        say("\n".join(f"  {name:<{width}}  {value}" for name, value in rows))
        if self.world_size > 1 and waiting > WAITING_HINT:
            cheaper = {
                "gloo": "horovodrun --mpi with --allreduce direct and one rank per core, "
            }.get(self.controller, "")
            if self.controller == "mpi" and self.config.allreduce != "direct":
                cheaper = "--allreduce direct, "
            say(
                f"hvd-cpu: the ranks waited for each other {waiting:.0%} of the time: cheaper or "
                f"fewer synchronisations pay here ({cheaper}a larger --batch-size, --sync-every "
                "8, or fewer processes); `hvd-cpu bench` measures which",
                sys.stderr,
            )

    def _controller(self) -> str:
        """Which of Horovod's controllers ran the job, and how the ranks stayed in step."""
        name = CONTROLLER_NAMES[self.controller]
        if self.config.sync_every > 1:
            return f"{name}; parameters averaged every {self.config.sync_every} steps"
        if self.config.allreduce == "direct":
            return f"{name}; gradients averaged by one MPI allreduce per step (direct)"
        return f"{name}; gradients averaged by hvd.DistributedOptimizer"

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
