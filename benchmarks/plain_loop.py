"""Contender (a): the seed user's loop as they wrote it: a per-row Dataset, DataLoader batch 64,
Adam, MSE, one process. Validation after each epoch is not timed.

Usage: python benchmarks/plain_loop.py FRAME MODEL EPOCHS BATCH OUT.jsonl
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pandas as pd
import torch
from common import (
    CustomDataset,
    build,
    seed_epoch,
    train_and_validation,
    validation_loss,
    write_epochs,
)
from torch.utils.data import DataLoader


def main(frame_path: str, model_name: str, epochs: int, batch: int, out: str) -> None:
    train, val = train_and_validation(pd.read_parquet(frame_path))
    loader = DataLoader(
        CustomDataset(train.drop(columns=["target"]), train[["target"]]),
        batch_size=batch,
        shuffle=True,
    )
    model = build(model_name, train.shape[1] - 1)
    optimizer = torch.optim.Adam(model.parameters())
    records = []
    first_step_unix = time.time()  # launch to here is the start-up cost
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        seed_epoch(model, loader, optimizer)
        seconds = time.perf_counter() - start
        records.append(
            {"epoch": epoch, "seconds": seconds, "samples": len(train),
             "val_loss": validation_loss(model, val)}
        )  # fmt: skip
    records[0]["first_step_unix"] = first_step_unix
    write_epochs(Path(out), records)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
