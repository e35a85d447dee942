"""Real training jobs under horovodrun: they finish, agree, and average gradients correctly."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pandas as pd
import pytest
import torch

from hvd_cpu.model.networks import Network, parameter_digest

from .jobs import (
    BIN,
    REPO,
    Run,
    horovodrun,
    hvd_cpu,
    load_model,
    metrics,
    ranks,
    run,
    slow_except,
)


@pytest.mark.parametrize("np", slow_except([2, 4], [2]))
def test_ranks_train_together_and_end_identical(np: int, demo_parquet: Path, tmp_path: Path):
    out = tmp_path / "out"
    args = ["train", "--data", str(demo_parquet), "--epochs", "3", "--output", str(out)]
    job = horovodrun(np, *args)
    assert job.returncode == 0, job.stdout + job.stderr

    epoch_lines = [(rank, text) for rank, text in job.rank_lines() if text.startswith("Epoch ")]
    assert [rank for rank, _ in epoch_lines] == [0, 0, 0], "only rank 0 prints epoch lines"
    assert [text.split(":")[0] for _, text in epoch_lines] == ["Epoch 1", "Epoch 2", "Epoch 3"]
    printed = [float(re.search(r"Train Loss: ([\d.]+)", text)[1]) for _, text in epoch_lines]
    assert printed[-1] < printed[0], "the loss falls"

    history = metrics(out)
    assert [m["epoch"] for m in history] == [1, 2, 3]
    assert [round(m["train_loss"], 4) for m in history] == printed
    rows = len(pd.read_parquet(demo_parquet))
    train_rows = rows - round(0.1 * rows)  # --val-fraction 0.1 held out
    shard = -(-train_rows // np)  # the sampler pads the shards to equal length
    assert all(m["samples"] == shard * np and m["samples_per_s"] > 0 for m in history)
    assert all(m["world_size"] == np and m["lr"] == pytest.approx(1e-3 * np) for m in history)

    ranks = json.loads((out / "ranks.json").read_text())
    assert [r["rank"] for r in ranks] == list(range(np))
    assert len({r["pid"] for r in ranks}) == np
    assert {r["shard_rows"] for r in ranks} == {shard}
    assert {r["param_sha256"] for r in ranks} == {parameter_digest(load_model(out))}


def test_np4_at_batch_16_equals_np1_at_batch_64(demo_parquet: Path, tmp_path: Path) -> None:
    """Averaged gradients of 4 ranks x 16 rows are the gradient of the same 64 rows at once."""
    common = ["train", "--data", str(demo_parquet), "--epochs", "1"]
    # 256 rows held out, 3840 = 60 x 64 trained: no rank pads its shard with repeated rows
    common += ["--no-shuffle", "--no-scale-lr", "--val-fraction", "0.0625"]
    four = horovodrun(4, *common, "--batch-size", "16", "--output", str(tmp_path / "np4"))
    one = hvd_cpu(*common, "--batch-size", "64", "--output", str(tmp_path / "np1"))
    assert four.returncode == 0, four.stdout + four.stderr
    assert one.returncode == 0, one.stdout + one.stderr

    torch.manual_seed(0)  # the initial parameters of a run with --seed 0
    start = Network(8)
    parallel, single = load_model(tmp_path / "np4"), load_model(tmp_path / "np1")
    for name, value in single.state_dict().items():
        assert not torch.allclose(value, start.state_dict()[name]), f"{name} did not train"
        torch.testing.assert_close(parallel.state_dict()[name], value, rtol=0, atol=2e-6)
    for key in ("train_loss", "val_loss"):  # the same rows are held out whatever the ranks
        assert metrics(tmp_path / "np4")[0][key] == pytest.approx(
            metrics(tmp_path / "np1")[0][key], rel=1e-5
        )


def test_a_plain_process_is_a_job_of_one(demo_parquet: Path, tmp_path: Path) -> None:
    job = hvd_cpu("train", "--data", str(demo_parquet), "--epochs", "2", "--output", str(tmp_path))
    assert job.returncode == 0, job.stderr
    epochs = [line.split(":")[0] for line in job.stdout.splitlines() if line.startswith("Epoch")]
    assert epochs == ["Epoch 1", "Epoch 2"]
    assert metrics(tmp_path)[0]["world_size"] == 1


def demo(output: Path, *args: str) -> Run:
    """README's command 1, launch/demo.sh, its extra arguments going to train: here an
    --output outside the repository's runs/."""
    job = run(["launch/demo.sh", "--output", str(output), *args], cwd=REPO,
              env={"HVD_CPU_VENV": str(BIN.parent)})  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr
    return job


# A demo's folder, and its output, metrics and ranks as it left them.
DemoRun = tuple[Path, Run, list[dict], list[dict]]


@pytest.fixture(scope="module")
def first_demo(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """One demo run, shared by the tests that read it and the one that runs the demo again."""
    output = tmp_path_factory.mktemp("demo")
    job = demo(output)
    return output, job, metrics(output), ranks(output)


@pytest.mark.slow
def test_the_demo_loss_falls_in_each_of_ten_epochs(first_demo: DemoRun) -> None:
    """`horovodrun -np 4 hvd-cpu train` on the demo frame."""
    _, job, records, _ = first_demo
    assert len([t for r, t in job.rank_lines(0) if t.startswith("Epoch")]) == 10
    losses = [m["train_loss"] for m in records]
    assert len(losses) == 10
    assert all(later < earlier for earlier, later in itertools.pairwise(losses))
    assert losses[-1] < 0.02  # near the demo's noise floor, NOISE_STD ** 2 = 0.01
    assert "over 4 rank(s)" in job.stdout


@pytest.mark.slow
def test_a_second_demo_replaces_the_first(first_demo: DemoRun) -> None:
    """README: the demo replaces its output on every run (launch/demo.sh passes --overwrite).
    Again into the first's folder, for 1 epoch: the first's checkpoint does not refuse it, and
    the folder then holds the second run alone."""
    output, _, _, first = first_demo
    assert (output / "checkpoint.pt").exists()
    demo(output, "--epochs", "1", "--quiet")
    assert [m["epoch"] for m in metrics(output)] == [1]
    second = ranks(output)
    assert len(second) == 4 and {r["epochs_run"] for r in second} == {1}
    assert min(r["first_step_unix"] for r in second) > max(r["first_step_unix"] for r in first)
    assert not {r["pid"] for r in first} & {r["pid"] for r in second}
