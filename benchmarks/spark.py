"""What Spark costs: hvd_cpu.spark.fit against hvd_cpu.fit on the same frame, the same ranks
and options, on a standalone cluster started here (a master and two workers of two cores,
tests/spark_cluster.py). Measured: the cluster's and the session's start, each job's wall
time from the call to its return, and its training throughput (rank 0's summary), alternated
in rounds; medians.

Usage (from the repository, after launch/install.sh --test, which installs pyspark and Java):
    .venv/bin/python benchmarks/spark.py [--rounds 3] [--rows 100000] [--np 4] [--epochs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import make_frame

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import hvd_cpu  # noqa: E402
import hvd_cpu.spark  # noqa: E402
from hvd_cpu.spark import cluster  # noqa: E402
from tests.spark_cluster import SparkCluster  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    frame = make_frame(args.rows)
    options = {"epochs": args.epochs, "overwrite": True, "quiet": True}
    with tempfile.TemporaryDirectory() as folder:
        started = time.monotonic()
        with SparkCluster(Path(folder) / "cluster") as running:
            cluster_start = time.monotonic() - started
            started = time.monotonic()
            spark = cluster.session(running.master, "hvd-cpu benchmark")
            session_start = time.monotonic() - started
            table = spark.createDataFrame(frame).repartition(args.np).cache()
            table.count()
            walls: dict[str, list[float]] = {"hvd_cpu.spark.fit": [], "hvd_cpu.fit": []}
            speeds: dict[str, list[float]] = {name: [] for name in walls}
            for _ in range(args.rounds):
                for name in walls:
                    output = Path(folder) / name
                    started = time.monotonic()
                    if name == "hvd_cpu.fit":
                        result = hvd_cpu.fit(frame, np=args.np, output=output, **options)
                    else:
                        result = hvd_cpu.spark.fit(
                            table, num_proc=args.np, output=output, **options
                        )
                    walls[name].append(time.monotonic() - started)
                    speeds[name].append(result.history["samples_per_s"].iloc[1:].median())
            spark.stop()
    print(f"{args.rows} rows, {args.np} ranks, {args.epochs} epochs, {args.rounds} round(s)")
    print(f"cluster start (master + 2 workers): {cluster_start:.1f} s")
    print(f"session start (driver JVM, executors): {session_start:.1f} s")
    for name in walls:
        print(
            f"{name:18} wall {statistics.median(walls[name]):5.1f} s   training "
            f"{statistics.median(speeds[name]):9,.0f} samples/s"
        )


if __name__ == "__main__":
    main()
