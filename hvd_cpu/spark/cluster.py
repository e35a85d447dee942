"""The driver's side of a Spark cluster: pyspark and Java being there, a session on a master
that answers, the frame to train on, and task slots enough for every rank.

Each check turns what would be a hang or a page of Java into one line: barrier mode waits
(and retries for minutes) when a job asks for more tasks than the cluster has slots, and a
master URL nobody listens on makes Spark retry its connection for a minute.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from hvd_cpu.clusters.worker import import_check
from hvd_cpu.errors import InputError

SPARK_EXTRA = "pip install 'hvd-cpu[spark]'"
JAVA = "Java 17 or 21 (Debian/Ubuntu: apt-get install openjdk-17-jre-headless; or set JAVA_HOME)"
LOG_CONFIG = Path(__file__).with_name("log4j2.properties")
# How long a new session's executors get to register before the slots are counted.
REGISTER_SECONDS = 30.0
# How long a spark:// master gets to answer.
CONNECT_SECONDS = 5.0
# What a rank imports on an executor (pandas for mapInPandas, then clusters/rank.py's).
RANK_NEEDS = ("pandas", "pyarrow", "hvd_cpu", "torch", "horovod.torch")
LOOPBACK = "127.0.0.1"


def require_spark() -> None:
    """pyspark and Java, or one line saying what to install."""
    try:
        import pyspark  # noqa: F401
    except ImportError:
        raise InputError(f"pyspark is not installed: {SPARK_EXTRA}, and {JAVA}") from None
    home = os.environ.get("JAVA_HOME")
    if not (home and Path(home, "bin", "java").exists()) and shutil.which("java") is None:
        raise InputError(f"Spark needs Java, and none was found: install {JAVA}")
    # pyspark 4.x warns about pandas 3 at every conversion; what hvd-cpu uses of it works.
    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas")


def session(master: str, name: str) -> Any:
    """A SparkSession on `master` ("local[4]", "spark://host:7077", "yarn", ...), the Spark UI
    showing it as `name`; a spark:// master that does not answer is one line."""
    require_spark()
    from pyspark.sql import SparkSession

    url = urlparse(master)
    if url.scheme == "spark":
        for location in (url.netloc or "").split(","):
            host, _, port = location.partition(":")
            try:
                socket.create_connection((host, int(port or 7077)), CONNECT_SECONDS).close()
            except (OSError, ValueError) as exc:
                raise InputError(
                    f"no Spark master answers at {master} ({getattr(exc, 'strerror', exc)}); "
                    "start it (SPARK_HOME/sbin/start-master.sh) or pass its URL"
                ) from None
    # The executors' Python: this one (at the same path on every host, as for horovodrun).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    return (
        SparkSession.builder.master(master)
        .appName(name)
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{LOG_CONFIG}")
        .getOrCreate()
    )


def task_slots(spark: Any, wanted: int, until: float | None = None) -> int:
    """How many tasks the session's executors run at once; while there are fewer than
    `wanted`, wait for executors still registering: until time.time() reaches `until`
    (default: while the session is younger than REGISTER_SECONDS)."""
    context = spark.sparkContext._jsc.sc()
    deadline = context.startTime() / 1000 + REGISTER_SECONDS if until is None else until
    while True:
        profile = context.resourceProfileManager().defaultResourceProfile()
        slots = int(context.maxNumConcurrentTasks(profile))
        if slots >= wanted or time.time() > deadline:
            return slots
        time.sleep(0.5)


def check_slots(spark: Any, num_proc: int) -> None:
    """Barrier mode starts every rank at once: fewer slots than ranks would wait, not run."""
    slots = task_slots(spark, num_proc)
    if slots < num_proc:
        master = spark.sparkContext.master
        raise InputError(
            f"the Spark cluster at {master} has {slots} task slot(s), fewer than num_proc="
            f"{num_proc} (every rank is a task, all running at once); use num_proc={slots} or "
            "fewer, or give the application more executors or cores"
        )


def local_slots(master: str) -> int | None:
    """The task slots of a local master ("local", "local[N]", "local[*]", "local[N,F]"), known
    before any session starts; None for a cluster's master."""
    found = re.fullmatch(r"local(?:\[(\*|\d+)(?:,\d+)?\])?", master.strip())
    if not found:
        return None
    cores = found.group(1) or "1"
    return os.cpu_count() or 1 if cores == "*" else int(cores)


def check_local_slots(master: str, num_proc: int | None) -> None:
    """A local master with fewer slots than ranks: said before a session starts (which takes
    seconds, tens of them on a busy machine)."""
    slots = local_slots(master)
    if slots is not None and num_proc is not None and slots < num_proc:
        raise InputError(
            f"the master {master} runs {slots} task(s) at once, fewer than num_proc={num_proc} "
            f"(every rank is a task, all running at once); use num_proc={slots} or fewer, or "
            f"local[{num_proc}]"
        )


def check_executors(spark: Any, slots: int) -> None:
    """The executors' Python can run a rank: it is PYSPARK_PYTHON's (Spark's default: the
    first python3 on the executors' PATH), which need not be this one. One small Spark job."""
    check = import_check(RANK_NEEDS)
    context = spark.sparkContext
    probes = context.parallelize(range(slots), slots).mapPartitions(lambda _: [check()])
    for python, missing in probes.collect():
        if missing:
            raise InputError(
                f"Spark's executors run {python}, which cannot import {'; '.join(missing)}: "
                f"set PYSPARK_PYTHON={sys.executable} (this environment's Python) before the "
                "session starts, or install hvd-cpu in theirs"
            )


def relay_address(spark: Any) -> str:
    """The address the executors reach the driver at, which the relay of the ranks' lines
    (clusters/relay.py) listens on alone: spark.driver.host's, 127.0.0.1 under a local master
    (its executors are this process)."""
    context = spark.sparkContext
    if context.master.startswith("local"):
        return LOOPBACK
    return socket.gethostbyname(context.getConf().get("spark.driver.host"))


def session_of(data: Any) -> Any:
    """The session `data` belongs to (a DataFrame's own; for a path, the active one)."""
    from pyspark.sql import DataFrame, SparkSession

    if isinstance(data, DataFrame):
        return data.sparkSession
    if not isinstance(data, (str, Path)):
        raise InputError(
            f"data is a {type(data).__name__}; pass a Spark DataFrame or the path of parquet the "
            "executors can read (a pandas frame: hvd_cpu.fit)"
        )
    spark = SparkSession.getActiveSession()
    if spark is None:
        raise InputError(f"no Spark session to read {data} with: pass master= or a DataFrame")
    return spark


def frame_of(data: Any, spark: Any) -> Any:
    """`data` as a Spark DataFrame: itself, or the parquet at a path the executors read (which
    may take a Spark job: check the slots first, or it waits for executors that never come)."""
    from pyspark.sql import DataFrame

    return data if isinstance(data, DataFrame) else spark.read.parquet(str(data))


def check_columns(frame: Any, names: list[str]) -> None:
    """Columns the options name that the DataFrame lacks, before any task starts."""
    have = set(frame.columns)
    for name in names:
        if name not in have:
            raise InputError(
                f"the DataFrame has no column {name!r} (it has {', '.join(frame.columns)}); "
                "name one of those, or add it"
            )
