"""Run on every rank of a real Gloo job (tests/test_shared_memory_edges.py): a random loop of
collectives through the shared-memory engine, each result compared bit for bit with the
rank-order reference, while a random rank sleeps before some of them (sometimes past the
engine's spin, so that the others sleep on the futex).

    python tests/shared_memory_stress.py SEED SECONDS

Every rank draws the same sequence from SEED: which collective (the direct allreduce, sum or
average; Horovod's own allreduce, sum, min or max; its broadcast and allgather), its size
(0, 1, around the 4096-byte and 1 MB chunk edges, several MB), its dtype, and who sleeps how
long. Prints "looping RANK" once it has joined, "stress ok RANK CALLS" at the end, or, when
a peer is lost (the test kills one), "lost RANK LEARNT ENTERED": the Unix times when this
rank learnt it and when it entered the collective that failed; and exits 3. It ignores
SIGTERM: the launcher sends it to every rank the moment one dies, and each must learn the
loss itself.
"""

from __future__ import annotations

import random
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import horovod.torch as hvd
import torch

# Elements: none, one, either side of the sizes where a float32 allreduce is summed by parts
# (16 KB) and where it takes a second chunk (1 MB slots: 262144 float32), and several MB.
COUNTS = (0, 1, 4095, 4096, 4097, 262143, 262144, 262145, 1_500_001)
DIRECT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.int64, torch.int32,
                 torch.int16, torch.int8, torch.uint8, torch.bool)  # fmt: skip
HOROVOD_DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32)


def inputs(rank: int, call: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7919 * call + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (count,), generator=generator).bool()
    if dtype.is_floating_point:
        return torch.randn(count, generator=generator, dtype=torch.float64).to(dtype)
    return torch.randint(0, 30, (count,), generator=generator).to(dtype)


def rank_order(size: int, call: int, count: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    """The reduction in rank order, as the shared memory makes it (float16 in float32, a
    boolean sum an any)."""
    if dtype == torch.bool:
        total = inputs(0, call, count, dtype)
        for rank in range(1, size):
            total = total | inputs(rank, call, count, dtype)
        return total
    wide = torch.float32 if dtype == torch.float16 else dtype
    combine = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum}[op]
    total = inputs(0, call, count, dtype).to(wide)
    for rank in range(1, size):
        total = combine(total, inputs(rank, call, count, dtype).to(wide))
    return total.to(dtype)


T = TypeVar("T")
# When this rank last entered a collective: a rank busy with its own work (the references
# below take a while at 1.5 M elements) can only learn of a lost peer once it waits for it.
entered = 0.0


def waiting(collective: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    global entered
    entered = time.time()
    return collective(*args, **kwargs)


def one_call(rank: int, size: int, call: int, draw: random.Random) -> None:
    kind = draw.choice(["direct", "direct", "average", "horovod", "broadcast", "allgather"])
    count = draw.choice(COUNTS)
    if draw.random() < 0.3:  # a late rank: a few ms, sometimes long past the spin
        late, seconds = draw.randrange(size), draw.choice([0.001, 0.005, 0.02, 0.05])
        if late == rank:
            time.sleep(seconds)
    if kind in ("direct", "average"):
        dtype = draw.choice(DIRECT_DTYPES if kind == "direct" else DIRECT_DTYPES[:3])
        got = waiting(hvd.direct_allreduce_, inputs(rank, call, count, dtype),
                      op=hvd.Sum if kind == "direct" else hvd.Average)  # fmt: skip
        want = rank_order(size, call, count, dtype, "sum")
        if kind == "average":
            want = (want.to(torch.float64) / size).to(dtype)
            assert torch.allclose(got.double(), want.double(), rtol=1e-3), (call, kind, dtype)
            return
    elif kind == "horovod":
        dtype, op = draw.choice(HOROVOD_DTYPES), draw.choice(["sum", "min", "max"])
        count = max(count, 1)
        hvd_op = {"sum": hvd.Sum, "min": hvd.Min, "max": hvd.Max}[op]
        got = waiting(hvd.allreduce, inputs(rank, call, count, dtype), op=hvd_op, name=f"c{call}")
        want = rank_order(size, call, count, dtype, op)
    elif kind == "broadcast":
        root = draw.randrange(size)
        mine = inputs(rank, call, count, torch.float32)
        got = waiting(hvd.broadcast, mine, root, name=f"c{call}")
        want = inputs(root, call, count, torch.float32)
    else:
        mine = inputs(rank, call, count, torch.int32).view(-1, 1)
        got = waiting(hvd.allgather, mine, name=f"c{call}")
        want = torch.cat([inputs(r, call, count, torch.int32).view(-1, 1) for r in range(size)])
    assert torch.equal(got, want), (call, kind, count, got.dtype)


def main() -> None:
    seed, seconds = int(sys.argv[1]), float(sys.argv[2])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    draw = random.Random(seed)
    until, calls = time.monotonic() + seconds, 0
    print(f"looping {rank}", flush=True)
    try:
        while True:
            # Every rank goes on or stops together: rank 0's clock decides.
            going = torch.tensor([time.monotonic() < until and rank == 0])
            go = waiting(hvd.direct_allreduce_, going)
            if not go.item():
                break
            one_call(rank, size, calls, draw)
            calls += 1
    except hvd.HorovodInternalError:
        print(f"lost {rank} {time.time():.6f} {entered:.6f}", flush=True)
        sys.exit(3)
    print(f"stress ok {rank} {calls}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
