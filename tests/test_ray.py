"""hvd_cpu.ray on a real Ray cluster of two nodes (ray.cluster_utils.Cluster: a head and a
worker node, each a raylet of its own with one CPU, started here): training from a DataFrame,
a Dataset and parquet against hvd_cpu.fit, prediction by Ray Data's tasks, bad input, a lost
node with and without elastic=True, and nothing left running."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

import hvd_cpu
from hvd_cpu.clusters.worker import FOLDER_PREFIX
from hvd_cpu.errors import InputError, RunFailed
from tests.jobs import processes_naming
from tests.spark_cluster import ROWS, table

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from hvd_cpu import ray as hvd_ray  # noqa: E402

# Beside another test (launch/test.sh's first stage): the cluster's ports are Ray's free ones,
# and the rank processes counted are this file's: their command lines name their folders,
# which the workers make in this machine's temporary folder (the Spark tests' cluster gives
# its workers a folder of its own).
pytestmark = [pytest.mark.slow, pytest.mark.beside]
RANKS = 2
RANK_PROCESS = os.path.join(tempfile.gettempdir(), FOLDER_PREFIX)
OPTIONS = {"epochs": 3, "batch_size": 64, "seed": 3}


class RayCluster:
    """A head node and a worker node of one CPU each, this process their driver."""

    def __init__(self) -> None:
        self.cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
        )
        self.worker = self.cluster.add_node(num_cpus=1)
        ray.init(address=self.cluster.address)

    def replace_worker(self) -> None:
        """The worker node again (after a test removed it)."""
        self.worker = self.cluster.add_node(num_cpus=1)
        self.cluster.wait_for_nodes()

    def close(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    running = RayCluster()
    yield running
    running.close()


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def assert_same_training(ours: hvd_cpu.api.FitResult, theirs: hvd_cpu.api.FitResult) -> None:
    """The same computation: the same parameters and losses, bit for bit."""
    for name, value in parameters(theirs.model).items():
        assert torch.equal(parameters(ours.model)[name], value), name
    columns = ["epoch", "train_loss", "val_loss"]
    pd.testing.assert_frame_equal(ours.history[columns], theirs.history[columns], check_exact=True)


def test_ray_fit_trains_as_fit_does_and_predicts(cluster: RayCluster, tmp_path: Path) -> None:
    """Rank i trains on the i-th contiguous block of the rows, as hvd_cpu.fit(shard_read=True)
    rank i on the i-th row group of a parquet file: the same parameters and losses, bit for
    bit, from a DataFrame and from a Ray Dataset (a parquet path: the command line's test).
    Then Ray Data's tasks predict what the model predicts here."""
    frame = table()
    parquet = tmp_path / "table.parquet"
    frame.to_parquet(parquet, row_group_size=ROWS // RANKS)
    theirs = hvd_cpu.fit(parquet, np=RANKS, shard_read=True, output=tmp_path / "fit", **OPTIONS)
    ours = hvd_ray.fit(frame, num_proc=RANKS, output=tmp_path / "frame", **OPTIONS)
    assert_same_training(ours, theirs)
    assert (tmp_path / "frame" / "model.pt").exists()
    from_dataset = hvd_ray.fit(
        ray.data.from_pandas(frame), num_proc=RANKS, output=tmp_path / "dataset", **OPTIONS
    )
    assert_same_training(from_dataset, theirs)
    assert processes_naming(RANK_PROCESS, grace=10) == []

    keyed = frame.drop(columns="target").assign(key=range(ROWS))
    predicted = hvd_ray.predict(ours, ray.data.from_pandas(keyed), id_column="key")
    assert isinstance(predicted, ray.data.Dataset)
    got = predicted.to_pandas().sort_values("key").reset_index(drop=True)
    pd.testing.assert_frame_equal(got, ours.predict(keyed, "key"), check_dtype=False)
    from_folder = hvd_ray.predict(tmp_path / "frame", frame.drop(columns="target")).to_pandas()
    assert sorted(from_folder["prediction"]) == sorted(got["prediction"])


def test_the_command_line_trains_on_the_cluster(cluster: RayCluster, tmp_path: Path) -> None:
    """`hvd-cpu ray-train --address` from another process, on the same cluster: rank 0's
    epoch lines on its stdout, the run's folder written."""
    parquet = tmp_path / "table.parquet"
    table().to_parquet(parquet)
    done = subprocess.run(
        [str(Path(sys.executable).with_name("hvd-cpu")), "ray-train", "--address",
         cluster.cluster.address, "--np", str(RANKS), "--data", str(parquet), "--epochs", "2",
         "--output", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Epoch 2: Train Loss" in done.stdout, done.stdout
    assert (tmp_path / "out" / "model.pt").exists()


def test_bad_input_is_one_line_within_seconds(cluster: RayCluster, tmp_path: Path) -> None:
    frame = table(200)
    started = time.monotonic()
    with pytest.raises(InputError, match=r"has 2 CPU\(s\), fewer than num_proc=3"):
        hvd_ray.fit(frame, num_proc=3, output=tmp_path / "a")
    with pytest.raises(InputError, match="the Dataset has no column 'y'"):
        hvd_ray.fit(frame, "y", num_proc=2, output=tmp_path / "b")
    with pytest.raises(InputError, match="placement must be one of pack, spread"):
        hvd_ray.fit(frame, num_proc=2, placement="close", output=tmp_path / "c")
    assert time.monotonic() - started < 20
    assert not (tmp_path / "a").exists()

    # From another process: a free port, and a Python where Ray cannot be imported.
    script = (
        "import sys, socket\n"
        "if sys.argv[1] == 'no-ray': sys.modules['ray'] = None\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "from hvd_cpu import ray as r\n"
        "from hvd_cpu.data.demo import make_demo_frame\n"
        "r.fit(make_demo_frame(100, 2), address=f'127.0.0.1:{port}')\n"
    )
    for case, said in (
        ("no-ray", "Ray is not installed: pip install 'hvd-cpu[ray]'"),
        ("no-cluster", "no Ray cluster answers at 127.0.0.1:"),
    ):
        began = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", script, case], capture_output=True, text=True, timeout=60
        )
        assert time.monotonic() - began < 20, case
        assert done.returncode != 0 and said in done.stderr, (case, done.stderr)


def test_workers_whose_python_cannot_run_a_rank_are_named(tmp_path: Path) -> None:
    """A node whose Ray runs a Python without Horovod (here: one that finds a `horovod` which
    fails to import first on its path): one line naming the node, its Python and what it lacks,
    before any rank starts. A cluster of its own, so the others' nodes stay sound."""
    shadow = tmp_path / "shadow" / "horovod"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named horovod')\n")
    script = (
        "import ray, sys\n"
        "from ray.cluster_utils import Cluster\n"
        "c = Cluster(initialize_head=True, head_node_args={'num_cpus': 1, "
        "'include_dashboard': False, 'env_vars': {'PYTHONPATH': sys.argv[1]}})\n"
        "ray.init(address=c.address)\n"
        "from hvd_cpu import ray as r\n"
        "from hvd_cpu.errors import InputError\n"
        "from hvd_cpu.data.demo import make_demo_frame\n"
        "try:\n"
        "    r.fit(make_demo_frame(100, 2), num_proc=1, output=sys.argv[2])\n"
        "except InputError as e:\n"
        "    print(e)\n"
        "finally:\n"
        "    ray.shutdown(); c.shutdown()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(shadow.parent), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"run {sys.executable}, which cannot import horovod.torch" in done.stdout, done.stdout
    assert not (tmp_path / "out").exists()


def _node_lost_while_training(
    cluster: RayCluster, output: Path, replaced: bool, job: Callable[[], Any]
) -> Any:
    """What `job` returns (or raises), run in a thread while this one removes the worker node
    (its raylet and workers killed) once the job has written its first checkpoint, and
    (`replaced`) then starts another, as a cluster replaces a node (Ray starts nodes from the
    main thread)."""
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(job)
        deadline = time.monotonic() + 120
        while not (output / "checkpoint.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        cluster.cluster.remove_node(cluster.worker, allow_graceful=False)
        if replaced:
            cluster.replace_worker()
        return running.result(timeout=600)


def test_a_lost_node_ends_the_job_in_one_line_or_elastic_goes_on(
    cluster: RayCluster, tmp_path: Path
) -> None:
    """The worker node killed mid-training: the job ends with RunFailed naming the rank and
    its node, the checkpoint kept, no rank left. With elastic=True the job goes on by itself
    from its last checkpoint, on the node that replaced it, to the end."""
    frame = table(ROWS * 2)
    options = {"epochs": 40, "checkpoint_every": 1, "seed": 3}
    folders_before = set(glob.glob(RANK_PROCESS + "*"))
    output = tmp_path / "once"
    with pytest.raises(RunFailed) as failed:
        _node_lost_while_training(
            cluster,
            output,
            False,
            lambda: hvd_ray.fit(frame, num_proc=RANKS, output=output, **options),
        )
    said = str(failed.value)
    assert "Ray actor on" in said or "process ended" in said, said
    assert "\n" not in said and (output / "checkpoint.pt").exists(), said
    assert processes_naming(RANK_PROCESS, grace=15) == []
    cluster.replace_worker()

    output = tmp_path / "elastic"
    result = _node_lost_while_training(
        cluster,
        output,
        True,
        lambda: hvd_ray.fit(
            frame, num_proc=RANKS, output=output, elastic=True, max_restarts=2, **options
        ),
    )
    assert result.history["epoch"].tolist()[-1] == options["epochs"]
    assert processes_naming(RANK_PROCESS, grace=15) == []
    assert (output / "model.pt").exists()
    # The killed node's workers could not remove their ranks' folders: their ranks did.
    assert set(glob.glob(RANK_PROCESS + "*")) <= folders_before
