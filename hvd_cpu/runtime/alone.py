"""The job of one's collectives: a plain process, or a rank preparing alone under --elastic,
exchanges nothing (each collective through Horovod's background thread would cost a hand-over
to it and back, and a fit makes dozens)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from hvd_cpu.runtime.collectives import Collectives

T = TypeVar("T")


class Alone(Collectives):
    """The job of one: every collective is this process's own value."""

    in_calling_thread = True

    def sum(self, values: torch.Tensor, name: str) -> torch.Tensor:
        return values.clone()

    def average_(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return tensor

    def broadcast_(self, tensors: Mapping[str, torch.Tensor]) -> None:
        pass

    def broadcast_object(self, obj: Any, name: str) -> Any:
        return obj

    def gather(self, obj: Any, name: str) -> list[Any]:
        return [obj]

    def agreed(self, step: Callable[[], T]) -> T:
        return step()  # nobody to agree with: the error goes up as it is
