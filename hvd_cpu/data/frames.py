"""Read and write DataFrame files: the format comes from the extension or `--format`."""

from __future__ import annotations

import contextlib
import csv
import errno
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from hvd_cpu.atomic import NO_LINK, atomic_write, check_own_folder
from hvd_cpu.config.formats import EXTENSIONS
from hvd_cpu.data.columns import check_unique_columns, row_batches, text_column_names
from hvd_cpu.data.parquet import Pieces
from hvd_cpu.errors import InputError, RunFailed


def _read_parquet(path: Path) -> pd.DataFrame:
    return parquet_rows(path).frame()


# Keyed by formats.FORMATS. Unpickling runs whatever code the file names: only load pickles
# you made yourself.
READERS = {
    "parquet": _read_parquet,
    "pickle": pd.read_pickle,
    "feather": pd.read_feather,
    "csv": pd.read_csv,  # with the encoding (read_frame)
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


def data_format(path: Path, override: str | None = None) -> str:
    """The format to read --data in: a folder is a parquet dataset (its part files), a file
    is read by `format_of`."""
    if not path.is_dir():
        return format_of(path, override)
    if override not in (None, "parquet"):
        raise InputError(
            f"{path} is a folder, which hvd-cpu reads as a parquet dataset, not as "
            f"{override}; leave out --format or point --data at one {override} file"
        )
    return "parquet"


def _check_exists(path: Path) -> None:
    if not path.exists():
        raise InputError(
            f"data file not found: {path}; check the path (it must exist on every host)"
        )


def _unreadable(path: Path, fmt: str, exc: Exception) -> InputError:
    return InputError(
        f"cannot read {path} as {fmt}: {type(exc).__name__}: {exc}; "
        "check that the file is complete and in the format its extension (or --format) says"
    )


def parquet_rows(path: Path) -> Pieces:
    """A parquet file or folder, opened to be read piece by piece; it must hold rows."""
    _check_exists(path)
    pieces = Pieces.open(path)
    if pieces.rows == 0:
        raise InputError(f"the data has no rows: {path} is empty")
    return pieces


def read_frame(path: Path, fmt: str | None = None, encoding: str | None = None) -> pd.DataFrame:
    """Read a whole DataFrame file or parquet folder (a CSV file in `encoding`, default
    UTF-8); a missing, unreadable or empty one is the user's to fix."""
    fmt = data_format(path, fmt)
    _check_exists(path)
    if fmt == "csv":
        _check_csv_header(path, encoding)
    try:
        frame = READERS[fmt](path, **({"encoding": encoding or "utf-8"} if fmt == "csv" else {}))
    except InputError:
        raise
    except UnicodeDecodeError as exc:
        said = f"{encoding} text either" if encoding else "UTF-8 text"
        raise InputError(
            f"{path} is not {said} (byte 0x{exc.object[exc.start]:02x} at {exc.start}); name "
            "its encoding with --encoding, e.g. --encoding latin-1 or --encoding cp1252"
        ) from exc
    except Exception as exc:  # any reader failure means the file is not what it claims
        raise _unreadable(path, fmt, exc) from exc
    if not isinstance(frame, pd.DataFrame):
        raise InputError(
            f"{path} holds a {type(frame).__name__}, not a pandas DataFrame; save a DataFrame "
            "to it (a Series: series.to_frame())"
        )
    if len(frame) == 0:
        raise InputError(f"the data has no rows: {path} is empty")
    return text_column_names(frame, path)


def _check_csv_header(path: Path, encoding: str | None) -> None:
    """What pandas' CSV reader would hide: it reads a file separated by anything but commas
    as one wide column, and renames a repeated column name `a` to `a.1`."""
    try:
        with path.open(encoding=encoding or "utf-8-sig", newline="") as handle:
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


class InMemory:
    """A frame read whole (any format but a parquet source): parts and batches are views."""

    def __init__(self, frame: pd.DataFrame) -> None:
        self.whole = frame

    @property
    def rows(self) -> int:
        return len(self.whole)

    @property
    def columns(self) -> list[tuple[str, str]]:
        """Each column's name and kind of value, as every rank must read them."""
        return [(str(name), value_kind(dtype)) for name, dtype in self.whole.dtypes.items()]

    def frame(self, start: int = 0, stop: int | None = None) -> pd.DataFrame:
        return self.whole.iloc[start:stop]

    def batches(self) -> Iterator[pd.DataFrame]:
        return row_batches(self.whole)


def value_kind(dtype: Any) -> str:
    """What a column holds, as far as the features care (numbers of any width are one)."""
    if pd.api.types.is_bool_dtype(dtype):
        return "booleans"
    if pd.api.types.is_numeric_dtype(dtype):
        return "numbers"
    if pd.api.types.is_datetime64_any_dtype(dtype):
        return "timestamps"
    if isinstance(dtype, pd.CategoricalDtype) or pd.api.types.is_object_dtype(dtype):
        return "text"
    return "text" if pd.api.types.is_string_dtype(dtype) else str(dtype)


def open_rows(path: Path, fmt: str | None = None, encoding: str | None = None) -> Pieces | InMemory:
    """The rows of --data, ready to be read in parts and batches: parquet stays on disk until
    then (`Pieces`), other formats are read whole now."""
    if data_format(path, fmt) == "parquet":
        return parquet_rows(path)
    return InMemory(read_frame(path, fmt, encoding))


def probe_folder(folder: Path, name: str = ".hvd-cpu-write-test") -> None:
    """Before the work, not after it: that a file `name` can be made in `folder`, folders made
    as needed (raises the OSError). Folders made only to test this go again: the run makes them
    when it has something to write, so one that stops on bad input leaves none behind. The
    probe is a new file of a name no one can guess, so nothing planted there is touched."""
    made = [parent for parent in (folder, *folder.parents) if not parent.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f"{name}.{secrets.token_hex(8)}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NO_LINK, 0o666))
        probe.unlink()
    finally:
        for parent in made:  # the deepest first
            with contextlib.suppress(OSError):
                parent.rmdir()


def check_writable(path: Path) -> None:
    """That the file `path` can be written (probe_folder on its folder) into a folder of this
    user's own, or why not."""
    check_own_folder(path.parent)
    try:
        probe_folder(path.parent, f".{path.name}.hvd-cpu-write-test")
    except OSError as exc:
        raise _write_failure(path, exc) from exc


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
