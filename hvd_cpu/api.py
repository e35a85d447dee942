"""Train from Python: `hvd_cpu.fit(frame, target="y", np=4, model=Network)` from a script or
a notebook, with the classes and functions defined right there.

It launches the ranks itself (Horovod's programmatic launcher in a child process, no
horovodrun command), runs the same training as `hvd-cpu train`, and returns rank 0's model,
its metrics and a predict() that encodes new rows as training did. `hvd_cpu.predict(...)`
predicts from a run's folder.
`hvd_cpu.benchmark(...)` is `hvd-cpu bench`: the command line only parses options for it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import cloudpickle
import pandas as pd
import torch
from torch import nn

from hvd_cpu.atomic import check_own_folder
from hvd_cpu.config.options import DEMO_FEATURES, TrainConfig
from hvd_cpu.data.demo import make_demo_frame
from hvd_cpu.data.features import FeatureTransform
from hvd_cpu.data.frames import write_frame
from hvd_cpu.errors import InputError
from hvd_cpu.model import user_code
from hvd_cpu.model.networks import load_model_factory
from hvd_cpu.output.notebook import EpochBar, in_notebook
from hvd_cpu.output.records import METRICS
from hvd_cpu.runtime import driver
from hvd_cpu.runtime.cores import usable_cores
from hvd_cpu.runtime.lifecycle import launch_rank, launch_rank_known
from hvd_cpu.tools import bench
from hvd_cpu.tools.predict import check_columns, load_model, predictions
from hvd_cpu.training.train import TrainResult, train


@dataclass
class FitResult:
    """What fit() hands back: rank 0's trained model (the same on every rank), each epoch's
    metrics, the feature encoding fitted on the data, and the run's folder."""

    model: nn.Module
    history: pd.DataFrame
    transform: FeatureTransform
    output: Path

    def predict(self, data: pd.DataFrame, id_column: str | None = None) -> pd.DataFrame:
        """The model's predictions for `data` (the training frame's feature columns), encoded
        as in training: a frame with a prediction column per target (and the --id column)."""
        check_columns(data, self.transform, id_column)
        return predictions(self.model, self.transform, data, id_column)


def _rank_main(config: TrainConfig, shipped: dict[str, bytes]) -> bytes | None:
    """What each rank runs; rank 0 hands back the model and metrics, pickled by value (its
    class may come from the user's file or notebook)."""
    user_code.receive(shipped)
    result = train(config)
    return cloudpickle.dumps(result) if launch_rank() == 0 else None


