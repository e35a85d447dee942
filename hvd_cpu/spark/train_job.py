"""`hvd_cpu.spark.fit`: train on a Spark cluster's executors, from a Spark DataFrame.

The driver (this process) never holds the table: the frame is split into `num_proc`
partitions, and one barrier task per partition runs one rank on that partition's rows
(spark/task.py), as `--shard-read` ranks train on their own pieces of a parquet file. Rank 0
writes the run's folder as `hvd-cpu train` does and hands its model back through Spark.
Spark does not start a failed barrier stage again; with elastic=True this module does, from
the job's last checkpoint, on the executors there are then (clusters/restarts.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import cloudpickle

from hvd_cpu.api import FitResult, cluster_config, fit_result, shipped_code
from hvd_cpu.clusters.relay import Relay
from hvd_cpu.clusters.restarts import RankLost, Restarts, first_killed, had_their_say, result_of
from hvd_cpu.config.options import TrainConfig
from hvd_cpu.runtime import secret
from hvd_cpu.spark import cluster
from hvd_cpu.spark.task import OUTCOME_SCHEMA, rank_task

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
    config, code, elastic = cluster_config(data, target, num_proc, model, loss, options, DATAFRAME)
    if master:
        cluster.check_local_slots(master, num_proc)
    spark = cluster.session(master, "hvd-cpu") if master else cluster.session_of(data)
    num_proc = num_proc or cluster.task_slots(spark, 1)
    cluster.check_slots(spark, num_proc)
    cluster.check_executors(spark, num_proc)
    frame = cluster.frame_of(data, spark)
    cluster.check_columns(frame, [*config.targets, *(config.features or ())])
    training = Training(spark, frame, config, shipped_code(config, code))
    rows = training.going_on(num_proc) if elastic else training.once(num_proc)
    return fit_result(result_of(rows), config.output)


class Training(Restarts):
    """One training job on the executors: a barrier stage of one task per rank. Spark computes
    a lost partition again from the frame's lineage, so no rows are lost with an executor."""

    resume = "resume=True (spark-train --resume)"

    def __init__(self, spark: Any, frame: Any, config: TrainConfig, code: dict[str, bytes]) -> None:
        super().__init__(config)
        self.spark, self.frame, self.code = spark, frame, code
        self.columns = frame.limit(0).toPandas()

    def _room_after(self, wanted: int, lost: RankLost) -> int:
        """The task slots once the cluster has had time to replace a lost executor."""
        return cluster.task_slots(self.spark, wanted, until=time.time() + REPLACE_SECONDS)

    def _run(self, config: TrainConfig, num_proc: int) -> list[Any]:
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
        if not had_their_say(rows):
            raise RankLost(first_killed(rows))
        return sorted(rows, key=lambda row: row.rank)


def _reason(exc: Exception) -> str:
    """Spark's reason for ending a stage, on one line; a Python worker's with the line its
    traceback ends with (what was raised), which Spark's first lines leave out."""
    java = getattr(exc, "java_exception", None)  # py4j's; pyspark's own say it in str()
    text = str(java.getMessage()) if java is not None else str(exc)
    text = text.partition("Most recent failure reason:")[2] or text
    before, traceback, after = text.partition("Traceback (most recent call last):")
    if not traceback:
        return " ".join(" ".join(text.split("\n")[:2]).split())
    python = after.split("\n\tat ")[0].split("\n")  # the Python part, before Java's frames
    raised = [line for line in python if line.strip() and not line[0].isspace()]
    said = " ".join(before.split())
    return f"{said} {raised[-1].strip()}" if raised else said
