"""Horovod's own overhead: allreduce latency per controller and message size, and the training
throughput of the seed's MLP, swept over HOROVOD_CYCLE_TIME and the fusion threshold.

Usage (from the repository, after launch/install.sh):
    .venv/bin/python benchmarks/allreduce.py [--output runs/allreduce]

Each row is one `horovodrun -np 2` job on this host; every job measures, side by side, Horovod's
allreduce (what hvd.DistributedOptimizer's hooks did per gradient) and the same sum as one
call from the calling thread (what --allreduce direct does): over MPI one mpi4py call, over
Gloo through shared memory hvd.direct_allreduce_. Gloo runs twice, through shared memory and
over TCP (HOROVOD_GLOO_SHARED_MEMORY=0, as before the gloo-shared-memory patch). Latency is
the median of many calls after a warm-up. Prints Markdown tables and writes results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from common import median_seconds

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
# float32 values: 3 KB (about the seed MLP's 705 gradients), 64 KB, 2 MB (the wide MLP), 8 MB
SIZES = {"3 KB": 768, "64 KB": 16_384, "2 MB": 524_288, "8 MB": 2_097_152}
CYCLE_TIMES_MS = (0.1, 1.0, 5.0, 100.0)  # Horovod's default is 1 ms, hvd-cpu's 100 ms
FUSION_MB = (0, 64)  # 64 MB is Horovod's default; 0 turns fusion off


def _median_ms(call: Callable[[], object], repeats: int) -> float:
    return median_seconds(call, repeats, warm_up=max(5, repeats // 10)) * 1e3


def rank_program(out: Path) -> None:
    """Runs on every rank of one job: latency per size, Horovod's and direct (MPI's, or Gloo's
    through shared memory). It calls Horovod itself, not hvd-cpu's collectives."""
    import horovod.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    found = {}
    for label, count in SIZES.items():
        tensor = torch.ones(count)
        repeats = 400 if count < 100_000 else 60
        row = {
            "horovod_ms": _median_ms(
                lambda t=tensor, n=label: hvd.allreduce(t, op=hvd.Sum, name=n), repeats
            )
        }
        if hvd.mpi_enabled():
            from mpi4py import MPI

            buffer = tensor.numpy()
            row["direct_ms"] = _median_ms(
                lambda b=buffer: MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM), repeats
            )
        elif hvd.gloo_shared_memory() == "":
            row["direct_ms"] = _median_ms(lambda t=tensor: hvd.direct_allreduce_(t), repeats)
        found[label] = row
    if hvd.rank() == 0:
        controller = "mpi" if hvd.mpi_enabled() else "gloo"
        if os.environ.get("HOROVOD_GLOO_SHARED_MEMORY") == "0":
            controller = "gloo over TCP"
        out.write_text(json.dumps({"controller": controller, "sizes": found}))


def horovodrun(controller: str, cycle_ms: float, fusion_mb: int, command: list[str]) -> None:
    """`horovodrun -np 2 COMMAND` over `controller`: mpi, gloo, or gloo-tcp (Gloo with its
    shared memory turned off)."""
    tcp = {"HOROVOD_GLOO_SHARED_MEMORY": "0"} if controller == "gloo-tcp" else {}
    flag = f"--{controller.removesuffix('-tcp')}"
    launcher = [str(BIN / "horovodrun"), flag, "-np", "2", "--disable-cache"]
    launcher += ["--cycle-time-ms", str(cycle_ms), "--fusion-threshold-mb", str(fusion_mb)]
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **tcp}
    done = subprocess.run([*launcher, *command], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(launcher)} failed:\n{done.stdout}\n{done.stderr}")


def latency_rows(output: Path) -> list[dict]:
    rows = []
    for controller in ("mpi", "gloo", "gloo-tcp"):
        for cycle in CYCLE_TIMES_MS:
            out = output / f"latency-{controller}-{cycle}.json"
            program = [sys.executable, __file__, "--rank-program", str(out)]
            horovodrun(controller, cycle, 64, program)
            rows.append({"cycle_ms": cycle, **json.loads(out.read_text())})
            print(f"latency {controller} cycle {cycle} ms done", file=sys.stderr, flush=True)
    return rows


def training_rows(output: Path, frame: Path, epochs: int) -> list[dict]:
    """The seed MLP at batch 64 per rank, 2 ranks, every cycle time and fusion setting, its
    gradients averaged by hvd.DistributedOptimizer (under MPI too, where auto is direct)."""
    rows = []
    for controller in ("mpi", "gloo"):
        for cycle in CYCLE_TIMES_MS:
            for fusion in FUSION_MB:
                run = output / f"train-{controller}-{cycle}-{fusion}"
                hvd_cpu = [str(BIN / "hvd-cpu"), "train", "--data", str(frame), "--quiet"]
                hvd_cpu += ["--allreduce", "horovod"]
                hvd_cpu += ["--epochs", str(epochs), "--output", str(run), "--overwrite"]
                horovodrun(controller, cycle, fusion, hvd_cpu)
                lines = (run / "metrics.jsonl").read_text().splitlines()
                last = json.loads(lines[-1])
                rows.append(
                    {
                        "controller": controller,
                        "cycle_ms": cycle,
                        "fusion_mb": fusion,
                        "samples_per_s": last["samples_per_s"],
                        "wait_share": last["wait_seconds"] / last["seconds"],
                    }
                )
                print(f"train {controller} {cycle} {fusion} done", file=sys.stderr, flush=True)
    return rows


def markdown(latency: list[dict], training: list[dict]) -> str:
    sizes = list(SIZES)
    lines = [
        "Allreduce latency, 2 ranks, float32, median ms (direct: from the calling thread, one "
        "mpi4py call or hvd.direct_allreduce_)",
        "",
        "| controller | cycle time | " + " | ".join(sizes) + " |",
        "|---|---|" + "---|" * len(sizes),
    ]
    for row in latency:
        cells = []
        for size in sizes:
            measured = row["sizes"][size]
            cell = f"{measured['horovod_ms']:.3f}"
            if "direct_ms" in measured:
                cell += f" (direct {measured['direct_ms']:.3f})"
            cells.append(cell)
        lines.append(f"| {row['controller']} | {row['cycle_ms']} ms | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Seed MLP, batch 64 per rank, 2 ranks, last epoch (samples/s; share of time waiting)",
        "",
        "| controller | cycle time | fusion threshold | samples/s | waiting |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['controller']} | {r['cycle_ms']} ms | {r['fusion_mb']} MB "
        f"| {r['samples_per_s']:,.0f} | {r['wait_share']:.0%} |"
        for r in training
    ]
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["--rank-program"]:
        rank_program(Path(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("runs/allreduce"))
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(HERE))
    from common import make_frame

    frame = args.output / f"frame-{args.rows}.parquet"
    if not frame.exists():
        make_frame(args.rows).to_parquet(frame)
    latency = latency_rows(args.output)
    training = training_rows(args.output, frame, args.epochs)
    table = markdown(latency, training)
    print(table)
    (args.output / "results.json").write_text(
        json.dumps({"latency": latency, "training": training}, indent=2) + "\n"
    )
    (args.output / "results.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
