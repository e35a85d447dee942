"""The loss: built in by name (--loss mse|l1|huber), or the user's own (--loss MODULE:FN)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hvd_cpu.config.options import LOSS_NAMES, Task
from hvd_cpu.config.values import is_spec
from hvd_cpu.errors import InputError
from hvd_cpu.model.user_code import import_object

# Regression losses by name. Huber is squared near zero and linear past delta 1 (in the
# target's units, or in standard deviations with --standardize-target): tabular targets with
# outliers (a delay in minutes) move the model less than under MSE. The names are config's
# (it checks them without importing torch); strict: a name without a loss fails here.
REGRESSION_LOSSES: dict[str, Callable[[], nn.Module]] = dict(
    zip(LOSS_NAMES, (nn.MSELoss, nn.L1Loss, nn.HuberLoss), strict=True)
)

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_loss(loss: str | None, task: str) -> Loss:
    """The loss to train and validate with: the named or the user's, else MSE for regression
    and cross-entropy for classification."""
    if loss is None:
        return nn.CrossEntropyLoss() if task == Task.CLASSIFICATION else nn.MSELoss()
    if not is_spec(loss):
        return REGRESSION_LOSSES[loss]()
    found = import_object(loss, "--loss")
    if isinstance(found, type):  # a loss class such as torch.nn:SmoothL1Loss
        if not issubclass(found, nn.Module):
            raise InputError(f"--loss {loss!r}: {found.__name__} is not a torch.nn.Module class")
        try:
            return found()
        except Exception as exc:
            raise InputError(
                f"--loss {loss!r}: {found.__name__}() failed: {type(exc).__name__}: {exc}; "
                "a loss class must build without arguments (or pass a function)"
            ) from exc
    if not callable(found):
        raise InputError(f"--loss {loss!r} names a {type(found).__name__}, not a function")
    return found


def check_loss(loss_fn: Loss, spec: str, output: torch.Tensor, target: torch.Tensor) -> None:
    """Call the user's loss once on the model's own output, before training: it must give
    one number that gradients flow back from (the batch's mean, as torch's losses do)."""
    try:
        value = loss_fn(output, target)
    except Exception as exc:
        raise InputError(
            f"--loss {spec!r} failed on an output of shape {tuple(output.shape)} and targets "
            f"of shape {tuple(target.shape)} ({target.dtype}): {type(exc).__name__}: {exc}; "
            "it is called as fn(output, target)"
        ) from exc
    if not (isinstance(value, torch.Tensor) and value.numel() == 1 and value.requires_grad):
        got = (
            f"a tensor of shape {tuple(value.shape)}"
            + ("" if value.requires_grad else " that no gradient flows back from")
            if isinstance(value, torch.Tensor)
            else f"a {type(value).__name__}"
        )
        raise InputError(
            f"--loss {spec!r} returned {got}; return one number computed from the output "
            "(the batch's mean, e.g. ((output - target) ** 2).mean())"
        )
