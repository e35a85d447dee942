"""Preemption: a SIGTERM to any rank (Kubernetes, SLURM, a spot machine, the launcher's own on
Ctrl-C) stops every rank after the same step, and rank 0 saves that exact point, so the same
command run again (--auto-resume) ends with the parameters of a run never stopped.

The ranks cannot each stop when their own signal arrives: they would stop at different steps
and wait for each other in a collective. So every few steps, at the same step on every rank,
they sum two numbers: how many were asked to stop, and rank 0's choice of when to ask next (as
many steps as take about CHECK_SECONDS at the pace so far): one small collective per half
second of training, however short a step is.
"""

from __future__ import annotations

import time

import torch

from hvd_cpu.runtime.lifecycle import stop_asked
from hvd_cpu.training.trainer import Trainer

# About how often the ranks ask each other whether to stop, in seconds of training.
CHECK_SECONDS = 0.5
FIRST_CHECK_STEPS = 10
MAX_CHECK_STEPS = 10_000


class StopAgreed(Exception):
    """Every rank was told, at the same step, that some rank was asked to stop."""


class StopCheck:
    """Called after every step (Job.run's `after_step`); raises StopAgreed, on every rank
    together, after the first agreed step at which some rank had been asked to stop. Only
    steps that end with the ranks' models equal count (--sync-every K: every K-th)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        step = trainer.state.step
        self.next_check = step + FIRST_CHECK_STEPS
        self.since = (step, time.perf_counter())

    def __call__(self) -> None:
        trainer = self.trainer
        step = trainer.state.step
        if step < self.next_check or step % trainer.config.sync_every or trainer.epoch_trained():
            return  # (an epoch's last step: it validates and saves first, then stops)
        asked = torch.tensor([float(stop_asked()), float(self._proposal(step))])
        stops, steps = trainer.world.collectives.sum(asked, "stop_check").tolist()
        self.next_check = step + int(steps)
        if stops:
            raise StopAgreed

    def _proposal(self, step: int) -> int:
        """Rank 0: steps until the next check, from the pace since the last one (0 elsewhere:
        the sum is rank 0's)."""
        now = time.perf_counter()
        last_step, last_time = self.since
        self.since = (step, now)
        if not self.trainer.world.is_root:
            return 0
        per_step = (now - last_time) / max(step - last_step, 1)
        steps = round(CHECK_SECONDS / per_step) if per_step > 0 else MAX_CHECK_STEPS
        return min(max(steps, 1), MAX_CHECK_STEPS)
