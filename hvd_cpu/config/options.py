"""Training options, shared by the CLI and the Python API so both mean the same thing."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from hvd_cpu.data.formats import FORMATS
from hvd_cpu.errors import InputError
from hvd_cpu.model.user_code import is_spec

# The demo frame used when no --data is given: small enough that ten epochs over four ranks
# on two cores take seconds, and that the loss still falls in each of them (on 20 000 rows the
# seed's model reaches the noise floor in two epochs and then only jitters).
DEMO_ROWS = 2048
DEMO_FEATURES = 16
# Seeds feed numpy (non-negative) and torch (seed x 1_000_003 + epoch < 2**64).
SEED_MAX = 2**32 - 1
# Horovod's two controllers, as the summary and bench name them.
CONTROLLER_NAMES = {"mpi": "MPI", "gloo": "Gloo"}


def steps_use_horovod(allreduce: str, sync_every: int) -> bool:
    """Whether training steps go through Horovod (its DistributedOptimizer); when none does,
    Horovod's background thread can cycle slowly (dist.IDLE_CYCLE_MS)."""
    return allreduce == "horovod" and sync_every == 1


# --loss by name (losses.py builds them); anything with a ":" is the user's MODULE:FN.
LOSS_NAMES = ("mse", "l1", "huber")

# The options with a fixed set of values (the command line's choices; fit() passes anything).
CHOICES = {
    "task": ("regression", "classification"),
    "activation": ("none", "relu", "gelu"),
    "allreduce": ("horovod", "direct"),
    "format": (None, *FORMATS),
}


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training job needs; each rank builds the same one from the same options."""

    # the data
    data: Path | None = None  # None: the generated demo frame
    format: str | None = None  # None: from the file's extension
    targets: tuple[str, ...] = ("target",)
    features: tuple[str, ...] | None = None  # None: every column but the targets and --drop
    drop: tuple[str, ...] = ()
    task: Literal["regression", "classification"] = "regression"
    max_categories: int = 32
    standardize_target: bool = False
    shard_read: bool = False  # each rank reads only its row groups of a parquet file
    # the model
    model: str | None = None  # "package.module:Class" or "file.py:Class"; None: the MLP below
    model_args: dict[str, Any] | None = None  # more keyword arguments for --model
    hidden: tuple[int, ...] = (32,)
    activation: Literal["none", "relu", "gelu"] = "none"
    # the optimisation
    loss: str | None = None  # a LOSS_NAMES or "module:fn"; None: MSE, or cross-entropy
    epochs: int = 10
    batch_size: int = 64  # per rank; the global batch is batch_size x world size
    lr: float = 1e-3  # Adam's default, before scaling by the world size
    scale_lr: bool = True  # Horovod's convention: lr x size, since the global batch grows
    shuffle: bool = True
    warmup_epochs: int = 0  # lr rises from lr to lr x size over these epochs
    plateau_patience: int | None = None  # halve the lr after this many epochs without progress
    seed: int = 0
    threads: int | None = None  # per rank; None: usable cores / ranks on this host
    # 1: average gradients every step (synchronous, as one process with the global batch).
    # K > 1: local SGD, each rank steps on its own and parameters are averaged every K steps
    # and at the end of each epoch: K times fewer waits for the other ranks.
    sync_every: int = 1
    # How gradients are averaged every step: "horovod", hvd.DistributedOptimizer (Horovod's
    # background thread, either controller); "direct", one MPI_Allreduce of all gradients in
    # the training thread (MPI controller only: much less per-step overhead, see README).
    allreduce: Literal["horovod", "direct"] = "horovod"
    # Horovod's elastic mode: ranks may die or join, training goes on (launch/elastic.sh).
    elastic: bool = False
    commit_every: int = 100  # --elastic: steps between in-memory commits (what a failure loses)
    max_restarts: int = 3  # --elastic: lost ranks to go on after; one more ends the job
    # validation and stopping
    val_fraction: float = 0.1  # held out (by seed) and sharded across ranks; 0: none
    patience: int | None = None  # stop after this many epochs without a better validation loss
    # output
    output: Path = Path("runs/hvd-cpu")
    checkpoint_every: int = 1  # epochs between checkpoints
    resume: bool = False
    overwrite: bool = False
    progress: bool | None = None  # None: a progress bar when stdout is a terminal
    quiet: bool = False
    # experiment tracking, by rank 0 only (tracking.py; the tracking extra)
    tensorboard: Path | None = None  # a folder for the job's one TensorBoard event file
    mlflow: bool = False  # one MLflow run per job, on the server of MLFLOW_TRACKING_URI
    # None: MLFLOW_EXPERIMENT_NAME if set, else "hvd-cpu" (made if missing)
    mlflow_experiment: str | None = None
    mlflow_run_name: str | None = None  # None: a name MLflow makes up

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

    def __post_init__(self) -> None:
        counts = (
            "epochs",
            "batch_size",
            "max_categories",
            "checkpoint_every",
            "sync_every",
            "commit_every",
        )
        for name in counts:
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_restarts < 0:
            raise InputError(f"max_restarts must be at least 0, got {self.max_restarts}")
        if not 0 <= self.seed <= SEED_MAX:
            raise InputError(f"--seed must be between 0 and {SEED_MAX}, got {self.seed}")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise InputError(
                    f"{name} must be one of {', '.join(map(repr, allowed))}, "
                    f"got {getattr(self, name)!r}"
                )
        if self.lr <= 0:
            raise InputError(f"lr must be positive, got {self.lr}")
        if self.threads is not None and self.threads < 1:
            raise InputError(f"threads must be at least 1, got {self.threads}")
        if not self.targets:
            raise InputError("name at least one --target column")
        if any(size < 1 for size in self.hidden):
            raise InputError(f"hidden layer sizes must be at least 1, got {self.hidden}")
        if self.shard_read and self.data is None:
            raise InputError("--shard-read reads a parquet file or folder: pass it with --data")
        if not 0 <= self.val_fraction < 1:
            raise InputError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.patience is not None and self.val_fraction == 0:
            raise InputError("--patience watches the validation loss: set --val-fraction above 0")
        if self.resume and self.overwrite:
            raise InputError("--resume continues the checkpoint, --overwrite discards it: pick one")
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
        if self.task == "classification":
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
        if self.allreduce == "direct":
            raise InputError(
                "--elastic runs over Gloo and --allreduce direct needs MPI: leave out one of them"
            )

    @property
    def horovod_steps(self) -> bool:
        return steps_use_horovod(self.allreduce, self.sync_every)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (paths as strings), for checkpoints and the exported model."""
        return {
            k: str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v
            for k, v in asdict(self).items()
        }
