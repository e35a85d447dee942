"""Read and write DataFrame files: the format comes from the extension or `--format`."""

from __future__ import annotations

import bisect
import contextlib
import csv
import errno
import itertools
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from hvd_cpu.atomic import atomic_write
from hvd_cpu.data.features import check_unique_columns
from hvd_cpu.data.formats import EXTENSIONS
from hvd_cpu.errors import InputError, RunFailed


def _read_parquet(path: Path) -> pd.DataFrame:
    return _to_pandas(pq.ParquetFile(path, pre_buffer=False).read())


def _to_pandas(table: pa.Table) -> pd.DataFrame:
    """Convert without holding the Arrow and pandas copies at once (peak memory ~1x, not 3x)."""
    return table.to_pandas(split_blocks=True, self_destruct=True)


# Keyed by formats.FORMATS. Unpickling runs whatever code the file names: only load pickles
# you made yourself.
READERS = {
    "parquet": _read_parquet,
    "pickle": pd.read_pickle,
    "feather": pd.read_feather,
    "csv": pd.read_csv,
}
WRITERS = {
    "parquet": lambda frame, path: frame.to_parquet(path, index=False),
    "pickle": lambda frame, path: frame.to_pickle(path),
    "feather": lambda frame, path: frame.to_feather(path),
    "csv": lambda frame, path: frame.to_csv(path, index=False),
}
# What else a "CSV" is often separated by (Excel in many locales writes ";").
SEPARATORS = (";", "\t", "|")


def format_of(path: Path, override: str | None = None) -> str:
    """The format to read/write `path` in: `override` if given, else by extension."""
    if override is not None:
        return override
    suffix = path.suffix.lower()
    if suffix not in EXTENSIONS:
        raise InputError(
            f"unknown data format {suffix or '(no extension)'!r} for {path}; "
            f"save the frame as one of {', '.join(EXTENSIONS)} or name the format with --format"
        )
    return EXTENSIONS[suffix]


def _check_exists(path: Path) -> None:
    if not path.is_file():
        raise InputError(
            f"data file not found: {path}; check the path (it must exist on every host)"
        )


def _unreadable(path: Path, fmt: str, exc: Exception) -> InputError:
    return InputError(
        f"cannot read {path} as {fmt}: {type(exc).__name__}: {exc}; "
        "check that the file is complete and in the format its extension (or --format) says"
    )


def read_frame(path: Path, fmt: str | None = None) -> pd.DataFrame:
    """Read a whole DataFrame file; a missing, unreadable or empty file is the user's to fix."""
    fmt = format_of(path, fmt)
    _check_exists(path)
    if fmt == "csv":
        _check_csv_header(path)
    try:
        frame = READERS[fmt](path)
    except Exception as exc:  # any reader failure means the file is not what it claims
        raise _unreadable(path, fmt, exc) from exc
    if not isinstance(frame, pd.DataFrame):
        raise InputError(
            f"{path} holds a {type(frame).__name__}, not a pandas DataFrame; save a DataFrame "
            "to it (a Series: series.to_frame())"
        )
    if len(frame) == 0:
        raise InputError(f"the data has no rows: {path} is empty")
    return _text_column_names(frame, path)


def _check_csv_header(path: Path) -> None:
    """What pandas' CSV reader would hide: it reads a file separated by anything but commas
    as one wide column, and renames a repeated column name `a` to `a.1`."""
    try:
        with path.open(encoding="utf-8-sig", newline="") as handle:
            header = handle.readline()
    except (OSError, UnicodeDecodeError):
        return  # not text: the reader says why
    separator = next((s for s in SEPARATORS if s in header), None)
    if "," not in header and separator is not None:
        raise InputError(
            f"{path} is separated by {separator!r}, not by commas; save it with commas "
            "(frame.to_csv(path, index=False)), or as parquet"
        )
    names = next(csv.reader([header]), [])
    check_unique_columns([name for name in names if name])


def _text_column_names(frame: pd.DataFrame, path: Path) -> pd.DataFrame:
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


def read_parquet_shard(path: Path, rank: int, size: int) -> pd.DataFrame:
    """Read only this rank's contiguous run of row groups (about 1/size of the rows).

    Per-rank memory is then about 1/size of the table; row groups are the unit because
    parquet cannot read part of one without decoding all of it.
    """
    _check_exists(path)
    try:
        parquet = pq.ParquetFile(path, pre_buffer=False)
        rows = [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)]
        if sum(rows) == 0:
            raise InputError(f"the data has no rows: {path} is empty")
        if len(rows) < size:
            raise InputError(
                f"{path} has {len(rows)} row group(s), fewer than the {size} ranks, so "
                "--shard-read cannot give every rank rows; rewrite it with smaller row groups "
                "(e.g. frame.to_parquet(path, row_group_size=100_000)) or drop --shard-read"
            )
        frame = _to_pandas(parquet.read_row_groups(list(assign_row_groups(rows, size)[rank])))
    except InputError:
        raise
    except Exception as exc:
        raise _unreadable(path, "parquet", exc) from exc
    return frame


def assign_row_groups(rows: list[int], size: int) -> list[range]:
    """Split row groups (given their row counts) into `size` contiguous, non-empty runs of
    about equal rows. Needs at least `size` row groups."""
    starts = list(itertools.accumulate(rows, initial=0))
    bounds = [0]
    for rank in range(1, size):
        first = bisect.bisect_left(starts, rank * starts[-1] / size)
        bounds.append(min(max(first, bounds[-1] + 1), len(rows) - (size - rank)))
    bounds.append(len(rows))
    return [range(bounds[r], bounds[r + 1]) for r in range(size)]


def check_writable(path: Path) -> None:
    """Before the work, not after it: that `path` can be written, folders made as needed.
    Folders made only to test this go again, so a run that stops leaves none behind."""
    made = [folder for folder in path.parents if not folder.exists()]
    probe = path.parent / f".{path.name}.hvd-cpu-write-test"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise _write_failure(path, exc) from exc
    finally:
        for folder in made:  # the deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()


def write_frame(frame: pd.DataFrame, path: Path) -> None:
    """Write a DataFrame in the format its extension names, atomically."""
    writer = WRITERS[format_of(path)]
    try:
        atomic_write(path, lambda handle: writer(frame, handle))
    except OSError as exc:
        raise _write_failure(path, exc) from exc


def _write_failure(path: Path, exc: OSError) -> Exception:
    """A full disk is the machine's fault (exit 1); a path that cannot be written is the
    user's to change (exit 2)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return RunFailed(f"could not write {path}: {exc.strerror}; free space and run again")
    blocker = next((folder for folder in path.parents if folder.is_file()), None)
    why = f"{blocker} is a file, not a folder" if blocker else exc.strerror or str(exc)
    return InputError(f"cannot write {path}: {why}; choose a path in a folder you can write to")
