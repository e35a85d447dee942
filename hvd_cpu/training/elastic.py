"""--elastic, in one place on the training side: its membership (`Elastic`: each rank prepares
alone, and the job runs inside Horovod's elastic loop, runtime/elastic_loop.py, again each time
ranks come or go, from the state all ranks just took from rank 0). What the loop keeps
(`capture`), puts back (`apply`) and shares (`rejoin`) is here; the sampler goes on mid-epoch
from the rows the ranks trained (data/loader.py, ShardSampler.set_epoch).
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any

from hvd_cpu.config.options import TrainConfig
from hvd_cpu.errors import InputError, RunFailed
from hvd_cpu.lines import say
from hvd_cpu.output.model_files import CHECKPOINT, Checkpoint
from hvd_cpu.runtime import elastic_loop, horovod, join
from hvd_cpu.runtime.world import World
from hvd_cpu.training.job import Job, checkpoint_kept
from hvd_cpu.training.membership import Membership
from hvd_cpu.training.prepare import Start, open_output_together
from hvd_cpu.training.scope import RunScope


class Elastic(Membership):
    """Ranks that go and come: each prepares alone, as a job of one on all the rows (the same
    statistics, since every rank reads the same file), because a rank that joins later must
    not wait in a collective the others have long passed. The output is checked, and the
    checkpoint resumed, once the ranks are together (ElasticJob)."""

    def __init__(self, scope: RunScope | None = None) -> None:
        self.scope = scope or RunScope()  # the run's: it watches each set of ranks

    @classmethod
    def launched(cls, scope: RunScope) -> Elastic:
        """The membership of this process, which horovodrun's elastic mode must have started."""
        if not join.elastic_launched():
            raise InputError(
                "--elastic needs horovodrun's elastic mode: start it with launch/elastic.sh (or "
                "horovodrun --gloo --min-np N --host-discovery-script FILE), or leave out "
                "--elastic"
            )
        return cls(scope)

    def start(self, config: TrainConfig, world: World) -> Start:
        # --resume: the checkpoint's fitted features, read by each rank itself (so the
        # checkpoint must be readable on every host: a shared --output).
        fitted = Checkpoint.load(config.output / CHECKPOINT).features if config.resume else None
        return Start(world.alone(), None, fitted)

    def has_validation(self, held_out: int, world: World) -> bool:
        return held_out > 0  # every rank holds all held-out rows: no collective before the loop

    def run(self, job: Job, world: World, resumed: Checkpoint | None) -> None:
        ElasticJob(job, self.scope).run()

    def after_failure(self, output: Path, job: Job | None) -> str:
        return "the others go on without it (--elastic; --max-restarts bounds how often)"


class ElasticJob:
    """A Job run by Horovod's elastic loop: after a lost rank the survivors roll back to the
    last commit, after ranks came or went every rank goes on from rank 0's."""

    # Set by `rejoin`, which runs before each pass: this rank's place now, and the job's size
    # before (for the line that says how it goes on).
    world: World
    before: int

    def __init__(self, job: Job, scope: RunScope) -> None:
        self.job, self.scope = job, scope
        self.state = horovod.ElasticState(self.capture, self.apply, self.rejoin, self.broadcast)

    def run(self) -> None:
        """The whole run, or RunFailed after more than --max-restarts lost ranks."""
        job, config = self.job, self.job.config
        try:
            elastic_loop.run_elastic(
                self.state, self._run_once, config.max_restarts, self.scope.stop_watching
            )
        except RunFailed as failed:
            raise RunFailed(
                f"{failed}; {checkpoint_kept(config.output, job.saved_epoch)}: "
                "find what ends the ranks, then run again with --resume (or raise "
                "--max-restarts)"
            ) from failed

    def capture(self) -> dict[str, Any]:
        # Not saved_epoch: it tells what is on disk, which a rollback does not undo.
        return {**self.job.trainer.snapshot(), "started": self.job.started}

    def apply(self, saved: dict[str, Any]) -> None:
        self.job.trainer.load(saved["model"], saved["optimizer"], saved["loop"])
        self.job.started = saved["started"]

    def broadcast(self, obj: Any, name: str) -> Any:
        """Rank 0's `obj`, through the collectives of the ranks `rejoin` found (counted)."""
        return self.world.collectives.broadcast_object(obj, name)

    def rejoin(self) -> None:
        """At each (re)start, on the ranks there are now: first this rank's new place (rank 0
        may be gone, and another rank is rank 0 now), then rank 0's state."""
        job = self.job
        self.before = job.trainer.world.size
        self.world = join.elastic_world(job.config.threads)
        self.scope.watch(self.world, job.config.stall_seconds, elastic=True)
        job.trainer.resize(self.world)
        job.trainer.take_root_state()
        shared = job.trainer.world.collectives.broadcast_object(
            (job.started, job.saved_epoch), "job_state"
        )
        job.started, job.saved_epoch = shared

    def _run_once(self) -> None:
        """One pass of the elastic loop, on the ranks `rejoin` just found."""
        job, state, world, before = self.job, self.state, self.world, self.before
        if not job.started:
            job.start(world, open_output_together(job.config, world, None))
            state.commit()
        else:
            job.write_root(world, partial(self._going_on, world, before))
        trainer, every = job.trainer, job.config.commit_every

        def after_step() -> None:
            # Not after an epoch's last step: a commit there would keep an epoch with no rows
            # left and no metrics yet (the epoch-end commit follows its validation).
            if trainer.state.step % every == 0 and not trainer.epoch_trained():
                state.commit()

        job.run(world, after_step, state.commit)

    def _going_on(self, world: World, before: int) -> None:
        """Rank 0 says how the job goes on after ranks came or went."""
        self.job.open_records(world, [])
        loop = self.job.trainer.state
        say(
            f"hvd-cpu: {before} -> {world.size} ranks; going on from the last commit "
            f"(epoch {loop.epoch + 1}, step {loop.step}, {loop.epoch_rows} rows into it)",
            sys.stderr,
        )
