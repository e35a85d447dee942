"""A DataFrame as users bring them."""

from __future__ import annotations

import numpy as np
import pandas as pd


def messy_frame(rows: int = 400, seed: int = 0) -> pd.DataFrame:
    """What users bring: an id, strings with gaps, timestamps, booleans, NaN, a constant,
    an empty column, a category, and a target with a few holes. y depends on most of them."""
    rng = np.random.default_rng(seed)
    size = rng.normal(50, 20, rows)
    size[rng.random(rows) < 0.1] = np.nan
    city = rng.choice(np.array(["Oslo", "Lima", "Pune", None], dtype=object), rows)
    when = pd.Series(pd.Timestamp("2024-01-01") + pd.to_timedelta(rng.integers(0, 365, rows), "D"))
    when[rng.random(rows) < 0.05] = pd.NaT
    flag = rng.random(rows) < 0.3
    grade = pd.Categorical(rng.choice(["a", "b", "c"], rows))
    bump = pd.Series(city).map({"Oslo": 3.0, "Lima": -2.0, "Pune": 0.5}).fillna(0).to_numpy()
    target = 0.05 * np.nan_to_num(size, nan=50) + bump + 2.0 * flag + rng.normal(0, 0.3, rows)
    target[rng.random(rows) < 0.03] = np.nan
    return pd.DataFrame(
        {
            "id": np.arange(rows),
            "size": size,
            "city": city,
            "when": when,
            "flag": flag,
            "grade": grade,
            "constant": 7.0,
            "empty": np.nan,
            "target": target,
        }
    )
