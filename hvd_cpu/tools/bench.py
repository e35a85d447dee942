"""`hvd-cpu bench`: measure, on this machine, which process count, controller (MPI or Gloo),
threads per rank, per-rank batch, sync interval and gradient allreduce train a given frame and
model fastest, and say so honestly, ending with the command line that runs it.

For each process count, thread count and controller it launches one job (Horovod's programmatic
launcher, as `hvd_cpu.fit` does: a process whose torch thread count changes after it has run
trains several times slower than one started with it). In the job, every setting trains from the
same start for a few epochs with the real training loop; the last epoch is timed (the first
pays for warm-up). A step's time
splits into compute and the wait for the other ranks (the gradient allreduce, or the
parameter average of local SGD).
"""

from __future__ import annotations

import copy
import json
import platform
import shlex
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from hvd_cpu.atomic import atomic_write
from hvd_cpu.config.cli_options import command_words
from hvd_cpu.config.options import CONTROLLER_NAMES, TrainConfig
from hvd_cpu.errors import InputError, RunFailed
from hvd_cpu.runtime import join, launch
from hvd_cpu.runtime.cores import default_threads
from hvd_cpu.training.membership import Fixed
from hvd_cpu.training.prepare import prepare
from hvd_cpu.training.trainer import build_trainer

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
    controller: str = "gloo"  # of a job of several processes
    allreduce: str = "horovod"  # of every-step averaging: horovod or direct

    def label(self) -> str:
        if self.sync_every > 1:
            sync = f"sync every {self.sync_every} steps"
        else:
            sync = "sync every step" + (" (direct)" if self.allreduce == "direct" else "")
        where = f"-np {self.processes}"
        if self.processes > 1:
            where += f" {CONTROLLER_NAMES[self.controller]}"
        return f"{where}, {self.threads} thread(s)/rank, batch {self.batch_size}/rank, {sync}"


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
    controllers: tuple[str, ...] = ("mpi", "gloo")

    def __post_init__(self) -> None:
        for name in ("process_counts", "batch_sizes", "sync_intervals"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise InputError(f"{name.replace('_', ' ')} must be integers >= 1, got {values}")
        unknown = set(self.controllers) - set(CONTROLLER_NAMES)
        if not self.controllers or unknown:
            raise InputError(f"controllers are gloo and mpi, got {', '.join(self.controllers)}")


def default_process_counts(cores: int) -> tuple[int, ...]:
    """1, 2 and one per core."""
    return tuple(sorted({1, 2, cores}))


def jobs(config: BenchConfig) -> list[list[Setting]]:
    """The settings of each job to launch. One process tries one thread and all cores'
    threads; N processes share the cores (as `train` does by default) and, under each
    controller, try each sync interval (and the direct allreduce too where there is one)."""
    found = []
    for processes in config.process_counts:
        if processes == 1:
            found += [
                [Setting(1, t, batch, 1) for batch in config.batch_sizes]
                for t in sorted({1, config.cores})
            ]
            continue
        threads = max(1, config.cores // processes)
        for controller in config.controllers:
            ways = [(k, "horovod") for k in config.sync_intervals]
            if join.may_average_directly(controller) and 1 in config.sync_intervals:
                ways.insert(1, (1, "direct"))
            settings = [
                Setting(processes, threads, batch, k, controller, allreduce)
                for batch in config.batch_sizes
                for k, allreduce in ways
            ]
            found.append(settings)
    return found


def _measure_on_rank(
    train_config: TrainConfig, settings: list[Setting], epochs: int
) -> tuple[list[Measurement], float] | None:
    """Run on every rank: train each setting (all with the same threads) from the same start.
    Rank 0 returns the measurements and the time of the first step (to measure the launch)."""
    first = settings[0]
    world = join.init(first.threads)
    prepared = prepare(train_config, world, Fixed())
    first_step = time.time()
    measurements = []
    for setting in settings:
        if setting.allreduce == "direct" and not world.averages_directly:
            continue  # Gloo fell back to TCP here: there is no direct allreduce to measure
        config = replace(
            train_config,
            batch_size=setting.batch_size,
            sync_every=setting.sync_every,
            allreduce=setting.allreduce,
        )
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
        first = settings[0]
        launched = time.time()
        found, first_step = launch.launch(
            _measure_on_rank,
            (config.train, settings, epochs),
            np=first.processes,
            hosts=None,
            controller=first.controller,
        )[0]
        measurements += found
        launches.append(
            {
                "processes": first.processes,
                "threads": first.threads,
                "controller": first.controller,
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
        "recommendation": recommend(
            measurements, config.batch_sizes[0], config.train, config.cores
        ),
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


def recommend(
    measurements: list[Measurement], batch_size: int, train_config: TrainConfig, cores: int
) -> dict[str, Any]:
    """The fastest way to train as asked (the requested per-rank batch, gradients averaged
    every step), or a clearly faster one that changes the optimisation; why, in this
    machine's numbers; and the command line that runs it."""
    as_asked = [
        m for m in measurements if m.setting.batch_size == batch_size and m.setting.sync_every == 1
    ]
    best = max(as_asked, key=lambda m: m.samples_per_s)
    fastest = max(measurements, key=lambda m: m.samples_per_s)
    chosen = best
    if fastest is not best and fastest.samples_per_s >= CLEAR_WIN * best.samples_per_s:
        chosen = fastest
    reasons = [_why(chosen, measurements)]
    if chosen is not best:
        reasons.append(
            f"{chosen.samples_per_s / best.samples_per_s:.1f}x the fastest setting that trains "
            f"exactly as asked ({best.setting.label()}), but it changes the optimisation: "
            + " and ".join(_changes(chosen.setting, batch_size))
        )
    elif best.setting.processes == 1:
        several = [m for m in as_asked if m.setting.processes > 1]
        if several:
            top = max(several, key=lambda m: m.samples_per_s)
            reasons.append(
                f"with {top.setting.processes} processes ({top.setting.label()}) each step "
                f"waits {top.wait_ms:.2f} ms for the others, against {top.compute_ms:.2f} ms of "
                "compute"
            )
    return {
        "setting": asdict(chosen.setting),
        "label": chosen.setting.label(),
        "samples_per_s": chosen.samples_per_s,
        "reasons": reasons,
        "command": command_line(chosen.setting, train_config, cores),
    }


def _why(chosen: Measurement, measurements: list[Measurement]) -> str:
    """The chosen setting's speed, against one process with one thread."""
    text = f"{chosen.samples_per_s:,.0f} samples/s, {_times(chosen.speedup)} one process"
    text += " with one thread at the same batch"
    if chosen.setting.processes > 1:
        text += f"; {chosen.wait_ms:.2f} ms of each {chosen.step_ms:.2f} ms step is waiting"
        other = [
            m
            for m in measurements
            if m.setting.processes == chosen.setting.processes
            and m.setting.batch_size == chosen.setting.batch_size
            and m.setting.sync_every == chosen.setting.sync_every
            and m.setting.controller != chosen.setting.controller
        ]
        if other:
            rival = max(other, key=lambda m: m.samples_per_s)
            text += (
                f"; {chosen.samples_per_s / rival.samples_per_s:.2f}x the same over "
                f"{CONTROLLER_NAMES[rival.setting.controller]}"
            )
    return text


def _changes(setting: Setting, batch_size: int) -> list[str]:
    """What a faster setting changes about the optimisation, and what to watch."""
    change = []
    if setting.batch_size != batch_size:
        change.append(
            f"a per-rank batch of {setting.batch_size} (raise --lr or add --warmup-epochs, "
            "and check the validation loss)"
        )
    if setting.sync_every > 1:
        change.append(
            f"local SGD with --sync-every {setting.sync_every} (parameters averaged less "
            "often: check the validation loss)"
        )
    return change


def command_line(setting: Setting, train_config: TrainConfig, cores: int) -> str:
    """`hvd-cpu train ...` (under its launcher) for `setting` and the benchmarked data and
    model: every option that differs from its default, spelled as the CLI spells it."""
    chosen = replace(
        train_config,
        batch_size=setting.batch_size,
        sync_every=setting.sync_every,
        allreduce=_allreduce_option(setting),
        threads=setting.threads,
        val_fraction=TrainConfig.val_fraction,
        quiet=False,
    )
    words = ["hvd-cpu", "train"]
    if setting.processes > 1:
        words = ["horovodrun", f"--{setting.controller}", "-np", str(setting.processes), *words]
    train_default = default_threads(setting.processes, cores)
    for field in fields(TrainConfig):
        value, default = getattr(chosen, field.name), field.default
        if field.name in ("output", "progress") or value == default:
            continue
        if field.name == "threads" and value == train_default:
            continue
        words += command_words(field.name, value)
    return shlex.join(words)


def _allreduce_option(setting: Setting) -> str:
    """--allreduce for `setting`: auto where auto picks the same (or nothing is averaged):
    direct wherever the job had one (training/sync.py's `averaging`), and a direct row is
    only measured where it had."""
    auto = "direct" if join.may_average_directly(setting.controller) else "horovod"
    if setting.processes == 1 or setting.sync_every > 1 or setting.allreduce == auto:
        return "auto"
    return setting.allreduce


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
    lines += [f"run it: {recommendation['command']}"]
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
    atomic_write(path, lambda handle: figure.savefig(handle, format="png"))


def write(report: dict[str, Any], output: Path) -> None:
    """bench.json and bench.png in `output`; a failed write after the measurements (a full
    disk) is one line, as in training."""
    try:
        text = json.dumps(report, indent=2) + "\n"
        atomic_write(output / "bench.json", lambda handle: handle.write(text.encode()))
        plot(report, output / "bench.png")
    except OSError as exc:
        raise RunFailed(
            f"could not write to {output}: {exc.strerror or exc}; free space (or choose another "
            "--output) and run the bench again"
        ) from exc
