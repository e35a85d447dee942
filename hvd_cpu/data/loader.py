"""Which rows are this rank's (its block to read, its shard to train on), and its batches,
fetched with one tensor index each.

A DataLoader over a per-row Dataset calls __getitem__ and collates once per row: for a
small model that Python work costs more than the step itself. Here a sampler only decides
the order; each batch is a single `index_select` on the in-memory tensors.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DistributedSampler

from hvd_cpu.data.features import Arrays


def rank_block(count: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of this rank's contiguous block of `count` rows: what a rank reads to fit
    statistics or to predict; the blocks of all ranks are disjoint and cover every row."""
    return rank * count // size, (rank + 1) * count // size


def index_type(rows: int) -> torch.dtype:
    """int32 positions below 2**31 rows: half the memory of int64, the same permutations."""
    return torch.int32 if rows < 2**31 else torch.int64


def padded(order: torch.Tensor, length: int) -> torch.Tensor:
    """`order` repeated to `length` positions, as DistributedSampler pads; copied only when
    it must grow."""
    if length <= len(order):
        return order[:length]
    return order.repeat(-(-length // len(order)))[:length]


class ShardSampler(DistributedSampler):
    """This rank's positions in the rows every rank holds, reshuffled by `set_epoch`.

    `order` gives them as one tensor, what the batches are cut from: iterated, 13.5 M rows are
    a list of Python ints of 0.5 GB, as an int32 tensor 54 MB. Every rank takes the same number
    of positions (some rows twice), so no rank waits for steps another does not take.

    Rank r takes every size-th row of the epoch's order (seed + epoch), so after k steps of b
    rows the ranks together have trained exactly its first k x b x size rows. An epoch that
    goes on with other ranks (--elastic: `reshard`) is told how many (`set_epoch`'s
    `trained`), and the rest are shared out among the ranks there are now: within an epoch no
    row is dropped or trained twice. From the epoch's start the shards are
    DistributedSampler's, disjoint and reshuffled across ranks each epoch.
    """

    def __init__(self, rows: int, rank: int, size: int, shuffle: bool, seed: int) -> None:
        super().__init__(range(rows), num_replicas=size, rank=rank, shuffle=shuffle, seed=seed)
        self.trained = 0
        self.as_begun = True

    def set_epoch(self, epoch: int, trained: int = 0, as_begun: bool = True) -> None:
        """Epoch `epoch`'s order, of which the ranks have trained the first `trained` rows.
        `as_begun`: as many ranks as now trained them, and the rest is padded as the epoch's
        start padded it (an epoch resumed at a step trains the rows an uninterrupted one
        does); otherwise (--elastic, other ranks now) from the rest's own rows, so that no row
        of the epoch trains twice."""
        super().set_epoch(epoch)
        self.trained, self.as_begun = trained, as_begun

    def reshard(self, rank: int, size: int) -> None:
        """Go on as `rank` of `size` (--elastic)."""
        self.rank, self.num_replicas = rank, size

    def __len__(self) -> int:
        return -(-max(len(self.dataset) - self.trained, 0) // self.num_replicas)

    def order(self) -> torch.Tensor:
        whole = permutation(len(self.dataset), self.shuffle, self.seed + self.epoch)
        places = len(self) * self.num_replicas
        if self.as_begun:
            rest = padded(whole, self.trained + places)[self.trained :]
        else:
            rest = padded(whole[self.trained :], places)
        return rest[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.order().tolist())


class OwnRowsSampler(ShardSampler):
    """--shard-read: the rows are this rank's own. It shuffles within them (seed + 1_000_003 x
    epoch + rank) and repeats some to reach `length`, the longest rank's, so that every rank
    takes the same number of steps. An epoch resumed at a step (`set_epoch`'s `trained`, the
    same on every rank) goes on from this rank's share of them."""

    def __init__(
        self, rows: int, rank: int, size: int, shuffle: bool, seed: int, length: int
    ) -> None:
        super().__init__(rows, rank, size, shuffle, seed)
        self.length = length

    def __len__(self) -> int:
        return max(self.length - self.trained // self.num_replicas, 0)

    def order(self) -> torch.Tensor:
        seed = self.seed + 1_000_003 * self.epoch + self.rank
        whole = padded(permutation(len(self.dataset), self.shuffle, seed), self.length)
        return whole[self.trained // self.num_replicas :]


def permutation(rows: int, shuffle: bool, seed: int) -> torch.Tensor:
    """All positions, shuffled by `seed` (as DistributedSampler shuffles) or in order."""
    if not shuffle:
        return torch.arange(rows, dtype=index_type(rows))
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(rows, generator=generator, dtype=index_type(rows))


class ShardedBatches:
    """Iterates over (x, y) batches in the sampler's order; call set_epoch before each epoch.

    `rows` are the row numbers of `arrays` to train on (the rest are held out for
    validation); the sampler picks positions in `rows`, so no subset is ever copied.
    """

    def __init__(
        self, arrays: Arrays, rows: torch.Tensor, batch_size: int, sampler: ShardSampler
    ) -> None:
        self.x = torch.from_numpy(arrays.x)
        self.y = torch.from_numpy(arrays.y)
        self.rows = rows
        self.batch_size = batch_size
        self.sampler = sampler

    def set_epoch(self, epoch: int, trained: int = 0, as_begun: bool = True) -> None:
        """Reshuffle: every rank passes the same epoch, so global shards stay disjoint; of it
        the ranks have trained `trained` rows (an epoch resumed, or going on with other ranks:
        ShardSampler.set_epoch)."""
        self.sampler.set_epoch(epoch, trained, as_begun)

    def indices(self) -> torch.Tensor:
        """The row numbers of this rank's shard for the current epoch, in batch order."""
        return self.rows[self.sampler.order()]

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in self.indices().split(self.batch_size):
            yield self.x.index_select(0, batch), self.y.index_select(0, batch)
