"""Contender (b): torchrun + DistributedDataParallel over gloo, written the way the PyTorch
tutorials do: the per-row Dataset, a DistributedSampler, DataLoader, lr x world size (as
hvd-cpu), threads = cores / processes (as hvd-cpu). Rank 0 validates, untimed.

Usage: torchrun --nproc-per-node N benchmarks/ddp.py FRAME MODEL EPOCHS BATCH OUT.jsonl
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from common import (
    CustomDataset,
    build,
    seed_epoch,
    train_and_validation,
    validation_loss,
    write_epochs,
)
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler


def main(frame_path: str, model_name: str, epochs: int, batch: int, out: str) -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // size))
    train, val = train_and_validation(pd.read_parquet(frame_path))
    dataset = CustomDataset(train.drop(columns=["target"]), train[["target"]])
    sampler = DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler)
    model = DistributedDataParallel(build(model_name, train.shape[1] - 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3 * size)
    records = []
    first_step_unix = time.time()  # launch to here is the start-up cost
    for epoch in range(1, epochs + 1):
        sampler.set_epoch(epoch)
        dist.barrier()
        start = time.perf_counter()
        seed_epoch(model, loader, optimizer)
        dist.barrier()
        seconds = time.perf_counter() - start
        if rank == 0:
            records.append(
                {"epoch": epoch, "seconds": seconds, "samples": len(sampler) * size,
                 "val_loss": validation_loss(model.module, val)}
            )  # fmt: skip
    if rank == 0:
        records[0]["first_step_unix"] = first_step_unix
        write_epochs(Path(out), records)
    # Torch's Gloo aborted a rank that tore its group down while rank 0 still validated and
    # wrote ("terminate called without an active exception", once in CI): leave together.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
