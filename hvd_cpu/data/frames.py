"""Read and write DataFrame files, choosing the format by the file's extension."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from hvd_cpu.errors import InputError

READERS = {
    ".parquet": pd.read_parquet,
    ".pq": pd.read_parquet,
    # Unpickling can run arbitrary code: only load pickles you made yourself (prefer parquet).
    ".pkl": pd.read_pickle,
    ".pickle": pd.read_pickle,
    ".feather": pd.read_feather,
    ".csv": pd.read_csv,
}
WRITERS = {
    ".parquet": lambda frame, path: frame.to_parquet(path, index=False),
    ".pq": lambda frame, path: frame.to_parquet(path, index=False),
    ".pkl": lambda frame, path: frame.to_pickle(path),
    ".pickle": lambda frame, path: frame.to_pickle(path),
    ".feather": lambda frame, path: frame.to_feather(path),
    ".csv": lambda frame, path: frame.to_csv(path, index=False),
}
KNOWN = ", ".join(READERS)


def format_of(path: Path) -> str:
    """The extension that picks the reader/writer, or an InputError naming the ones we know."""
    suffix = path.suffix.lower()
    if suffix not in READERS:
        raise InputError(
            f"unknown data format {suffix or '(no extension)'!r} for {path}; "
            f"save the frame as one of {KNOWN}"
        )
    return suffix


def read_frame(path: Path) -> pd.DataFrame:
    """Read a whole DataFrame file; a missing or unreadable file is the user's to fix."""
    suffix = format_of(path)
    if not path.is_file():
        raise InputError(
            f"data file not found: {path}; check the path (it must exist on every host)"
        )
    try:
        return READERS[suffix](path)
    except Exception as exc:  # any reader failure means the file is not what its name says
        raise InputError(
            f"cannot read {path} as {suffix}: {type(exc).__name__}: {exc}; "
            "check that the file is complete and matches its extension"
        ) from exc


def write_frame(frame: pd.DataFrame, path: Path) -> None:
    """Write a DataFrame in the format its extension names."""
    WRITERS[format_of(path)](frame, path)
