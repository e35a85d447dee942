"""The optimizer: Adam with its fused CPU kernel, built without importing torch's compiler.

Two costs, neither of which buys anything on a CPU job that never compiles (what each
measured: docs/measurements.md, "What was tried and what was kept"):
- torch imports torch._dynamo (and sympy) the first time an optimizer is built or steps, only
  to mark the optimizer's methods as "do not compile": a second of CPU per process, paid by
  every rank at launch.
- Adam's default (foreach) update takes about twice the fused kernel's time, which matters
  where a whole step of a small model is a fraction of a millisecond.
Skipping the import relies on how torch wraps Optimizer's methods and Adam.step. Both are
checked first: if a torch release changes them, `adam` quietly returns stock fused Adam, the
same updates with the import's cost back. tests/test_optim.py checks that the lean path is
taken on the installed torch (so such a release fails it), that the result equals stock
Adam's, and that torch._dynamo is never imported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.optimizer import Optimizer

# Where torch's `_disable_dynamo` wrapper caches what importing the compiler gives it, on the
# function it wraps; cached there, the wrapper calls it without the import.
DYNAMO_CACHE = "__dynamo_disable"
# The wrappers around Adam.step, by __qualname__, whose work Adam.step below does itself or
# gets anyway: grad mode (and compiler graph breaks, which import torch._dynamo), and the
# profiling hooks torch puts around the step of every optimizer class it builds.
STEP_WRAPPERS = frozenset(
    {
        "_use_grad_for_differentiable.<locals>._use_grad",
        "Optimizer.profile_hook_step.<locals>.wrapper",
    }
)


def dynamo_markers(optimizer: type = Optimizer) -> list[Callable[..., Any]] | None:
    """The functions under `optimizer`'s `_disable_dynamo` wrappers, if each such wrapper reads
    its cache from DYNAMO_CACHE; None if there is none, or one that does not."""
    found = []
    for method in vars(optimizer).values():
        code = getattr(method, "__code__", None)
        if code is None or "_disable_dynamo" not in code.co_qualname:
            continue
        wrapped = getattr(method, "__wrapped__", None)
        if wrapped is None or DYNAMO_CACHE not in code.co_consts:
            return None
        found.append(wrapped)
    return found or None


def plain_step(adam: type = torch.optim.Adam) -> Callable[..., Any] | None:
    """`adam.step` without its wrappers, if it has some and each is one of STEP_WRAPPERS;
    None otherwise (skipping a wrapper we do not know could skip what it does)."""
    step = adam.step
    while (wrapped := getattr(step, "__wrapped__", None)) is not None:
        code = getattr(step, "__code__", None)
        if code is None or code.co_qualname not in STEP_WRAPPERS:
            return None
        step = wrapped
    return None if step is adam.step else step


_MARKERS = dynamo_markers()
_PLAIN_STEP = plain_step()


class Adam(torch.optim.Adam):
    """torch.optim.Adam whose step never imports the compiler; `adam` builds it only when the
    checks above found what it relies on."""

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        with torch.no_grad():  # what the wrapper does when the optimizer is not differentiable
            return _PLAIN_STEP(self, closure)


def adam(parameters: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.Adam:
    """Adam with the fused CPU kernel (same defaults as torch.optim.Adam otherwise): the lean
    one above if this torch is wrapped as expected, else stock (only slower to start)."""
    if _MARKERS is None or _PLAIN_STEP is None:
        return torch.optim.Adam(parameters, lr=lr, fused=True)
    for function in _MARKERS:
        # What importing the compiler would cache there when nothing is being compiled.
        setattr(function, DYNAMO_CACHE, function)
    return Adam(parameters, lr=lr, fused=True)
