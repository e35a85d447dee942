"""Real frames under horovodrun: encoding, global statistics, shard reads, user models."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from hvd_cpu.data.features import FeatureTransform

from .jobs import SLOW, horovodrun, hvd_cpu, metrics, weights
from .messy import messy_frame

# Slow tests here may run beside another test (launch/test.sh's first stage, two workers).
pytestmark = pytest.mark.beside

USER_MODEL = """
import torch


class Wide(torch.nn.Module):
    def __init__(self, n_features, n_outputs):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(n_features, 16), torch.nn.ReLU(), torch.nn.Linear(16, n_outputs)
        )

    def forward(self, x):
        return self.body(x)
"""


@pytest.fixture(scope="module")
def messy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("messy") / "messy.pkl"
    messy_frame(rows=2000).to_pickle(path)
    return path


def read_json(path: Path):
    return json.loads(path.read_text())


def losses(output: Path, key: str = "train_loss") -> list[float]:
    return [record[key] for record in metrics(output)]


def test_a_messy_frame_trains_on_two_ranks(messy: Path, tmp_path: Path) -> None:
    job = horovodrun(
        2, "train", "--data", str(messy), "--drop", "id", "--epochs", "5", "--output", str(tmp_path)
    )
    assert job.returncode == 0, job.stdout + job.stderr
    notes = [(rank, text) for rank, text in job.rank_lines() if text.startswith("hvd-cpu: ")]
    assert {rank for rank, _ in notes} == {0}
    assert any("filled" in text and "city" in text for _, text in notes)
    assert ("hvd-cpu: warning: column constant is constant; dropped") in [t for _, t in notes]
    transform = read_json(tmp_path / "features.json")
    assert transform["report"]["rows"] == len(pd.read_pickle(messy))
    assert "empty" in transform["report"]["dropped_columns"]
    history = losses(tmp_path)
    assert history[-1] < history[0] / 2


def test_statistics_of_four_ranks_equal_one_process(messy: Path, tmp_path: Path) -> None:
    args = ["train", "--data", str(messy), "--drop", "id", "--epochs", "1", "--standardize-target"]
    four = horovodrun(4, *args, "--output", str(tmp_path / "np4"))
    one = hvd_cpu(*args, "--output", str(tmp_path / "np1"))
    assert four.returncode == 0 and one.returncode == 0, four.stderr + one.stderr
    parallel, single = (read_json(tmp_path / d / "features.json") for d in ("np4", "np1"))
    for key in ("inputs", "report", "classes", "targets"):
        assert parallel[key] == single[key], key
    for part in ("outputs", "target_scale"):
        assert [c["name"] for c in parallel[part]] == [c["name"] for c in single[part]]
        for a, b in zip(parallel[part], single[part], strict=True):
            assert a["mean"] == pytest.approx(b["mean"], rel=1e-12, abs=1e-12), a["name"]
            assert a["std"] == pytest.approx(b["std"], rel=1e-12), a["name"]


def test_a_user_model_from_a_file_trains(messy: Path, tmp_path: Path) -> None:
    (tmp_path / "my_model.py").write_text(USER_MODEL)
    model = f"{tmp_path / 'my_model.py'}:Wide"
    job = horovodrun(
        2,
        "train",
        "--data",
        str(messy),
        "--drop",
        "id",
        "--model",
        model,
        "--epochs",
        "4",
        "--output",
        str(tmp_path / "out"),
    )
    assert job.returncode == 0, job.stdout + job.stderr
    history = losses(tmp_path / "out")
    assert history[-1] < history[0]
    ranks = read_json(tmp_path / "out" / "ranks.json")
    assert len({r["param_sha256"] for r in ranks}) == 1


@pytest.mark.slow
def test_classification_reports_accuracy_over_all_ranks(messy: Path, tmp_path: Path) -> None:
    job = horovodrun(
        2,
        "train",
        "--data",
        str(messy),
        "--drop",
        "id",
        "--target",
        "city",
        "--task",
        "classification",
        "--epochs",
        "6",
        "--hidden",
        "32",
        "--activation",
        "relu",
        "--output",
        str(tmp_path),
    )
    assert job.returncode == 0, job.stdout + job.stderr
    assert read_json(tmp_path / "features.json")["classes"] == ["Lima", "Oslo", "Pune"]
    accuracy = losses(tmp_path, "train_accuracy")
    assert accuracy[-1] > accuracy[0] and accuracy[-1] > 0.6  # 3 classes: chance is 1/3
    epoch_lines = [text for rank, text in job.rank_lines(0) if text.startswith("Epoch")]
    assert f"Train Accuracy: {accuracy[-1]:.4f}, Val Loss: " in epoch_lines[-1]
    assert losses(tmp_path, "val_accuracy")[-1] > 0.6


@pytest.mark.slow
def test_shard_reads_fit_the_same_statistics_with_a_fraction_of_the_rows(tmp_path: Path) -> None:
    frame = messy_frame(rows=4000).drop(columns=["grade"])  # category dtype is not in parquet's
    path = tmp_path / "messy.parquet"
    frame.to_parquet(path, row_group_size=250)
    args = ["train", "--data", str(path), "--drop", "id", "--epochs", "3"]
    sharded = horovodrun(2, *args, "--shard-read", "--output", str(tmp_path / "shard"))
    whole = horovodrun(2, *args, "--output", str(tmp_path / "whole"))
    assert sharded.returncode == 0 and whole.returncode == 0, sharded.stderr + whole.stderr
    shard, full = (read_json(tmp_path / d / "features.json") for d in ("shard", "whole"))
    assert shard["report"] == full["report"]
    np.testing.assert_allclose(
        [c["std"] for c in shard["outputs"]], [c["std"] for c in full["outputs"]], rtol=1e-12
    )
    ranks = read_json(tmp_path / "shard" / "ranks.json")
    trained = round(int(frame["target"].notna().sum()) * 0.9)  # 10% held out for validation
    assert sum(r["shard_rows"] for r in ranks) >= trained - 1  # the shorter shard is padded
    assert all(r["shard_rows"] < 0.6 * trained for r in ranks)
    history = losses(tmp_path / "shard")
    assert history[-1] < history[0]


@pytest.mark.slow
def test_several_targets_are_several_outputs(tmp_path: Path) -> None:
    frame = messy_frame(rows=1000).assign(double=lambda f: 2 * f["target"])
    path = tmp_path / "two.feather"
    frame.drop(columns=["grade"]).to_feather(path)
    job = hvd_cpu(
        "train",
        "--data",
        str(path),
        "--drop",
        "id",
        "--target",
        "target",
        "--target",
        "double",
        "--epochs",
        "2",
        "--output",
        str(tmp_path / "out"),
    )
    assert job.returncode == 0, job.stderr
    state = torch.load(tmp_path / "out" / "model.pt", weights_only=True)["state_dict"]
    assert state["linear_2.weight"].shape[0] == 2


@SLOW
def test_a_duration_column_trains_as_standardised_seconds(tmp_path: Path) -> None:
    """docs/usage.md: durations become seconds, missing ones filled with the mean, then
    standardised (mean 0, std 1) with statistics over all ranks' rows."""
    rng = np.random.default_rng(1)
    minutes = rng.uniform(1, 120, 1000)
    waited = pd.Series(pd.to_timedelta(minutes, unit="min"))
    waited[::10] = pd.NaT
    frame = pd.DataFrame({"waited": waited, "x": rng.normal(size=1000)})
    frame["target"] = 0.02 * minutes + frame["x"] + rng.normal(0, 0.1, 1000)
    frame.to_parquet(tmp_path / "waits.parquet")
    out = tmp_path / "out"
    job = horovodrun(2, "train", "--data", str(tmp_path / "waits.parquet"), "--epochs", "5",
                     "--output", str(out))  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr
    fitted = read_json(out / "features.json")
    assert fitted["inputs"][0] == {"name": "waited", "kind": "timedelta", "levels": []}
    assert fitted["report"]["filled"] == {"waited": 100}
    seconds = (waited / pd.Timedelta(seconds=1)).to_numpy()
    mean = np.nanmean(seconds)
    std = np.sqrt(np.nansum((seconds - mean) ** 2) / len(seconds))  # the filled ones add 0
    [scale] = [c for c in fitted["outputs"] if c["name"] == "waited"]
    assert scale["mean"] == pytest.approx(mean, rel=1e-12)
    assert scale["std"] == pytest.approx(std, rel=1e-12)
    x = FeatureTransform.from_dict(fitted).features(frame)
    expected = (np.where(np.isnan(seconds), mean, seconds) - mean) / std
    np.testing.assert_allclose(x[:, 0], expected, rtol=1e-5, atol=1e-6)  # float32
    assert weights(out)["linear_1.weight"].shape[1] == 2  # the duration and x
    history = losses(out)
    assert history[-1] < history[0] / 2
