"""Files that must never be seen half-written, and the two kinds of model file hvd-cpu writes.

- `checkpoint.pt`: everything needed to continue training (model, optimizer, loop state,
  feature transformation, config), rewritten every --checkpoint-every epochs.
- `model.pt`: the exported artifact, everything `predict` needs and nothing more.

Both load with `torch.load(..., weights_only=True)`: plain containers and tensors, so loading
one never runs code.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from hvd_cpu.errors import InputError

CHECKPOINT = "checkpoint.pt"
MODEL = "model.pt"
MODEL_FORMAT = "hvd-cpu model 1"
_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write through a temporary file in the same folder, then rename it over `path`.

    A crash at any moment leaves either the old file or the new one, never a torn mix; the
    temporary files of earlier crashes are removed after the next successful write.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # as open() would create it, not mkstemp's 0600
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)


def save(obj: dict[str, Any], path: Path) -> None:
    """torch.save, atomically. A failed write (a full disk) comes out as the OSError it is:
    torch.save reports it as a RuntimeError from its zip writer."""
    try:
        atomic_write(path, lambda handle: torch.save(obj, handle))
    except RuntimeError as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, OSError):
            raise cause from exc
        raise


def load(path: Path, what: str, fix: str = "check the path") -> dict[str, Any]:
    """torch.load without code execution; a missing or damaged file is the user's to fix
    (`fix` says how, when it is missing)."""
    if not path.is_file():
        raise InputError(f"no {what} at {path}; {fix}")
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:
        raise InputError(
            f"cannot load the {what} {path}: {type(exc).__name__}: {exc}; it is damaged or "
            "was not written by hvd-cpu"
        ) from exc


CHECKPOINT_KEYS = ("model", "optimizer", "loop", "features", "config")
MODEL_KEYS = ("format", "state_dict", "features", "architecture")


def load_checkpoint(path: Path) -> dict[str, Any]:
    """checkpoint.pt for --resume: a file that loads but is not one (a model.pt, a tensor,
    another program's pickle) is refused here in one line, not half-used."""
    state = load(
        path,
        "checkpoint to resume",
        "leave out --resume to start a new run, or pass the --output of the run to continue",
    )
    if not isinstance(state, dict) or any(key not in state for key in CHECKPOINT_KEYS):
        raise InputError(
            f"{path} is not a checkpoint written by hvd-cpu train; resume from the output "
            "folder of an hvd-cpu run, or start again with --overwrite"
        )
    return state


def load_model_file(path: Path) -> dict[str, Any]:
    """The exported model: `path` is model.pt or the training's output folder."""
    if path.is_dir():
        path = path / MODEL
    artifact = load(
        path, "trained model", "pass --model the --output folder of hvd-cpu train, or its model.pt"
    )
    if (
        not isinstance(artifact, dict)
        or artifact.get("format") != MODEL_FORMAT
        or any(key not in artifact for key in MODEL_KEYS)
    ):
        raise InputError(
            f"{path} is not a model exported by hvd-cpu train; pass --model the --output "
            "folder of hvd-cpu train, or its model.pt"
        )
    return artifact
