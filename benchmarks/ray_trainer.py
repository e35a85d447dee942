"""Ray's two CPU paths side by side on one Ray cluster started here (ray.cluster_utils: two
nodes of one CPU each, so that the ranks of both take this machine's two cores):
hvd_cpu.ray.fit against Ray Train's TorchTrainer with its defaults on CPUs (DDP over Gloo
around the loop a user writes: get_dataset_shard, iter_torch_batches, prepare_model),
training the seed's MLP (Linear(16, 32) -> Linear(32, 1), MSE, Adam lr 1e-3, batch 64 per
rank) on the same materialised Ray Dataset with the same two ranks, alternated in rounds;
medians.

Measured for each: the wall seconds from the call to its return; the training samples/s
(epochs' samples over their seconds, rank 0's clock); the training seconds until an epoch's
training loss reaches the higher of the two last ones ("time to loss"); and the start (wall minus
training seconds: actors or Ray Train's worker group, the rendezvous, the processes'
imports). The target is standardised first, so that both losses are on one scale (hvd-cpu
standardises it itself; its 10 % hold-out means it trains on 90 % of the rows an epoch).

Usage (from the repository, after launch/install.sh --test, which installs Ray):
    .venv/bin/python benchmarks/ray_trainer.py [--rounds 2] [--rows 100000] [--epochs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import make_frame, time_to_loss

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import hvd_cpu.ray  # noqa: E402

BATCH = 64


def ddp_loop(config: dict[str, Any]) -> None:
    """What a Ray Train user writes for the seed's MLP (each of TorchTrainer's workers)."""
    import json
    import time

    import ray.train
    import ray.train.torch
    import torch
    from torch import nn

    torch.manual_seed(0)
    features = config["features"]
    model = ray.train.torch.prepare_model(
        nn.Sequential(nn.Linear(len(features), 32), nn.Linear(32, 1))
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()
    shard = ray.train.get_dataset_shard("train")
    for epoch in range(config["epochs"]):
        started, total, samples = time.perf_counter(), 0.0, 0
        for batch in shard.iter_torch_batches(batch_size=BATCH, dtypes=torch.float32):
            x = torch.stack([batch[name] for name in features], dim=1)
            y = batch["target"].unsqueeze(1)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(y)
            samples += len(y)
        seconds = time.perf_counter() - started
        context = ray.train.get_context()
        record = {"epoch": epoch + 1, "train_loss": total / samples, "seconds": seconds,
                  "samples": samples * context.get_world_size()}  # fmt: skip
        ray.train.report(record)
        if context.get_world_rank() == 0:  # Ray Train 2's Result keeps the last report only
            with open(config["record"], "a") as epochs:
                epochs.write(json.dumps(record) + "\n")


def torch_trainer(dataset: Any, features: list[str], epochs: int, folder: Path) -> list[dict]:
    """TorchTrainer on two CPU workers, its defaults otherwise; rank 0's epochs."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    record = folder / "epochs.jsonl"
    record.unlink(missing_ok=True)
    trainer = TorchTrainer(
        ddp_loop,
        train_loop_config={"features": features, "epochs": epochs, "record": str(record)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        datasets={"train": dataset},
        run_config=RunConfig(storage_path=str(folder), name="torch-trainer"),
    )
    trainer.fit()
    return [json.loads(line) for line in record.read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    frame = make_frame(args.rows)
    frame["target"] = (frame["target"] - frame["target"].mean()) / frame["target"].std()
    features = [name for name in frame.columns if name != "target"]
    started = time.monotonic()
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, logging_level="WARNING")
    ray_start = time.monotonic() - started
    dataset = ray.data.from_pandas(frame).repartition(2).materialize()
    names = ("hvd_cpu.ray.fit", "TorchTrainer")
    runs: dict[str, list[list[dict]]] = {name: [] for name in names}
    walls: dict[str, list[float]] = {name: [] for name in names}
    try:
        with tempfile.TemporaryDirectory() as folder:
            for _ in range(args.rounds):
                for name in names:
                    began = time.monotonic()
                    if name == "TorchTrainer":
                        epochs = torch_trainer(dataset, features, args.epochs, Path(folder))
                    else:
                        result = hvd_cpu.ray.fit(
                            dataset, num_proc=2, epochs=args.epochs, batch_size=BATCH,
                            output=Path(folder) / "hvd", overwrite=True, quiet=True,
                        )  # fmt: skip
                        epochs = result.history.to_dict("records")
                    walls[name].append(time.monotonic() - began)
                    runs[name].append(epochs)
    finally:
        ray.shutdown()
        cluster.shutdown()
    # The loss both reach: the higher of the two last training losses (medians).
    target = max(statistics.median(r[-1]["train_loss"] for r in runs[name]) for name in names)
    print(f"{args.rows} rows, 16 features, 2 ranks, {args.epochs} epochs, {args.rounds} rounds")
    print(f"Ray cluster start (head + 1 node): {ray_start:.1f} s")
    print(f"time to loss: to the higher of the two last training losses, {target:.4f}")
    for name in names:
        speeds = [sum(e["samples"] for e in r) / sum(e["seconds"] for e in r) for r in runs[name]]
        trained = [sum(e["seconds"] for e in r) for r in runs[name]]
        starts = [wall - seconds for wall, seconds in zip(walls[name], trained, strict=True)]
        reached = [time_to_loss(r, target, "train_loss") for r in runs[name]]
        reach = [t for t in reached if t is not None]
        print(
            f"{name:16} wall {statistics.median(walls[name]):5.1f} s   start "
            f"{statistics.median(starts):5.1f} s   training {statistics.median(speeds):8,.0f} "
            f"samples/s   time to loss "
            + (f"{statistics.median(reach):5.2f} s" if reach else "not reached")
            + f"   last loss {statistics.median(r[-1]['train_loss'] for r in runs[name]):.4f}"
        )


if __name__ == "__main__":
    main()
