"""What --elastic costs when nothing fails: a commit (an in-memory copy of the state plus one
broadcast of Horovod's host updates) per --commit-every steps, and the elastic launch.

Usage (from the repository, after launch/install.sh):
    .venv/bin/python benchmarks/elastic.py [--np 2] [--repeats 2] [--output runs/elastic-bench]

Each row is one `launch/elastic.sh` job on this host (HVD_CPU_SLOTS=NP), the settings
interleaved `--repeats` times so the machine's drift hits them alike; a plain `horovodrun
--gloo` job gives the reference. Per-step time is training seconds / steps per rank, the cost
of a commit is the difference between committing every step and never.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BIN = Path(sys.executable).parent
COMMIT_EVERY = (1, 10, 100, 10**9)  # 10**9: never within these epochs
EPOCHS, ROWS, BATCH = 3, 20_000, 64


def run(command: list[str], env: dict[str, str]) -> float:
    """Seconds from start to exit; raises if the job fails."""
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"failed: {' '.join(command)}\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return time.perf_counter() - start


def step_ms(output: Path) -> float:
    """Median over epochs of training seconds per step of one rank."""
    lines = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    steps = [-(-m["samples"] // (m["world_size"] * BATCH)) for m in lines]
    return statistics.median(1000 * m["seconds"] / s for m, s in zip(lines, steps, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", type=Path, default=Path("runs/elastic-bench"))
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    data = args.output / "frame.parquet"
    subprocess.run([str(BIN / "hvd-cpu"), "make-demo-data", str(data), "--rows", str(ROWS),
                    "--features", "8"], check=True, capture_output=True)  # fmt: skip
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
           "HVD_CPU_VENV": str(BIN.parent), "NP": str(args.np)}  # fmt: skip
    train = ["train", "--data", str(data), "--epochs", str(EPOCHS), "--overwrite"]
    results: dict[str, list[tuple[float, float]]] = {}
    for repeat in range(args.repeats):
        output = args.output / f"plain-{repeat}"
        seconds = run([str(BIN / "horovodrun"), "--gloo", "-np", str(args.np),
                       str(BIN / "hvd-cpu"), *train, "--output", str(output)], env)  # fmt: skip
        results.setdefault("plain", []).append((step_ms(output), seconds))
        for every in COMMIT_EVERY:
            output = args.output / f"commit-{every}-{repeat}"
            elastic = [str(REPO / "launch" / "elastic.sh"), *train[1:], "--output", str(output)]
            seconds = run([*elastic, "--commit-every", str(every)], env)
            results.setdefault(f"elastic, commit every {every}", []).append(
                (step_ms(output), seconds)
            )
    medians = {name: statistics.median(ms for ms, _ in runs) for name, runs in results.items()}
    print(f"-np {args.np}, seed MLP, batch {BATCH}, {ROWS} rows, {EPOCHS} epochs; medians of "
          f"{args.repeats} interleaved runs\n")  # fmt: skip
    print("| run | ms per step | job seconds (launch included) |")
    print("|---|---|---|")
    for name, runs in results.items():
        seconds = statistics.median(s for _, s in runs)
        print(f"| {name} | {medians[name]:.3f} | {seconds:.1f} |")
    # Only a commit every step stands out of this machine's noise: its cost per commit.
    cost = medians["elastic, commit every 1"] - medians[f"elastic, commit every {10**9}"]
    print(f"\none commit: {cost:.1f} ms (commit every step against never)")
    (args.output / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
