"""`hvd_cpu.ray.predict`: a trained model's predictions for a Ray Dataset, computed by Ray
Data's tasks batch by batch (map_batches), the rows encoded as in training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from hvd_cpu.api import FitResult, trained_model
from hvd_cpu.errors import InputError
from hvd_cpu.ray import cluster
from hvd_cpu.tools.predict import check_columns, predictions


def predict(
    run: FitResult | str | Path,
    data: Any,
    id_column: str | None = None,
    model: Any = None,
    address: str | None = None,
) -> Any:
    """A Ray Dataset of predictions for `data` (a Ray Dataset, a pandas DataFrame, or parquet
    at a path every node reads), one row per row, with the prediction columns of `hvd-cpu
    predict` (and `id_column`). `run` is what ray.fit or hvd_cpu.fit returned, or a run's
    folder (or model.pt); `model`: the class it was trained with when it was defined in a
    notebook or script, as for hvd_cpu.predict. Lazy, as Ray Datasets are: the predictions
    are made when the Dataset is read or written."""
    cluster.require_ray()
    cluster.connect(address)
    dataset = cluster.dataset_of(data)
    trained, transform = trained_model(run, model)
    sample = dataset.limit(1).to_pandas()
    check_columns(sample, transform, id_column)
    if sample.empty:
        raise InputError("the Dataset has no rows to predict")

    def predict_batch(batch: pd.DataFrame) -> pd.DataFrame:
        return predictions(trained, transform, batch, id_column)

    return dataset.map_batches(predict_batch, batch_format="pandas")
