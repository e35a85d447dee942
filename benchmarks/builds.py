"""This Horovod build beside an earlier one, run by run alternated (this machine is noisy):
what a patch costs a job where it matters, its start and its steps.

Usage (from the repository, after launch/install.sh):
    .venv/bin/python benchmarks/builds.py DIR [--runs 5]

DIR is an earlier Horovod wheel unzipped (e.g. one from ~/.cache/hvd-cpu/wheels/, built
before the patches to compare); its package is put first on the ranks' PYTHONPATH. Each
round, for each build: a `horovodrun --gloo -np 2` job that starts Horovod and makes one
allreduce (start to end), a rank program timing a waited 3 KB allreduce through shared
memory (the direct path, and Horovod's own), and a 2-rank `hvd-cpu train` of the seed's MLP
(the median epoch); once, one process's epoch, for the speed-up. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import median_seconds

BIN = Path(sys.executable).parent
START = "import horovod.torch as hvd, torch; hvd.init(); hvd.allreduce(torch.ones(4))"


def rank_program() -> None:
    """On each rank: the median µs of a waited 3 KB allreduce, direct and Horovod's."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)
    tensor = torch.ones(768)
    direct = median_seconds(lambda: hvd.direct_allreduce_(tensor), 2000, warm_up=200)
    horovod = median_seconds(lambda: hvd.allreduce(tensor, name="x"), 2000, warm_up=200)
    if hvd.rank() == 0:
        print(json.dumps({"direct": direct * 1e6, "horovod": horovod * 1e6}), flush=True)


def _environment(build: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if build is not None:
        env["PYTHONPATH"] = f"{build}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def _gloo(np: int, *command: str, build: Path | None) -> str:
    launcher = [str(BIN / "horovodrun"), "--gloo", "-np", str(np), "--disable-cache"]
    done = subprocess.run([*launcher, *command], env=_environment(build), check=True,
                          capture_output=True, text=True)  # fmt: skip
    return done.stdout


def job_start(build: Path | None) -> float:
    started = time.perf_counter()
    _gloo(2, sys.executable, "-c", START, build=build)
    return time.perf_counter() - started


def latencies(build: Path | None) -> dict[str, float]:
    out = _gloo(2, sys.executable, __file__, "--rank-program", build=build)
    return json.loads(next(line.split(":", 1)[1] for line in out.splitlines() if "direct" in line))


def epoch_seconds(frame: Path, output: Path, np: int, build: Path | None) -> float:
    train = [str(BIN / "hvd-cpu"), "train", "--data", str(frame), "--epochs", "5",
             "--overwrite", "--quiet", "--output", str(output)]  # fmt: skip
    if np == 1:
        subprocess.run(train, env=_environment(build), check=True, capture_output=True)
    else:
        _gloo(np, *train, build=build)
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["seconds"] for r in records)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("earlier", type=Path, nargs="?", help="an earlier Horovod wheel, unzipped")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rank-program", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_program:
        rank_program()
        return
    builds = {"this build": None, str(args.earlier): args.earlier}
    rows: dict[str, dict[str, list[float]]] = {name: {} for name in builds}
    with tempfile.TemporaryDirectory() as folder:
        frame = Path(folder) / "frame.parquet"
        subprocess.run([str(BIN / "hvd-cpu"), "make-demo-data", str(frame), "--rows", "100000"],
                       check=True, capture_output=True)  # fmt: skip
        alone = epoch_seconds(frame, Path(folder) / "alone", 1, None)
        for _ in range(args.runs):
            for name, build in builds.items():  # alternated: the noise falls on both alike
                row = rows[name]
                row.setdefault("start, init, one allreduce (s)", []).append(job_start(build))
                for path, us in latencies(build).items():
                    row.setdefault(f"waited 3 KB allreduce, {path} (µs)", []).append(us)
                epoch = epoch_seconds(frame, Path(folder) / "run", 2, build)
                row.setdefault("2 ranks: an epoch (s)", []).append(epoch)
                row.setdefault("2 ranks against one process", []).append(alone / epoch)
    print(f"| median of {args.runs}, alternated | " + " | ".join(builds) + " |")
    print("|---|" + "---:|" * len(builds))
    for measure in rows["this build"]:
        cells = [f"{statistics.median(rows[n][measure]):.3g}" for n in builds]
        print(f"| {measure} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
