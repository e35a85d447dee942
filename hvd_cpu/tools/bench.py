"""`hvd-cpu bench`: measure, on this machine, which process count, controller (MPI or Gloo),
threads per rank, per-rank batch, sync interval, gradient allreduce and precision train a given
frame and model fastest, and say so honestly, ending with the command line that runs it; and
which reaches the same loss soonest, since a faster step that learns less per epoch (a larger
batch, local SGD, bfloat16) may need more of them.

For each process count, thread count and controller it launches one job (Horovod's programmatic
launcher, as `hvd_cpu.fit` does: a process whose torch thread count changes after it has run
trains several times slower than one started with it). In the job, every setting trains from the
same start for a few epochs with the real training loop; the last epoch is timed (the first
pays for warm-up). A step's time
splits into compute and the wait for the other ranks (the gradient allreduce, or the
parameter average of local SGD). Each epoch's training loss is kept: the time to a loss is
the epochs a setting needed to reach it (interpolated within an epoch) times its timed epoch.
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
from hvd_cpu.training.precision import Precision, bf16_failure, native_bf16
from hvd_cpu.training.prepare import first_batch, prepare
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
    precision: str = "fp32"  # or bf16

    def label(self) -> str:
        if self.sync_every > 1:
            sync = f"sync every {self.sync_every} steps"
        else:
            sync = "sync every step" + (" (direct)" if self.allreduce == "direct" else "")
        where = f"-np {self.processes}"
        if self.processes > 1:
            where += f" {CONTROLLER_NAMES[self.controller]}"
        return (
            f"{where}, {self.threads} thread(s)/rank, batch {self.batch_size}/rank, {sync}, "
            f"{self.precision}"
        )


@dataclass
class Measurement:
    """One setting's timed epoch, over all ranks."""

    setting: Setting
    samples_per_s: float
    step_ms: float  # per rank
    compute_ms: float  # of step_ms: forward, backward, update, fetching the batch
    wait_ms: float  # of step_ms: waiting for the other ranks
    epoch_seconds: float = 0.0  # the timed epoch (every row once, however many ranks)
    losses: tuple[float, ...] = ()  # each epoch's training loss, over all ranks
    speedup: float | None = None  # vs one process, one thread, the same per-rank batch
    efficiency: float | None = None  # speedup / cores used (processes x threads)
    seconds_to_loss: float | None = None  # to the loss all settings as asked reached


