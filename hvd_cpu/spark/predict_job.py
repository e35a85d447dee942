"""`hvd_cpu.spark.predict`: a trained model's predictions for a Spark DataFrame, computed on
the executors batch by batch (mapInPandas), the rows encoded as in training."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from hvd_cpu.api import FitResult, trained_model
from hvd_cpu.errors import InputError
from hvd_cpu.spark import cluster
from hvd_cpu.tools.predict import check_columns, predictions


def predict(
    run: FitResult | str | Path,
    data: Any,
    id_column: str | None = None,
    model: Any = None,
) -> Any:
    """A Spark DataFrame of predictions for `data` (a Spark DataFrame, or parquet at a path
    the executors read), one row per row, with the prediction columns of `hvd-cpu predict`
    (and `id_column`). `run` is what spark.fit or hvd_cpu.fit returned, or a run's folder
    (or model.pt); `model`: the class it was trained with when it was defined in a notebook
    or script, as for hvd_cpu.predict."""
    cluster.require_spark()
    frame = cluster.frame_of(data, cluster.session_of(data))
    trained, transform = trained_model(run, model)
    sample = frame.limit(1).toPandas()
    check_columns(sample, transform, id_column)
    if sample.empty:
        raise InputError("the DataFrame has no rows to predict")
    schema = frame.sparkSession.createDataFrame(
        predictions(trained, transform, sample, id_column)
    ).schema

    def predict_batches(batches: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        for batch in batches:
            yield predictions(trained, transform, batch, id_column)

    return frame.mapInPandas(predict_batches, schema)
