"""`hvd_cpu.spark.fit`: train on a Spark cluster's executors, from a Spark DataFrame.

The driver (this process) never holds the table: the frame is split into `num_proc`
partitions, and one barrier task per partition runs one rank on that partition's rows
(spark/task.py), as `--shard-read` ranks train on their own pieces of a parquet file. Rank 0
writes the run's folder as `hvd-cpu train` does and hands its model back through Spark.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import cloudpickle

from hvd_cpu.api import FitResult, fit_result, shipped_code, user_config
from hvd_cpu.errors import InputError, RunFailed
from hvd_cpu.output.model_files import CHECKPOINT, Checkpoint
from hvd_cpu.runtime.failure import failure_from
from hvd_cpu.spark import cluster
from hvd_cpu.spark.relay import Relay
from hvd_cpu.spark.task import OUTCOME_SCHEMA, rank_task
from hvd_cpu.training.job import checkpoint_kept

# What config.toml records as --data for a DataFrame that was no parquet path.
DATAFRAME = Path("spark-dataframe")


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
    executor killed): the checkpoint stays, and `resume=True` goes on from it.
    """
    cluster.require_spark()
    if options.get("elastic"):
        raise InputError(
            "--elastic is not available on Spark: a lost task ends the job, and resume=True "
            "goes on from its checkpoint"
        )
    # Each rank trains on its own rows, as --shard-read ranks do.
    where = Path(data) if isinstance(data, (str, Path)) else DATAFRAME
    config, code = user_config(target, model, loss, {**options, "data": where, "shard_read": True})
    config = replace(config, output=Path(config.output).absolute())
    spark = cluster.session(master, "hvd-cpu") if master else cluster.session_of(data)
    if num_proc is not None and num_proc < 1:
        raise InputError(f"num_proc must be at least 1, got {num_proc}")
    num_proc = num_proc or cluster.task_slots(spark, 1)
    cluster.check_slots(spark, num_proc)
    frame = cluster.frame_of(data, spark)
    cluster.check_columns(frame, [*config.targets, *(config.features or ())])
    if frame.rdd.getNumPartitions() != num_proc:
        frame = frame.repartition(num_proc)
    job = cloudpickle.dumps((config, shipped_code(config, code)))
    columns = frame.limit(0).toPandas()
    outcomes = _run(spark, frame, job, columns, num_proc, config.output)
    return fit_result(_result(outcomes), config.output)


def _run(
    spark: Any, frame: Any, job: bytes, columns: Any, num_proc: int, output: Path
) -> list[Any]:
    """The barrier job; its tasks' rows, by rank. Spark does not start a failed barrier
    result stage again: a task lost (its executor killed, say) ends the job, with its line."""
    context = spark.sparkContext
    with Relay() as relay:
        driver = (context.getConf().get("spark.driver.host"), relay.port)
        context.setJobDescription(f"hvd-cpu: training on {num_proc} ranks")
        try:
            rows = frame.mapInPandas(
                rank_task(job, columns, driver), OUTCOME_SCHEMA, barrier=True
            ).collect()
        except Exception as exc:
            raise RunFailed(_lost(exc, output)) from exc
        finally:
            context.setJobDescription(None)
    return sorted(rows, key=lambda row: row.rank)


def _lost(exc: Exception, output: Path) -> str:
    """The line for a job Spark ended: its reason, and what the run left to resume from."""
    java = getattr(exc, "java_exception", None)  # py4j's; pyspark's own say it in str()
    text = str(java.getMessage()) if java is not None else str(exc)
    text = text.partition("Most recent failure reason:")[2] or text
    reason = " ".join(" ".join(text.split("\n")[:2]).split())
    path = output / CHECKPOINT
    saved = Checkpoint.load(path).loop["epoch"] if path.exists() else None
    then = "run it again with resume=True (spark-train --resume) to go on from there"
    return (
        f"a Spark task of the job failed ({reason}); the job ends; "
        f"{checkpoint_kept(output, saved)}: {then if saved else 'fix it, then run it again'}"
    )


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