@dataclass(frozen=True)
class BenchConfig:
    """What to measure: the job's data and model (`train`), and the settings to try."""

    train: TrainConfig
    process_counts: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    sync_intervals: tuple[int, ...]
    cores: int
    controllers: tuple[str, ...] = ("mpi", "gloo")
    precisions: tuple[str, ...] = ("fp32",)

    def __post_init__(self) -> None:
        for name in ("process_counts", "batch_sizes", "sync_intervals"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise InputError(f"{name.replace('_', ' ')} must be integers >= 1, got {values}")
        unknown = set(self.controllers) - set(CONTROLLER_NAMES)
        if not self.controllers or unknown:
            raise InputError(f"controllers are gloo and mpi, got {', '.join(self.controllers)}")
        if not self.precisions or set(self.precisions) - set(PRECISIONS):
            raise InputError(f"precisions are fp32 and bf16, got {', '.join(self.precisions)}")


# What bench can measure (auto is a choice between them, made by a trial at the job's start).
PRECISIONS = ("fp32", "bf16")


def default_precisions() -> tuple[str, ...]:
    """fp32, and bf16 where the CPU does it natively (elsewhere it is emulated, and slower)."""
    return PRECISIONS if native_bf16() else ("fp32",)


def default_process_counts(cores: int) -> tuple[int, ...]:
    """1, 2 and one per core."""
    return tuple(sorted({1, 2, cores}))


def jobs(config: BenchConfig) -> list[list[Setting]]:
    """The settings of each job to launch. One process tries one thread and all cores'
    threads; N processes share the cores (as `train` does by default) and, under each
    controller, try each sync interval (and the direct allreduce too where there is one);
    each in every precision."""
    found = []
    precisions = config.precisions
    for processes in config.process_counts:
        if processes == 1:
            found += [
                [
                    Setting(1, t, batch, 1, precision=precision)
                    for batch in config.batch_sizes
                    for precision in precisions
                ]
                for t in sorted({1, config.cores})
            ]
            continue
        threads = max(1, config.cores // processes)
        for controller in config.controllers:
            ways = [(k, "horovod") for k in config.sync_intervals]
            if join.may_average_directly(controller) and 1 in config.sync_intervals:
                ways.insert(1, (1, "direct"))
            settings = [
                Setting(processes, threads, batch, k, controller, allreduce, precision)
                for batch in config.batch_sizes
                for k, allreduce in ways
                for precision in precisions
            ]
            found.append(settings)
    return found


def _measure_on_rank(
    train_config: TrainConfig, settings: list[Setting], epochs: int
) -> tuple[list[Measurement], float, list[str]] | None:
    """Run on every rank: train each setting (all with the same threads) from the same start.
    Rank 0 returns the measurements, the time of the first step (to measure the launch) and
    notes on what it could not measure."""
    first = settings[0]
    world = join.init(first.threads)
    prepared = prepare(train_config, world, Fixed())
    first_step = time.time()
    measurements, notes = [], []
    failure = None
    if any(s.precision == "bf16" for s in settings):
        batch = first_batch(prepared.arrays, prepared.train_rows, train_config.batch_size)
        failure = bf16_failure(prepared.model, prepared.loss_fn, batch)
        if failure:
            notes.append(f"bf16 not measured: the model or loss cannot run in bfloat16 ({failure})")
    for setting in settings:
        if setting.allreduce == "direct" and not world.averages_directly:
            continue  # Gloo fell back to TCP here: there is no direct allreduce to measure
        if setting.precision == "bf16" and failure:
            continue
        config = replace(
            train_config,
            batch_size=setting.batch_size,
            sync_every=setting.sync_every,
            allreduce=setting.allreduce,
        )
        precision = Precision(setting.precision, "bench")
        model = copy.deepcopy(prepared.model)
        trainer = build_trainer(config, world, prepared, model, precision)
        trainer.restore(None)
        epochs_run = [trainer.run_epoch(None) for _ in range(epochs)]
        metrics = epochs_run[-1]
        steps = len(trainer.batches)
        step_ms = metrics.seconds / steps * 1e3
        wait_ms = metrics.wait_seconds / steps * 1e3
        split = (step_ms, step_ms - wait_ms, wait_ms)
        losses = tuple(m.train_loss for m in epochs_run)
        measurements.append(
            Measurement(setting, metrics.samples_per_s, *split, metrics.seconds, losses)
        )
    return (measurements, first_step, notes) if world.is_root else None


def run(config: BenchConfig, epochs: int) -> dict[str, Any]:
    """Launch the jobs one after another and collect every setting's measurement."""
    measurements: list[Measurement] = []
    launches, notes = [], []
    for settings in jobs(config):
        first = settings[0]
        launched = time.time()
        found, first_step, said = launch.launch(
            _measure_on_rank,
            (config.train, settings, epochs),
            np=first.processes,
            hosts=None,
            controller=first.controller,
        )[0]
        measurements += found
        notes += [note for note in said if note not in notes]
        launches.append(
            {
                "processes": first.processes,
                "threads": first.threads,
                "controller": first.controller,
                "seconds_to_first_step": first_step - launched,
            }
        )
    _relate(measurements)
    target = to_same_loss(measurements, config.batch_sizes[0])
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
        "notes": notes,
        "recommendation": recommend(
            measurements, config.batch_sizes[0], config.train, config.cores
        ),
        "to_same_loss": soonest(measurements, target, config.train, config.cores),
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
    as_asked = asked(measurements, batch_size)
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
    if chosen.setting.precision == "bf16":
        reasons.append(
            "forward and loss in bfloat16 (weights, gradients and Adam in float32): compare its "
            "validation loss with fp32's"
        )
    return {
        "setting": asdict(chosen.setting),
        "label": chosen.setting.label(),
        "samples_per_s": chosen.samples_per_s,
        "reasons": reasons,
        "command": command_line(chosen.setting, train_config, cores),
    }


def asked(measurements: list[Measurement], batch_size: int) -> list[Measurement]:
    """The settings that train as asked: the requested per-rank batch, every step averaged
    (in either precision)."""
    return [
        m for m in measurements if m.setting.batch_size == batch_size and m.setting.sync_every == 1
    ]


def epochs_to(losses: tuple[float, ...], target: float) -> float | None:
    """The epochs a run with these epoch losses took to reach `target`: the epoch it first got
    there, less the part of it (linear between the epochs) it did not need; None if never."""
    for index, loss in enumerate(losses):
        if loss <= target:
            if index == 0:
                return 1.0
            before = losses[index - 1]
            return index + (before - target) / (before - loss)
    return None


def to_same_loss(measurements: list[Measurement], batch_size: int) -> float | None:
    """The training loss every setting that trains as asked reached (the highest of their last
    epochs'); sets each measurement's seconds to it (None where it never got there)."""
    losses = [m.losses[-1] for m in asked(measurements, batch_size) if m.losses]
    if not losses:
        return None
    target = max(losses)
    for m in measurements:
        epochs = epochs_to(m.losses, target)
        m.seconds_to_loss = None if epochs is None else epochs * m.epoch_seconds
    return target


def soonest(
    measurements: list[Measurement], target: float | None, train_config: TrainConfig, cores: int
) -> dict[str, Any] | None:
    """The setting that reached `target` soonest, against fp32's soonest, and its command."""
    reached = [m for m in measurements if m.seconds_to_loss is not None]
    if target is None or not reached:
        return None
    best = min(reached, key=lambda m: m.seconds_to_loss or 0.0)
    text = f"train loss {target:.4g} in {best.seconds_to_loss:.2f} s"
    fp32 = [m for m in reached if m.setting.precision == "fp32"]
    if best.setting.precision != "fp32" and fp32:
        rival = min(fp32, key=lambda m: m.seconds_to_loss or 0.0)
        text += (
            f", {(rival.seconds_to_loss or 0.0) / (best.seconds_to_loss or 1.0):.2f}x sooner "
            f"than fp32's soonest ({rival.setting.label()}, {rival.seconds_to_loss:.2f} s)"
        )
    return {
        "loss": target,
        "setting": asdict(best.setting),
        "label": best.setting.label(),
        "seconds": best.seconds_to_loss,
        "reason": text,
        "command": command_line(best.setting, train_config, cores),
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
        precision=setting.precision,
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
        f"{'efficiency':>10}  {'to loss s':>9}  setting"
    )
    lines = [header] + [
        f"{m['samples_per_s']:>11,.0f}  {m['step_ms']:>8.3f}  {m['wait_ms']:>8.3f}  "
        f"{_times(m['speedup']):>8}  {_share(m['efficiency']):>10}  "
        f"{_seconds(m.get('seconds_to_loss')):>9}  {m['label']}"
        for m in rows
    ]
    recommendation = report["recommendation"]
    lines += ["", f"recommended: {recommendation['label']}"]
    lines += [f"  - {reason}" for reason in recommendation["reasons"]]
    lines += [f"run it: {recommendation['command']}"]
    soonest = report.get("to_same_loss")
    if soonest:
        lines += ["", f"soonest to the same loss: {soonest['label']}", f"  - {soonest['reason']}"]
        lines += [f"run it: {soonest['command']}"]
    lines += [f"note: {note}" for note in report.get("notes", [])]
    return "\n".join(lines)


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _seconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


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
