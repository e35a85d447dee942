"""Experiment tracking, from rank 0 only: TensorBoard event files (--tensorboard DIR) and MLflow
runs (--mlflow).

Under Horovod every rank that logs makes its own event file or run; here only rank 0's Records
open a Tracking, so a job is one event file and one MLflow run whatever the number of ranks.
TensorBoard and MLflow are an optional extra (pip install 'hvd-cpu[tracking]'), imported here
only, and only when asked for: a run without these options does not pay for them.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from hvd_cpu.config.options import TrainConfig
from hvd_cpu.errors import InputError, RunFailed
from hvd_cpu.lines import say
from hvd_cpu.training.state import EpochMetrics

EXTRA = "pip install 'hvd-cpu[tracking]'"
DEFAULT_EXPERIMENT = "hvd-cpu"  # when neither --mlflow-experiment nor MLFLOW_EXPERIMENT_NAME
# MLflow's client retries a request 7 times with growing pauses, each with a 120 s timeout:
# minutes before an unreachable server is reported. These bound it to seconds, unless set.
MLFLOW_HTTP_LIMITS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}


def check(config: TrainConfig) -> None:
    """Rank 0, before any data is read: what was asked for is installed and has somewhere to
    log, so a missing extra does not end a job after its first epoch."""
    asked = [("--tensorboard", config.tensorboard is not None, "tensorboard")]
    asked.append(("--mlflow", config.mlflow, "mlflow"))
    for option, wanted, package in asked:
        if wanted and importlib.util.find_spec(package) is None:
            raise InputError(f"{option} needs the tracking extra: {EXTRA}")
    if config.tensorboard is not None:  # a folder that cannot be written is the user's to fix
        from hvd_cpu.data.frames import check_writable

        check_writable(config.tensorboard / "events")
    if config.mlflow and not os.environ.get("MLFLOW_TRACKING_URI"):
        raise InputError(
            "--mlflow logs to the tracking server named by MLFLOW_TRACKING_URI: set it "
            "(export MLFLOW_TRACKING_URI=http://HOST:5000) or leave out --mlflow"
        )


def epoch_values(metrics: EpochMetrics) -> dict[str, float]:
    """What is logged per epoch, under metrics.jsonl's names (wait_share: of the epoch's time,
    waiting for the other ranks)."""
    values = {
        "train_loss": metrics.train_loss,
        "val_loss": metrics.val_loss,
        "train_accuracy": metrics.train_accuracy,
        "val_accuracy": metrics.val_accuracy,
        "samples_per_s": metrics.samples_per_s,
        "wait_share": metrics.wait_seconds / metrics.seconds if metrics.seconds > 0 else 0.0,
        "lr": metrics.lr,
    }
    return {name: value for name, value in values.items() if value is not None}


def reason(exc: BaseException) -> str:
    """The gist of a failure in a few words: an OS error's text (MLflow's messages bury it in
    a paragraph of URLs and pool names), else the message on one line."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    found = re.search(r"\[Errno -?\d+\] [^\"'()]+", str(exc))
    if found:
        return found.group(0).strip(" :")
    return " ".join(str(exc).split())[:300] or type(exc).__name__


class Tracker(Protocol):
    """One place rank 0 logs to."""

    option: str  # the option that asked for it, for messages

    def start(self, params: dict[str, Any]) -> None: ...
    def epoch(self, metrics: EpochMetrics) -> None: ...
    def finished(self, files: list[Path]) -> None: ...
    def close(self, failed: bool) -> None: ...


