"""How rows that do not divide by the ranks are padded, and what an elastic resume leaves
each rank; tests/test_loader.py has the even cases and the mid-epoch reshard."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hvd_cpu.data.loader import EpochSampler, ResumableSampler, global_sampler

Sampler = Callable[[int, int, int, bool, int], EpochSampler]  # (rows, rank, size, shuffle, seed)
SAMPLERS: dict[str, Sampler] = {"distributed": global_sampler, "resumable": ResumableSampler}


def epoch_shards(sampler: Sampler, rows: int, size: int, shuffle: bool) -> list[list[int]]:
    """Every rank's rows of epoch 1, in order."""
    shards = []
    for rank in range(size):
        one = sampler(rows, rank, size, shuffle, 7)
        one.set_epoch(1)
        shards.append(list(one))
    return shards


@pytest.mark.parametrize("kind", SAMPLERS)
def test_the_first_rows_of_the_order_pad_the_last_shards(kind: str) -> None:
    # 10 rows over 4 ranks: 12 places, so rows 0 and 1 (the order's first) come twice
    shards = epoch_shards(SAMPLERS[kind], rows=10, size=4, shuffle=False)
    assert shards == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize(("rows", "size"), [(10, 4), (101, 3), (3, 4), (1, 3)])
def test_every_rank_takes_the_same_count_and_no_row_is_dropped(
    rows: int, size: int, shuffle: bool
) -> None:
    """No drop_last: every row trains every epoch, and a few train twice so that every rank
    takes the same number of steps (a rank with fewer would leave the others waiting)."""
    shards = epoch_shards(global_sampler, rows, size, shuffle)
    per_rank = -(-rows // size)
    assert [len(shard) for shard in shards] == [per_rank] * size
    assert {row for shard in shards for row in shard} == set(range(rows))


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize(("rows", "size"), [(10, 4), (101, 3), (3, 4), (1, 3)])
def test_a_resumable_sampler_pads_as_a_distributed_sampler_does(
    rows: int, size: int, shuffle: bool
) -> None:
    expected = epoch_shards(global_sampler, rows, size, shuffle)
    assert epoch_shards(ResumableSampler, rows, size, shuffle) == expected


def test_the_shuffled_order_changes_each_epoch_and_repeats_with_the_seed() -> None:
    def order(epoch: int, seed: int) -> list[int]:
        sampler = ResumableSampler(40, rank=0, size=1, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert order(1, seed=0) == order(1, seed=0)
    assert order(1, seed=0) != order(2, seed=0)
    assert order(1, seed=0) != order(1, seed=1)
    assert sorted(order(2, seed=0)) == list(range(40))


def test_the_rest_of_an_epoch_is_padded_from_its_own_rows() -> None:
    """Two rows left for four ranks: each rank takes one of them, never a row the epoch
    already trained."""
    full = ResumableSampler(20, rank=0, size=1, shuffle=True, seed=2)
    full.set_epoch(3)
    order = list(full)
    rest = []
    for rank in range(4):
        sampler = ResumableSampler(20, rank, 4, shuffle=True, seed=2)
        sampler.set_epoch(3)
        sampler.skip = 18
        assert len(sampler) == 1
        rest += list(sampler)
    assert rest == [order[18], order[19], order[18], order[19]]


@pytest.mark.parametrize("skip", [20, 24])
def test_an_epoch_already_trained_to_its_end_leaves_every_rank_nothing(skip: int) -> None:
    """The rows trained count padded batches too, so they can pass the epoch's rows."""
    for rank in range(3):
        sampler = ResumableSampler(20, rank, 3, shuffle=True, seed=0)
        sampler.set_epoch(1)
        sampler.skip = skip
        assert len(sampler) == 0
        assert list(sampler) == []
