"""A synthetic frame shaped like the seed's: float features and a `target` column."""

from __future__ import annotations

import numpy as np
import pandas as pd

# The target is a linear function of the features plus Gaussian noise of this standard
# deviation, so the best reachable mean squared error is NOISE_STD ** 2.
NOISE_STD = 0.1


def make_demo_frame(rows: int, features: int, seed: int = 0) -> pd.DataFrame:
    """Features ~ N(0, 1); target = features @ w + b + N(0, NOISE_STD^2), w and b fixed by seed."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, features), dtype=np.float32)
    weights = rng.uniform(-1.0, 1.0, features).astype(np.float32)
    bias = np.float32(rng.uniform(-0.5, 0.5))
    noise = rng.normal(0.0, NOISE_STD, rows).astype(np.float32)
    frame = pd.DataFrame(x, columns=[f"x{i}" for i in range(features)])
    frame["target"] = x @ weights + bias + noise
    return frame
