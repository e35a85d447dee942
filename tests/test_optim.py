"""The lean Adam: the same updates as torch.optim.Adam, without importing torch's compiler."""

from __future__ import annotations

import subprocess
import sys

import torch

from hvd_cpu.optim import adam

from .conftest import REPO


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
        "import sys, torch; from hvd_cpu.optim import adam; "
        "m = torch.nn.Linear(4, 1); o = adam(m.parameters(), 0.1); "
        "m(torch.randn(8, 4)).sum().backward(); o.step(); o.zero_grad(); "
        "o.load_state_dict(o.state_dict()); "
        "print('torch._dynamo' in sys.modules, o.state[m.weight]['step'].item())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "1.0"]
