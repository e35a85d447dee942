"""Train from Python: `hvd_cpu.fit(frame, target="y", np=4)` from a script or a notebook.

It launches the ranks itself (Horovod's programmatic launcher, no horovodrun command), runs
the same training as `hvd-cpu train`, and returns rank 0's model and metrics.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd

from hvd_cpu import dist
from hvd_cpu.config import TrainConfig
from hvd_cpu.errors import InputError
from hvd_cpu.lifecycle import launch_rank
from hvd_cpu.train import TrainResult, train


def _rank_main(config: TrainConfig) -> TrainResult | None:
    """What each rank runs; rank 0 hands back the model and metrics."""
    result = train(config)
    return result if launch_rank() == 0 else None


def fit(
    data: pd.DataFrame | str | Path,
    target: str | tuple[str, ...] = "target",
    np: int = 4,
    hosts: str | None = None,
    controller: str = "gloo",
    comm: Any = None,
    **options: Any,
) -> TrainResult:
    """Train on `data` (a DataFrame, or a path to a frame file) with `np` CPU processes.

    `options` are the fields of TrainConfig (the long option names of `hvd-cpu train` with
    underscores: epochs=20, batch_size=256, val_fraction=0.2, output="runs/x", ...).
    `hosts` is horovodrun's -H ("host1:2,host2:2"); by default all ranks run here.
    `controller` is "gloo" or "mpi" (Open MPI's shared memory between the ranks of a host;
    with allreduce="direct" and at most one rank per core, the fastest here: README).
    With `comm`, an mpi4py communicator of your own program, nothing is launched: every
    process of `comm` calls fit and trains as one rank of it (np, hosts and controller unused).
    Raises InputError for bad input, with the same message the command line prints.
    """
    if not isinstance(data, (pd.DataFrame, str, Path)):
        raise InputError(
            f"data is a {type(data).__name__}; pass a pandas DataFrame or the path of a frame "
            "file (a Series: series.to_frame(), an array: pd.DataFrame(array))"
        )
    if comm is None and np < 1:
        raise InputError(f"np must be at least 1, got {np}")
    targets = (target,) if isinstance(target, str) else tuple(target)
    config = TrainConfig(targets=targets, **options)
    with tempfile.TemporaryDirectory(prefix="hvd-cpu-fit-") as folder:
        if isinstance(data, pd.DataFrame):
            # Pickle keeps every dtype exactly; this file is ours, so loading it is safe.
            path = Path(folder) / "frame.pkl"
            data.to_pickle(path)
        else:
            path = Path(data)
        config = replace(config, data=path, output=Path(config.output).absolute())
        if comm is not None:
            return train(config, comm=comm)
        return dist.launch(_rank_main, (config,), np=np, hosts=hosts, controller=controller)[0]
