"""What the readers and the encoder agree on about a frame: its columns are named by unique
text, and it is worked through BATCH rows at a time.

Apart from features.py so that the readers (frames.py, parquet.py) need not import the encoder.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pandas as pd

from hvd_cpu.errors import InputError

BATCH = 65_536  # rows encoded (and decoded from parquet) at a time


def check_unique_columns(names: list[str]) -> None:
    """Refuse a frame with two columns of one name: which of them a step takes would depend on
    how it looks the name up."""
    duplicates = sorted(n for n, count in Counter(names).items() if count > 1)
    if duplicates:
        raise InputError(
            f"duplicate column names in the data: {', '.join(duplicates)}; rename them so each "
            "column has its own name"
        )


def row_batches(frame: pd.DataFrame) -> Iterator[pd.DataFrame]:
    """`frame` BATCH rows at a time, as views."""
    for start in range(0, len(frame), BATCH):
        yield frame.iloc[start : start + BATCH]


def text_column_names(frame: pd.DataFrame, path: Path) -> pd.DataFrame:
    """Column names as the command line and features.json name them: text. Numbers (a frame
    built from a matrix) become their text, so `--target 7` names column 7; a MultiIndex has no
    one name to give, so flattening it is the user's choice."""
    if isinstance(frame.columns, pd.MultiIndex):
        raise InputError(
            f"{path} has MultiIndex columns (e.g. {frame.columns[0]!r}); flatten them to text "
            "names (frame.columns = ['_'.join(map(str, c)) for c in frame.columns]) and save it "
            "again"
        )
    if not all(isinstance(name, str) for name in frame.columns):
        frame.columns = [str(name) for name in frame.columns]
    return frame
