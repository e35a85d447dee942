"""What the stall watchdog (runtime/watchdog.py) costs a training step: the same job with the
heartbeats on (--stall-seconds 60, the default) and off (0), alternated, on the path where a
step is shortest and so any cost shows most (the seed's MLP, batch 64, MPI, --allreduce direct),
and on the card's default (Gloo, Horovod's DistributedOptimizer).

Usage (from the repository, after launch/install.sh):
    .venv/bin/python benchmarks/watchdog.py [--rounds 3] [--output runs/watchdog]

Throughput is samples over training seconds of every epoch but the first (warm-up).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from common import frame_file, training_throughput

BIN = Path(sys.executable).parent
HOROVODRUN = [str(BIN / "horovodrun"), "-np", "2", "--disable-cache"]
LAUNCHERS = {
    "MPI direct": ([*HOROVODRUN, "--mpi"], ["--allreduce", "direct"]),
    "Gloo, DistributedOptimizer": ([*HOROVODRUN, "--gloo"], []),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=Path("runs/watchdog"))
    args = parser.parse_args()
    frame = frame_file(args.output, 50_000)
    print("| job (2 ranks, seed MLP, batch 64) | heartbeats off | on (60 s) | on / off |")
    print("|---|---:|---:|---:|")
    for name, (launcher, options) in LAUNCHERS.items():
        samples: dict[str, list[float]] = {"0": [], "60": []}
        for _ in range(args.rounds):
            for stall in samples:  # alternated: the machine's drift hits both alike
                run = training_throughput(
                    launcher, frame, args.output / "run", *options, "--stall-seconds", stall
                )
                samples[stall].append(run)
        off, on = (statistics.median(samples[s]) for s in ("0", "60"))
        print(f"| {name} | {off:,.0f}/s | {on:,.0f}/s | {on / off:.3f} |")


if __name__ == "__main__":
    main()
