"""--precision: the arithmetic of the training step's forward pass and loss.

- fp32 (the default): every step exact as written, as before.
- bf16: `torch.autocast("cpu", torch.bfloat16)` around forward and loss, with float32 master
  weights, gradients and optimizer state (what Lightning's "bf16-mixed" does): the matrix
  multiplies run in bfloat16, which CPUs with native bfloat16 instructions do about twice as
  fast; the model file and checkpoints stay float32, so predict and --resume are unchanged,
  and validation runs in float32 (it measures the model predict will serve).
- auto: bf16 where a few timed steps of both, on copies of this model at its batch, on every
  rank at once, say it pays (PAYS); else fp32, and the summary says why.

Refused with one line: bf16 on a CPU without native bfloat16 (emulated, it is slower), or for a
model or loss with an op that has no bfloat16 kernel on the CPU (one step is tried first).
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hvd_cpu.errors import InputError
from hvd_cpu.model.losses import Loss
from hvd_cpu.model.optim import adam
from hvd_cpu.runtime.collectives import Collectives

# What /proc/cpuinfo calls native bfloat16 arithmetic: x86's AVX-512 BF16 and AMX (its "flags"),
# Arm's BF16 (its "Features").
NATIVE_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
CPUINFO = Path("/proc/cpuinfo")
# auto picks bf16 when its step is at least this much faster than fp32's: below that the noise
# of a shared machine could be deciding, and bf16 costs a little accuracy.
PAYS = 1.1
# auto's trial: each precision's step timed up to TRIAL_STEPS times (interleaved, medians
# compared; at least 3, fewer than 12 once TRIAL_SECONDS are spent), after WARM_STEPS untimed.
TRIAL_STEPS = 12
TRIAL_SECONDS = 0.5
WARM_STEPS = 2


@dataclass(frozen=True)
class Precision:
    """What a job's steps run in (fp32 or bf16, `auto` resolved) and why: the summary and
    ranks.json say both."""

    name: str
    why: str

    @property
    def bf16(self) -> bool:
        return self.name == "bf16"

    @property
    def described(self) -> str:
        what = "bf16 autocast, fp32 weights" if self.bf16 else "fp32"
        return f"{what} ({self.why})"

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Around a step's forward pass and loss (not its backward, which autocast sees to)."""
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=torch.bfloat16)


def native_bf16(cpuinfo: Path = CPUINFO) -> str | None:
    """The flag by which this CPU does bfloat16 natively, or None (none, or no /proc/cpuinfo)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags = set(value.split())
            return next((flag for flag in NATIVE_FLAGS if flag in flags), None)
    return None


Batch = tuple[torch.Tensor, torch.Tensor]


def _step(
    model: nn.Module, loss_fn: Loss, batch: Batch, precision: Precision
) -> Callable[[], None]:
    """One training step of `model` (a copy) in `precision`, with its own Adam."""
    optimizer = adam(model.parameters(), 1e-3)
    x, y = batch

    def step() -> None:
        optimizer.zero_grad()
        with precision.autocast():
            loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()

    return step


def bf16_failure(model: nn.Module, loss_fn: Loss, batch: Batch) -> str | None:
    """Why `model` and `loss_fn` cannot train under bfloat16 autocast (the error of one step on
    copies, its first line: it names the op), or None."""
    step = _step(copy.deepcopy(model), loss_fn, batch, Precision("bf16", "trial"))
    try:
        step()
    except (RuntimeError, NotImplementedError) as exc:
        said = str(exc).strip()
        return said.splitlines()[0] if said else type(exc).__name__
    return None


def step_seconds(model: nn.Module, loss_fn: Loss, batch: Batch) -> dict[str, float]:
    """The median seconds of one training step in fp32 and in bf16, timed interleaved on copies
    of `model` at `batch`, so a busy moment of the machine slows both."""
    steps = {
        name: _step(copy.deepcopy(model), loss_fn, batch, Precision(name, "trial"))
        for name in ("fp32", "bf16")
    }
    for step in steps.values():
        for _ in range(WARM_STEPS):
            step()
    timed: dict[str, list[float]] = {name: [] for name in steps}
    spent = 0.0
    while len(timed["fp32"]) < 3 or (len(timed["fp32"]) < TRIAL_STEPS and spent < TRIAL_SECONDS):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            timed[name].append(time.perf_counter() - start)
            spent += timed[name][-1]
    return {name: statistics.median(times) for name, times in timed.items()}


def choose(
    requested: str,
    model: nn.Module,
    loss_fn: Loss,
    batch: Batch,
    collectives: Collectives,
    resumed: str | None = None,
) -> Precision:
    """What --precision means for this job, the same on every rank (call on all of them).

    `resumed`: the precision of the run this one continues (rank 0's checkpoint, else None);
    auto keeps it, so a resumed run goes on as it began. bf16 that cannot run here raises
    InputError on every rank.
    """
    if requested == "fp32":
        return Precision("fp32", "--precision fp32")
    flags = collectives.gather(native_bf16(), "native_bf16")
    failure = bf16_failure(model, loss_fn, batch) if all(flags) else None
    failure = next((f for f in collectives.gather(failure, "bf16_failure") if f), None)
    resumed = collectives.broadcast_object(resumed, "resumed_precision")
    if requested == "bf16":
        if not all(flags):
            raise InputError(
                "--precision bf16 needs a CPU with native bfloat16 (avx512_bf16, amx_bf16 or "
                f"Arm's bf16 in {CPUINFO}; {_ranks_without(flags)}), where it would run slower "
                "than fp32: leave out --precision"
            )
        if failure:
            raise InputError(
                f"--precision bf16: your model or loss cannot run in bfloat16 on the CPU "
                f"({failure}); train it with --precision fp32"
            )
        return Precision("bf16", "--precision bf16")
    if not all(flags):
        return Precision("fp32", f"auto: no native bfloat16 ({_ranks_without(flags)})")
    if failure:
        return Precision("fp32", f"auto: the model or loss cannot run in bfloat16 ({failure})")
    if resumed:
        return Precision(resumed, "auto: as the run it resumes")
    # Every rank times both at once (as the job will run), and the slowest rank sets the pace.
    timings = collectives.gather(step_seconds(model, loss_fn, batch), "precision_trial")
    fp32, bf16 = (max(t[name] for t in timings) for name in ("fp32", "bf16"))
    measured = f"a step {fp32 * 1e3:.3g} ms in fp32, {bf16 * 1e3:.3g} ms in bf16 here"
    if fp32 >= PAYS * bf16:
        return Precision("bf16", f"auto: {measured}")
    return Precision("fp32", f"auto: {measured}")


def _ranks_without(flags: list[str | None]) -> str:
    """Which ranks lack native bfloat16, in words."""
    missing = [rank for rank, flag in enumerate(flags) if not flag]
    if len(missing) == len(flags):
        return "this CPU has none"
    return f"rank(s) {', '.join(map(str, missing))} have none"
