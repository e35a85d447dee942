"""A cluster's training job as its driver runs it: once, or (elastic) again after a lost rank,
from the job's last checkpoint, on the workers there are then; and the model the ranks' ends
hand back. Spark's and Ray's jobs are subclasses of `Restarts`: each says how one run of the
ranks goes (`_run`) and how many ranks the cluster has room for after a loss (`_room_after`).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import cloudpickle

from hvd_cpu.config.options import TrainConfig
from hvd_cpu.errors import RunFailed
from hvd_cpu.lines import say
from hvd_cpu.output.model_files import CHECKPOINT, Checkpoint
from hvd_cpu.runtime.failure import failure_from
from hvd_cpu.training.job import job_ends


class RankLost(Exception):
    """A rank was lost: its worker (a Spark task, a Ray actor) or node ended from outside, or
    its process was killed (the out-of-memory killer, say). What happened, in words."""


class Restarts:
    """One training job on a cluster. `resume`: how a user goes on from its checkpoint, for
    the line that ends a job (e.g. "resume=True (spark-train --resume)")."""

    resume = "resume=True"

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.checkpoint = config.output / CHECKPOINT
        self.found = stamp(self.checkpoint)  # an earlier run's checkpoint is not this job's

    def _run(self, config: TrainConfig, num_proc: int) -> list[Any]:
        """One run of `num_proc` ranks: how each ended (clusters/worker.py's RankEnd, or a row
        with its fields), by rank; RankLost when one was lost."""
        raise NotImplementedError

    def _room_after(self, wanted: int, lost: RankLost) -> int:
        """How many ranks the cluster can run once it has had time to replace what was lost."""
        raise NotImplementedError

    def once(self, num_proc: int) -> list[Any]:
        """The ranks' ends, by rank; RunFailed when a rank was lost."""
        try:
            return self._run(self.config, num_proc)
        except RankLost as lost:
            raise RunFailed(f"{lost}; {self._left()}") from lost

    def going_on(self, num_proc: int) -> list[Any]:
        """As `once`, but after a lost rank the job goes on by itself (up to max_restarts
        times), with as many ranks as the cluster has room for, at most `num_proc`."""
        config, ranks, most, restart = self.config, num_proc, self.config.max_restarts, 0
        while True:
            try:
                return self._run(config, ranks)
            except RankLost as lost:
                restart += 1
                if restart > most:
                    raise RunFailed(
                        f"{lost} after {most} restart(s) (max_restarts, --max-restarts); "
                        f"{self._left()}"
                    ) from lost
                saved = self._saved_epoch()
                if saved:
                    config = replace(self.config, resume=True, overwrite=False)
                ranks = self._room_after(num_proc, lost)
                if ranks < 1:
                    ended = f"{lost}, and the cluster has no room left; {self._left()}"
                    raise RunFailed(ended) from lost
                ranks = min(num_proc, ranks)
                start = f"from epoch {saved}'s checkpoint" if saved else self._first_start()
                say(
                    f"hvd-cpu: {lost}; going on (elastic, restart {restart} of at most "
                    f"{most}) on {ranks} ranks, {start}",
                    sys.stderr,
                )

    def _saved_epoch(self) -> int | None:
        """The epoch of this job's last checkpoint, if it wrote one."""
        if stamp(self.checkpoint) in (None, self.found):
            return None
        return int(Checkpoint.load(self.checkpoint).loop["epoch"])

    def _first_start(self) -> str:
        """Where the job starts again when it wrote no checkpoint: where it started."""
        return "from the checkpoint it resumed" if self.config.resume else "from the start"

    def _left(self) -> str:
        """What the run left to resume from, for the line that ends it."""
        return job_ends(self.config.output, self._saved_epoch(), f"run it again with {self.resume}")


def stamp(path: Path) -> tuple[int, int] | None:
    """What tells one writing of a file from another: its change time and size."""
    try:
        status = path.stat()
    except FileNotFoundError:
        return None
    return status.st_mtime_ns, status.st_size


def first_killed(ends: list[Any]) -> str:
    """Which rank's process ended first (by a signal, before the others that then lost it)."""
    first = min(ends, key=lambda end: (end.code >= 0, end.rank))
    how = f"killed by signal {-first.code}" if first.code < 0 else f"exit code {first.code}"
    return f"rank {first.rank}'s process ended ({how})"


def had_their_say(ends: list[Any]) -> bool:
    """Whether any rank ended with an outcome or a failure of its own (else one was ended from
    outside, and the others lost it)."""
    return any(end.outcome is not None or end.failure is not None for end in ends)


def result_of(ends: list[Any]) -> Any:
    """Rank 0's TrainResult, or what the ranks raised."""
    for end in ends:
        if end.failure is not None:
            raise failure_from(end.failure)
    for end in ends:
        if end.outcome is not None:
            kind, value = cloudpickle.loads(end.outcome)
            if kind == "error":
                raise value
            if value is not None:
                return cloudpickle.loads(value)
    codes = ", ".join(f"rank {end.rank}: {end.code}" for end in ends if end.code)
    raise RunFailed(f"the job ended without a model (exit codes {codes or 'none'}); see above")
