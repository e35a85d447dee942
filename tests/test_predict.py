"""What predict writes: class labels with their probabilities, and regression predictions in
the target's own units. Each test trains a small model in this process (a job of one)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch

from hvd_cpu.config.options import TrainConfig
from hvd_cpu.tools.predict import PredictConfig, load_model, predict
from hvd_cpu.training.train import train

ROWS = 600


def trained(frame: pd.DataFrame, tmp_path: Path, **options: object) -> Path:
    """The output folder of a short training on `frame`."""
    data = tmp_path / "frame.parquet"
    frame.to_parquet(data)
    output = tmp_path / "run"
    config = TrainConfig(
        data=data, output=output, epochs=8, batch_size=32, lr=1e-2, quiet=True, **options
    )
    train(config)
    return output


def predicted(model: Path, frame: pd.DataFrame, tmp_path: Path) -> pd.DataFrame:
    """predict's result on `frame`, checked to be what it wrote."""
    data, output = tmp_path / "new.parquet", tmp_path / "predictions.parquet"
    frame.to_parquet(data)
    result = predict(PredictConfig(model_path=model, data=data, output=output))
    assert result is not None
    pd.testing.assert_frame_equal(pd.read_parquet(output), result)
    return result


def features(seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"x0": rng.normal(size=ROWS), "x1": rng.normal(size=ROWS)})


def test_classification_gives_the_labels_and_their_probabilities(tmp_path: Path) -> None:
    frame = features(0)
    score = frame["x0"] + frame["x1"]
    frame["kind"] = np.where(score > 0.7, "high", np.where(score < -0.7, "low", "mid"))
    model = trained(
        frame, tmp_path, targets=("kind",), task="classification", hidden=(16,), activation="relu"
    )
    new = features(1)
    result = predicted(model, new, tmp_path)

    network, transform = load_model(model)
    classes = transform.classes
    assert sorted(classes) == ["high", "low", "mid"]
    assert list(result.columns) == ["prediction", *(f"probability_{c}" for c in classes)]
    # Column i is the probability of class i: the network's output i on the stored features.
    with torch.no_grad():
        raw = network(torch.from_numpy(transform.features(new)))
    probabilities = result.iloc[:, 1:].to_numpy()
    np.testing.assert_allclose(probabilities, torch.softmax(raw, dim=1).numpy(), rtol=1e-5)
    assert list(result["prediction"]) == [classes[i] for i in probabilities.argmax(axis=1)]
    score = new["x0"] + new["x1"]
    truth = np.where(score > 0.7, "high", np.where(score < -0.7, "low", "mid"))
    assert (result["prediction"] == truth).mean() > 0.8


def test_regression_predictions_come_back_in_the_targets_units(tmp_path: Path) -> None:
    """Trained on standardised targets, the model's outputs are in standard deviations; predict
    turns each column back into its own target's units."""
    frame = features(0)
    frame["price"] = 1000 + 200 * frame["x0"]
    frame["temperature"] = -40 + 3 * frame["x1"]
    targets = ("price", "temperature")
    model = trained(frame, tmp_path, targets=targets, standardize_target=True)
    new = features(1)
    result = predicted(model, new, tmp_path)

    assert list(result.columns) == ["prediction_price", "prediction_temperature"]
    network, transform = load_model(model)
    with torch.no_grad():
        raw = network(torch.from_numpy(transform.features(new))).double().numpy()
    for i, (target, scale) in enumerate(zip(targets, transform.target_scale, strict=True)):
        assert scale.name == target
        expected = raw[:, i] * scale.std + scale.mean
        np.testing.assert_allclose(result[f"prediction_{target}"], expected, rtol=1e-12)
    price, temperature = 1000 + 200 * new["x0"], -40 + 3 * new["x1"]
    # Linear targets, learnt to within a hundredth of each one's standard deviation.
    assert np.abs(result["prediction_price"] - price).mean() < 2
    assert np.abs(result["prediction_temperature"] - temperature).mean() < 0.03
