"""The gradient synchronisation strategies, one rank at a time, over a backend of our own
interface that counts what it is asked (the real backends are tests/test_collectives.py's;
whole jobs of each strategy are tests/test_jobs.py's, test_mpi.py's and test_speed.py's)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hvd_cpu.config.options import TrainConfig
from hvd_cpu.errors import InputError
from hvd_cpu.runtime.collectives import Alone
from hvd_cpu.runtime.horovod import World
from hvd_cpu.training import sync


class Counting(Alone):
    """The job of one, remembering each average asked for (its name and a copy of what it
    averaged); `in_calling_thread` as the test needs."""

    def __init__(self, in_calling_thread: bool = True) -> None:
        self.in_calling_thread = in_calling_thread
        self.averaged: list[tuple[str, torch.Tensor]] = []

    def average_(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        self.averaged.append((name, tensor.clone()))
        return tensor


def world_of(size: int, collectives: Alone) -> World:
    return World(0, size, 0, size, 1, collectives)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))


def backward(net: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 3, generator=generator), torch.randn(8, 1, generator=generator)
    nn.functional.mse_loss(net(x), y).backward()


def test_direct_averaging_averages_the_gradients_backward_wrote_in_one_buffer() -> None:
    """Step for step as plain SGD on the same model (the job of one's average is the gradient
    itself), each step's gradients carried by one collective, in parameter order."""
    net, reference, counting = model(), model(), Counting()
    strategy = sync.DirectAveraging(torch.optim.SGD(net.parameters(), lr=0.1), net, counting)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in (1, 2, 3):
        strategy.zero_grad()
        backward(net, step)
        plain.zero_grad()
        backward(reference, step)
        strategy.step(step)
        plain.step()
        name, carried = counting.averaged[-1]
        grads = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
        assert name == "gradients" and torch.equal(carried, grads)
    assert len(counting.averaged) == 3
    for ours, theirs in zip(net.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)


def test_direct_averaging_refuses_parameters_of_two_dtypes() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1).double())
    with pytest.raises(InputError, match="one dtype"):
        sync.DirectAveraging(torch.optim.SGD(net.parameters(), lr=0.1), net, Counting())


def test_local_sgd_averages_the_parameters_every_k_steps_and_at_the_epoch_end() -> None:
    net, counting = model(), Counting()
    strategy = sync.LocalSGD(torch.optim.SGD(net.parameters(), lr=0.1), net, counting, every=3)
    waits = []
    for step in range(1, 8):
        strategy.zero_grad()
        backward(net, step)
        waits.append(strategy.step(step))
    assert [name for name, _ in counting.averaged] == ["average_parameters"] * 2  # steps 3, 6
    assert [wait > 0 for wait in waits] == [False, False, True, False, False, True, False]
    strategy.end_epoch()
    flat = torch.nn.utils.parameters_to_vector(net.parameters())
    assert torch.equal(counting.averaged[-1][1], flat.detach())
    assert not strategy.global_batch_steps  # its lr is not scaled with the ranks


@pytest.mark.parametrize(
    ("options", "size", "expected"),
    [
        ({"sync_every": 4}, 2, sync.LocalSGD),
        ({"allreduce": "direct"}, 2, sync.DirectAveraging),
        ({"sync_every": 4, "allreduce": "direct"}, 2, sync.LocalSGD),
    ],
)
def test_the_options_choose_the_strategy(options: dict, size: int, expected: type) -> None:
    net = model()
    chosen = sync.choose(
        TrainConfig(**options), torch.optim.SGD(net.parameters(), lr=0.1), net,
        world_of(size, Counting()),
    )  # fmt: skip
    assert type(chosen) is expected


def test_the_direct_allreduce_needs_a_backend_that_runs_in_the_calling_thread() -> None:
    net = model()
    with pytest.raises(InputError, match="--allreduce direct needs the MPI controller"):
        sync.choose(
            TrainConfig(allreduce="direct"), torch.optim.SGD(net.parameters(), lr=0.1), net,
            world_of(2, Counting(in_calling_thread=False)),
        )  # fmt: skip
