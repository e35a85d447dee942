"""`train`: what every rank runs for `hvd-cpu train` and `hvd_cpu.fit`, in the order the data
flows: join the job, prepare (read, fit, encode, build), build the trainer, run the job (under
--elastic, inside Horovod's elastic loop), hand back the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd
from torch import nn

from hvd_cpu.config.options import TrainConfig
from hvd_cpu.data.features import FeatureTransform
from hvd_cpu.runtime import join, startup
from hvd_cpu.runtime.lifecycle import launch_rank_known
from hvd_cpu.training.elastic import Elastic
from hvd_cpu.training.job import Job
from hvd_cpu.training.membership import Fixed
from hvd_cpu.training.prepare import prepare
from hvd_cpu.training.scope import RunScope
from hvd_cpu.training.trainer import build_trainer


@dataclass
class TrainResult:
    """The trained model (identical on every rank) and every epoch's metrics."""

    model: nn.Module
    transform: FeatureTransform
    history: list[dict[str, Any]]


def train(config: TrainConfig, comm: Any = None, own: pd.DataFrame | None = None) -> TrainResult:
    """Train as configured; call on every rank of the job (a plain process is a job of one,
    the processes of `comm`, an mpi4py communicator, are one job over MPI). `own`: this rank's
    own rows (a Spark task's partitions), read instead of --data, with --shard-read set."""
    startup.reached("imported")
    # The run's watch and output folder end with it: the others may finish later (this rank
    # is not stalled, it is done), and a Python caller's process goes on after the job.
    with RunScope(process_goes_on=comm is not None or not launch_rank_known()) as scope:
        membership = Elastic.launched(scope) if config.elastic else Fixed(scope)
        world = join.init(config.threads, comm, config.stall_seconds)
        startup.reached("joined")
        job: Job | None = None
        with scope.failures_end_the_job(
            lambda: job.trainer.world if job else world,
            lambda: membership.after_failure(config.output, job),
        ):
            prepared = prepare(config, world, membership, own)  # rank 0 takes the output folder
            trainer = build_trainer(config, world, prepared, prepared.model)
            startup.reached("prepared")
            job = Job(config, prepared, trainer)
            try:
                membership.run(job, world, prepared.resumed)
            except BaseException:
                job.close(failed=True)
                raise
    return TrainResult(trainer.model, prepared.transform, trainer.state.history)
