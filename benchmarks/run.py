"""The benchmark: the seed user's loop, torchrun + DDP and hvd-cpu, side by side in one run,
on the same frame, hold-out and models. Prints a Markdown table and writes results.json.

Usage (from the repository, after launch/install.sh):
    .venv/bin/python benchmarks/run.py [--rows 200000] [--output runs/benchmark]

Throughput is every epoch's samples over every epoch's training seconds (validation untimed).
Time to loss is the training time until the validation loss first reaches the loss the
seed's loop (a) ends with. Launch is the time from starting horovodrun to the last rank's
first step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import make_frame

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


@dataclass
class Contender:
    name: str
    kind: str  # plain | ddp | hvd-cpu
    processes: int
    model: str
    batch: int  # per process
    epochs: int
    options: list[str] = field(default_factory=list)  # extra hvd-cpu train options


def contenders() -> list[Contender]:
    seed, wide = "seed", "wide"
    return [
        Contender("(a) plain loop", "plain", 1, seed, 64, 10),
        Contender("(b) torchrun DDP -np 2", "ddp", 2, seed, 64, 10),
        Contender("(c) hvd-cpu -np 1", "hvd-cpu", 1, seed, 64, 10),
        Contender("(c) hvd-cpu -np 2", "hvd-cpu", 2, seed, 64, 10),
        Contender("(c) hvd-cpu -np 4", "hvd-cpu", 4, seed, 64, 3),
        Contender("(c) hvd-cpu -np 2 --sync-every 8", "hvd-cpu", 2, seed, 64, 10,
                  ["--sync-every", "8"]),
        Contender("(c) hvd-cpu -np 1 --batch-size 1024 --lr 0.004", "hvd-cpu", 1, seed, 1024, 10,
                  ["--lr", "0.004"]),
        Contender("(c) hvd-cpu -np 2 --batch-size 1024 --sync-every 4 --lr 0.004", "hvd-cpu", 2,
                  seed, 1024, 10, ["--lr", "0.004", "--sync-every", "4"]),
        Contender("(c) hvd-cpu -np 2 --batch-size 1024 --sync-every 8 --lr 0.004", "hvd-cpu", 2,
                  seed, 1024, 10, ["--lr", "0.004", "--sync-every", "8"]),
        Contender("(a) plain loop", "plain", 1, wide, 64, 3),
        Contender("(b) torchrun DDP -np 2", "ddp", 2, wide, 64, 3),
        Contender("(c) hvd-cpu -np 1", "hvd-cpu", 1, wide, 64, 3),
        Contender("(c) hvd-cpu -np 2", "hvd-cpu", 2, wide, 64, 3),
        Contender("(c) hvd-cpu -np 4", "hvd-cpu", 4, wide, 64, 1),
        # the same global batch of 256
        Contender("(c) hvd-cpu -np 1 --batch-size 256 --threads 1", "hvd-cpu", 1, wide, 256, 3,
                  ["--threads", "1"]),
        Contender("(c) hvd-cpu -np 1 --batch-size 256 (all cores' threads)", "hvd-cpu", 1, wide,
                  256, 3),
        Contender("(c) hvd-cpu -np 2 --batch-size 128", "hvd-cpu", 2, wide, 128, 3),
        Contender("(c) hvd-cpu -np 2 --batch-size 128 --sync-every 8", "hvd-cpu", 2, wide, 128, 3,
                  ["--sync-every", "8"]),
    ]  # fmt: skip


def run_one(contender: Contender, frame: Path, out: Path) -> dict:
    """Run one contender in `out`; return its epochs (and, for hvd-cpu, its launch time)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    epochs_file = out / "epochs.jsonl"
    common = [str(frame), contender.model, str(contender.epochs), str(contender.batch)]
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    if contender.kind == "plain":
        command = [sys.executable, str(HERE / "plain_loop.py"), *common, str(epochs_file)]
    elif contender.kind == "ddp":
        command = [str(BIN / "torchrun"), "--nproc-per-node", str(contender.processes),
                   str(HERE / "ddp.py"), *common, str(epochs_file)]  # fmt: skip
    else:
        from common import MODELS

        hidden, activation = MODELS[contender.model]
        command = [
            str(BIN / "horovodrun"), "-np", str(contender.processes), str(BIN / "hvd-cpu"),
            "train", "--data", str(frame), "--epochs", str(contender.epochs),
            "--batch-size", str(contender.batch), "--hidden", ",".join(map(str, hidden)),
            "--activation", activation, "--output", str(out / "run"), "--quiet",
            *contender.options,
        ]  # fmt: skip
    launched = time.time()
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{contender.name} failed:\n{done.stdout}\n{done.stderr}")
    result: dict = {"wall_seconds": time.time() - launched}
    if contender.kind == "hvd-cpu":
        lines = (out / "run" / "metrics.jsonl").read_text().splitlines()
        result["epochs"] = [json.loads(line) for line in lines]
        ranks = json.loads((out / "run" / "ranks.json").read_text())
        result["launch_seconds"] = max(r["first_step_unix"] for r in ranks) - launched
    else:
        result["epochs"] = [json.loads(line) for line in epochs_file.read_text().splitlines()]
    return result


