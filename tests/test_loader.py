"""The sharding contract, checked without Horovod: what each rank reads and in which order
(tests/test_padding.py: rows that do not divide by the ranks)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from hvd_cpu.data.features import Arrays
from hvd_cpu.data.loader import OwnRowsSampler, ShardedBatches, ShardSampler, rank_block


def make_arrays(rows: int, features: int = 3) -> Arrays:
    # Row i holds the value i everywhere, so a batch tells which rows it came from.
    x = np.repeat(np.arange(rows, dtype=np.float32)[:, None], features, axis=1)
    return Arrays(x=x, y=x[:, :1].copy(), feature_names=tuple(f"f{i}" for i in range(features)))


def shards(rows: int, size: int, shuffle: bool, epoch: int, batch_size: int = 7):
    arrays = make_arrays(rows)
    loaders = [
        ShardedBatches(
            arrays, torch.arange(rows), batch_size, ShardSampler(rows, r, size, shuffle, seed=3)
        )
        for r in range(size)
    ]
    for loader in loaders:
        loader.set_epoch(epoch)
    return loaders


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shards_are_disjoint_and_cover_every_row(size: int, shuffle: bool) -> None:
    rows = 96  # divisible by 1..4: no padding
    seen = [loader.indices().tolist() for loader in shards(rows, size, shuffle, epoch=2)]
    flat = [i for shard in seen for i in shard]
    assert sorted(flat) == list(range(rows))
    assert {len(shard) for shard in seen} == {rows // size}


def test_the_shuffled_order_changes_each_epoch_and_repeats_with_the_seed() -> None:
    def order(epoch: int, seed: int) -> list[int]:
        sampler = ShardSampler(40, rank=0, size=1, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert order(1, seed=0) == order(1, seed=0)
    assert order(1, seed=0) != order(2, seed=0)
    assert order(1, seed=0) != order(1, seed=1)
    assert sorted(order(2, seed=0)) == list(range(40))


@pytest.mark.parametrize("rank", [0, 2])
def test_batches_hold_exactly_the_sampled_rows_in_order(rank: int) -> None:
    arrays = make_arrays(55)
    rows = torch.arange(5, 55)  # rows 0-4 held out
    loader = ShardedBatches(arrays, rows, 4, ShardSampler(50, rank, 3, shuffle=True, seed=1))
    loader.set_epoch(5)
    torch_shard = DistributedSampler(range(50), num_replicas=3, rank=rank, shuffle=True, seed=1)
    torch_shard.set_epoch(5)
    wanted = rows[list(torch_shard)].tolist()
    batches = list(loader)
    assert [len(x) for x, _ in batches] == [4, 4, 4, 4, 1]
    got_x = torch.cat([x for x, _ in batches])
    got_y = torch.cat([y for _, y in batches])
    assert torch.equal(got_x, torch.from_numpy(arrays.x[wanted]))
    assert torch.equal(got_y, torch.from_numpy(arrays.y[wanted]))
    assert len(loader) == len(batches)


@pytest.mark.parametrize("epoch", [0, 1, 3])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize(("rows", "size"), [(96, 4), (50, 3), (7, 1), (10, 4), (3, 4), (1, 3)])
def test_the_shards_are_torch_distributed_samplers(rows, size, shuffle, epoch) -> None:
    """What the product promises: each rank reads the shard torch's DistributedSampler gives
    it, as a tensor (`order`, int32) and iterated, padded alike."""
    for rank in range(size):
        ours = ShardSampler(rows, rank, size, shuffle, seed=5)
        torch_shard = DistributedSampler(
            range(rows), num_replicas=size, rank=rank, shuffle=shuffle, seed=5
        )
        ours.set_epoch(epoch)
        torch_shard.set_epoch(epoch)
        expected = list(torch_shard)
        assert ours.order().tolist() == list(ours) == expected
        assert ours.order().dtype == torch.int32
        assert len(ours) == len(torch_shard) == len(expected)


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 3), (3, 1), (2, 7)])
def test_ranks_that_change_mid_epoch_neither_drop_nor_repeat_rows(before: int, after: int):
    """After k steps of b rows at `before` ranks, the shards at `after` ranks hold each of the
    epoch's remaining rows once, and only the padding (the first of them) again."""
    rows, batch, steps = 122, 5, 4  # 4 steps at `before` ranks, then the rest at `after`
    full = ShardSampler(rows, 0, 1, shuffle=True, seed=1)  # one rank: the epoch's whole order
    full.set_epoch(2)
    samplers = [ShardSampler(rows, r, before, shuffle=True, seed=1) for r in range(before)]
    for sampler in samplers:
        sampler.set_epoch(2)
    done = [i for s in samplers for i in list(s)[: steps * batch]]
    skip = steps * batch * before
    assert sorted(done) == sorted(list(full)[:skip])
    remaining = list(full)[skip:]
    rest = []
    for rank in range(after):
        sampler = samplers[0]
        sampler.reshard(rank, after)
        sampler.set_epoch(2, skip, as_begun=False)
        assert len(sampler) == -(-len(remaining) // after)  # equal shards, as before
        rest += list(sampler)
    padding = len(rest) - len(remaining)
    assert 0 <= padding < after
    assert Counter(rest) == Counter(remaining + remaining[:padding])
    assert not set(done) & set(rest)


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_local_shard_is_shuffled_within_and_padded_to_the_longest(shuffle: bool) -> None:
    sampler = OwnRowsSampler(rows=10, rank=1, size=2, shuffle=shuffle, seed=0, length=13)
    sampler.set_epoch(1)
    first = list(sampler)
    assert len(first) == len(sampler) == 13
    assert sorted(set(first)) == list(range(10))  # every row, three of them twice
    assert first[10:] == first[:3]  # padded from the start of its own order
    assert (first[:10] == list(range(10))) != shuffle
    sampler.set_epoch(2)
    assert (list(sampler) != first) == shuffle


@pytest.mark.parametrize(("seed", "epoch"), [(4, 2), (0, 0), (7, 5)])
def test_a_local_shard_keeps_its_seed_formula(seed: int, epoch: int) -> None:
    """--shard-read's order, fixed: torch.randperm(rows) seeded with seed + 1_000_003 x epoch
    + rank, then its first rows again to reach the longest shard."""
    for rank in (0, 1):
        sampler = OwnRowsSampler(rows=6, rank=rank, size=2, shuffle=True, seed=seed, length=8)
        sampler.set_epoch(epoch)
        generator = torch.Generator().manual_seed(seed + 1_000_003 * epoch + rank)
        order = torch.randperm(6, generator=generator).tolist()
        assert sampler.order().tolist() == order + order[:2]


@pytest.mark.parametrize(("count", "size"), [(10, 3), (3, 4), (100, 1), (7, 7)])
def test_rank_blocks_are_contiguous_disjoint_and_cover_every_row(count: int, size: int) -> None:
    blocks = [rank_block(count, rank, size) for rank in range(size)]
    assert [row for start, stop in blocks for row in range(start, stop)] == list(range(count))
    assert max(b - a for a, b in blocks) - min(b - a for a, b in blocks) <= 1
