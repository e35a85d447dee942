"""`hvd-cpu bench`: measure, on this machine, which process count, threads per rank, per-rank
batch and sync interval train a given frame and model fastest, and say so honestly.

For each process count and thread count it launches one job (Horovod's programmatic
launcher, as `hvd_cpu.fit` does: changing torch's thread count inside a running process
measured up to 5x slower than starting with it). In the job, every setting trains from the
same start for a few epochs with the real training loop; the last epoch is timed (the first
pays for warm-up). A step's time
splits into compute and the wait for the other ranks (the gradient allreduce, or the
parameter average of local SGD).
"""

from __future__ import annotations

import copy
import json
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from hvd_cpu import dist
from hvd_cpu.config import TrainConfig
from hvd_cpu.errors import InputError
from hvd_cpu.prepare import prepare
from hvd_cpu.train import build_trainer

# A faster setting is recommended over the requested one only when it is this much faster:
# below that, the noise of a shared machine could be deciding.
CLEAR_WIN = 1.2


@dataclass(frozen=True)
class Setting:
    """One way to run the job."""

    processes: int
    threads: int  # per rank
    batch_size: int  # per rank
    sync_every: int  # 1: gradients averaged every step; K: local SGD

    def label(self) -> str:
        sync = "every step" if self.sync_every == 1 else f"every {self.sync_every} steps"
        return (
            f"-np {self.processes}, {self.threads} thread(s)/rank, batch {self.batch_size}/rank, "
            f"sync {sync}"
        )


@dataclass
class Measurement:
    """One setting's timed epoch, over all ranks."""

    setting: Setting
    samples_per_s: float
    step_ms: float  # per rank
    compute_ms: float  # of step_ms: forward, backward, update, fetching the batch
    wait_ms: float  # of step_ms: waiting for the other ranks
    speedup: float | None = None  # vs one process, one thread, the same per-rank batch
    efficiency: float | None = None  # speedup / cores used (processes x threads)


