"""The lean Adam: the same updates as torch.optim.Adam, without importing torch's compiler."""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hvd_cpu.model import optim
from hvd_cpu.model.optim import adam

from .jobs import REPO


def _train(optimizer_for, steps: int = 30) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = optimizer_for(model.parameters())
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model


def test_same_parameters_as_stock_fused_adam() -> None:
    ours = _train(lambda p: adam(p, lr=0.01))
    stock = _train(lambda p: torch.optim.Adam(p, lr=0.01, fused=True))
    for a, b in zip(ours.parameters(), stock.parameters(), strict=True):
        assert torch.equal(a, b)


def test_close_to_stock_foreach_adam() -> None:
    ours = _train(lambda p: adam(p, lr=0.01))
    stock = _train(lambda p: torch.optim.Adam(p, lr=0.01))
    for a, b in zip(ours.parameters(), stock.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_training_never_imports_the_compiler() -> None:
    """In a fresh process: build, step, save and load the optimizer, then look at sys.modules."""
    code = (
        "import sys, torch; from hvd_cpu.model.optim import adam; "
        "m = torch.nn.Linear(4, 1); o = adam(m.parameters(), 0.1); "
        "m(torch.randn(8, 4)).sum().backward(); o.step(); o.zero_grad(); "
        "o.load_state_dict(o.state_dict()); "
        "print('torch._dynamo' in sys.modules, o.state[m.weight]['step'].item())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "1.0"]


def test_the_lean_path_is_taken_on_the_installed_torch() -> None:
    """If a torch release wraps Optimizer or Adam.step differently, adam() falls back to stock
    Adam quietly (same updates, about 1 s more per rank at start): this fails so someone looks."""
    where = f"torch {torch.__version__}: see hvd_cpu/model/optim.py"
    assert optim.dynamo_markers() is not None, where
    assert optim.plain_step() is not None, where
    assert type(adam(torch.nn.Linear(2, 1).parameters(), lr=0.1)) is optim.Adam


def _disable_dynamo(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for a torch whose wrapper caches the compiler's answer under another name."""

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        return getattr(fn, "__compiled_away", fn)(*args, **kwargs)

    return inner


def _timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for a step wrapper optim.py does not know."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


class Unwrapped:
    def zero_grad(self) -> None: ...

    def step(self, closure: Any = None) -> None: ...


class OtherWrappers:
    @_disable_dynamo
    def zero_grad(self) -> None: ...

    @_timed
    def step(self, closure: Any = None) -> None: ...


@pytest.mark.parametrize("stand_in", [Unwrapped, OtherWrappers])
def test_the_checks_find_nothing_where_torch_is_wrapped_otherwise(stand_in: type) -> None:
    assert optim.dynamo_markers(stand_in) is None
    assert optim.plain_step(stand_in) is None


def test_without_the_internals_adam_is_stock_fused_adam(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(optim, "_PLAIN_STEP", optim.plain_step(OtherWrappers))
    built = adam(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    assert type(built) is torch.optim.Adam and built.defaults["fused"]
    ours = _train(lambda p: adam(p, lr=0.01))
    stock = _train(lambda p: torch.optim.Adam(p, lr=0.01, fused=True))
    for a, b in zip(ours.parameters(), stock.parameters(), strict=True):
        assert torch.equal(a, b)
