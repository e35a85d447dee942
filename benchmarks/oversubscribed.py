"""More ranks than cores: `horovodrun -np 4` on this 2-core host, over MPI with Open MPI's
busy-polling wait (OMPI_MCA_mpi_yield_when_idle=0, what hvd-cpu left before) and with a waiting
rank yielding its core (what hvd-cpu now sets when ranks outnumber cores), against Gloo, the
seed's MLP at batch 64, alternated in rounds.

Usage (from the repository, after launch/install.sh):
    .venv/bin/python benchmarks/oversubscribed.py [--rounds 3] [--output runs/oversubscribed]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from common import frame_file, training_throughput

BIN = Path(sys.executable).parent
HOROVODRUN = [str(BIN / "horovodrun"), "-np", "4", "--disable-cache"]
SETTINGS = {
    "MPI, busy-polling wait": ([*HOROVODRUN, "--mpi"], {"OMPI_MCA_mpi_yield_when_idle": "0"}),
    "MPI, waiting rank yields (default now)": ([*HOROVODRUN, "--mpi"], {}),
    "Gloo": ([*HOROVODRUN, "--gloo"], {}),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=Path("runs/oversubscribed"))
    args = parser.parse_args()
    frame = frame_file(args.output, 50_000)
    samples: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name, (launcher, env) in SETTINGS.items():
            samples[name].append(training_throughput(launcher, frame, args.output / "run", env=env))
    print("| -np 4 on 2 cores, seed MLP, batch 64 | samples/s (median) | runs |")
    print("|---|---:|---|")
    for name, runs in samples.items():
        listed = ", ".join(f"{r:,.0f}" for r in runs)
        print(f"| {name} | {statistics.median(runs):,.0f} | {listed} |")


if __name__ == "__main__":
    main()
