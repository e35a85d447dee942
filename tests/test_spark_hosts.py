"""hvd-cpu spark-train on a Spark cluster whose two workers run in two namespace hosts
(tests/hosts.py): the ranks' Gloo crosses a network, the driver (here) reaches the executors
over the hosts' bridge, and the run trains as on one host."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.hosts import Hosts, assert_ranks_numbered_by_host, needs_namespaces
from tests.spark_cluster import COMMAND, SparkCluster, needs_spark, table

pytestmark = [needs_namespaces, needs_spark, pytest.mark.slow]
# A bridge and subnet of their own: never the multi-host tests' (tests/test_hosts.py).
BRIDGE, SUBNET = "hvdspark0", "198.18.5"


def test_ranks_on_two_hosts(tmp_path: Path) -> None:
    """The data and the run in tmp_path: the storage all hosts share, as Spark's --output must
    be (docs/spark.md); each host's /dev/shm its own."""
    parquet = tmp_path / "t.parquet"
    table(8000).to_parquet(parquet)
    names = ["sparkhosta", "sparkhostb"]
    (tmp_path / "hosts").mkdir()
    with (
        Hosts(tmp_path / "hosts", names, sshd=False, bridge=BRIDGE, subnet=SUBNET) as hosts,
        SparkCluster(tmp_path / "cluster", host=f"{SUBNET}.1", hosts=hosts.hosts) as cluster,
    ):
        done = subprocess.run(
            [*COMMAND, "--master", cluster.master, "--np", "4", "--data", str(parquet),
             "--output", str(tmp_path / "run"), "--epochs", "3"],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "SPARK_LOCAL_IP": f"{SUBNET}.1"},  # the driver, on the bridge
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Epoch 3:" in done.stdout
    ranks = json.loads((tmp_path / "run" / "ranks.json").read_text())
    # Two consecutive ranks on each host, as horovodrun lays them out; which host holds
    # rank 0 is Spark's choice (where partition 0's task runs).
    assert_ranks_numbered_by_host(ranks, names, 2)
    assert {rank["transport"] for rank in ranks} == {"shared memory"}
    assert len({rank["param_sha256"] for rank in ranks}) == 1  # one model, averaged across
    assert sum(rank["rows_read"] for rank in ranks) == 8000  # each its own partition
