"""Run on every rank of a real Gloo job (tests/test_shared_memory.py): Horovod's collectives
through our gloo-shared-memory patch, checked against what they must give, then
"shared memory ok RANK SIZE".

Every rank makes every rank's inputs from seeds, so it knows the exact answer: a sum must be
the rank-order sum, bit for bit, at every size (one chunk summed whole, a chunk summed by
parts, several chunks), the same on every rank and for every way in (Horovod's allreduce,
several fused into one, and the direct allreduce from the calling thread).
"""

from __future__ import annotations

import os
import sys

import horovod.torch as hvd
import torch

# float32 counts: a few, below the size summed by parts, above it, several 1 MB chunks.
COUNTS = (1, 705, 3000, 70_001, 600_000)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.uint8)
HOROVOD_TAKES = set(DTYPES) - {torch.uint8}  # Horovod's torch allreduce refuses bytes


def inputs(rank: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + count)
    if dtype.is_floating_point:
        return torch.randn(count, generator=generator, dtype=torch.float64).to(dtype)
    return torch.randint(0, 50, (count,), generator=generator).to(dtype)


def rank_order(size: int, count: int, dtype: torch.dtype, op: str = "sum") -> torch.Tensor:
    """The reduction in rank order, as the shared memory sums (half precision in float)."""
    wide = torch.float32 if dtype == torch.float16 else dtype
    total = inputs(0, count, dtype).to(wide)
    for rank in range(1, size):
        other = inputs(rank, count, dtype).to(wide)
        total = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum}[op](total, other)
    return total.to(dtype)


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    assert hvd.gloo_shared_memory() == "", hvd.gloo_shared_memory()
    for count in COUNTS:
        for dtype in DTYPES:
            want = rank_order(size, count, dtype)
            if dtype in HOROVOD_TAKES:
                got = hvd.allreduce(inputs(rank, count, dtype), op=hvd.Sum, name=f"{count}{dtype}")
                assert torch.equal(got, want), (count, dtype, (got - want).abs().max())
            direct = hvd.direct_allreduce_(inputs(rank, count, dtype))
            assert torch.equal(direct, want), (count, dtype, "direct")
    for op, name in ((hvd.Min, "min"), (hvd.Max, "max")):
        got = hvd.allreduce(inputs(rank, 3000, torch.float32), op=op, name=name)
        assert torch.equal(got, rank_order(size, 3000, torch.float32, name)), name
    mean = hvd.allreduce(torch.full((5,), float(rank)), op=hvd.Average, name="mean")
    assert torch.allclose(mean, torch.full((5,), (size - 1) / 2)), mean
    # several tensors fused into one buffer, as DistributedOptimizer's gradients are
    handles = [
        hvd.allreduce_async(inputs(rank, n, torch.float32), op=hvd.Sum, name=f"fused{n}")
        for n in (10, 2000, 70_001)
    ]
    for handle, n in zip(handles, (10, 2000, 70_001), strict=True):
        assert torch.equal(hvd.synchronize(handle), rank_order(size, n, torch.float32))
    average = hvd.direct_allreduce_(torch.full((7,), float(rank)), op=hvd.Average)
    assert torch.allclose(average, torch.full((7,), (size - 1) / 2)), average
    flags = hvd.direct_allreduce_(torch.tensor([rank == 0, False]))
    assert flags.tolist() == [True, False]

    root = size - 1
    sent = torch.arange(2_500_000, dtype=torch.float32) * (rank + 1)  # 10 MB: several chunks
    got = hvd.broadcast(sent, root_rank=root, name="broadcast")
    assert torch.equal(got, torch.arange(2_500_000, dtype=torch.float32) * size)
    gathered = hvd.allgather(torch.full((rank + 1, 3), rank), name="gather")  # unequal parts
    assert gathered.tolist() == [[r] * 3 for r in range(size) for _ in range(r + 1)]
    objects = hvd.allgather_object({"rank": rank, "pid": os.getpid()}, name="objects")
    assert [o["rank"] for o in objects] == list(range(size))
    assert hvd.broadcast_object(f"from {rank}", root_rank=root, name="object") == f"from {root}"

    # a process set of the first two ranks: its own segment on this host
    if size > 2:
        pair = hvd.add_process_set([0, 1])
        if rank < 2:
            got = hvd.allreduce(torch.tensor([rank + 1.0]), op=hvd.Sum, process_set=pair)
            assert got.item() == 3.0
        hvd.remove_process_set(pair)
    hvd.barrier()
    print(f"shared memory ok {rank} {size}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