def fit(
    data: pd.DataFrame | str | Path,
    target: str | tuple[str, ...] = "target",
    np: int = 4,
    hosts: str | None = None,
    controller: str = "gloo",
    comm: Any = None,
    model: type[nn.Module] | Callable[..., nn.Module] | str | None = None,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | str | None = None,
    **options: Any,
) -> FitResult:
    """Train on `data` (a DataFrame, or a path to a frame file) with `np` CPU processes.

    `model` is your own torch.nn.Module class or a function returning one, defined in the
    notebook or script itself or imported from an installed module (or "module:Name",
    "file.py:Name"); `model_args=` gives it more arguments. `loss` is your fn(output, target),
    or a name ("mse", "huber", ...). Objects defined in the notebook or script reach the
    ranks by value (cloudpickle), imported ones by their module's name.
    `options` are the other fields of TrainConfig (the long option names of `hvd-cpu train`
    with underscores: epochs=20, batch_size=256, val_fraction=0.2, output="runs/x", ...).
    `hosts` is horovodrun's -H ("host1:2,host2:2"); by default all ranks run here.
    `controller` is "gloo" or "mpi" (Open MPI's shared memory between the ranks of a host,
    where gradients are averaged by one MPI allreduce per step: the fastest here, README).
    With `comm`, an mpi4py communicator of your own program, nothing is launched: every
    process of `comm` calls fit and trains as one rank of it (np, hosts and controller unused).
    Raises InputError for bad input, with the same message the command line prints; the
    exception a rank's code raised when one fails (your model's, say), its cause that rank's
    traceback; Preempted when its ranks were stopped by SIGTERM at a step, saved
    (auto_resume=True goes on from it); and KeyboardInterrupt when interrupted, once every rank
    has stopped.
    """
    if not isinstance(data, (pd.DataFrame, str, Path)):
        raise InputError(
            f"data is a {type(data).__name__}; pass a pandas DataFrame or the path of a frame "
            "file (a Series: series.to_frame(), an array: pd.DataFrame(array))"
        )
    if comm is None and np < 1:
        raise InputError(f"np must be at least 1, got {np}")
    if not isinstance(data, pd.DataFrame):
        options["data"] = Path(data)  # checked with the options (--shard-read needs it)
    config, code = user_config(target, model, loss, options)
    with tempfile.TemporaryDirectory(prefix="hvd-cpu-fit-") as folder:
        if isinstance(data, pd.DataFrame):
            # Pickle keeps every dtype exactly; this file is ours, so loading it is safe.
            path = Path(folder) / "frame.pkl"
            data.to_pickle(path)
        else:
            path = Path(data)
        board = config.tensorboard and Path(config.tensorboard).absolute()
        config = replace(
            config, data=path, output=Path(config.output).absolute(), tensorboard=board
        )
        if comm is not None:
            with user_code.provided({label: obj for label, (_, obj) in code.items()}):
                return fit_result(train(config, comm=comm), config.output)
        shipped = shipped_code(config, code)
        bar = EpochBar(config.output / METRICS, config.epochs) if in_notebook() else None
        try:
            results = driver.run(_rank_main, (config, shipped), np, hosts, controller, bar)
        finally:
            if bar:
                bar.close()
    return fit_result(cloudpickle.loads(results[0]), config.output)


def user_config(
    target: str | tuple[str, ...], model: Any, loss: Any, options: dict[str, Any]
) -> tuple[TrainConfig, dict[str, tuple[str, Any]]]:
    """fit()'s arguments as a TrainConfig, and the user's own objects among them (model= and
    loss= given as a class or function) by the name the config records for each."""
    code: dict[str, tuple[str, Any]] = {}
    for option, value in (("model", model), ("loss", loss)):
        if value is not None and not isinstance(value, str):
            label = user_code.label_of(value, option)
            if label in code:  # two lambdas, say
                raise InputError(
                    f"model= and loss= are both named {label.rpartition(':')[2]}; "
                    "define one of them with def (or class) and a name of its own"
                )
            code[label] = (option, value)
            value = label
        options[option] = value
    targets = (target,) if isinstance(target, str) else tuple(target)
    return TrainConfig(targets=targets, **options), code


def cluster_config(
    data: Any,
    target: str | tuple[str, ...],
    num_proc: int | None,
    model: Any,
    loss: Any,
    options: dict[str, Any],
    not_a_path: Path,
) -> tuple[TrainConfig, dict[str, tuple[str, Any]], bool]:
    """A cluster engine's fit() arguments (hvd_cpu.spark's, hvd_cpu.ray's) as user_config's
    pair, and whether the job is elastic. Each rank trains on its own rows, as --shard-read
    ranks do; data that is no path is recorded as `not_a_path`; the output folder is absolute,
    as the workers do not share this process's working folder."""
    if num_proc is not None and num_proc < 1:
        raise InputError(f"num_proc must be at least 1, got {num_proc}")
    elastic = bool(options.pop("elastic", False))
    where = Path(data) if isinstance(data, (str, Path)) else not_a_path
    config, code = user_config(target, model, loss, {**options, "data": where, "shard_read": True})
    return replace(config, output=Path(config.output).absolute()), code, elastic


def shipped_code(config: TrainConfig, code: dict[str, tuple[str, Any]]) -> dict[str, bytes]:
    """The user's objects as the ranks receive them (user_code.receive). A model named by
    "module:Name" or "file.py:Name" is imported here first: its trained class comes back by
    reference to its module (a FILE.py is no module this process has), and this checks it
    before anything is launched."""
    if config.model and config.model not in code:
        load_model_factory(config.model)
    return {label: user_code.ship(obj, label, o) for label, (o, obj) in code.items()}


