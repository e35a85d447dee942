"""Everything before the first step, on every rank: output checks, reading, fitting, encoding,
splitting off validation rows, building the model.

Each step that can meet bad input runs through `collectives.agreed`: if any rank fails, every rank
raises the same InputError at the same point, so none is left waiting in a collective and
rank 0 reports it once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import pandas as pd
import torch
from torch import nn

from hvd_cpu.atomic import check_own_folder
from hvd_cpu.config.options import DEMO_FEATURES, DEMO_ROWS, TrainConfig
from hvd_cpu.data.agreement import check_same_data
from hvd_cpu.data.demo import make_demo_frame
from hvd_cpu.data.features import (
    Arrays,
    FeatureTransform,
    Selection,
    fit,
)
from hvd_cpu.data.frames import InMemory, data_format, open_rows, parquet_rows, probe_folder
from hvd_cpu.data.loader import index_type, rank_block
from hvd_cpu.data.parquet import Pieces
from hvd_cpu.errors import InputError
from hvd_cpu.model.losses import Loss, build_loss, check_loss
from hvd_cpu.model.networks import build_model
from hvd_cpu.output import seal, tracking
from hvd_cpu.output.model_files import CHECKPOINT, Checkpoint
from hvd_cpu.runtime.world import World
from hvd_cpu.training.precision import Batch, Precision
from hvd_cpu.training.precision import choose as choose_precision
from hvd_cpu.training.scope import RunScope


class Start(NamedTuple):
    """What a rank prepares from: the world it prepares on, rank 0's checkpoint to resume
    (None elsewhere, or not yet), and the fitted features to reuse (--resume)."""

    world: World
    resumed: Checkpoint | None
    fitted: dict[str, Any] | None


class Joining(Protocol):
    """What preparing asks of the way the ranks come together (training/membership.py's
    classes, which call this module: the knowledge goes one way)."""

    def start(self, config: TrainConfig, world: World) -> Start:
        """Before preparing: check the output (or leave that for later) and say what to
        prepare from."""
        ...

    def has_validation(self, held_out: int, world: World) -> bool:
        """Whether the job has held-out rows, given this rank's `held_out`."""
        ...


@dataclass
class Prepared:
    """What the training loop starts from; identical in shape on every rank."""

    transform: FeatureTransform
    arrays: Arrays
    train_rows: torch.Tensor  # rows of `arrays` to train on (all ranks' pool, or this shard's)
    val_rows: torch.Tensor  # this rank's validation rows
    train_length: int  # --shard-read: the longest shard's training rows (others pad to it)
    model: nn.Module
    loss_fn: Loss
    precision: Precision  # what the steps run in, the same on every rank
    resumed: Checkpoint | None  # rank 0: the checkpoint to continue from
    has_validation: bool  # some rank holds out rows


def open_output(
    config: TrainConfig, world: World, scope: RunScope | None = None
) -> Checkpoint | None:
    """Rank 0: refuse to overwrite an earlier run's checkpoint, or load it for --resume; check
    that the tracking asked for can log (only rank 0 logs), that the folder is this user's
    own, and that the user's model code can be sealed; with the run's `scope`, hold the
    folder for it (not under --elastic, whose rank 0 may move to another process)."""
    if not world.is_root:
        return None
    tracking.check(config)
    check_own_folder(config.output)
    if config.model:  # the model.pt it exports is sealed with this user's key
        seal.ready_key()
    try:
        probe_folder(config.output)
    except OSError as exc:
        raise InputError(
            f"cannot write to output folder {config.output}: {exc.strerror}; "
            "choose another --output"
        ) from exc
    if scope:
        scope.hold(config.output)
    path = config.output / CHECKPOINT
    if not (config.resume or (config.auto_resume and path.exists())):
        if path.exists() and not config.overwrite:
            raise InputError(
                f"{config.output} holds a checkpoint from an earlier run; pass --resume (or "
                "--auto-resume) to continue it or --overwrite to start again, or choose another "
                "--output"
            )
        return None
    state = Checkpoint.load(path)
    earlier, now = state.config, config.to_dict()
    same = TrainConfig.JOB if config.auto_resume else TrainConfig.ARCHITECTURE
    changed = [k for k in same if earlier.get(k) != now[k]]
    if changed:
        was = ", ".join(f"{k}={earlier.get(k)!r}" for k in changed)
        if config.auto_resume:
            raise InputError(
                f"{config.output} holds the checkpoint of another job (trained with {was}); "
                "choose another --output, or start again there with --overwrite"
            )
        raise InputError(
            f"the checkpoint in {config.output} was trained with {was}; resume with the "
            "same options, or start again with --overwrite"
        )
    return state


def open_output_together(
    config: TrainConfig, world: World, scope: RunScope | None
) -> Checkpoint | None:
    """open_output, agreed by every rank (under --elastic, once the ranks are together)."""
    return world.collectives.agreed(lambda: open_output(config, world, scope))


