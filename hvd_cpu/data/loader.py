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
    """This rank's positions in the rows of each epoch, reshuffled by `set_epoch`.

    `order` gives them as one tensor, what the batches are cut from: iterated, 13.5 M rows are
    a list of Python ints of 0.5 GB, as an int32 tensor 54 MB. Every rank takes the same number
    of positions (some rows twice), so no rank waits for steps another does not take.

    - Every rank holds all rows (default): the shards are DistributedSampler's, disjoint and
      reshuffled across ranks each epoch (seed + epoch).
    - --elastic: rank r takes every size-th row of the epoch's order, so after k steps of b rows
      the ranks together have trained exactly its first k x b x size rows. `skip` says how
      many; the rest are shared out among however many ranks there are now (`reshard`), so
      within an epoch no row is dropped or trained twice. With skip 0 the shards are
      DistributedSampler's.
    - --shard-read (`length` given): `rows` are this rank's own; it shuffles within them (seed
      + 1_000_003 x epoch + rank) and repeats some to reach `length`, the longest shard.
    """

    def __init__(
        self, rows: int, rank: int, size: int, shuffle: bool, seed: int, length: int | None = None
    ) -> None:
        super().__init__(range(rows), num_replicas=size, rank=rank, shuffle=shuffle, seed=seed)
        self.length = length
        self.skip = 0

    def reshard(self, rank: int, size: int) -> None:
        """--elastic: go on as `rank` of `size`, from `skip` on."""
        self.rank, self.num_replicas = rank, size

    def __len__(self) -> int:
        if self.length is not None:
            return self.length
        return -(-max(len(self.dataset) - self.skip, 0) // self.num_replicas)

    def order(self) -> torch.Tensor:
        if self.length is not None:
            own = self._permutation(self.seed + 1_000_003 * self.epoch + self.rank)
            return padded(own, self.length)
        rest = self._permutation(self.seed + self.epoch)[self.skip :]
        return padded(rest, len(self) * self.num_replicas)[self.rank :: self.num_replicas]

    def _permutation(self, seed: int) -> torch.Tensor:
        """All positions, shuffled by `seed` (as DistributedSampler shuffles) or in order."""
        rows = len(self.dataset)
        if not self.shuffle:
            return torch.arange(rows, dtype=index_type(rows))
        generator = torch.Generator().manual_seed(seed)
        return torch.randperm(rows, generator=generator, dtype=index_type(rows))

    def __iter__(self) -> Iterator[int]:
        return iter(self.order().tolist())


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

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle: every rank passes the same epoch, so global shards stay disjoint."""
        self.sampler.set_epoch(epoch)

    def indices(self) -> torch.Tensor:
        """The row numbers of this rank's shard for the current epoch, in batch order."""
        return self.rows[self.sampler.order()]

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in self.indices().split(self.batch_size):
            yield self.x.index_select(0, batch), self.y.index_select(0, batch)
