"""`hvd_cpu.spark.fit`: train on a Spark cluster's executors, from a Spark DataFrame.

The driver (this process) never holds the table: the frame is split into `num_proc`
partitions, and one barrier task per partition runs one rank on that partition's rows
(spark/task.py), as `--shard-read` ranks train on their own pieces of a parquet file. Rank 0
writes the run's folder as `hvd-cpu train` does and hands its model back through Spark.
Spark does not start a failed barrier stage again; with elastic=True this module does, from
the job's last checkpoint, on the executors there are then.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import cloudpickle

from hvd_cpu.api import FitResult, fit_result, shipped_code, user_config
from hvd_cpu.config.options import TrainConfig
from hvd_cpu.errors import InputError, RunFailed
from hvd_cpu.lines import say
from hvd_cpu.output.model_files import CHECKPOINT, Checkpoint
from hvd_cpu.runtime import secret
from hvd_cpu.runtime.failure import failure_from
from hvd_cpu.spark import cluster
from hvd_cpu.spark.relay import Relay
from hvd_cpu.spark.task import OUTCOME_SCHEMA, rank_task
from hvd_cpu.training.job import job_ends

# What config.toml records as --data for a DataFrame that was no parquet path.
DATAFRAME = Path("spark-dataframe")
# How long a job going on (elastic) waits for the cluster to replace a lost executor.
REPLACE_SECONDS = 30.0


def fit(
    data: Any,
    target: str | tuple[str, ...] = "target",
    num_proc: int | None = None,
    model: Any = None,
    loss: Any = None,
    master: str | None = None,
    **options: Any,
) -> FitResult:
    """Train on `data`, a Spark DataFrame (or the path of parquet its executors can read),
    with `num_proc` ranks, each a Spark task on its own part of the rows (None: one per
    task slot of the cluster). `model`, `loss` and `options` are hvd_cpu.fit's; `master`
    starts a session for a path when none is active. Returns what hvd_cpu.fit returns.

    Raises InputError for bad input (no master, too few task slots, a missing column); the
    exception a rank's code raised, as hvd_cpu.fit does; RunFailed when a task was lost (an
    executor killed): the checkpoint stays, and `resume=True` goes on from it. With
    elastic=True the job goes on by itself instead, up to `max_restarts` times.
    """
    cluster.require_spark()
    if num_proc is not None and num_proc < 1:
        raise InputError(f"num_proc must be at least 1, got {num_proc}")
    elastic = bool(options.pop("elastic", False))
    # Each rank trains on its own rows, as --shard-read ranks do.
    where = Path(data) if isinstance(data, (str, Path)) else DATAFRAME
    config, code = user_config(target, model, loss, {**options, "data": where, "shard_read": True})
    config = replace(config, output=Path(config.output).absolute())
    spark = cluster.session(master, "hvd-cpu") if master else cluster.session_of(data)
    num_proc = num_proc or cluster.task_slots(spark, 1)
    cluster.check_slots(spark, num_proc)
    frame = cluster.frame_of(data, spark)
    cluster.check_columns(frame, [*config.targets, *(config.features or ())])
    training = Training(spark, frame, config, shipped_code(config, code))
    rows = training.going_on(num_proc) if elastic else training.once(num_proc)
    return fit_result(_result(rows), config.output)


class RankLost(Exception):
    """A rank was lost: Spark ended the stage for a lost task (its executor killed, say; Spark
    does not start a failed barrier result stage again), or a rank's process was killed (the
    out-of-memory killer, say). What happened, in words."""


class Training:
    """One training job on the executors: a barrier stage of one task per rank, run once,
    or (elastic) again after a lost rank, from this job's last checkpoint, on the task slots
    there are then. Spark computes a lost partition again from the frame's lineage, so no
    rows are lost with an executor."""

    def __init__(self, spark: Any, frame: Any, config: TrainConfig, code: dict[str, bytes]) -> None:
        self.spark, self.frame, self.config, self.code = spark, frame, config, code
        self.columns = frame.limit(0).toPandas()
        self.checkpoint = config.output / CHECKPOINT
        self.found = _stamp(self.checkpoint)  # an earlier run's checkpoint is not this job's

    def once(self, num_proc: int) -> list[Any]:
        """The stage's rows, by rank; RunFailed when a rank was lost."""
        try:
            return self._stage(self.config, num_proc)
        except RankLost as lost:
            raise RunFailed(f"{lost}; {self._ends()}") from lost

    def going_on(self, num_proc: int) -> list[Any]:
        """As `once`, but after a lost rank the job goes on by itself (up to max_restarts
        times), with as many ranks as there are task slots, at most `num_proc`."""
        config, ranks, most, restart = self.config, num_proc, self.config.max_restarts, 0
        while True:
            try:
                return self._stage(config, ranks)
            except RankLost as lost:
                restart += 1
                if restart > most:
                    raise RunFailed(
                        f"{lost} after {most} restart(s) (max_restarts, --max-restarts); "
                        f"{self._ends()}"
                    ) from lost
                saved = self._saved_epoch()
                if saved:
                    config = replace(self.config, resume=True, overwrite=False)
                ranks = min(num_proc, self._slots_again(num_proc, lost))
                start = f"from epoch {saved}'s checkpoint" if saved else self._first_start()
                say(
                    f"hvd-cpu: {lost}; going on (elastic, restart {restart} of at most "
                    f"{most}) on {ranks} ranks, {start}",
                    sys.stderr,
                )

    def _slots_again(self, wanted: int, lost: RankLost) -> int:
        """The task slots once the cluster has had time to replace a lost executor."""
        slots = cluster.task_slots(self.spark, wanted, until=time.time() + REPLACE_SECONDS)
        if slots < 1:
            raise RunFailed(f"{lost}, and no task slot is left; {self._ends()}")
        return slots

    def _stage(self, config: TrainConfig, num_proc: int) -> list[Any]:
        """One barrier stage of `num_proc` tasks; its rows, by rank."""
        frame = self.frame
        if frame.rdd.getNumPartitions() != num_proc:
            frame = frame.repartition(num_proc)
        job = cloudpickle.dumps((config, self.code))
        context = self.spark.sparkContext
        key = bytes.fromhex(secret.new_key())  # this stage's: its tasks get it with their code
        with Relay(cluster.relay_address(self.spark), num_proc, key) as relay:
            context.setJobDescription(f"hvd-cpu: training on {num_proc} ranks")
            try:
                task = rank_task(job, self.columns, relay.address, key)
                rows = frame.mapInPandas(task, OUTCOME_SCHEMA, barrier=True).collect()
            except Exception as exc:
                raise RankLost(f"a Spark task of the job failed ({_reason(exc)})") from exc
            finally:
                context.setJobDescription(None)
        if not any(row.outcome is not None or row.failure is not None for row in rows):
            raise RankLost(_killed(rows))  # no rank had its say: one was ended from outside
        return sorted(rows, key=lambda row: row.rank)

    def _saved_epoch(self) -> int | None:
        """The epoch of this job's last checkpoint, if it wrote one."""
        if _stamp(self.checkpoint) in (None, self.found):
            return None
        return int(Checkpoint.load(self.checkpoint).loop["epoch"])

    def _first_start(self) -> str:
        """Where the job starts again when it wrote no checkpoint: where it started."""
        return "from the checkpoint it resumed" if self.config.resume else "from the start"

    def _ends(self) -> str:
        """What the run left to resume from, for the line that ends it."""
        resume = "run it again with resume=True (spark-train --resume)"
        return job_ends(self.config.output, self._saved_epoch(), resume)