@dataclass(frozen=True)
class BenchConfig:
    """What to measure: the job's data and model (`train`), and the settings to try."""

    train: TrainConfig
    process_counts: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    sync_intervals: tuple[int, ...]
    cores: int

    def __post_init__(self) -> None:
        for name in ("process_counts", "batch_sizes", "sync_intervals"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise InputError(f"{name.replace('_', ' ')} must be integers >= 1, got {values}")


def default_process_counts(cores: int) -> tuple[int, ...]:
    """1, 2 and one per core."""
    return tuple(sorted({1, 2, cores}))


def jobs(config: BenchConfig) -> list[list[Setting]]:
    """The settings of each job to launch. One process tries one thread and all cores'
    threads; N processes share the cores (as `train` does by default) and try each sync
    interval."""
    found = []
    for processes in config.process_counts:
        if processes == 1:
            threads, intervals = sorted({1, config.cores}), (1,)
        else:
            threads, intervals = [max(1, config.cores // processes)], config.sync_intervals
        found += [
            [
                Setting(processes, t, batch, sync)
                for batch in config.batch_sizes
                for sync in intervals
            ]
            for t in threads
        ]
    return found


def _measure_on_rank(
    train_config: TrainConfig, settings: list[Setting], epochs: int
) -> tuple[list[Measurement], float] | None:
    """Run on every rank: train each setting (all with the same threads) from the same start.
    Rank 0 returns the measurements and the time of the first step (to measure the launch)."""
    world = dist.init(settings[0].threads)
    prepared = prepare(train_config, world)
    first_step = time.time()
    measurements = []
    for setting in settings:
        config = replace(train_config, batch_size=setting.batch_size, sync_every=setting.sync_every)
        trainer = build_trainer(config, world, prepared, copy.deepcopy(prepared.model))
        trainer.restore(None)
        for _ in range(epochs):
            metrics = trainer.run_epoch(None)
        steps = len(trainer.batches)
        step_ms = metrics.seconds / steps * 1e3
        wait_ms = metrics.wait_seconds / steps * 1e3
        measurements.append(
            Measurement(setting, metrics.samples_per_s, step_ms, step_ms - wait_ms, wait_ms)
        )
    return (measurements, first_step) if world.is_root else None


def run(config: BenchConfig, epochs: int) -> dict[str, Any]:
    """Launch the jobs one after another and collect every setting's measurement."""
    measurements: list[Measurement] = []
    launches = []
    for settings in jobs(config):
        processes = settings[0].processes
        launched = time.time()
        found, first_step = dist.launch(
            _measure_on_rank, (config.train, settings, epochs), np=processes, hosts=None
        )[0]
        measurements += found
        launches.append(
            {
                "processes": processes,
                "threads": settings[0].threads,
                "seconds_to_first_step": first_step - launched,
            }
        )
    _relate(measurements)
    return {
        "machine": {
            "cores": config.cores,
            "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "data": str(config.train.data),
        "model": config.train.model or f"MLP hidden={list(config.train.hidden)}",
        "epochs": epochs,
        "measurements": [{**asdict(m), "label": m.setting.label()} for m in measurements],
        "launches": launches,
        "recommendation": recommend(measurements, config.batch_sizes[0]),
    }


def _relate(measurements: list[Measurement]) -> None:
    """Speed-up and efficiency against one process with one thread at the same batch."""
    single = {
        m.setting.batch_size: m.samples_per_s
        for m in measurements
        if m.setting.processes == 1 and m.setting.threads == 1
    }
    for m in measurements:
        base = single.get(m.setting.batch_size)
        if base:
            m.speedup = m.samples_per_s / base
            m.efficiency = m.speedup / (m.setting.processes * m.setting.threads)


def recommend(measurements: list[Measurement], batch_size: int) -> dict[str, Any]:
    """The fastest way to train as asked (the requested per-rank batch, gradients averaged
    every step), and a faster one that changes the optimisation if there is a clear one."""
    as_asked = [
        m for m in measurements if m.setting.batch_size == batch_size and m.setting.sync_every == 1
    ]
    best = max(as_asked, key=lambda m: m.samples_per_s)
    fastest = max(measurements, key=lambda m: m.samples_per_s)
    reasons = [_why(best, as_asked)]
    chosen = best
    if fastest is not best and fastest.samples_per_s >= CLEAR_WIN * best.samples_per_s:
        chosen = fastest
        change = []
        if fastest.setting.batch_size != batch_size:
            change.append(
                f"a per-rank batch of {fastest.setting.batch_size} (raise --lr or add "
                "--warmup-epochs, and check the validation loss)"
            )
        if fastest.setting.sync_every > 1:
            change.append(
                f"local SGD with --sync-every {fastest.setting.sync_every} (parameters "
                "averaged less often: check the validation loss)"
            )
        reasons.append(
            f"{fastest.samples_per_s / best.samples_per_s:.1f}x faster still: "
            f"{fastest.setting.label()}, with " + " and ".join(change)
        )
    return {
        "setting": asdict(chosen.setting),
        "label": chosen.setting.label(),
        "samples_per_s": chosen.samples_per_s,
        "reasons": reasons,
    }


def _why(best: Measurement, as_asked: list[Measurement]) -> str:
    """Why the best setting at the requested batch is the best, in the machine's numbers."""
    if best.setting.processes == 1:
        waits = [m for m in as_asked if m.setting.processes > 1]
        text = f"one process is fastest at this batch ({best.samples_per_s:,.0f} samples/s)"
        if waits:
            worst = max(waits, key=lambda m: m.wait_ms)
            text += (
                f": with {worst.setting.processes} processes each step waits "
                f"{worst.wait_ms:.2f} ms for the others, against {worst.compute_ms:.2f} ms of "
                "compute"
            )
        return text
    return (
        f"{best.setting.processes} processes are fastest at this batch "
        f"({best.samples_per_s:,.0f} samples/s, {_times(best.speedup)} one process with one "
        f"thread; {best.wait_ms:.2f} ms of each {best.step_ms:.2f} ms step is waiting)"
    )


def table(report: dict[str, Any]) -> str:
    """The measurements as aligned text, fastest first, and the recommendation."""
    rows = sorted(report["measurements"], key=lambda m: -m["samples_per_s"])
    header = (
        f"{'samples/s':>11}  {'step ms':>8}  {'wait ms':>8}  {'speed-up':>8}  "
        f"{'efficiency':>10}  setting"
    )
    lines = [header] + [
        f"{m['samples_per_s']:>11,.0f}  {m['step_ms']:>8.3f}  {m['wait_ms']:>8.3f}  "
        f"{_times(m['speedup']):>8}  {_share(m['efficiency']):>10}  {m['label']}"
        for m in rows
    ]
    recommendation = report["recommendation"]
    lines += ["", f"recommended: {recommendation['label']}"]
    lines += [f"  - {reason}" for reason in recommendation["reasons"]]
    return "\n".join(lines)


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _share(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.0%}"


def plot(report: dict[str, Any], path: Path) -> None:
    """Throughput per setting, and each step split into compute and waiting."""
    from matplotlib.figure import Figure  # only here: a plot is the one thing that needs it

    rows = sorted(report["measurements"], key=lambda m: m["samples_per_s"])
    labels = [m["label"] for m in rows]
    figure = Figure(figsize=(12, 1.2 + 0.45 * len(rows)), layout="constrained")
    throughput, split = figure.subplots(1, 2, sharey=True)
    throughput.barh(labels, [m["samples_per_s"] for m in rows], color="tab:blue")
    throughput.set_xlabel("samples/s (all ranks)")
    compute = [m["compute_ms"] for m in rows]
    split.barh(labels, compute, color="tab:green", label="compute")
    split.barh(labels, [m["wait_ms"] for m in rows], left=compute, color="tab:red", label="wait")
    split.set_xlabel("ms per step (one rank)")
    split.legend()
    figure.suptitle(f"hvd-cpu bench: {report['model']}, {report['machine']['cores']} cores")
    figure.savefig(path)


def write(report: dict[str, Any], output: Path) -> None:
    """bench.json and bench.png in `output`."""
    output.mkdir(parents=True, exist_ok=True)
    (output / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, output / "bench.png")
