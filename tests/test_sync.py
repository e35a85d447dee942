"""The gradient synchronisation strategies, one rank at a time, over a backend of our own
interface that counts what it is asked (the real backends are tests/test_collectives.py's;
whole jobs of each strategy are tests/test_jobs.py's, test_mpi.py's and test_speed.py's)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hvd_cpu.config.options import TrainConfig
from hvd_cpu.errors import InputError
from hvd_cpu.runtime import join
from hvd_cpu.runtime.alone import Alone
from hvd_cpu.runtime.world import SHARED_MEMORY, World
from hvd_cpu.training import sync


class Halving(Alone):
    """A job whose "other ranks" all hold zeros, of any size: each average halves the tensor in
    place (what two ranks give when the other's part is zero), so a strategy that averages a
    copy, or steps before it averages, ends elsewhere. It remembers each average asked for
    (its name and what it was given); `in_calling_thread` as the test needs."""

    def __init__(self, in_calling_thread: bool = True) -> None:
        self.in_calling_thread = in_calling_thread
        self.averaged: list[tuple[str, torch.Tensor]] = []

    def average_(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        self.averaged.append((name, tensor.clone()))
        return tensor.mul_(0.5)


def world_of(size: int, collectives: Alone) -> World:
    """A job of `size` over `collectives`: with a backend that runs in the calling thread,
    MPI's; otherwise Gloo's over TCP."""
    mpi = collectives.in_calling_thread
    controller, transport = ("mpi", "") if mpi else ("gloo", "TCP (turned off)")
    return World(0, size, 0, size, 1, collectives, controller, transport)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))


def backward(net: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 3, generator=generator), torch.randn(8, 1, generator=generator)
    nn.functional.mse_loss(net(x), y).backward()


def test_direct_averaging_steps_on_the_average_of_the_gradients_backward_wrote() -> None:
    """Step for step as plain SGD on half the gradients (what Halving's average gives), each
    step's gradients carried by one collective, in parameter order."""
    net, reference, halving = model(), model(), Halving()
    strategy = sync.DirectAveraging(torch.optim.SGD(net.parameters(), lr=0.1), net, halving)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in (1, 2, 3):
        strategy.zero_grad()
        backward(net, step)
        plain.zero_grad()
        backward(reference, step)
        strategy.step(step)
        name, carried = halving.averaged[-1]
        grads = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
        assert name == "gradients" and torch.equal(carried, grads)
        for p in reference.parameters():
            p.grad.mul_(0.5)
        plain.step()
    assert len(halving.averaged) == 3
    for ours, theirs in zip(net.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)


class Mixed(nn.Module):
    """Parameters of three dtypes, one of which (bfloat16) MPI cannot sum."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 4).double()
        self.c = nn.Linear(4, 1).bfloat16()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x).double()).bfloat16()).float()


def test_direct_averaging_carries_each_dtype_in_a_buffer_of_its_own() -> None:
    """One collective per dtype; bfloat16 travels as float32 (MPI has no sum of it) and comes
    back into the gradients backward wrote."""
    net, reference, halving = Mixed(), Mixed(), Halving()
    strategy = sync.DirectAveraging(torch.optim.SGD(net.parameters(), lr=0.0), net, halving)
    strategy.zero_grad()
    backward(net, 1)
    backward(reference, 1)
    strategy.step(1)
    assert [given.dtype for _, given in halving.averaged] == [
        torch.float32, torch.float64, torch.float32
    ]  # fmt: skip
    for ours, theirs in zip(net.parameters(), reference.parameters(), strict=True):
        assert ours.grad.dtype == theirs.dtype
        assert torch.equal(ours.grad, theirs.grad * 0.5)


def test_local_sgd_averages_the_parameters_every_k_steps_and_at_the_epoch_end() -> None:
    net, halving = model(), Halving()
    strategy = sync.LocalSGD(torch.optim.SGD(net.parameters(), lr=0.1), net, halving, every=3)
    waits = []
    for step in range(1, 8):
        strategy.zero_grad()
        backward(net, step)
        before_step = torch.nn.utils.parameters_to_vector(net.parameters()).detach().clone()
        waits.append(strategy.step(step))
        after = torch.nn.utils.parameters_to_vector(net.parameters()).detach()
        if step % 3 == 0:  # averaged after this step: what was averaged is in the parameters
            name, given = halving.averaged[-1]
            assert name == "average_parameters" and not torch.equal(given, before_step)
            assert torch.equal(after, given * 0.5)
    assert len(halving.averaged) == 2  # steps 3 and 6
    assert [wait > 0 for wait in waits] == [False, False, True, False, False, True, False]
    before = torch.nn.utils.parameters_to_vector(net.parameters()).detach().clone()
    strategy.end_epoch()
    assert torch.equal(torch.nn.utils.parameters_to_vector(net.parameters()), before * 0.5)
    assert not strategy.global_batch_steps  # its lr is not scaled with the ranks
    assert strategy.described == "parameters averaged every 3 steps"


@pytest.mark.parametrize(
    ("options", "size", "expected"),
    [
        ({}, 2, sync.DirectAveraging),  # auto, under MPI
        ({"sync_every": 4}, 2, sync.LocalSGD),
        ({"allreduce": "direct"}, 2, sync.DirectAveraging),
        ({"sync_every": 4, "allreduce": "direct"}, 2, sync.LocalSGD),
    ],
)
def test_the_options_choose_the_strategy(options: dict, size: int, expected: type) -> None:
    """Under MPI (a backend that runs in the calling thread); the summary says why."""
    net, config = model(), TrainConfig(**options)
    chosen = sync.choose(
        config, torch.optim.SGD(net.parameters(), lr=0.1), net, world_of(size, Halving())
    )
    assert type(chosen) is expected
    if expected is sync.DirectAveraging:
        why = "--allreduce direct" if options else "auto: the fastest under MPI"
        assert chosen.described == f"gradients averaged by one allreduce per step ({why})"


@pytest.mark.parametrize(
    ("requested", "controller", "allreduce"),
    [
        ("auto", "mpi", "direct"),
        ("auto", "gloo", "direct"),  # through shared memory (our build)
        ("auto", None, "horovod"),  # Gloo over TCP: the card's DistributedOptimizer
        ("horovod", "mpi", "horovod"),
        ("direct", None, "direct"),  # asked for: choose() refuses it in one line
    ],
)
def test_auto_is_direct_where_there_is_one_else_horovods_optimizer(
    requested: str, controller: str | None, allreduce: str
) -> None:
    # Gloo through shared memory has a backend that runs in the calling thread, as MPI's.
    transport = {"mpi": "", "gloo": SHARED_MEMORY, None: "TCP (why)"}[controller]
    in_calling_thread = controller is not None
    world = World(0, 2, 0, 2, 1, Halving(in_calling_thread), controller or "gloo", transport)
    averaging = sync.averaging(requested, world)
    assert averaging.allreduce == allreduce
    assert averaging.why.startswith("auto: " if requested == "auto" else f"--allreduce {requested}")
    if requested == "auto" and controller is None:
        assert averaging.why == "auto: no direct allreduce (Gloo over TCP (why))"


def test_the_direct_allreduce_needs_a_backend_that_runs_in_the_calling_thread() -> None:
    net = model()
    with pytest.raises(InputError, match="--allreduce direct needs MPI or Gloo through shared"):
        sync.choose(
            TrainConfig(allreduce="direct"), torch.optim.SGD(net.parameters(), lr=0.1), net,
            world_of(2, Halving(in_calling_thread=False)),
        )  # fmt: skip


def test_a_job_of_one_takes_horovods_optimizer_whatever_the_options() -> None:
    """And its collectives are the job of one's: nothing goes through Horovod's cycle."""
    world = join.init(threads=1)
    assert world.size == 1 and type(world.collectives) is Alone
    for options in ({}, {"sync_every": 4}, {"allreduce": "direct"}):
        net = model()
        chosen = sync.choose(
            TrainConfig(**options), torch.optim.SGD(net.parameters(), lr=0.1), net, world
        )
        assert type(chosen) is sync.HorovodAveraging
        assert chosen.described == "gradients averaged by hvd.DistributedOptimizer"