def _stamp(path: Path) -> tuple[int, int] | None:
    """What tells one writing of a file from another: its change time and size."""
    try:
        status = path.stat()
    except FileNotFoundError:
        return None
    return status.st_mtime_ns, status.st_size


def _killed(rows: list[Any]) -> str:
    """Which rank's process ended first (by a signal, before the others that then lost it)."""
    first = min(rows, key=lambda row: (row.code >= 0, row.rank))
    how = f"killed by signal {-first.code}" if first.code < 0 else f"exit code {first.code}"
    return f"rank {first.rank}'s process ended ({how})"


def _reason(exc: Exception) -> str:
    """Spark's reason for ending a stage, on one line."""
    java = getattr(exc, "java_exception", None)  # py4j's; pyspark's own say it in str()
    text = str(java.getMessage()) if java is not None else str(exc)
    text = text.partition("Most recent failure reason:")[2] or text
    return " ".join(" ".join(text.split("\n")[:2]).split())


def _result(rows: list[Any]) -> Any:
    """Rank 0's TrainResult, or what the ranks raised."""
    for row in rows:
        if row.failure is not None:
            raise failure_from(row.failure)
    for row in rows:
        if row.outcome is not None:
            kind, value = cloudpickle.loads(row.outcome)
            if kind == "error":
                raise value
            if value is not None:
                return cloudpickle.loads(value)
    codes = ", ".join(f"rank {row.rank}: {row.code}" for row in rows if row.code)
    raise RunFailed(f"the job ended without a model (exit codes {codes or 'none'}); see above")
