"""A real Spark standalone cluster for the Spark tests: a master and workers started from
pyspark's own jars (`spark-class`), each worker with its own cores; everything under a
temporary folder and stopped on exit, executors included.

`with SparkCluster(folder, workers=2, cores=2) as cluster:` cluster.master is its URL.
`hosts=[...]` starts each worker inside a namespace host (tests/hosts.py) instead.
Where a job's work happened, seen from outside it: `bytes_to_driver` (what its tasks sent the
driver) and `Witness` (which processes ran a model).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pandas as pd
import psutil
import pytest
import torch
from torch import nn

from tests.hosts import Host

BIN = Path(sys.executable).parent
# What the Spark tests need; they skip without it (launch/test.sh installs both).
needs_spark = pytest.mark.skipif(
    not (BIN / "spark-class").exists() or shutil.which("java") is None,
    reason="the Spark tests need pyspark (hvd-cpu[spark]) and Java",
)
START_SECONDS = 60
COMMAND = [str(BIN / "hvd-cpu"), "spark-train"]
ROWS = 4000
T = TypeVar("T")


def table(rows: int = ROWS) -> pd.DataFrame:
    """A learnable table: four features, a linear target with a little noise."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 4))
    frame = pd.DataFrame(x, columns=[f"f{i}" for i in range(4)])
    frame["target"] = x @ [1.0, -2.0, 0.5, 3.0] + 0.1 * rng.normal(size=rows)
    return frame


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


class SparkCluster:
    def __init__(
        self,
        folder: Path,
        workers: int = 2,
        cores: int = 2,
        host: str = "127.0.0.1",
        hosts: Sequence[Host] = (),
    ) -> None:
        self.folder, self.cores, self.host = folder, cores, host
        self.places: list[Host | None] = list(hosts) or [None] * workers
        self.port, self.ui_port = free_port(), free_port()
        self.master = f"spark://{host}:{self.port}"
        self.processes: list[subprocess.Popen[bytes]] = []
        import pyspark

        self.env = {
            **os.environ,
            "SPARK_HOME": str(Path(pyspark.__file__).parent),
            "PYSPARK_PYTHON": sys.executable,
            "SPARK_LOG_DIR": str(folder / "logs"),
            # The executors import what the driver's code imports (this repository's tests),
            # as a real cluster's Python environment must.
            "PYTHONPATH": str(Path(__file__).parent.parent),
            # Where its workers put their ranks' folders (clusters/worker.py): a rank's command
            # line names it, so a test counts this cluster's ranks, and finds what they left.
            "TMPDIR": str(folder / "ranks"),
        }
        self.ranks = folder / "ranks"

    def _start(self, name: str, command: list[str], place: Host | None = None) -> None:
        log = (self.folder / f"{name}.log").open("wb")
        env = {**self.env, "SPARK_WORKER_DIR": str(self.folder / name)}
        if place is not None:
            env["SPARK_LOCAL_IP"] = place.address
            # A hostname of the host's own, which resolves there, as on a real host.
            shell = f'hostname {place.name} && exec "$@"'
            command = place.exec("unshare", "--uts", "sh", "-c", shell, "sh", *command)
        self.processes.append(
            subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        )

    def __enter__(self) -> SparkCluster:
        self.ranks.mkdir(parents=True, exist_ok=True)
        spark_class = str(BIN / "spark-class")
        self._start(
            "master",
            [spark_class, "org.apache.spark.deploy.master.Master", "--host", self.host,
             "--port", str(self.port), "--webui-port", str(self.ui_port)],
        )  # fmt: skip
        for index, place in enumerate(self.places):
            self._start(
                f"worker{index}",
                [spark_class, "org.apache.spark.deploy.worker.Worker", self.master,
                 "--cores", str(self.cores), "--memory", "2g", "--webui-port", "0",
                 *(["--host", place.address] if place else [])],
                place,
            )  # fmt: skip
        deadline = time.monotonic() + START_SECONDS
        while self.alive_workers() < len(self.places):
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"the Spark cluster did not start; see {self.folder}")
            time.sleep(0.5)
        return self

    def alive_workers(self) -> int:
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.ui_port}/json/", timeout=2) as r:
                state = json.load(r)
        except (OSError, ValueError):  # not up yet
            return 0
        return sum(worker["state"] == "ALIVE" for worker in state["workers"])

    def executors(self) -> list[psutil.Process]:
        """The executor processes the workers started (one per application and worker)."""
        found = []
        for process in self.processes:
            for child in psutil.Process(process.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):  # a zombie of spark-class's shell
                    if "CoarseGrainedExecutorBackend" in " ".join(child.cmdline()):
                        found.append(child)
        return found

    def kill_executor(self) -> int:
        """Kill (SIGKILL) the last executor; its pid. Its worker starts the application another."""
        executor = self.executors()[-1]
        executor.kill()
        return executor.pid

    def kill_worker(self) -> int:
        """Kill the last worker's session (SIGKILL: the worker, its executor and their Python
        workers), as when its host dies; the worker's pid."""
        worker = self.processes[-1]
        os.killpg(worker.pid, signal.SIGKILL)
        return worker.pid

    def __exit__(self, *exc: object) -> None:
        """Kill each daemon's session: the daemon, its executors and their Python workers."""
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


class Witness(nn.Module):
    """A trained model that notes which process ran each of its forward passes, and on how many
    rows: a file per process id in `folder` (on this machine, where the executors run too)."""

    def __init__(self, model: nn.Module, folder: Path) -> None:
        super().__init__()
        self.model, self.folder = model, str(folder)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with open(os.path.join(self.folder, str(os.getpid())), "a") as noted:
            noted.write(f"{len(x)}\n")
        return self.model(x)


def rows_by_process(folder: Path) -> dict[int, int]:
    """What Witness noted in `folder`: the rows each process ran the model on."""
    return {int(p.name): sum(map(int, p.read_text().split())) for p in folder.iterdir()}


def bytes_to_driver(spark: Any, action: Callable[[], T]) -> tuple[T, int]:
    """`action()`'s value, and the bytes its Spark jobs' tasks sent the driver as their results
    (each stage's resultSize, from the application's REST API): a collect of rows shows here,
    a shuffle between executors does not."""
    first = _marker_job(spark)
    value = action()
    last = _marker_job(spark)
    jobs = [job for job in _status(spark, "jobs") if first < job["jobId"] < last]
    stages = {stage for job in jobs for stage in job["stageIds"]}
    sent = sum(
        attempt["resultSize"] for stage in stages for attempt in _status(spark, f"stages/{stage}")
    )
    return value, sent


def _marker_job(spark: Any) -> int:
    """The id of a job of one task run now, once the application's status store (which Spark's
    listener fills behind the jobs, in their order) shows it ended: every job before it is
    there too."""
    context = spark.sparkContext
    name = f"hvd-cpu tests: marker {time.monotonic_ns()}"
    context.setJobDescription(name)
    try:
        context.parallelize([0], 1).count()
    finally:
        context.setJobDescription(None)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for job in _status(spark, "jobs"):
            if job.get("description") == name and job["status"] == "SUCCEEDED":
                return job["jobId"]
        time.sleep(0.1)
    raise RuntimeError(f"Spark's status store never showed the job {name!r}")


def _status(spark: Any, path: str) -> Any:
    """A page of the application's REST API (served by its UI)."""
    context = spark.sparkContext
    url = f"{context.uiWebUrl}/api/v1/applications/{context.applicationId}/{path}"
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.load(answer)
