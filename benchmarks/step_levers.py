"""Two levers for compute-bound models, measured against hvd-cpu's direct allreduce on one
step of the wide MLP (3 hidden layers of 512, 525 k parameters, one thread per rank):

- overlap: gradient buckets averaged by non-blocking MPI allreduces started from gradient
  hooks as backward produces them (as DDP does), progressed from the later hooks;
- ZeRO-1: gradients reduce-scattered, each rank's Adam on its 1/N of the parameters, the
  parameters all-gathered (as torch's ZeroRedundancyOptimizer does).

Each rank times its steps (backward, averaging, Adam), alternated in rounds; the parameters
each lever ends with are compared with the direct path's. Neither paid here (see
docs/measurements.md), so neither is in hvd-cpu.

Usage (from the repository, after launch/install.sh):
    mpirun -np 2 .venv/bin/python benchmarks/step_levers.py [--batch 128] [--steps 300]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from mpi4py import MPI
from torch import nn

from hvd_cpu.model.networks import Network
from hvd_cpu.model.optim import adam

COMM = MPI.COMM_WORLD


def wide() -> nn.Module:
    torch.manual_seed(0)
    return Network(16, (512, 512, 512), 1, "relu")


def flat_grads(params: list[nn.Parameter], padded_to: int = 1) -> torch.Tensor:
    """One buffer every .grad is a view of (backward accumulates into it)."""
    total = sum(p.numel() for p in params)
    flat = torch.zeros(total + (-total) % padded_to)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


def direct(net: nn.Module) -> Callable[[Callable[[], None]], None]:
    params = list(net.parameters())
    grads, optimizer = flat_grads(params), adam(params, 1e-3)

    def step(backward: Callable[[], None]) -> None:
        grads.zero_()
        backward()
        COMM.Allreduce(MPI.IN_PLACE, grads.numpy(), op=MPI.SUM)
        grads.mul_(1 / COMM.size)
        optimizer.step()

    return step


def overlapped(net: nn.Module, bucket: int) -> Callable[[Callable[[], None]], None]:
    params = list(net.parameters())
    grads, optimizer = flat_grads(params), adam(params, 1e-3)
    spans, offset = [], 0
    for p in params:
        spans.append((offset, offset + p.numel()))
        offset += p.numel()
    buckets: list[list[int]] = [[]]  # in the order backward produces them: the last layer first
    for i in reversed(range(len(params))):
        if sum(spans[j][1] - spans[j][0] for j in buckets[-1]) >= bucket:
            buckets.append([])
        buckets[-1].append(i)
    of = {i: b for b, members in enumerate(buckets) for i in members}
    pending: list[MPI.Request] = []
    left: list[int] = []

    def hook(i: int) -> Callable[[torch.Tensor], None]:
        def ready(_: torch.Tensor) -> None:
            left[of[i]] -= 1
            if left[of[i]] == 0:
                lo, hi = spans[buckets[of[i]][-1]][0], spans[buckets[of[i]][0]][1]
                view = grads.numpy()[lo:hi]
                pending.append(COMM.Iallreduce(MPI.IN_PLACE, view, op=MPI.SUM))
            elif pending:
                MPI.Request.Testall(pending)  # Open MPI progresses only inside MPI calls

        return ready

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(hook(i))

    def step(backward: Callable[[], None]) -> None:
        grads.zero_()
        pending.clear()
        left[:] = [len(members) for members in buckets]
        backward()
        MPI.Request.Waitall(pending)
        grads.mul_(1 / COMM.size)
        optimizer.step()

    return step


def zero1(net: nn.Module) -> Callable[[Callable[[], None]], None]:
    params = list(net.parameters())
    grads = flat_grads(params, padded_to=COMM.size)
    weights = torch.zeros_like(grads)
    offset = 0
    for p in params:  # the parameters become views of one buffer, to all-gather in place
        weights[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
        p.data = weights[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    size = grads.numel() // COMM.size
    lo, hi = COMM.rank * size, (COMM.rank + 1) * size
    shard = nn.Parameter(weights[lo:hi])  # shares the buffer: Adam writes the model's weights
    shard.grad = torch.empty(size)
    optimizer = adam([shard], 1e-3)

    def step(backward: Callable[[], None]) -> None:
        grads.zero_()
        backward()
        COMM.Reduce_scatter_block(grads.numpy(), shard.grad.numpy(), op=MPI.SUM)
        shard.grad.mul_(1 / COMM.size)
        optimizer.step()
        COMM.Allgather(MPI.IN_PLACE, weights.numpy())

    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(COMM.rank)
    x, y = torch.randn(args.batch, 16, generator=generator), torch.randn(args.batch, 1)
    levers = {
        "direct allreduce (hvd-cpu)": direct,
        "overlap, buckets of 64 k floats": lambda net: overlapped(net, 2**16),
        "overlap, buckets of 256 k floats": lambda net: overlapped(net, 2**18),
        "ZeRO-1": zero1,
    }
    times: dict[str, list[float]] = {name: [] for name in levers}
    ended: dict[str, torch.Tensor] = {}
    for _ in range(args.rounds):
        for name, lever in levers.items():
            net = wide()
            step = lever(net)

            def backward(net: nn.Module = net) -> None:
                nn.functional.mse_loss(net(x), y).backward()

            start = time.perf_counter()
            for _ in range(args.steps):
                step(backward)
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
            ended[name] = nn.utils.parameters_to_vector(net.parameters()).detach()
    if COMM.rank == 0:
        base = ended["direct allreduce (hvd-cpu)"]
        print(f"| {COMM.size} ranks, wide MLP, batch {args.batch}/rank | ms per step (median) "
              "| runs | largest parameter difference from direct |")  # fmt: skip
        print("|---|---:|---|---:|")
        for name, runs in times.items():
            listed = ", ".join(f"{r:.2f}" for r in runs)
            gap = (ended[name] - base).abs().max().item()
            print(f"| {name} | {statistics.median(runs):.2f} | {listed} | {gap:.1e} |")


if __name__ == "__main__":
    main()
