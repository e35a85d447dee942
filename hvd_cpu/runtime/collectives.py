"""What the ranks exchange (statistics, metrics, state, errors, and the gradients or parameters
of the strategies that average them themselves: training/sync.py): one interface, one object
per backend, chosen once when a rank joins the job and held by its `World`.

Backends, one module each: Horovod's collectives (runtime/horovod.py; under Gloo they are all
there is, through shared memory from the calling thread where our build has it), an mpi4py
communicator beside Horovod (runtime/mpi.py; from the calling thread, without Horovod's
background thread) and `Alone`, the job of one (runtime/alone.py: a plain process, a rank
preparing alone under --elastic). A new backend is one new subclass, chosen in
runtime/join.py's `_backend`.
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np
import torch

from hvd_cpu.errors import InputError

T = TypeVar("T")


class Collectives(ABC):
    """Collectives over every rank of the job. `name` must be the same on every rank (Horovod
    matches collectives by name); backends that match by order ignore it."""

    # Whether a collective runs in the calling thread, at once (what --allreduce direct needs),
    # rather than on a background thread.
    in_calling_thread = False
    # How many collectives this rank has entered, and how many it is inside now, where they
    # are counted (`Counted`).
    entered = 0
    inside = 0

    def wait_for_others(self, step: Callable[..., T], *args: Any) -> T:
        """`step(*args)`, a wait for the other ranks made outside these methods (Horovod's
        optimizer step), counted as a collective where they are counted."""
        return step(*args)

    @abstractmethod
    def sum(self, values: torch.Tensor, name: str) -> torch.Tensor:
        """A new tensor: the element-wise sum of `values` over all ranks (metrics, counts)."""

    @abstractmethod
    def average_(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """`tensor` (contiguous) replaced in place by its mean over all ranks."""

    @abstractmethod
    def broadcast_(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Each of `tensors` (a state_dict) replaced in place by rank 0's."""

    @abstractmethod
    def broadcast_object(self, obj: Any, name: str) -> Any:
        """Rank 0's object on every rank (other ranks pass anything, typically None)."""

    @abstractmethod
    def gather(self, obj: Any, name: str) -> list[Any]:
        """Every rank's object, in rank order, on every rank."""

    def sum_numbers(self, values: np.ndarray) -> np.ndarray:
        """`sum` for the statistics of a fit (data/features.py): float64 arrays."""
        tensor = torch.from_numpy(np.array(values, dtype=np.float64))
        return self.sum(tensor, "statistics").numpy()

    def agree_on_error(self, message: str | None, kind: type[Exception] = InputError) -> None:
        """Raise the same error (InputError, or `kind`) on every rank if any rank found one.

        Every rank calls this once after reading its input, so a problem seen by one rank only
        (a file missing on one host) ends all ranks instead of leaving them in a collective.
        """
        reports = self.gather((socket.gethostname(), message), "agree_on_error")
        failed = [(rank, host, text) for rank, (host, text) in enumerate(reports) if text]
        if failed:
            rank, host, text = failed[0]
            everywhere = len(failed) == len(reports)
            raise kind(text if everywhere else f"on rank {rank} ({host}): {text}")

    def agreed(self, step: Callable[[], T]) -> T:
        """Run a step on every rank; bad input on any rank ends every rank here, together."""
        error, value = None, None
        try:
            value = step()
        except InputError as exc:
            error = str(exc)
        self.agree_on_error(error)
        return value  # type: ignore[return-value]


class Counted(Collectives):
    """Another backend's collectives, counted as this rank enters them: how far the rank has
    come, and whether it waits inside one now. Every rank enters the same collectives in the
    same order, so a rank behind the others, and not inside one, is the one they wait for
    (runtime/watchdog.py names it if it does not move on). Inside one, a rank may be behind
    and still waiting: MPI lets some ranks leave a collective before others can."""

    def __init__(self, backend: Collectives) -> None:
        self.backend = backend
        self.in_calling_thread = backend.in_calling_thread
        self.entered = 0
        self.inside = 0

    def wait_for_others(self, step: Callable[..., T], *args: Any) -> T:
        self.entered += 1
        self.inside += 1
        try:
            return step(*args)
        finally:
            self.inside -= 1

    def sum(self, values: torch.Tensor, name: str) -> torch.Tensor:
        return self.wait_for_others(self.backend.sum, values, name)

    def average_(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return self.wait_for_others(self.backend.average_, tensor, name)

    def broadcast_(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.wait_for_others(self.backend.broadcast_, tensors)

    def broadcast_object(self, obj: Any, name: str) -> Any:
        return self.wait_for_others(self.backend.broadcast_object, obj, name)

    def gather(self, obj: Any, name: str) -> list[Any]:
        return self.wait_for_others(self.backend.gather, obj, name)
