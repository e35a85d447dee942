"""This rank's shard of the rows, in batches fetched with one tensor index each.

A DataLoader over a per-row Dataset calls __getitem__ and collates once per row: for a
small model that Python work costs more than the step itself. Here a sampler only decides
the order; each batch is a single `index_select` on the in-memory tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
from torch.utils.data import DistributedSampler

from hvd_cpu.data.features import Arrays


class EpochSampler(Protocol):
    """A sampler that reshuffles per epoch, like DistributedSampler. `order` is the epoch's
    positions as one tensor, what the batches are cut from: iterated, 13.5 M rows are a list of
    Python ints of 0.5 GB, as an int32 tensor 54 MB."""

    def set_epoch(self, epoch: int) -> None: ...
    def order(self) -> torch.Tensor: ...
    def __iter__(self) -> Iterator[int]: ...
    def __len__(self) -> int: ...


class GlobalSampler(DistributedSampler):
    """torch's DistributedSampler, whose shard `order` also gives as a tensor (the same
    positions as iterating it: tested)."""

    def order(self) -> torch.Tensor:
        rows = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(rows, generator=generator, dtype=index_type(rows))
        else:
            order = torch.arange(rows, dtype=index_type(rows))
        return padded(order, self.total_size)[self.rank : self.total_size : self.num_replicas]


def index_type(rows: int) -> torch.dtype:
    """int32 positions below 2**31 rows: half the memory of int64, the same permutations."""
    return torch.int32 if rows < 2**31 else torch.int64


def padded(order: torch.Tensor, length: int) -> torch.Tensor:
    """`order` repeated to `length` positions, as DistributedSampler pads; copied only when
    it must grow."""
    if length <= len(order):
        return order[:length]
    return order.repeat(-(-length // len(order)))[:length]


def global_sampler(rows: int, rank: int, size: int, shuffle: bool, seed: int) -> EpochSampler:
    """Every rank holds all rows; the sampler gives each rank its own, disjoint shard (padded
    so every rank takes the same number of steps) and reshuffles them across ranks each epoch."""
    return GlobalSampler(range(rows), num_replicas=size, rank=rank, shuffle=shuffle, seed=seed)


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that goes on mid-epoch with another number of ranks (--elastic).

    Rank r takes every size-th row of the epoch's order, so after k steps of b rows the ranks
    together have trained exactly the first k x b x size rows of it. `skip` says how many;
    the rest are shared out among however many ranks there are now, so within an epoch no
    row is dropped or trained twice. With skip 0 the shards are DistributedSampler's.
    """

    def __init__(self, rows: int, rank: int, size: int, shuffle: bool, seed: int) -> None:
        super().__init__(range(rows), num_replicas=size, rank=rank, shuffle=shuffle, seed=seed)
        self.skip = 0

    def reshard(self, rank: int, size: int) -> None:
        self.rank, self.num_replicas = rank, size

    def __len__(self) -> int:
        return -(-max(len(self.dataset) - self.skip, 0) // self.num_replicas)

    def order(self) -> torch.Tensor:
        rows = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(rows, generator=generator, dtype=index_type(rows))
        else:
            order = torch.arange(rows, dtype=index_type(rows))
        total = len(self) * self.num_replicas  # padded, as DistributedSampler pads
        return padded(order[self.skip :], total)[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.order().tolist())


class LocalShardSampler:
    """Each rank holds only its own rows (--shard-read): shuffle within them, and repeat some
    to reach `length`, the longest shard, so that every rank takes the same number of steps."""

    def __init__(self, rows: int, length: int, rank: int, shuffle: bool, seed: int) -> None:
        self.rows, self.length, self.rank = rows, length, rank
        self.shuffle, self.seed = shuffle, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> torch.Tensor:
        if self.shuffle:
            generator = torch.Generator().manual_seed(
                self.seed + 1_000_003 * self.epoch + self.rank
            )
            order = torch.randperm(self.rows, generator=generator, dtype=index_type(self.rows))
        else:
            order = torch.arange(self.rows, dtype=index_type(self.rows))
        return padded(order, self.length)

    def __iter__(self) -> Iterator[int]:
        return iter(self.order().tolist())

    def __len__(self) -> int:
        return self.length


class ShardedBatches:
    """Iterates over (x, y) batches in the sampler's order; call set_epoch before each epoch.

    `rows` are the row numbers of `arrays` to train on (the rest are held out for
    validation); the sampler picks positions in `rows`, so no subset is ever copied.
    """

    def __init__(
        self, arrays: Arrays, rows: torch.Tensor, batch_size: int, sampler: EpochSampler
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
