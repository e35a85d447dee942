"""The two kinds of model file hvd-cpu writes, and the one place that knows their keys.

- `checkpoint.pt`: everything needed to continue training (model, optimizer, loop state,
  feature transformation, config), rewritten every --checkpoint-every epochs.
- `model.pt`: the exported artifact, everything `predict` needs and nothing more.

Both are plain dicts of containers and tensors on disk, loaded with
`torch.load(..., weights_only=True)`: loading one never runs code, and the runs of earlier
versions load as they are. In memory they are the records below, so no caller spells a key.
A model.pt whose model is the user's own code also records the sha256 of that code's file,
and seals its architecture with this user's key (output/seal.py): what predict may run of it
is decided in output/model_code.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hvd_cpu.atomic import atomic_write
from hvd_cpu.errors import InputError
from hvd_cpu.model.code_source import recorded_sha256
from hvd_cpu.model.user_code import portable_spec
from hvd_cpu.output import seal

if TYPE_CHECKING:
    from torch import nn

    from hvd_cpu.config.options import TrainConfig
    from hvd_cpu.data.features import FeatureTransform

CHECKPOINT = "checkpoint.pt"
MODEL = "model.pt"
MODEL_FORMAT = "hvd-cpu model 1"


def load(path: Path, what: str, fix: str = "check the path") -> Any:
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


def _save(obj: dict[str, Any], path: Path) -> None:
    """torch.save, atomically. A failed write (a full disk) comes out as the OSError it is:
    torch.save reports it as a RuntimeError from its zip writer."""
    try:
        atomic_write(path, lambda handle: torch.save(obj, handle))
    except RuntimeError as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, OSError):
            raise cause from exc
        raise


def _missing(saved: Any, record: type, optional: tuple[str, ...] = ()) -> bool:
    """Whether `saved` is not a dict holding every required field of `record`."""
    required = [f.name for f in fields(record) if f.name not in optional]
    return not isinstance(saved, dict) or any(name not in saved for name in required)


@dataclass
class Checkpoint:
    """Everything --resume needs: the state that changes while training (what an elastic
    commit keeps in memory too), and the features and options it was trained with."""

    model: dict[str, Any]  # the model's state_dict
    optimizer: dict[str, Any]  # the optimizer's state_dict
    loop: dict[str, Any]  # train.LoopState, as a dict
    features: dict[str, Any]  # FeatureTransform.to_dict()
    config: dict[str, Any]  # TrainConfig.to_dict()

    def to_dict(self) -> dict[str, Any]:
        """The file's contents (not dataclasses.asdict, which would copy every tensor)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, saved: Any, path: Path) -> Checkpoint:
        """A file that loads but is not a checkpoint (a model.pt, a tensor, another program's
        pickle) is refused here in one line, not half-used."""
        if _missing(saved, cls):
            raise InputError(
                f"{path} is not a checkpoint written by hvd-cpu train; resume from the output "
                "folder of an hvd-cpu run, or start again with --overwrite"
            )
        return cls(**{f.name: saved[f.name] for f in fields(cls)})

    def save(self, path: Path) -> None:
        _save(self.to_dict(), path)

    @classmethod
    def load(cls, path: Path) -> Checkpoint:
        saved = load(
            path,
            "checkpoint to resume",
            "leave out --resume to start a new run, or pass the --output of the run to continue",
        )
        return cls.from_dict(saved, path)


@dataclass
class ModelFile:
    """The exported model: its weights and what predict needs to rebuild it and its inputs."""

    state_dict: dict[str, Any]
    features: dict[str, Any]  # FeatureTransform.to_dict()
    # The MLP's numbers, or the user's code (its spec, its file's code_sha256), its arguments.
    architecture: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)  # the training's options, for people
    seal: str = ""  # seal.seal(architecture) when it names code; "" before seals, or none made

    @classmethod
    def export(
        cls, config: TrainConfig, model: nn.Module, transform: FeatureTransform
    ) -> ModelFile:
        spec = config.model and portable_spec(config.model)
        architecture = {
            "model": spec,
            "model_args": config.model_args,
            "hidden": list(config.hidden),
            "activation": config.activation,
            "n_features": transform.n_features,
            "n_outputs": transform.n_outputs,
        }
        if spec:
            architecture["code_sha256"] = recorded_sha256(spec)
        return cls(
            state_dict=model.state_dict(),
            features=transform.to_dict(),
            architecture=architecture,
            config=config.to_dict(),
            seal=seal.seal(architecture) if spec else "",
        )

    def sealed(self) -> bool:
        """Whether one of this user's runs recorded this architecture (seal.py)."""
        return seal.verify(self.architecture, self.seal)

    def to_dict(self) -> dict[str, Any]:
        """The file's contents; the MLP's, with no code to seal, as earlier versions wrote."""
        saved = {"format": MODEL_FORMAT, **{f.name: getattr(self, f.name) for f in fields(self)}}
        if not self.seal:
            del saved["seal"]
        return saved

    @classmethod
    def from_dict(cls, saved: Any, path: Path) -> ModelFile:
        """Refuse, in one line, a file that loads but was not exported by hvd-cpu train."""
        if (
            _missing(saved, cls, optional=("config", "seal"))
            or saved.get("format") != MODEL_FORMAT
            or not isinstance(saved["architecture"], dict)
        ):
            raise InputError(
                f"{path} is not a model exported by hvd-cpu train; pass --model the --output "
                "folder of hvd-cpu train, or its model.pt"
            )
        return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved})

    def save(self, path: Path) -> None:
        _save(self.to_dict(), path)

    @classmethod
    def load(cls, path: Path) -> ModelFile:
        """`path` is model.pt or the training's output folder."""
        if path.is_dir():
            path = path / MODEL
        saved = load(
            path,
            "trained model",
            "pass --model the --output folder of hvd-cpu train, or its model.pt",
        )
        return cls.from_dict(saved, path)