def read_rows(
    config: TrainConfig, world: World, own: pd.DataFrame | None = None
) -> tuple[Pieces | InMemory, int, int | None]:
    """(the rows this rank trains from, the bounds of its disjoint part of them for fitting
    statistics).

    By default every rank trains from the whole table and fits on a 1/size slice of it; with
    --shard-read a rank has only its own pieces and fits on all of them, as it does with the
    `own` rows it was handed (a Spark task's partitions, config.shard_read set). Parquet stays
    on disk until it is needed: first the part for the fit, then batch by batch into the
    matrices.
    """
    if own is not None:
        return InMemory(own), 0, None
    if config.data is None:
        rows: Pieces | InMemory = InMemory(make_demo_frame(DEMO_ROWS, DEMO_FEATURES, config.seed))
    elif config.shard_read:
        if data_format(config.data, config.format) != "parquet":
            raise InputError(
                "--shard-read reads parquet files and folders only; convert the data to parquet"
            )
        return parquet_rows(config.data).shard(world.rank, world.size), 0, None
    else:
        rows = open_rows(config.data, config.format, config.encoding)
    if rows.rows < world.size:
        raise InputError(
            f"the data has {rows.rows} row(s), fewer than the {world.size} ranks; "
            "use fewer ranks (-np) or more rows"
        )
    return rows, *rank_block(rows.rows, world.rank, world.size)


def encode(
    config: TrainConfig, world: World, fitted: dict[str, Any] | None, own: pd.DataFrame | None
) -> tuple[FeatureTransform, Arrays]:
    """Read this rank's part, fit the transformation over all ranks (or take the resumed
    one), then encode this rank's rows batch by batch into matrices made once: the part is
    dropped before, so the frame and the matrices are not in memory together (for parquet)."""
    agreed = world.collectives.agreed
    rows, start, stop = agreed(lambda: read_rows(config, world, own))
    check_same_data(config.data, rows, world.collectives, whole=not config.shard_read)
    if fitted is not None:
        transform = FeatureTransform.from_dict(fitted)
    else:
        selection = Selection(config.targets, config.features, config.drop)
        transform = agreed(
            lambda: fit(
                rows.frame(start, stop),
                selection,
                config.task,
                config.max_categories,
                config.standardize_target,
                world.collectives,
            )
        )
    return transform, agreed(lambda: transform.encode(rows.batches(), rows.rows))


def split(rows: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training rows, validation rows): a hold-out fixed by the seed, sorted (in place: both
    are views of one permutation), of the sampler's index type."""
    positions = torch.arange(rows, dtype=index_type(rows)).numpy()
    order = np.random.default_rng(seed).permutation(positions)
    held = round(rows * fraction)
    train, val = order[held:], order[:held]
    train.sort()
    val.sort()
    return torch.from_numpy(train), torch.from_numpy(val)


def first_batch(arrays: Arrays, rows: torch.Tensor, size: int) -> Batch:
    """The first `size` of `rows` as (inputs, targets): what a timed or trial step runs on."""
    first = rows[:size].numpy()
    return torch.from_numpy(arrays.x[first]), torch.from_numpy(arrays.y[first])


def prepare(
    config: TrainConfig, world: World, membership: Joining, own: pd.DataFrame | None = None
) -> Prepared:
    """Check the output, read, fit, encode, split and build on every rank, agreeing on bad
    input after each step; what to prepare from, and on which ranks, is the membership's
    (under --elastic each rank prepares alone: training/elastic.py). `own`: the rows this
    rank was handed, instead of reading --data."""
    world, resumed, fitted = membership.start(config, world)
    transform, arrays = encode(config, world, fitted, own)

    if config.shard_read:  # each rank holds its own rows: hold out some of them
        train_rows, val_rows = split(len(arrays), config.val_fraction, config.seed + world.rank)
    else:  # every rank holds all rows: hold out the same ones, then share them out
        train_rows, val_rows = split(len(arrays), config.val_fraction, config.seed)
        val_rows = val_rows[world.rank :: world.size]
    lengths = world.collectives.gather(len(train_rows), "train_rows")
    if min(lengths) == 0 or (not config.shard_read and lengths[0] < world.size):
        raise InputError(
            f"too few rows with a usable target to train {world.size} rank(s) "
            f"({lengths[world.rank]} here after holding out --val-fraction {config.val_fraction})"
        )

    def build() -> tuple[nn.Module, Loss]:
        torch.manual_seed(config.seed)  # every rank builds the same start; rank 0's is broadcast
        model = build_model(
            config.model,
            config.hidden,
            config.activation,
            transform.n_features,
            transform.n_outputs,
            config.model_args,
        )
        loss_fn = build_loss(config.loss, config.task)
        if config.loss is not None:  # the user's choice meets the model's output once, here
            sample = train_rows[:2]
            output = model(torch.from_numpy(arrays.x[sample]))
            check_loss(loss_fn, config.loss, output, torch.from_numpy(arrays.y[sample]))
        return model, loss_fn

    model, loss_fn = world.collectives.agreed(build)
    batch = first_batch(arrays, train_rows, config.batch_size)
    earlier = resumed.loop.get("precision") if resumed else None  # rank 0's, broadcast by choose
    chosen = choose_precision(config.precision, model, loss_fn, batch, world.collectives, earlier)
    has_validation = membership.has_validation(len(val_rows), world)
    return Prepared(
        transform, arrays, train_rows, val_rows, max(lengths), model, loss_fn, chosen, resumed,
        has_validation,
    )  # fmt: skip
