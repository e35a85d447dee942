"""What a lost executor costs `hvd-cpu spark-train --elastic`: on a standalone cluster started
here (a master and two workers of two cores, tests/spark_cluster.py), an executor is killed
(SIGKILL) when epoch K's line arrives; measured from the kill: the driver's "going on" line,
and the next epoch's line (the worker has started the application another executor, the
stage has started again and the ranks have resumed from epoch K's checkpoint).

Usage (from the repository, after launch/install.sh --test, which installs pyspark and Java):
    .venv/bin/python benchmarks/spark_elastic.py [--rows 40000] [--np 4] [--kill-after 3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import make_frame

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.spark_cluster import COMMAND, SparkCluster  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=40_000)
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--kill-after", type=int, default=3, help="epochs before the kill")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        data = Path(folder) / "table.parquet"
        make_frame(args.rows).to_parquet(data)
        with SparkCluster(Path(folder) / "cluster") as running:
            command = [
                *COMMAND, "--master", running.master, "--np", str(args.np), "--data", str(data),
                "--output", str(Path(folder) / "run"), "--epochs", str(args.kill_after + 3),
                "--elastic",
            ]  # fmt: skip
            job = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            killed = going_on = back = None
            assert job.stdout is not None
            for line in job.stdout:
                now = time.monotonic()
                if line.startswith(f"Epoch {args.kill_after}:") and killed is None:
                    running.kill_executor()
                    killed = now
                elif "going on (elastic" in line:
                    going_on = now
                elif line.startswith(f"Epoch {args.kill_after + 1}:") and killed:
                    back = now
            if job.wait() != 0 or killed is None or going_on is None or back is None:
                raise SystemExit(f"the job did not go on as it should (exit code {job.returncode})")
    print(f"kill -> the driver's going-on line: {going_on - killed:.1f} s")
    print(f"kill -> epoch {args.kill_after + 1}'s line: {back - killed:.1f} s")


if __name__ == "__main__":
    main()
