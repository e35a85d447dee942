"""Start-up: from `horovodrun -np N hvd-cpu train` (the default launcher, MPI here) to every
rank's first step, and where each rank's part of it goes (ranks.json's `start_seconds`:
imports, joining the job, preparing the data and model), median of several runs.

Usage (from the repository, after launch/install.sh):
    .venv/bin/python benchmarks/startup.py [--np 2,4] [--runs 3] [--output runs/startup]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from common import frame_file, train_job

BIN = Path(sys.executable).parent
PHASES = ("imported", "joined", "prepared", "first_step")


def one_start(processes: int, frame: Path, output: Path) -> dict[str, float]:
    """One job of one epoch: seconds from the launch to the last rank's first step, and
    each phase's seconds (the slowest rank's) from its process's start."""
    launcher = [str(BIN / "horovodrun"), "-np", str(processes), "--disable-cache"]
    launched = time.time()
    train_job(launcher, frame, output, 1)
    ranks = json.loads((output / "ranks.json").read_text())
    found = {"launch to first step": max(r["first_step_unix"] for r in ranks) - launched}
    for phase in PHASES:
        found[f"{phase} (since the rank's start)"] = max(r["start_seconds"][phase] for r in ranks)
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--np", default="2,4")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--output", type=Path, default=Path("runs/startup"))
    args = parser.parse_args()
    frame = frame_file(args.output, 20_000)
    counts = [int(n) for n in args.np.split(",")]
    runs: dict[int, list[dict[str, float]]] = {n: [] for n in counts}
    for _ in range(args.runs):
        for n in counts:  # alternated: the machine's noise falls on every count alike
            runs[n].append(one_start(n, frame, args.output / "run"))
    names = list(runs[counts[0]][0])
    columns = " | ".join(f"-np {n}" for n in counts)
    print(f"| seconds (median of {args.runs}) | {columns} |")
    print("|---|" + "---:|" * len(counts))
    for name in names:
        medians = [statistics.median(r[name] for r in runs[n]) for n in counts]
        print(f"| {name} | " + " | ".join(f"{m:.2f}" for m in medians) + " |")


if __name__ == "__main__":
    main()
