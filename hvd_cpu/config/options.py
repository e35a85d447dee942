"""Training options, shared by the CLI and the Python API so both mean the same thing: each is
a TrainConfig field that also declares its command-line option (cli_options.py makes them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar, Literal

import click

from hvd_cpu.config.formats import FORMATS, check_encoding, extensions_text
from hvd_cpu.config.values import JSON_OBJECT, NAMES, SIZES, is_spec
from hvd_cpu.errors import InputError

# The demo frame used when no --data is given: small enough that ten epochs over four ranks
# on two cores take seconds, and that the loss still falls in each of them (on 20 000 rows the
# seed's model reaches the noise floor in two epochs and then only jitters).
DEMO_ROWS = 2048
DEMO_FEATURES = 16
# Seeds feed numpy (non-negative) and torch (seed x 1_000_003 + epoch < 2**64).
SEED_MAX = 2**32 - 1
# Shorter bounds are within what a busy machine delays a heartbeat thread.
MIN_STALL_SECONDS = 2.0
STALL_SECONDS = 60.0  # --stall-seconds' default (predict's bound too)
# Horovod's two controllers, as the summary and bench name them.
CONTROLLER_NAMES = {"mpi": "MPI", "gloo": "Gloo"}


# --loss by name (losses.py builds them); anything with a ":" is the user's MODULE:FN.
LOSS_NAMES = ("mse", "l1", "huber")


class Task(StrEnum):
    """What the model predicts: numbers (MSE by default) or classes (cross-entropy)."""

    REGRESSION = "regression"
    CLASSIFICATION = "classification"


# The options with a fixed set of values (the command line's choices; fit() passes anything).
CHOICES = {
    "task": tuple(map(str, Task)),
    "activation": ("none", "relu", "gelu"),
    "allreduce": ("auto", "horovod", "direct"),
    "precision": ("fp32", "bf16", "auto"),
    "format": (None, *FORMATS),
}


@dataclass(frozen=True)
class Option:
    """How the command line, and so a --config file, gives one TrainConfig field.

    cli_options.py makes the click option from this and the field's default: a bool (a bool
    default, or type click.BOOL) is a flag, --x, or --x/--no-x when its default is not False;
    any other takes a value of `type` (text if None). The long option is --field-name unless
    `flag` names another.
    """

    help: str | None
    type: click.ParamType | None
    metavar: str | None
    flag: str | None
    repeat: bool  # given once per value (--target a --target b), not as one list


OPTION = "option"  # the key of a field's Option in its metadata


def option(
    default: Any,
    *,
    help: str | None = None,
    type: click.ParamType | None = None,
    metavar: str | None = None,
    flag: str | None = None,
    repeat: bool = False,
) -> Any:
    """A TrainConfig field and its `hvd-cpu train` option, declared together: the one place a
    training option is written (its click option, bench's spelling of it and its --config key
    follow from this)."""
    return field(default=default, metadata={OPTION: Option(help, type, metavar, flag, repeat)})


def _within(bounds: click.IntRange | click.FloatRange, value: float) -> bool:
    try:
        bounds.convert(value, None, None)
    except click.BadParameter:
        return False
    return True


def _range_words(bounds: click.IntRange | click.FloatRange) -> str:
    """A click range in words: "at least 1", "above 0", "between 0 and 9", "in [0, 1)"."""
    low, high = (f"{b:g}" if isinstance(b, float) else b for b in (bounds.min, bounds.max))
    if high is None:
        return f"above {low}" if bounds.min_open else f"at least {low}"
    if not bounds.min_open and not bounds.max_open:
        return f"between {low} and {high}"
    return f"in {'(' if bounds.min_open else '['}{low}, {high}{')' if bounds.max_open else ']'}"


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training job needs; each rank builds the same one from the same options.

    Each field is an option of `hvd-cpu train`, in this order in its --help.
    """

    # the data
    data: Path | None = option(
        None,  # the generated demo frame
        help=f"DataFrame file ({extensions_text()}) or a folder of parquet files (Spark, Dask; "
        "key=value folders become columns). Default: a generated demo frame.",
        type=click.Path(path_type=Path),
    )
    format: str | None = option(
        None,  # from the file's extension
        help="Read --data in this format whatever its extension.",
        type=click.Choice(FORMATS),
    )
    encoding: str | None = option(
        None,  # UTF-8
        help="Text encoding of a CSV --data file, e.g. latin-1 or cp1252 (default utf-8).",
    )
    targets: tuple[str, ...] = option(
        ("target",),
        help="Column to predict; repeat for several outputs (regression).",
        flag="--target",
        repeat=True,
    )
    features: tuple[str, ...] | None = option(
        None,  # every column but the targets and --drop
        help="Feature columns. Default: every column but the targets.",
        type=NAMES,
        metavar="COL,...",
    )
    drop: tuple[str, ...] = option(
        (), help="Columns to leave out (an id, a leak).", type=NAMES, metavar="COL,..."
    )
    task: str = option(
        Task.REGRESSION.value,
        help="regression: MSE loss; classification: cross-entropy, accuracy reported.",
        type=click.Choice(CHOICES["task"]),
    )
    max_categories: int = option(
        32,
        help="Most levels a text/category column may have (each becomes a 0/1 feature).",
        type=click.IntRange(min=1),
    )
    standardize_target: bool = option(
        False,
        help="Regression: train on the target scaled to mean 0, std 1 (loss in those units).",
    )
    shard_read: bool = option(
        False,
        help="Parquet file or folder: each rank reads only its own row groups (about 1/N of "
        "the memory); rows are then shuffled within each rank's shard.",
    )
    # the model
    model: str | None = option(
        None,  # the MLP below
        help="Your own torch.nn.Module class, or a function returning one; built with the "
        "feature count for a parameter named like input_size (or its only one) and the output "
        "count for one named like n_outputs.",
        metavar="MODULE:NAME|FILE.py:NAME",
    )
    model_args: dict[str, Any] | None = option(
        None,
        help="More keyword arguments for --model, e.g. '{\"hidden\": 64}'.",
        type=JSON_OBJECT,
        metavar="JSON",
    )
    hidden: tuple[int, ...] = option(
        (32,), help="Hidden layer sizes of the default MLP.", type=SIZES, metavar="N,..."
    )
    activation: Literal["none", "relu", "gelu"] = option(
        "none",
        help="Activation between the MLP's layers (the seed's has none).",
        type=click.Choice(CHOICES["activation"]),
    )
    # the optimisation
    loss: str | None = option(
        None,  # MSE, or cross-entropy for classes
        help="Regression loss (default mse; huber moves less for outliers), or your own "
        "fn(output, target) returning the batch's mean. Classification: cross-entropy.",
        metavar=f"{'|'.join(LOSS_NAMES)}|MODULE:FN",
    )
    epochs: int = option(10, type=click.IntRange(min=1))
    batch_size: int = option(
        64,
        help="Rows per step on each rank; the global batch is this times the ranks.",
        type=click.IntRange(min=1),
    )
    lr: float = option(
        1e-3,  # Adam's default
        help="Adam's learning rate before scaling.",
        type=click.FloatRange(min=0, min_open=True),
    )
    scale_lr: bool = option(
        True,  # since the global batch grows with the ranks
        help="Multiply --lr by the number of ranks (Horovod's convention).",
    )
    shuffle: bool = option(True, help="Reshuffle the rows every epoch.")
    seed: int = option(0, type=click.IntRange(0, SEED_MAX))
    threads: int | None = option(
        None,
        help="Torch threads per rank. Default: usable cores / ranks on the host.",
        type=click.IntRange(min=1),
    )
    # 1: average gradients every step (synchronous, as one process with the global batch).
    # K > 1: local SGD, each rank steps on its own and parameters are averaged every K steps
    # and at the end of each epoch: K times fewer waits for the other ranks.
    sync_every: int = option(
        1,
        help="1: average gradients every step. K > 1: local SGD, each rank steps alone and the "
        "parameters are averaged every K steps (and each epoch's end); the lr is not scaled.",
        type=click.IntRange(min=1),
    )
    # How gradients are averaged every step: "horovod", hvd.DistributedOptimizer (Horovod's
    # cycle, either controller); "direct", one allreduce of all gradients in the training
    # thread (MPI, or Gloo through shared memory: much less per-step overhead, see README);
    # "auto", the faster of the two for the job (training/sync.py, `averaging`).
    allreduce: Literal["auto", "horovod", "direct"] = option(
        "auto",
        help="How gradients are averaged each step: horovod, hvd.DistributedOptimizer; direct, "
        "one allreduce of all gradients from the training loop (MPI, or Gloo through shared "
        "memory; far less overhead per step); auto, direct where there is one, else horovod.",
        type=click.Choice(CHOICES["allreduce"]),
    )
    # The arithmetic of forward and loss (training/precision.py): bf16 is autocast with fp32
    # weights, for CPUs with native bfloat16; auto takes it where a timed trial says it pays.
    precision: Literal["fp32", "bf16", "auto"] = option(
        "fp32",
        help="Arithmetic of forward and loss: fp32; bf16, autocast with fp32 weights, optimizer "
        "and files (CPUs with native bfloat16: about 2x faster matrix multiplies); auto, bf16 "
        "where a few timed steps of both say it pays for this model here.",
        type=click.Choice(CHOICES["precision"]),
    )
    # output
    output: Path = option(
        Path("runs/hvd-cpu"),
        help="Folder for metrics.jsonl, checkpoint.pt, model.pt, features.json and ranks.json.",
        type=click.Path(path_type=Path, file_okay=False),
    )
    # the learning rate's schedule
    warmup_epochs: int = option(
        0,
        help="Raise the lr from --lr to --lr x ranks over these epochs (Horovod's warm-up).",
        type=click.IntRange(min=0),
    )
    plateau_patience: int | None = option(
        None,
        help="Halve the lr after this many epochs without a better validation loss.",
        type=click.IntRange(min=1),
    )
    # validation and stopping
    val_fraction: float = option(
        0.1,  # held out (by seed) and sharded across ranks
        help="Rows held out (fixed by --seed) to validate on; 0: none.",
        type=click.FloatRange(0, 1, max_open=True),
    )
    patience: int | None = option(
        None,
        help="Stop after this many epochs without a better validation loss.",
        type=click.IntRange(min=1),
    )
    # checkpoints
    checkpoint_every: int = option(
        1,
        help="Epochs between checkpoints (OUTPUT/checkpoint.pt, written atomically).",
        type=click.IntRange(min=1),
    )
    resume: bool = option(False, help="Continue from OUTPUT/checkpoint.pt up to --epochs.")
    overwrite: bool = option(False, help="Start again even if OUTPUT holds a checkpoint.")
    auto_resume: bool = option(
        False,
        help="Continue OUTPUT's checkpoint if it is this job's (same data, seed and model), "
        "else start: one command for first runs and retries (Kubernetes, SLURM's requeue).",
    )
    # Horovod's elastic mode: ranks may die or join, training goes on (launch/elastic.sh).
    elastic: bool = option(
        False,
        help="Go on when ranks die or join (Horovod's elastic mode; start with launch/elastic.sh).",
    )
    commit_every: int = option(
        100,
        help="--elastic: steps between commits of the state in memory; a lost rank costs the "
        "steps since the last one.",
        type=click.IntRange(min=1),
    )
    max_restarts: int = option(
        3,
        help="--elastic: lost ranks to go on after; the next one ends the job.",
        type=click.IntRange(min=0),
    )
    stall_seconds: float = option(
        STALL_SECONDS,
        help="End the job when a rank has not answered for this long (stopped, swapping, cut "
        "off), or has not moved on while the others wait for it (stuck in its code); under "
        f"--elastic drop it as lost. At least {MIN_STALL_SECONDS:g}; 0: wait forever.",
        type=click.FloatRange(min=0),
    )
    # what is shown
    progress: bool | None = option(
        None,
        help="A progress bar per epoch. Default: when stdout is a terminal.",
        type=click.BOOL,
    )
    quiet: bool = option(False, help="No epoch lines, progress or summary.")
    # experiment tracking, by rank 0 only (tracking.py; the tracking extra)
    tensorboard: Path | None = option(
        None,
        help="Rank 0 writes the job's one TensorBoard event file here (needs hvd-cpu[tracking]).",
        type=click.Path(path_type=Path, file_okay=False),
        metavar="DIR",
    )
    mlflow: bool = option(
        False,
        help="Rank 0 logs one MLflow run per job to MLFLOW_TRACKING_URI: the config, each "
        "epoch's metrics, model.pt (needs hvd-cpu[tracking]).",
    )
    mlflow_experiment: str | None = option(
        None,
        help="--mlflow: the experiment, made if missing. Default: MLFLOW_EXPERIMENT_NAME, else "
        "hvd-cpu.",
        metavar="NAME",
    )
    mlflow_run_name: str | None = option(
        None, help="--mlflow: the run's name. Default: one MLflow makes up.", metavar="NAME"
    )

    # Options that change what the model is: a checkpoint only resumes with the same ones.
    ARCHITECTURE: ClassVar[tuple[str, ...]] = (
        "targets",
        "features",
        "drop",
        "task",
        "model",
        "model_args",
        "hidden",
        "activation",
    )

    # Options that make a checkpoint another job's for --auto-resume: the model, the rows it
    # sees and the draws that order them.
    JOB: ClassVar[tuple[str, ...]] = (*ARCHITECTURE, "data", "seed", "val_fraction", "shard_read")

    def __post_init__(self) -> None:
        # The bounds are the command line's (each field's click range): declared once.
        for item in fields(self):
            bounds, value = item.metadata[OPTION].type, getattr(self, item.name)
            ranged = isinstance(bounds, click.IntRange | click.FloatRange)
            if ranged and value is not None and not _within(bounds, value):
                raise InputError(f"{item.name} must be {_range_words(bounds)}, got {value}")
        if not (self.stall_seconds == 0 or self.stall_seconds >= MIN_STALL_SECONDS):
            raise InputError(
                f"--stall-seconds must be 0 (never end a job) or at least {MIN_STALL_SECONDS:g} "
                f"(a busy machine delays a heartbeat by a second), got {self.stall_seconds:g}"
            )
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise InputError(
                    f"{name} must be one of {', '.join(map(repr, allowed))}, "
                    f"got {getattr(self, name)!r}"
                )
        check_encoding(self.encoding)
        if not self.targets:
            raise InputError("name at least one --target column")
        if any(size < 1 for size in self.hidden):
            raise InputError(f"hidden layer sizes must be at least 1, got {self.hidden}")
        if self.shard_read and self.data is None:
            raise InputError("--shard-read reads a parquet file or folder: pass it with --data")
        if self.patience is not None and self.val_fraction == 0:
            raise InputError("--patience watches the validation loss: set --val-fraction above 0")
        if self.resume and self.overwrite:
            raise InputError("--resume continues the checkpoint, --overwrite discards it: pick one")
        if self.auto_resume and (self.resume or self.overwrite):
            other = "--resume" if self.resume else "--overwrite"
            raise InputError(
                f"--auto-resume continues a checkpoint of this job when there is one and "
                f"starts otherwise: leave out {other}"
            )
        for name in ("mlflow_experiment", "mlflow_run_name"):
            if getattr(self, name) is not None and not self.mlflow:
                option = "--" + name.replace("_", "-")
                raise InputError(f"{option} names what --mlflow logs to: add --mlflow")
        if self.model_args is not None and self.model is None:
            raise InputError("--model-args go to your own --model: name it with --model")
        self._check_loss()
        if self.elastic:
            self._check_elastic()

    def _check_loss(self) -> None:
        """A name that is no loss, or a regression loss for classes, before any data is read."""
        if self.loss is None or is_spec(self.loss):
            return
        if self.loss not in LOSS_NAMES:
            raise InputError(
                f"--loss {self.loss!r} is not one of {', '.join(LOSS_NAMES)} or MODULE:FN "
                "(your own)"
            )
        if self.task == Task.CLASSIFICATION:
            raise InputError(
                f"--loss {self.loss} is a regression loss; classification trains with "
                "cross-entropy (leave out --loss) or your own MODULE:FN"
            )

    def _check_elastic(self) -> None:
        """--elastic reshares rows and rescales the lr whenever ranks come or go, which only
        the default path does: one gradient average per step over Gloo, every rank all rows."""
        if self.shard_read:
            raise InputError(
                "--elastic shares the rows out again when ranks come and go, so every rank "
                "reads the whole file: leave out --shard-read"
            )
        if self.sync_every > 1:
            raise InputError("--elastic averages gradients every step: leave out --sync-every")
        if self.precision == "auto":
            raise InputError(
                "--elastic ranks start apart, so they cannot time a precision together: choose "
                "--precision fp32 or bf16"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain values (paths as strings), for checkpoints and the exported model."""
        return {
            k: str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v
            for k, v in asdict(self).items()
        }
