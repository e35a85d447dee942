"""How rows that do not divide by the ranks are padded, and what an epoch resumed at a step
leaves each rank (by as many ranks as began it, or by others: --elastic); tests/test_loader.py
has the even cases, the order and the mid-epoch reshard."""

from __future__ import annotations

import pytest

from hvd_cpu.data.loader import ShardSampler


def epoch_shards(
    rows: int, size: int, shuffle: bool, skip: int = 0, as_begun: bool = True
) -> list[list[int]]:
    """Every rank's rows of epoch 1, in order, `skip` rows of it already trained."""
    shards = []
    for rank in range(size):
        one = ShardSampler(rows, rank, size, shuffle, seed=7)
        one.set_epoch(1, skip, as_begun)
        shards.append(list(one))
    return shards


@pytest.mark.parametrize("skip", [0, 8])
def test_the_first_rows_of_the_order_pad_the_last_shards(skip: int) -> None:
    # 10 rows over 4 ranks: 12 places, so rows 0 and 1 (the order's first) come twice; with
    # 8 rows trained by other ranks, the 2 left over 4 ranks pad the same way
    shards = epoch_shards(rows=10 + skip, size=4, shuffle=False, skip=skip, as_begun=False)
    shards = [[row - skip for row in shard] for shard in shards]
    assert shards == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("steps", [1, 3, 5])
def test_an_epoch_resumed_by_as_many_ranks_trains_the_rest_an_uninterrupted_one_does(
    shuffle: bool, steps: int
) -> None:
    """Preemption's retry (tests/test_preemption.py): after `steps` steps of 2 rows on 4
    ranks, each rank's shard is the rest of its uninterrupted one, padding included (23 rows:
    the uninterrupted epoch pads with the order's first row)."""
    uninterrupted = epoch_shards(rows=23, size=4, shuffle=shuffle)
    resumed = epoch_shards(rows=23, size=4, shuffle=shuffle, skip=steps * 2 * 4)
    assert resumed == [shard[steps * 2 :] for shard in uninterrupted]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize(("rows", "size"), [(10, 4), (101, 3), (3, 4), (1, 3)])
def test_every_rank_takes_the_same_count_and_no_row_is_dropped(
    rows: int, size: int, shuffle: bool
) -> None:
    """No drop_last: every row trains every epoch, and a few train twice so that every rank
    takes the same number of steps (a rank with fewer would leave the others waiting)."""
    shards = epoch_shards(rows, size, shuffle)
    per_rank = -(-rows // size)
    assert [len(shard) for shard in shards] == [per_rank] * size
    assert {row for shard in shards for row in shard} == set(range(rows))


def test_the_rest_of_an_epoch_other_ranks_began_is_padded_from_its_own_rows() -> None:
    """Two rows left for four ranks (--elastic, after one rank trained 18): each rank takes
    one of them, never a row the epoch already trained."""
    full = ShardSampler(20, rank=0, size=1, shuffle=True, seed=2)
    full.set_epoch(3)
    order = list(full)
    rest = []
    for rank in range(4):
        sampler = ShardSampler(20, rank, 4, shuffle=True, seed=2)
        sampler.set_epoch(3, 18, as_begun=False)
        assert len(sampler) == 1
        rest += list(sampler)
    assert rest == [order[18], order[19], order[18], order[19]]


@pytest.mark.parametrize("skip", [20, 24])
def test_an_epoch_already_trained_to_its_end_leaves_every_rank_nothing(skip: int) -> None:
    """The rows trained count padded batches too, so they can pass the epoch's rows."""
    for rank in range(3):
        sampler = ShardSampler(20, rank, 3, shuffle=True, seed=0)
        sampler.set_epoch(1, skip)
        assert len(sampler) == 0
        assert list(sampler) == []