def fit_result(result: TrainResult, output: Path) -> FitResult:
    return FitResult(result.model, pd.DataFrame(result.history), result.transform, output)


def predict(
    run: str | Path,
    data: pd.DataFrame,
    id_column: str | None = None,
    model: type[nn.Module] | Callable[..., nn.Module] | None = None,
    trust_code: bool = False,
) -> pd.DataFrame:
    """Predictions for `data` from a run's folder (or its model.pt), as `hvd-cpu predict`
    writes them. `model`: the class or function the run was trained with, when it was
    defined in a notebook or script (its model.pt names it `__main__:Name`). `trust_code`:
    run the code a model.pt names although no training of yours sealed it (`--trust-code`)."""
    trained, transform = trained_model(run, model, trust_code)
    return FitResult(trained, pd.DataFrame(), transform, Path(run)).predict(data, id_column)


def trained_model(
    run: FitResult | str | Path, model: Any = None, trust_code: bool = False
) -> tuple[nn.Module, FeatureTransform]:
    """The model and features of what fit() returned, or of a run's folder (or its model.pt);
    `model` and `trust_code` as for predict()."""
    if isinstance(run, FitResult):
        return run.model, run.transform
    code = {user_code.label_of(model, "model"): model} if model is not None else {}
    with user_code.provided(code):
        return load_model(Path(run), trust_code)


def benchmark(
    data: str | Path | None = None,
    target: str | tuple[str, ...] = "target",
    processes: tuple[int, ...] = (),
    batch_sizes: tuple[int, ...] = (64, 1024),
    sync_intervals: tuple[int, ...] = (1, 8),
    controllers: tuple[str, ...] = ("mpi", "gloo"),
    precisions: tuple[str, ...] = (),
    epochs: int = 2,
    rows: int = 65_536,
    output: str | Path = "runs/bench",
    overwrite: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """Measure which process count, controller, threads, per-rank batch, sync interval and
    precision train `data` (a frame file; None: a demo frame of `rows` rows) fastest here, as
    `hvd-cpu bench` does, and return the report that OUTPUT/bench.json then holds (its
    "recommendation" and "to_same_loss" end with the command lines that train fastest and
    reach the same loss soonest).

    Each setting trains `epochs` epochs, the last timed; `processes` () is 1, 2 and one per
    core; the first of `batch_sizes` is the one you train with; `precisions` () is fp32, and
    bf16 where the CPU has it natively. `options` are TrainConfig's
    fields of the data and model (features=, task=, model=, hidden=, lr=, ...). Run it outside
    horovodrun: it launches its own jobs. Raises InputError for bad input, with the message
    the command line prints.
    """
    if launch_rank_known():
        raise InputError("hvd-cpu bench launches its own jobs: run it without horovodrun")
    output = Path(output).absolute()
    check_own_folder(output)
    if (output / "bench.json").exists() and not overwrite:
        raise InputError(f"{output} holds an earlier bench; pass --overwrite or another --output")
    if not batch_sizes:
        raise InputError("--batch-size names no size; give at least one (e.g. 64,1024)")
    if epochs < 2:
        raise InputError(f"epochs must be at least 2 (the first is not timed), got {epochs}")
    if not data:
        data = output / "demo.parquet"
        write_frame(make_demo_frame(rows, DEMO_FEATURES, 0), data)
    cores = usable_cores()
    targets = (target,) if isinstance(target, str) else tuple(target)
    settings = {"data": Path(data), "targets": targets, "output": output}
    # Measured on every row: no hold-out, no epoch lines.
    settings |= {"batch_size": batch_sizes[0], "val_fraction": 0.0, "quiet": True}
    config = bench.BenchConfig(
        train=TrainConfig(**{**options, **settings}),
        process_counts=tuple(processes) or bench.default_process_counts(cores),
        batch_sizes=tuple(batch_sizes),
        sync_intervals=tuple(sync_intervals),
        cores=cores,
        controllers=tuple(controllers),
        precisions=tuple(precisions) or bench.default_precisions(),
    )
    report = bench.run(config, epochs)
    bench.write(report, output)
    return report
