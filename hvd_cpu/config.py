"""Training options, shared by the CLI and the Python API so both mean the same thing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hvd_cpu.errors import InputError

# The demo frame used when no --data is given: small enough that ten epochs over four ranks
# on two cores take seconds, and that the loss still falls in each of them (on 20 000 rows the
# seed's model reaches the noise floor in two epochs and then only jitters).
DEMO_ROWS = 2048
DEMO_FEATURES = 16


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training job needs; each rank builds the same one from the same options."""

    data: Path | None = None  # None: the generated demo frame
    target: str = "target"
    epochs: int = 10
    batch_size: int = 64  # per rank; the global batch is batch_size x world size
    lr: float = 1e-3  # Adam's default, before scaling by the world size
    scale_lr: bool = True  # Horovod's convention: lr x size, since the global batch grows
    shuffle: bool = True
    seed: int = 0
    threads: int | None = None  # per rank; None: usable cores / ranks on this host
    output: Path = Path("runs/hvd-cpu")

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise InputError(f"lr must be positive, got {self.lr}")
        if self.threads is not None and self.threads < 1:
            raise InputError(f"threads must be at least 1, got {self.threads}")
