"""Turn a DataFrame into float32 feature and target matrices, refusing what cannot be trained on."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from pandas.api.types import is_numeric_dtype

from hvd_cpu.errors import InputError


@dataclass(frozen=True)
class Arrays:
    """Features and targets as contiguous float32 matrices, one row per sample."""

    x: np.ndarray  # (rows, features)
    y: np.ndarray  # (rows, targets)
    feature_names: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.x)


def to_arrays(frame: pd.DataFrame, target: str) -> Arrays:
    """Split off the target column; every other column is a numeric feature."""
    if target not in frame.columns:
        shown = ", ".join(map(str, frame.columns[:10])) + (", ..." if frame.shape[1] > 10 else "")
        raise InputError(
            f"target column {target!r} not in the data (columns: {shown}); "
            "name the right one with --target"
        )
    features = frame.drop(columns=[target])
    if features.shape[1] == 0:
        raise InputError(f"the data has no feature columns besides the target {target!r}")
    non_numeric = [str(c) for c in features.columns if not is_numeric_dtype(features[c])]
    if non_numeric:
        raise InputError(
            f"non-numeric feature columns: {', '.join(non_numeric)}; "
            "convert them to numbers or drop them from the frame"
        )
    if not is_numeric_dtype(frame[target]):
        raise InputError(f"target column {target!r} is not numeric; convert it to numbers")
    if len(frame) == 0:
        raise InputError("the data has no rows")
    return Arrays(
        x=np.ascontiguousarray(features.to_numpy(dtype=np.float32, copy=True)),
        y=np.ascontiguousarray(frame[[target]].to_numpy(dtype=np.float32, copy=True)),
        feature_names=tuple(map(str, features.columns)),
    )