class TensorBoard:
    """One event file in `folder` per job; the steps are epoch numbers, so under --resume the
    curves go on where the checkpoint's left off (TensorBoard reads every file of a folder)."""

    option = "--tensorboard"

    def __init__(self, folder: Path) -> None:
        # torch's writer needs only the tensorboard package, not TensorFlow.
        from torch.utils.tensorboard import SummaryWriter

        try:
            self.writer = SummaryWriter(log_dir=str(folder))
        except OSError as exc:
            raise RunFailed(
                f"--tensorboard: cannot write to {folder}: {reason(exc)}; choose another folder"
            ) from exc

    def start(self, params: dict[str, Any]) -> None:
        rows = "".join(f"| {name} | {value} |\n" for name, value in params.items())
        self.writer.add_text("config", "| option | value |\n|---|---|\n" + rows, 0)
        self.writer.flush()

    def epoch(self, metrics: EpochMetrics) -> None:
        for name, value in epoch_values(metrics).items():
            self.writer.add_scalar(name, value, metrics.epoch)
        self.writer.flush()  # visible at once, not after the writer's 2 minutes

    def finished(self, files: list[Path]) -> None:
        self.writer.add_text("model", ", ".join(map(str, files)), 0)

    def close(self, failed: bool) -> None:
        self.writer.close()


class MLflow:
    """One run per job on the server named by MLFLOW_TRACKING_URI: the config as parameters,
    each epoch's values as metrics (step = epoch), model.pt and features.json as artifacts."""

    option = "--mlflow"

    def __init__(self, experiment: str | None, run_name: str | None) -> None:
        for name, value in MLFLOW_HTTP_LIMITS.items():
            os.environ.setdefault(name, value)
        from mlflow.tracking import MlflowClient

        self.uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        self.experiment = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_EXPERIMENT)
        self.run_name = run_name
        self.client = MlflowClient(self.uri)
        self.run_id = ""

    def start(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        client = self.client
        try:
            found = client.get_experiment_by_name(self.experiment)
            experiment_id = (
                found.experiment_id if found else client.create_experiment(self.experiment)
            )
            self.run_id = client.create_run(experiment_id, run_name=self.run_name).info.run_id
            client.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in params.items()])
        except Exception as exc:  # MLflow raises its own, requests' or sqlalchemy's errors
            raise RunFailed(
                f"--mlflow: cannot log to {self.uri} ({reason(exc)}); start the tracking server "
                "or correct MLFLOW_TRACKING_URI, or leave out --mlflow"
            ) from exc

    def epoch(self, metrics: EpochMetrics) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        values = epoch_values(metrics).items()
        logged = [Metric(name, value, stamp, metrics.epoch) for name, value in values]
        self.client.log_batch(self.run_id, metrics=logged)  # one request per epoch

    def finished(self, files: list[Path]) -> None:
        for path in files:
            self.client.log_artifact(self.run_id, str(path))

    def close(self, failed: bool) -> None:
        if self.run_id:
            self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


def asked_for(config: TrainConfig) -> list[Tracker]:
    """The trackers the options ask for (each imports its package here, on rank 0)."""
    trackers: list[Tracker] = []
    if config.tensorboard is not None:
        trackers.append(TensorBoard(config.tensorboard))
    if config.mlflow:
        trackers.append(MLflow(config.mlflow_experiment, config.mlflow_run_name))
    return trackers


class Tracking:
    """Rank 0's trackers. One that cannot start ends the job before training (RunFailed);
    one that fails later is reported once and dropped: training goes on without it."""

    def __init__(self, config: TrainConfig, params: dict[str, Any]) -> None:
        self.trackers: list[Tracker] = []
        try:
            for tracker in asked_for(config):
                self.trackers.append(tracker)
                tracker.start(params)
        except RunFailed:
            self.close(failed=True)
            raise

    def epoch(self, metrics: EpochMetrics) -> None:
        self._each(lambda tracker: tracker.epoch(metrics))

    def finished(self, files: list[Path]) -> None:
        self._each(lambda tracker: tracker.finished(files))

    def close(self, failed: bool) -> None:
        self._each(lambda tracker: tracker.close(failed))
        self.trackers = []

    def _each(self, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as exc:  # the tracker's own errors, whatever their type
                self.trackers.remove(tracker)
                say(
                    f"hvd-cpu: warning: {tracker.option} stopped logging ({reason(exc)}); "
                    "training goes on without it",
                    sys.stderr,
                )
