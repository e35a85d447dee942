"""One training run as every rank sees it: the epochs, rank 0's writing (agreed by all, so a
full disk ends every rank with one line) and the results."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from hvd_cpu.config.options import TrainConfig
from hvd_cpu.data.features import FeatureTransform
from hvd_cpu.errors import InputError, Preempted, RunFailed
from hvd_cpu.output.model_files import CHECKPOINT, MODEL, Checkpoint, ModelFile
from hvd_cpu.output.records import Records
from hvd_cpu.output.summary import Shape
from hvd_cpu.runtime import startup
from hvd_cpu.runtime.cores import usable_cores
from hvd_cpu.runtime.world import World
from hvd_cpu.training.prepare import Prepared
from hvd_cpu.training.state import EpochMetrics
from hvd_cpu.training.trainer import Trainer, rank_report


class Job:
    """The epochs left, rank 0's records and the results, from the state all ranks share.

    A plain run starts once and runs its epochs; under --elastic (training/elastic.py) the same
    steps run again each time ranks come or go.
    """

    def __init__(self, config: TrainConfig, prepared: Prepared, trainer: Trainer) -> None:
        self.config, self.prepared, self.trainer = config, prepared, trainer
        self.records: Records | None = None
        self.saved_epoch: int | None = None  # the epoch checkpoint.pt holds, once written
        self.started = False  # the output is checked and the run's first records written
        self.first_step_unix = 0.0  # launch to here is the start-up cost (ranks.json)

    def start(self, world: World, resumed: Checkpoint | None) -> None:
        """Every rank takes rank 0's starting point (`resumed`, if any); rank 0 opens its
        records."""
        self.trainer.restore(resumed)
        self.saved_epoch = self.trainer.state.epoch if resumed else None
        self.started = True
        notes = [*world.notes, *self.prepared.transform.report.lines()]
        self.write_root(world, partial(self.open_records, world, notes))

    def open_records(self, world: World, notes: list[str]) -> None:
        """Rank 0: (re)start its records from the loop's history; rank 0 may be new, and the
        last commit may be older than the last epoch written."""
        shape = Shape(
            world.size, world.controller, world.transport, world.local_size, usable_cores()
        )
        if self.records is None:
            self.records = Records(self.config, shape)
        self.records.shape = shape
        self.records.start(notes, self.trainer.state.history)

    def write_root(self, world: World, write: Callable[[], None]) -> None:
        """Rank 0 writes and every rank agrees it worked, so every epoch also starts on all
        ranks together (rank 0's writing is not counted as the others' waiting)."""
        written_by_root(world, write, self.config.output, self.saved_epoch)

    def run(
        self,
        world: World,
        after_step: Callable[[], None] | None = None,
        after_epoch: Callable[[], None] | None = None,
    ) -> None:
        """The epochs left, then the results."""
        trainer, config = self.trainer, self.config
        self.first_step_unix = self.first_step_unix or time.time()
        startup.reached("first_step")
        while not trainer.done():
            epoch = trainer.state.epoch + 1
            progress = self.records.progress(epoch, len(trainer.batches)) if world.is_root else None
            metrics = trainer.run_epoch(progress, after_step)
            if progress:
                progress.close()
            check_finite(metrics, config, self.saved_epoch)
            save = trainer.done() or metrics.epoch % config.checkpoint_every == 0
            saving = trainer if save else None
            self.write_root(
                world, partial(write_epoch, self.records, metrics, saving, self.prepared.transform)
            )
            if save:
                self.saved_epoch = metrics.epoch
            if after_epoch:
                after_epoch()
        self._finish(world)

    def stopped_here(self, world: World) -> Preempted:
        """Every rank, after the step the ranks agreed to stop at (training/stopping.py):
        rank 0 saves this exact point (the position in the epoch included); what the job
        ends with."""
        trainer, output = self.trainer, self.config.output
        trainer.carry_epoch()

        def save() -> None:
            trainer.checkpoint(self.prepared.transform).save(output / CHECKPOINT)

        self.write_root(world, save)
        self.saved_epoch = trainer.state.epoch
        state = trainer.state
        return Preempted(
            f"rank 0: stopped by SIGTERM after step {state.step} ({state.epoch_rows} rows into "
            f"epoch {state.epoch + 1}); {output / CHECKPOINT} holds that point: run the same "
            "command with --auto-resume (or --resume) to go on from it"
        )

    def _finish(self, world: World) -> None:
        trainer, model, transform = self.trainer, self.trainer.model, self.prepared.transform
        report = rank_report(world, trainer, self.first_step_unix)
        reports = world.collectives.gather(report, "rank_reports")

        def write_results() -> None:
            records = self.records
            records.ranks(reports)
            records.features(transform.to_dict())
            ModelFile.export(self.config, model, transform).save(self.config.output / MODEL)
            records.summary(
                trainer.state, trainer.gradient_sync.described, trainer.precision.described
            )
            records.close(failed=False)

        self.write_root(world, write_results)

    def close(self, failed: bool) -> None:
        """Rank 0 ends its tracking; a job that fails marks its MLflow run failed."""
        if self.records:
            self.records.close(failed)


def write_epoch(
    records: Records, metrics: EpochMetrics, saving: Trainer | None, transform: FeatureTransform
) -> None:
    """Rank 0, after an epoch: its line and metrics, and the checkpoint of `saving`, if any."""
    records.epoch(metrics)
    if saving:
        saving.checkpoint(transform).save(records.output / CHECKPOINT)


def written_by_root(
    world: World, write: Callable[[], None], output: Path, saved: int | None
) -> None:
    """Rank 0 writes; then every rank learns whether that worked, so a full disk (or a tracking
    server that cannot start a run) ends all of them with one line (and no peer is left
    waiting in the next collective)."""
    failure = None
    if world.is_root:
        try:
            write()
        except RunFailed as exc:
            failure = str(exc)
        except OSError as exc:
            failure = (
                f"could not write to {output}: {exc.strerror}; {checkpoint_kept(output, saved)}; "
                "free space (or choose another --output) and run again with --resume"
            )
    world.collectives.agree_on_error(failure, RunFailed)


def checkpoint_kept(output: Path, saved_epoch: int | None) -> str:
    """What a run that ends early leaves to --resume from, for its one line."""
    if saved_epoch:
        return f"{output / CHECKPOINT} holds epoch {saved_epoch}"
    return "no checkpoint of this run was written"


def job_ends(output: Path, saved_epoch: int | None, resume: str) -> str:
    """The end of the line of a run that failed: what it kept, and what to do next; `resume`
    says how this kind of run goes on from a checkpoint."""
    then = f"{resume} to go on from there" if saved_epoch else "run it again"
    return f"the job ends; {checkpoint_kept(output, saved_epoch)}: fix it, then {then}"


def check_finite(metrics: EpochMetrics, config: TrainConfig, saved_epoch: int | None) -> None:
    """Stop a diverging run before it checkpoints or exports parameters that are not finite.
    Every rank sees the same allreduced losses, so every rank stops here together."""
    losses = [metrics.train_loss, metrics.val_loss]
    if all(loss is None or math.isfinite(loss) for loss in losses):
        return
    raise InputError(
        f"training diverged in epoch {metrics.epoch} (train loss {metrics.train_loss:g}); "
        f"{checkpoint_kept(config.output, saved_epoch)}; lower --lr (now {metrics.lr:g}), add "
        "--warmup-epochs, or --standardize-target for a target with large values"
    )