def time_to_loss(epochs: list[dict], threshold: float) -> float | None:
    elapsed = 0.0
    for epoch in epochs:
        elapsed += epoch["seconds"]
        if epoch["val_loss"] <= threshold:
            return elapsed
    return None


def summarise(contender: Contender, result: dict, threshold: float) -> dict:
    epochs = result["epochs"]
    samples = sum(e["samples"] for e in epochs)
    seconds = sum(e["seconds"] for e in epochs)
    return {
        "name": contender.name,
        "model": contender.model,
        "processes": contender.processes,
        "batch_per_process": contender.batch,
        "epochs": len(epochs),
        "samples_per_s": samples / seconds,
        "final_val_loss": epochs[-1]["val_loss"],
        "threshold": threshold,
        "time_to_loss_s": time_to_loss(epochs, threshold),
        "launch_seconds": result.get("launch_seconds"),
        "wall_seconds": result["wall_seconds"],
    }


def markdown(rows: list[dict]) -> str:
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        group = [r for r in rows if r["model"] == model]
        plain = group[0]
        lines += [
            "",
            f"model `{model}`, loss to reach {plain['threshold']:.4f} "
            f"((a)'s after {plain['epochs']} epochs)",
            "",
            "| contender | epochs | samples/s | vs (a) | time to loss | vs (a) | final val loss "
            "| launch to 1st step |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in group:
            ttl = r["time_to_loss_s"]
            ttl_text = f"{ttl:.2f} s" if ttl is not None else "not reached"
            ttl_ratio = (
                f"{plain['time_to_loss_s'] / ttl:.1f}x" if ttl and plain["time_to_loss_s"] else "-"
            )
            launch = f"{r['launch_seconds']:.1f} s" if r["launch_seconds"] else "-"
            lines.append(
                f"| {r['name']} | {r['epochs']} | {r['samples_per_s']:,.0f} "
                f"| {r['samples_per_s'] / plain['samples_per_s']:.2f}x | {ttl_text} | {ttl_ratio} "
                f"| {r['final_val_loss']:.4f} | {launch} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--output", type=Path, default=Path("runs/benchmark"))
    parser.add_argument("--only", help="run only contenders whose model is this (seed, wide)")
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    frame = args.output / f"frame-{args.rows}.parquet"
    if not frame.exists():
        make_frame(args.rows).to_parquet(frame)
    rows, threshold = [], {}
    for number, contender in enumerate(contenders(), start=1):
        if args.only and contender.model != args.only:
            continue
        print(f"running {contender.model}: {contender.name}", file=sys.stderr, flush=True)
        result = run_one(contender, frame, args.output / f"{number:02d}-{contender.kind}")
        if contender.kind == "plain":
            threshold[contender.model] = result["epochs"][-1]["val_loss"]
        rows.append(summarise(contender, result, threshold[contender.model]))
    table = markdown(rows)
    print(table)
    (args.output / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    (args.output / "results.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
