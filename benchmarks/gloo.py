"""The card's controller, Gloo, on one host: one process against two and four ranks over Gloo's
shared memory (the default: the direct allreduce; and hvd.DistributedOptimizer), over TCP as
before the gloo-shared-memory patch, over MPI, and torchrun + DDP, the seed's MLP at batch 64
per rank, alternated in rounds (this machine is noisy: medians of each setting's rounds).

Usage (from the repository, after launch/install.sh):
    .venv/bin/python benchmarks/gloo.py [--rounds 3] [--rows 100000] [--output runs/gloo]

Throughput is samples per training second of every epoch but the first (warm-up), as in
benchmarks/oversubscribed.py; DDP's the same over its epochs. Writes results.json and prints
a Markdown table with each setting's runs and its median against one process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from common import frame_file, training_throughput
from run import Contender, run_one

BIN = Path(sys.executable).parent
HOROVODRUN = [str(BIN / "horovodrun"), "--disable-cache"]
TCP = {"HOROVOD_GLOO_SHARED_MEMORY": "0"}
HOROVOD = ("--allreduce", "horovod")
# name: (launcher, hvd-cpu train options, environment); None as launcher: torchrun + DDP
SETTINGS: dict[str, tuple[list[str] | None, tuple[str, ...], dict[str, str]]] = {
    "hvd-cpu train, one process": ([], (), {}),
    "horovodrun --gloo -np 2 (default: direct allreduce over shared memory)": (
        [*HOROVODRUN, "--gloo", "-np", "2"], (), {}),
    "horovodrun --gloo -np 2 --allreduce horovod (hvd.DistributedOptimizer)": (
        [*HOROVODRUN, "--gloo", "-np", "2"], HOROVOD, {}),
    "horovodrun --gloo -np 2 over TCP (HOROVOD_GLOO_SHARED_MEMORY=0)": (
        [*HOROVODRUN, "--gloo", "-np", "2"], (), TCP),
    "horovodrun --gloo -np 4 (the demo's 4 ranks on 2 cores)": (
        [*HOROVODRUN, "--gloo", "-np", "4"], (), {}),
    "horovodrun --gloo -np 4 over TCP": ([*HOROVODRUN, "--gloo", "-np", "4"], (), TCP),
    "horovodrun --mpi -np 2 (default: direct MPI allreduce)": (
        [*HOROVODRUN, "--mpi", "-np", "2"], (), {}),
    "torchrun + DDP (gloo) -np 2": (None, (), {}),
}  # fmt: skip


def ddp_throughput(frame: Path, output: Path) -> float:
    epochs = run_one(Contender("ddp", "ddp", 2, "seed", 64, 4), frame, output)["epochs"]
    return sum(e["samples"] for e in epochs[1:]) / sum(e["seconds"] for e in epochs[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--output", type=Path, default=Path("runs/gloo"))
    args = parser.parse_args()
    frame = frame_file(args.output, args.rows)
    runs: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for round_ in range(args.rounds):
        for name, (launcher, options, env) in SETTINGS.items():
            out = args.output / "run"
            if launcher is None:
                measured = ddp_throughput(frame, out)
            else:
                measured = training_throughput(launcher, frame, out, *options, env=env)
            runs[name].append(measured)
            print(f"round {round_ + 1}: {name}: {measured:,.0f}", file=sys.stderr, flush=True)
    one = statistics.median(runs["hvd-cpu train, one process"])
    lines = [
        f"| seed MLP, batch 64 per rank, {args.rows:,} rows | samples/s (median) | vs one "
        "process | runs |",
        "|---|---:|---:|---|",
    ]
    for name, measured in runs.items():
        median = statistics.median(measured)
        listed = ", ".join(f"{r:,.0f}" for r in measured)
        lines.append(f"| {name} | {median:,.0f} | {median / one:.2f}x | {listed} |")
    print("\n".join(lines))
    (args.output / "results.json").write_text(json.dumps(runs, indent=2) + "\n")


if __name__ == "__main__":
    main()
