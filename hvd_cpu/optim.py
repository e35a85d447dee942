"""The optimizer: Adam with its fused CPU kernel, built without importing torch's compiler.

Two measured costs, neither of which buys anything on a CPU job that never compiles:
- torch imports torch._dynamo (and sympy) the first time an optimizer is built or steps, only
  to mark the optimizer's methods as "do not compile": about 1 s of CPU per process, paid by
  every rank at launch (4 ranks on 2 cores wait about 2 s for it).
- Adam's default (foreach) update takes 0.18 ms per step of the seed's MLP; the fused kernel
  takes 0.08 ms, a third of the whole step at batch 64.
The updates are the same arithmetic; tests/test_optim.py checks that the result equals stock
Adam's and that torch._dynamo is never imported.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.optimizer import Optimizer


def _skip_dynamo_markers() -> None:
    """Let Optimizer's methods run without importing torch._dynamo.

    torch wraps them in `_disable_dynamo`, which imports the compiler on the first call and
    caches its result on the wrapped function as `__dynamo_disable`. Caching the function itself
    there is what that import would produce when nothing is being compiled.
    """
    for method in vars(Optimizer).values():
        wrapped = getattr(method, "__wrapped__", None)
        code = getattr(method, "__code__", None)
        if wrapped is not None and code is not None and "_disable_dynamo" in code.co_qualname:
            setattr(wrapped, "__dynamo_disable", wrapped)


def _plain_adam_step() -> Callable[..., Any] | None:
    """Adam.step without its wrappers (a profiling hook, and one that imports torch._dynamo to
    put compiler graph breaks around a no_grad step); None if a future torch has none."""
    plain = inspect.unwrap(torch.optim.Adam.step)
    return None if plain is torch.optim.Adam.step else plain


_PLAIN_ADAM_STEP = _plain_adam_step()


class Adam(torch.optim.Adam):
    """torch.optim.Adam whose step never imports the compiler."""

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        if _PLAIN_ADAM_STEP is None:
            return super().step(closure)
        with torch.no_grad():  # what the wrapper does when the optimizer is not differentiable
            return _PLAIN_ADAM_STEP(self, closure)


def adam(parameters: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.Adam:
    """Adam with the fused CPU kernel (same defaults as torch.optim.Adam otherwise)."""
    _skip_dynamo_markers()
    return Adam(parameters, lr=lr, fused=True)
