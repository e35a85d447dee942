"""This rank's shard of the rows, in batches fetched with one tensor index each.

A DataLoader over a per-row Dataset calls __getitem__ and collates once per row: for a
small model that Python work costs more than the step itself. Here the DistributedSampler
only decides the order; each batch is a single `index_select` on the in-memory tensors.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DistributedSampler

from hvd_cpu.data.features import Arrays


class ShardedBatches:
    """Iterates over (x, y) batches of this rank's shard; call set_epoch before each epoch.

    Every rank yields the same number of batches (the sampler pads the shards to equal
    length), which keeps the per-step gradient allreduce in lockstep.
    """

    def __init__(
        self,
        arrays: Arrays,
        batch_size: int,
        rank: int,
        size: int,
        shuffle: bool,
        seed: int,
    ) -> None:
        self.x = torch.from_numpy(arrays.x)
        self.y = torch.from_numpy(arrays.y)
        self.batch_size = batch_size
        # The sampler only reads len(dataset); the tensors stand in for the Dataset.
        self.sampler = DistributedSampler(
            self.x, num_replicas=size, rank=rank, shuffle=shuffle, seed=seed
        )

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle: every rank passes the same epoch, so the shards stay disjoint."""
        self.sampler.set_epoch(epoch)

    def indices(self) -> torch.Tensor:
        """The row numbers of this rank's shard for the current epoch, in batch order."""
        return torch.tensor(list(self.sampler), dtype=torch.long)

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in self.indices().split(self.batch_size):
            yield self.x.index_select(0, batch), self.y.index_select(0, batch)
