"""The sharding contract, checked without Horovod: what each rank reads and in which order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hvd_cpu.data.features import Arrays
from hvd_cpu.data.loader import (
    LocalShardSampler,
    ResumableSampler,
    ShardedBatches,
    global_sampler,
)


def make_arrays(rows: int, features: int = 3) -> Arrays:
    # Row i holds the value i everywhere, so a batch tells which rows it came from.
    x = np.repeat(np.arange(rows, dtype=np.float32)[:, None], features, axis=1)
    return Arrays(x=x, y=x[:, :1].copy(), feature_names=tuple(f"f{i}" for i in range(features)))


def shards(rows: int, size: int, shuffle: bool, epoch: int, batch_size: int = 7):
    arrays = make_arrays(rows)
    loaders = [
        ShardedBatches(
            arrays, torch.arange(rows), batch_size, global_sampler(rows, r, size, shuffle, seed=3)
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


def test_uneven_rows_are_padded_so_every_rank_takes_the_same_number_of_steps() -> None:
    rows, size = 101, 4
    loaders = shards(rows, size, shuffle=True, epoch=1)
    flat = [i for loader in loaders for i in loader.indices().tolist()]
    assert set(flat) == set(range(rows))
    assert len(flat) == 104  # 3 rows repeated to pad the shards to 26 each
    assert {len(loader) for loader in loaders} == {len(loaders[0])}


def test_epochs_reshuffle_the_same_way_on_every_rank() -> None:
    first = [loader.indices() for loader in shards(64, 2, shuffle=True, epoch=1)]
    again = [loader.indices() for loader in shards(64, 2, shuffle=True, epoch=1)]
    second = [loader.indices() for loader in shards(64, 2, shuffle=True, epoch=2)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], second[0])


@pytest.mark.parametrize("rank", [0, 2])
def test_batches_hold_exactly_the_sampled_rows_in_order(rank: int) -> None:
    arrays = make_arrays(55)
    rows = torch.arange(5, 55)  # rows 0-4 held out
    loader = ShardedBatches(arrays, rows, 4, global_sampler(50, rank, 3, shuffle=True, seed=1))
    loader.set_epoch(5)
    wanted = rows[list(loader.sampler)].tolist()
    batches = list(loader)
    assert [len(x) for x, _ in batches] == [4, 4, 4, 4, 1]
    got_x = torch.cat([x for x, _ in batches])
    got_y = torch.cat([y for _, y in batches])
    assert torch.equal(got_x, torch.from_numpy(arrays.x[wanted]))
    assert torch.equal(got_y, torch.from_numpy(arrays.y[wanted]))
    assert len(loader) == len(batches)


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_local_shard_is_shuffled_within_and_padded_to_the_longest(shuffle: bool) -> None:
    sampler = LocalShardSampler(rows=10, length=13, rank=1, shuffle=shuffle, seed=0)
    sampler.set_epoch(1)
    first = list(sampler)
    assert len(first) == len(sampler) == 13
    assert sorted(set(first)) == list(range(10))  # every row, three of them twice
    assert (first[:10] == list(range(10))) != shuffle
    sampler.set_epoch(2)
    assert (list(sampler) != first) == shuffle


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_a_resumable_sampler_from_the_start_is_a_distributed_sampler(size: int) -> None:
    for rank in range(size):
        resumable = ResumableSampler(50, rank, size, shuffle=True, seed=4)
        distributed = global_sampler(50, rank, size, shuffle=True, seed=4)
        resumable.set_epoch(3)
        distributed.set_epoch(3)
        assert list(resumable) == list(distributed)
        assert len(resumable) == len(distributed)


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 3), (3, 1)])
def test_ranks_that_change_mid_epoch_neither_drop_nor_repeat_rows(before: int, after: int):
    rows, batch, steps = 120, 5, 4  # 4 steps at `before` ranks, then the rest at `after`
    samplers = [ResumableSampler(rows, r, before, shuffle=True, seed=1) for r in range(before)]
    done = [i for s in samplers for i in list(s)[: steps * batch]]
    skip = steps * batch * before
    rest = []
    for rank in range(after):
        sampler = samplers[0]
        sampler.reshard(rank, after)
        sampler.skip = skip
        rest += list(sampler)
    assert len(rest) == -(-(rows - skip) // after) * after  # padded to equal shards, as before
    assert not set(done) & set(rest)
    assert sorted(set(done) | set(rest)) == list(range(rows))


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize(("rows", "size"), [(50, 3), (96, 4), (7, 1)])
def test_every_sampler_orders_as_a_tensor_what_it_iterates(rows, size, shuffle) -> None:
    for rank in range(size):
        samplers = [
            global_sampler(rows, rank, size, shuffle, seed=5),
            ResumableSampler(rows, rank, size, shuffle, seed=5),
            LocalShardSampler(rows - rank, rows, rank, shuffle, seed=5),
        ]
        for sampler in samplers:
            for epoch in (0, 3):
                sampler.set_epoch(epoch)
                assert sampler.order().tolist() == list(sampler)
