"""Predictions from an exported model: the stored feature transformation, then the model.

Under horovodrun each rank reads and predicts a contiguous block of rows and rank 0 writes
them, in the input's order, as one file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn

from hvd_cpu.config.formats import check_encoding
from hvd_cpu.config.options import STALL_SECONDS, Task
from hvd_cpu.data.agreement import check_same_data
from hvd_cpu.data.columns import check_unique_columns
from hvd_cpu.data.features import FeatureTransform
from hvd_cpu.data.frames import InMemory, check_writable, format_of, open_rows, write_frame
from hvd_cpu.data.loader import rank_block
from hvd_cpu.data.parquet import Pieces
from hvd_cpu.errors import InputError
from hvd_cpu.model.networks import EVAL_ROWS, outputs
from hvd_cpu.output.model_code import rebuild, trusted_source
from hvd_cpu.output.model_files import ModelFile
from hvd_cpu.runtime import failure, join
from hvd_cpu.runtime.lifecycle import launch_rank_known
from hvd_cpu.runtime.world import World
from hvd_cpu.training.scope import RunScope


@dataclass(frozen=True)
class PredictConfig:
    """The options of `hvd-cpu predict`."""

    model_path: Path
    data: Path
    output: Path
    format: str | None = None
    encoding: str | None = None
    id_column: str | None = None
    overwrite: bool = False
    trust_code: bool = False  # run the code an unsealed model file names (output/model_code.py)

    def __post_init__(self) -> None:
        check_encoding(self.encoding)


def load(
    config: PredictConfig, world: World
) -> tuple[nn.Module, FeatureTransform, Pieces | InMemory]:
    """The model, its transformation and the new rows, opened (parquet is read block by
    block later: a rank reads only the row groups its block lies in); rank 0, which writes
    the output, first checks that it can."""
    format_of(config.output)
    if config.output.exists() and not config.overwrite:
        raise InputError(f"{config.output} exists; pass --overwrite to replace it")
    if world.is_root:
        check_writable(config.output)
    model, transform = load_model(config.model_path, config.trust_code)
    rows = open_rows(config.data, config.format, config.encoding)
    return model, transform, rows


def block_of(
    rows: Pieces | InMemory,
    transform: FeatureTransform,
    world: World,
    id_column: str | None,
) -> pd.DataFrame:
    """This rank's contiguous block of the new rows, its columns checked."""
    block = rows.frame(*rank_block(rows.rows, world.rank, world.size))
    check_columns(block, transform, id_column)
    return block


def load_model(path: Path, trust_code: bool = False) -> tuple[nn.Module, FeatureTransform]:
    """The exported model with its weights, running only the code it may
    (output/model_code.py; `trust_code`: an unsealed file's too). A file that loads but whose
    parts do not fit together was damaged or written by another version: one line, not a
    traceback."""
    artifact = ModelFile.load(path)
    source = trusted_source(artifact, path, trust_code)
    try:
        transform = FeatureTransform.from_dict(artifact.features)
        model = rebuild(artifact, source)
    except InputError as exc:  # the user's class, as build_user_model reports it
        raise InputError(f"{path} needs the class it was trained with: {exc}") from exc
    except Exception as exc:
        raise InputError(
            f"cannot rebuild the model in {path}: {type(exc).__name__}: {exc}; it is damaged "
            "or was written by another version of hvd-cpu: train it again"
        ) from exc
    return model, transform


def output_names(transform: FeatureTransform) -> list[str]:
    """The columns predict writes besides --id."""
    if transform.task == Task.CLASSIFICATION:
        return ["prediction", *(f"probability_{label}" for label in transform.classes)]
    if len(transform.targets) == 1:
        return ["prediction"]
    return [f"prediction_{t}" for t in transform.targets]


def check_columns(frame: pd.DataFrame, transform: FeatureTransform, id_column: str | None) -> None:
    """The new frame must hold the training's feature columns and nothing it did not know."""
    columns = [str(c) for c in frame.columns]
    check_unique_columns(columns)
    missing = [c.name for c in transform.inputs if c.name not in columns]
    if missing:
        raise InputError(
            f"the data lacks the feature column(s) {', '.join(missing)} that the model was "
            "trained on; add them (missing values are allowed)"
        )
    if id_column is not None and id_column not in columns:
        raise InputError(f"--id column {id_column!r} is not in the data; check --id")
    if id_column in output_names(transform):
        raise InputError(
            f"--id column {id_column!r} has the name of a prediction column; rename it"
        )
    known = {c.name for c in transform.inputs} | {*transform.targets, *transform.ignored}
    extra = [c for c in columns if c not in known and c != id_column]
    if extra:
        raise InputError(
            f"the data has column(s) {', '.join(extra)} that the model's training data did not "
            "have; drop them, or name an identifier column with --id"
        )


def predictions(
    model: nn.Module, transform: FeatureTransform, frame: pd.DataFrame, id_column: str | None
) -> pd.DataFrame:
    """One row of predictions per row of `frame`, in order (none for none: a rank of a job
    with fewer rows than ranks)."""
    x = torch.from_numpy(transform.features(frame))
    if len(x):
        out = torch.cat(list(outputs(model, x.split(EVAL_ROWS))))
    else:
        out = torch.zeros(0, transform.n_outputs)
    names = output_names(transform)
    result: dict[str, Any] = {}
    if id_column is not None:
        result[id_column] = frame[id_column].to_numpy()
    if transform.task == Task.CLASSIFICATION:
        probabilities = torch.softmax(out, dim=1).numpy()
        result[names[0]] = [transform.classes[i] for i in probabilities.argmax(axis=1)]
        result.update({name: probabilities[:, i] for i, name in enumerate(names[1:])})
    else:
        values = out.double().numpy()
        for i, scale in enumerate(transform.target_scale):
            values[:, i] = values[:, i] * scale.std + scale.mean
        result.update({name: values[:, i] for i, name in enumerate(names)})
    return pd.DataFrame(result, index=frame.index)


def predict(config: PredictConfig) -> pd.DataFrame | None:
    """Predict on every rank's block of rows; rank 0 writes them all and returns them. A rank
    that fails or stalls ends the job as in training (training/scope.py)."""
    with RunScope(process_goes_on=not launch_rank_known()) as scope:
        world = join.init(stall_seconds=STALL_SECONDS)
        scope.watch(world, STALL_SECONDS, elastic=False)
        with scope.failures_end_the_job(lambda: world, lambda: failure.RUN_AGAIN):
            return _predict(config, world)


def _predict(config: PredictConfig, world: World) -> pd.DataFrame | None:
    agreed = world.collectives.agreed
    model, transform, rows = agreed(lambda: load(config, world))
    check_same_data(config.data, rows, world.collectives, whole=True)
    block = agreed(lambda: block_of(rows, transform, world, config.id_column))
    # agreed: a value that does not parse may sit in one rank's block only
    mine = agreed(lambda: predictions(model, transform, block, config.id_column))
    parts = world.collectives.gather(mine, "predictions")
    if not world.is_root:
        return None
    # Ranks without rows send empty parts, whose column types would change the others'.
    result = pd.concat([part for part in parts if len(part)]).reset_index(drop=True)
    write_frame(result, config.output)
    return result
