"""hvd_cpu.spark on a real Spark standalone cluster (a master and two workers of two cores
started here, tests/spark_cluster.py): training from a Spark DataFrame against hvd_cpu.fit,
prediction on the executors, the command line, bad input and a lost executor."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import psutil
import pytest
import torch
from torch import nn

import hvd_cpu
from hvd_cpu import spark as hvd_spark
from hvd_cpu.api import FitResult
from hvd_cpu.clusters.worker import FOLDER_PREFIX
from hvd_cpu.errors import InputError, RunFailed
from hvd_cpu.runtime.failure import RankTraceback
from hvd_cpu.spark import cluster
from tests.jobs import processes_naming
from tests.spark_cluster import (
    COMMAND,
    ROWS,
    SparkCluster,
    Witness,
    bytes_to_driver,
    needs_spark,
    rows_by_process,
    table,
)

# Beside another test, on one worker (launch/test.sh's first stage deals out whole files):
# they share one cluster, whose rank processes they count (their command lines name the
# cluster's folder for them, SparkCluster.ranks).
pytestmark = [needs_spark, pytest.mark.beside]
RANKS = 4


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with SparkCluster(tmp_path_factory.mktemp("spark")) as running:
        session = cluster.session(running.master, "hvd-cpu tests")
        session.cluster = running  # the tests that kill an executor reach it here
        yield session
        session.stop()


def partitioned(spark: Any, frame: pd.DataFrame, parts: int) -> Any:
    """A Spark DataFrame whose partition i holds the i-th contiguous run of `frame`'s rows,
    in order: what `--shard-read` gives rank i of a parquet file with `parts` row groups."""
    tagged = frame.assign(_part=np.arange(len(frame)) * parts // len(frame), _row=range(len(frame)))
    spread = spark.createDataFrame(tagged).repartitionByRange(parts, "_part")
    return spread.sortWithinPartitions("_row").drop("_part", "_row")


def parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def test_spark_fit_trains_as_fit_does(spark: Any, tmp_path: Path) -> None:
    """Each rank trains on its own partition, as hvd_cpu.fit(shard_read=True) ranks on their
    own row groups: the same parameters and losses, bit for bit, with partitions made to hold
    row group i each, and with the partitioning spark.fit makes itself of a one-partition frame
    the executors read (round robin, the same on every evaluation: one map task), while the
    driver receives far less than collecting those rows takes. Then predictions are computed
    on the executors and match the model's here."""
    frame = table()
    parquet = tmp_path / "table.parquet"
    frame.to_parquet(parquet, row_group_size=ROWS // RANKS)
    options = {"epochs": 3, "batch_size": 64, "seed": 3}
    ours = hvd_spark.fit(
        partitioned(spark, frame, RANKS), num_proc=RANKS, output=tmp_path / "spark", **options
    )
    theirs = hvd_cpu.fit(parquet, np=RANKS, shard_read=True, output=tmp_path / "fit", **options)
    assert_same_training(ours, theirs)
    assert (tmp_path / "spark" / "model.pt").exists()

    one_file = tmp_path / "one.parquet"  # one partition: spark.fit repartitions it itself
    table(ROWS * 5).to_parquet(one_file)
    dealt = tmp_path / "dealt.parquet"
    shards = spark_s_shards(spark, one_file, RANKS)
    shards.to_parquet(dealt, row_group_size=len(shards) // RANKS)
    own, sent = bytes_to_driver(
        spark, lambda: hvd_spark.fit(one_file, num_proc=RANKS, output=tmp_path / "own", **options)
    )
    dealt_fit = hvd_cpu.fit(dealt, np=RANKS, shard_read=True, output=tmp_path / "dealt", **options)
    assert_same_training(own, dealt_fit)
    _, collected = bytes_to_driver(spark, lambda: spark.read.parquet(str(one_file)).toPandas())
    assert collected > shards.memory_usage().sum(), "the measure sees rows collected"
    assert sent < collected / 10, (sent, collected)

    keyed = frame.drop(columns="target").assign(key=range(ROWS))
    seen = tmp_path / "seen"
    seen.mkdir()
    witnessed = replace(ours, model=Witness(ours.model, seen))
    predicted = hvd_spark.predict(witnessed, spark.createDataFrame(keyed), id_column="key")
    predicted = predicted.toPandas().sort_values("key").reset_index(drop=True)
    pd.testing.assert_frame_equal(predicted, ours.predict(keyed, "key"), check_dtype=False)
    by_process = rows_by_process(seen)
    assert by_process.pop(os.getpid(), 0) <= 1  # the one row the driver runs for the schema
    assert sum(by_process.values()) == ROWS
    executors = {executor.pid for executor in spark.cluster.executors()}
    for pid in by_process:  # Spark's Python workers, children of an executor
        assert executors & {parent.pid for parent in psutil.Process(pid).parents()}, pid
    with pytest.raises(InputError, match="lacks the feature column"):
        hvd_spark.predict(tmp_path / "spark", spark.createDataFrame(keyed.drop(columns="f1")))


def assert_same_training(ours: FitResult, theirs: FitResult) -> None:
    """The same computation: the same parameters and losses, bit for bit."""
    for name, value in parameters(theirs.model).items():
        assert torch.equal(parameters(ours.model)[name], value), name
    columns = ["epoch", "train_loss", "val_loss"]
    pd.testing.assert_frame_equal(ours.history[columns], theirs.history[columns], check_exact=True)


def spark_s_shards(spark: Any, path: Path, parts: int) -> pd.DataFrame:
    """The rows of the parquet at `path` as `repartition(parts)` deals them out (what spark.fit
    does to a frame of another partition count), partition after partition. From one
    partition (one map task) every evaluation deals them alike."""
    from pyspark.sql.functions import spark_partition_id

    read = spark.read.parquet(str(path))
    assert read.rdd.getNumPartitions() == 1
    dealt = read.repartition(parts)
    shards = dealt.withColumn("_part", spark_partition_id()).toPandas()
    assert shards["_part"].is_monotonic_increasing
    assert (shards["_part"].value_counts() == len(shards) // parts).all(), "equal row groups"
    return shards.drop(columns="_part")


@pytest.mark.slow
def test_bad_input_is_one_line(spark: Any, tmp_path: Path) -> None:
    frame = spark.createDataFrame(table(400))
    with pytest.raises(InputError, match=r"has no column 'y' \(it has f0, f1, f2, f3, target\)"):
        hvd_spark.fit(frame, target="y", num_proc=2, output=tmp_path / "a")
    with pytest.raises(
        InputError, match=r"has 4 task slot\(s\), fewer than num_proc=5.*num_proc=4"
    ):
        hvd_spark.fit(frame, num_proc=5, output=tmp_path / "b")


def test_command_line_bad_input(tmp_path: Path) -> None:
    """No cluster needed: each is one line and exit code 2, within seconds."""
    parquet = tmp_path / "t.parquet"
    table(100).to_parquet(parquet)
    cases = {
        "no Spark master answers at spark://127.0.0.1:9": ["--master", "spark://127.0.0.1:9"],
        "pyspark is not installed: pip install 'hvd-cpu[spark]'": ["--master", "local[2]"],
        "Spark needs Java": ["--master", "local[2]"],
        # said before a session starts (which took 34 s here on a busy machine)
        "the master local[1] runs 1 task(s) at once, fewer than num_proc=3": [
            "--master", "local[1]", "--np", "3",
        ],
    }  # fmt: skip
    envs = {
        "pyspark is not installed: pip install 'hvd-cpu[spark]'": "pyspark",
        "Spark needs Java": "java",
    }
    for said, words in cases.items():
        env = {**os.environ}
        prelude = ""
        if envs.get(said) == "pyspark":  # what an install without the extra meets
            prelude = "import sys; sys.modules['pyspark'] = None; "
        if envs.get(said) == "java":
            env["PATH"] = str(Path(sys.executable).parent)
            env.pop("JAVA_HOME", None)
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", prelude + "from hvd_cpu.cli import main; main()",
             "spark-train", *words, "--data", str(parquet), "--output", str(tmp_path / "o")],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and said in lines[0], done.stderr
        assert time.monotonic() - started < 60


def test_executors_whose_python_cannot_run_a_rank_are_named(tmp_path: Path) -> None:
    """A user's own session (local[2]) from a script run with this environment's Python,
    PYSPARK_PYTHON unset: the executors run the first python3 on the PATH, here the machine's,
    without torch (nor, here, pandas). One line says which Python they run, what it lacks
    and how to point them at this one, before any rank starts."""
    script = (
        "import sys\n"
        "from pyspark.sql import SparkSession\n"
        "import hvd_cpu.spark\n"
        "from hvd_cpu.errors import InputError\n"
        "spark = SparkSession.builder.master('local[2]').getOrCreate()\n"
        "sdf = spark.createDataFrame(hvd_cpu.data.demo.make_demo_frame(100, 2))\n"
        "try:\n"
        "    hvd_cpu.spark.fit(sdf, num_proc=2, output=sys.argv[1])\n"
        "except InputError as exc:\n"
        "    print(exc)\n"
    )
    java = Path(os.path.realpath(shutil.which("java") or "java")).parent
    env = {**os.environ, "PATH": f"/usr/bin:/bin:{java}"}
    env.pop("PYSPARK_PYTHON", None)
    done = subprocess.run(
        [sys.executable, "-c", "import hvd_cpu.data.demo\n" + script, str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout.strip().splitlines()
    assert len(said) == 1, done.stdout
    assert "Spark's executors run /usr/bin/python3, which cannot import " in said[0]
    assert "torch (ModuleNotFoundError: No module named 'torch')" in said[0]
    assert f"set PYSPARK_PYTHON={sys.executable}" in said[0]
    assert not (tmp_path / "out").exists()


class Breaks(nn.Module):
    """The seed's MLP, whose forward raises on rank 1 after a few steps."""

    def __init__(self, n_features: int, n_outputs: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_features, 32), nn.Linear(32, n_outputs))
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        if self.training and self.steps > 20 and os.environ.get("HOROVOD_RANK") == "1":
            raise ValueError("rank 1's model broke")
        return self.net(x)


@pytest.mark.slow
def test_a_rank_process_killed_under_elastic_goes_on(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rank's process killed from outside (as the out-of-memory killer does), its task
    alive: with elastic=True the job starts its stage again from its checkpoint, on all its
    ranks (no task slot was lost)."""
    frame = spark.createDataFrame(table(40_000)).repartition(RANKS)
    output, killed = tmp_path / "killed", []
    killer = threading.Thread(
        target=_kill_after, args=(output, 2, partial(_kill_a_rank, spark), killed)
    )
    killer.start()
    capsys.readouterr()
    result = hvd_spark.fit(frame, num_proc=RANKS, output=output, epochs=8, elastic=True)
    killer.join()
    assert killed, "no rank process was killed"
    said = capsys.readouterr().err
    assert re.search(
        r"hvd-cpu: rank \d's process ended \(killed by signal 9\); going on \(elastic, "
        r"restart 1 of at most 3\) on 4 ranks, from epoch \d+'s checkpoint", said
    ), said  # fmt: skip
    assert result.history["epoch"].iloc[-1] == 8
    assert_no_rank_left(spark)


def assert_no_rank_left(spark: Any) -> None:
    """No rank process of the cluster's, and nothing in the folder of a worker killed under
    its rank (its rank read the job, the user's code and rows, and removed them)."""
    assert not processes_naming(spark.cluster.ranks, grace=30)
    assert not list(spark.cluster.ranks.glob(f"{FOLDER_PREFIX}*/*"))


def _kill_a_rank(spark: Any) -> int:
    pid = processes_naming(spark.cluster.ranks)[-1]
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.slow
def test_rank_failure_and_lost_executor(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rank's exception reaches the caller (its traceback as the cause); an executor killed
    mid-training ends the job with its line, the checkpoint kept, and resume goes on; with
    elastic=True a killed worker does not end the job: it goes on, on the slots left. None
    leaves a rank behind."""
    frame = spark.createDataFrame(table(40_000)).repartition(RANKS)
    with pytest.raises(ValueError, match="rank 1's model broke") as failed:
        hvd_spark.fit(frame, num_proc=RANKS, model=Breaks, output=tmp_path / "broke", epochs=2)
    assert isinstance(failed.value.__cause__, RankTraceback)
    assert_no_rank_left(spark)

    output, killed = tmp_path / "lost", []
    args = (output, 2, spark.cluster.kill_executor, killed)
    killer = threading.Thread(target=_kill_after, args=args)
    killer.start()
    with pytest.raises(RunFailed, match=r"ExecutorLostFailure.*holds epoch \d+.*resume=True"):
        hvd_spark.fit(frame, num_proc=RANKS, output=output, epochs=40)
    killer.join()
    assert killed, "no executor was killed"
    assert_no_rank_left(spark)
    while spark.cluster.alive_workers() < 2 or cluster.task_slots(spark, RANKS) < RANKS:
        time.sleep(0.5)  # the worker starts the application a new executor

    # Resumed with elastic=True: a worker killed two epochs on (its executor and cores gone
    # for good), and the job goes on by itself on the 2 task slots left, six epochs more.
    epochs = len((output / "metrics.jsonl").read_text().splitlines())
    args = (output, epochs + 2, spark.cluster.kill_worker, killed)
    killer = threading.Thread(target=_kill_after, args=args)
    killer.start()
    capsys.readouterr()
    resumed = hvd_spark.fit(
        frame, num_proc=RANKS, output=output, epochs=epochs + 8, resume=True, elastic=True
    )
    killer.join()
    assert len(killed) == 2, "no worker was killed under elastic=True"
    said = capsys.readouterr().err
    going_on = re.search(
        r"a Spark task of the job failed \(.+\); going on \(elastic, restart 1 of at most 3\) "
        r"on 2 ranks, from epoch (\d+)'s checkpoint", said
    )  # fmt: skip
    assert going_on, said
    assert int(going_on.group(1)) >= epochs + 2
    assert resumed.history["epoch"].iloc[-1] == epochs + 8
    assert_no_rank_left(spark)
    # The folders of workers killed under their ranks (some runs leave none), which nobody
    # else removes: the next job's workers do.
    hvd_spark.fit(frame, num_proc=2, output=tmp_path / "next", epochs=1)
    assert not list(spark.cluster.ranks.glob(f"{FOLDER_PREFIX}*"))


def _kill_after(output: Path, epochs: int, kill: Callable[[], int], killed: list[int]) -> None:
    """`kill` (SIGKILL something, return its pid) once the job has checkpointed `epochs`."""
    metrics = output / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= epochs:
            killed.append(kill())
            return
        time.sleep(0.2)


def run(words: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(words, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_command_line_trains_and_resumes(spark: Any, tmp_path: Path) -> None:
    """`hvd-cpu spark-train` writes its run folder as `hvd-cpu train` does, its epoch lines
    and summary on the terminal; --resume goes on (rank 0's refusal to overwrite a run is
    train's own, tested with it). On a cluster whose cores another
    application holds (the tests' session) it says there are no task slots."""
    parquet = tmp_path / "t.parquet"
    table(2000).to_parquet(parquet)
    words = [*COMMAND, "--np", "2", "--data", str(parquet), "--output", str(tmp_path / "run")]
    busy = run([*words, "--master", spark.cluster.master])
    assert busy.returncode == 2
    assert (
        busy.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"hvd-cpu: error: the Spark cluster at {spark.cluster.master} has 0 task slot(s), "
            "fewer than num_proc=2"
        )
    ), busy.stderr
    with SparkCluster(tmp_path / "cluster") as own:
        words += ["--master", own.master]
        first = run([*words, "--epochs", "2"])
        assert first.returncode == 0, first.stderr
        assert "Epoch 2:" in first.stdout and "throughput" in first.stdout
        assert (tmp_path / "run" / "model.pt").exists()
        more = run([*words, "--epochs", "4", "--resume"])
        assert more.returncode == 0, more.stderr
        assert "Epoch 4:" in more.stdout and "Epoch 2:" not in more.stdout


def test_a_task_s_python_failure_names_what_was_raised() -> None:
    """Spark's message for a barrier stage whose Python worker failed (as pyspark 4.3 words it,
    its JVM frames after the Python traceback): the reason keeps the line the traceback ends
    with, which its first two lines leave out."""
    from hvd_cpu.spark.train_job import _reason

    said = _reason(
        Exception(
            "Job aborted due to stage failure: Could not recover from a failed barrier "
            "ResultStage. Most recent failure reason: Stage failed because barrier task "
            "ResultTask(0, 1) finished unsuccessfully.\n"
            "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
            '  File "/usr/lib/python3/dist-packages/pyspark/worker.py", line 5, in main\n'
            "    import pandas\n"
            "ModuleNotFoundError: No module named 'pandas'\n\n"
            "\tat org.apache.spark.api.python.BasePythonRunner.handlePythonException(x.scala:1)\n"
            "\tat org.apache.spark.scheduler.Task.run(Task.scala:147)"
        )
    )
    assert said.endswith("PythonException: ModuleNotFoundError: No module named 'pandas'"), said
    assert "\n" not in said and "Traceback" not in said
