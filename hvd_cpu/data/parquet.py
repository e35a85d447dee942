"""Parquet files and folders of part files (datasets) as pieces: one row group of one file.

Pieces are the unit of reading: `--shard-read` hands each rank a contiguous run of them, and
every reader decodes one piece at a time, so decoding buffers stay at one row group instead
of the whole table. A folder is read as Spark, Dask and pyarrow write it: every parquet file
below it, `key=value` folder names (hive partitioning) as columns, and files whose names start
with `_` or `.` (`_SUCCESS`, `.crc` checksums) skipped.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds

from hvd_cpu.data.columns import BATCH, text_column_names
from hvd_cpu.errors import InputError

# Column chunks read as they are decoded, not the whole row group's first (pre-buffering
# would hold a compressed row group beside the decoded batches, at the peak).
SCAN = ds.ParquetFragmentScanOptions(pre_buffer=False)


@dataclass(frozen=True)
class Piece:
    """One row group of one file, with its row count from the file's footer."""

    fragment: ds.ParquetFileFragment
    rows: int


def to_pandas(table: pa.Table) -> pd.DataFrame:
    """Convert without holding the Arrow and pandas copies at once (peak memory ~1x, not 3x).

    The pandas columns come from the system allocator, which hands a column's memory back
    when the frame is dropped; from jemalloc part of the frame stays resident.
    """
    return table.to_pandas(
        memory_pool=pa.system_memory_pool(), split_blocks=True, self_destruct=True
    )


class Pieces:
    """The pieces of a parquet file or folder, in file order then row-group order."""

    def __init__(self, path: Path, schema: pa.Schema, pieces: list[Piece]) -> None:
        self.path = path
        self.schema = schema
        self.pieces = pieces

    @classmethod
    def open(cls, path: Path) -> Pieces:
        """Read the footers (not the data) of `path`; a folder without parquet files or a file
        that is not parquet is the user's to fix."""
        _return_freed_memory()
        try:
            dataset = ds.dataset(path, format="parquet", partitioning="hive")
            if path.is_dir() and not dataset.files:
                raise InputError(
                    f"{path} holds no parquet files (names starting with _ or . are skipped); "
                    "point --data at a parquet file or a folder of them"
                )
            fragments = list(dataset.get_fragments())
            schema = agreed_schema(dataset.schema, fragments, path)
            pieces = [
                Piece(group, group.row_groups[0].num_rows)
                for fragment in fragments
                for group in fragment.split_by_row_group()
            ]
        except InputError:
            raise
        except Exception as exc:  # any reader failure means a file is not what it claims
            raise unreadable(path, exc) from exc
        return cls(path, schema, [p for p in pieces if p.rows])

    @property
    def rows(self) -> int:
        return sum(piece.rows for piece in self.pieces)

    @property
    def columns(self) -> list[tuple[str, str]]:
        """Each column's name and kind of value, as every rank must read them."""
        return [(field.name, kind(field.type)) for field in self.schema]

    def shard(self, rank: int, size: int) -> Pieces:
        """This rank's contiguous run of pieces, about 1/size of the rows."""
        if len(self.pieces) < size:
            raise InputError(
                f"{self.path} has {len(self.pieces)} row group(s), fewer than the {size} ranks, "
                "so --shard-read cannot give every rank rows; rewrite it with smaller row groups "
                "(e.g. frame.to_parquet(path, row_group_size=100_000)) or drop --shard-read"
            )
        run = assign_pieces([piece.rows for piece in self.pieces], size)[rank]
        return Pieces(self.path, self.schema, self.pieces[run.start : run.stop])

    def frame(self, start: int = 0, stop: int | None = None) -> pd.DataFrame:
        """Rows [start, stop) as one DataFrame, reading only the pieces that hold them."""
        stop = self.rows if stop is None else stop
        ends = list(itertools.accumulate(piece.rows for piece in self.pieces))
        first = bisect.bisect_right(ends, start)
        last = bisect.bisect_right(ends, stop - 1) + 1 if stop > start else first
        skip = ends[first - 1] if first else 0
        batches = [batch for piece in self.pieces[first:last] for batch in self._read(piece)]
        table = pa.Table.from_batches(batches, self.schema).slice(start - skip, stop - start)
        del batches  # then only the table holds them: converting frees each column as it goes
        return text_column_names(to_pandas(table), self.path)

    def batches(self) -> Iterator[pd.DataFrame]:
        """Every row, BATCH rows at a time, as DataFrames."""
        for piece in self.pieces:
            for batch in self._read(piece):
                yield text_column_names(to_pandas(pa.Table.from_batches([batch])), self.path)

    def _read(self, piece: Piece) -> Iterator[pa.RecordBatch]:
        try:
            yield from piece.fragment.to_batches(
                schema=self.schema,
                batch_size=BATCH,
                batch_readahead=0,
                fragment_readahead=0,
                fragment_scan_options=SCAN,
            )
        except Exception as exc:
            raise unreadable(Path(piece.fragment.path), exc) from exc


def kind(data_type: pa.DataType) -> str:
    """What a column holds, as far as the features care: numbers of any width are one kind."""
    if pa.types.is_integer(data_type) or pa.types.is_floating(data_type):
        return "numbers"
    if pa.types.is_string(data_type) or pa.types.is_large_string(data_type):
        return "text"
    if pa.types.is_dictionary(data_type):
        return kind(data_type.value_type)
    if pa.types.is_timestamp(data_type):
        return "timestamps"
    return str(data_type)


def agreed_schema(schema: pa.Schema, fragments: list[ds.Fragment], path: Path) -> pa.Schema:
    """The schema every file of a folder is read with, once each file's own (its footer) has
    been checked against the first's: the same columns (in any order: they are read by name),
    each holding one kind of value (a column all missing in one file holds any). The dataset's
    own schema is the first file's, into which pyarrow would quietly cast the others (a text
    column read as numbers, a missing column as empty): ranks reading different files would
    then fit different statistics. Numbers of different widths are read as float64."""
    if len(fragments) < 2:
        return schema
    first, first_name = fragments[0].physical_schema, _relative(fragments[0], path)
    widened: dict[str, pa.DataType] = {}
    for fragment in fragments[1:]:
        other, name = fragment.physical_schema, _relative(fragment, path)
        for a, b, in_a, in_b in (
            (first, other, first_name, name),
            (other, first, name, first_name),
        ):
            missing = [column for column in a.names if column not in b.names]
            if missing:
                raise InputError(
                    f"column {missing[0]!r} is in {in_a} but not in {in_b} ({path}); every "
                    "file of a dataset needs the same columns: rewrite them, or read one file"
                )
        for field in other:
            ours = first.field(field.name).type
            if field.type == ours or pa.types.is_null(field.type):
                continue
            if pa.types.is_null(ours):
                widened.setdefault(field.name, field.type)
            elif kind(field.type) == kind(ours):
                if kind(ours) == "numbers":
                    widened[field.name] = pa.float64()
            else:
                raise InputError(
                    f"column {field.name!r} holds {kind(ours)} in {first_name} but "
                    f"{kind(field.type)} in {name} ({path}); every file of a dataset needs one "
                    "kind of value per column: rewrite them with one type"
                )
    for column, data_type in widened.items():
        schema = schema.set(schema.get_field_index(column), pa.field(column, data_type))
    return schema


def _relative(fragment: ds.Fragment, path: Path) -> str:
    """A file of the dataset as the user finds it in the folder."""
    return str(Path(fragment.path).relative_to(path)) if path.is_dir() else fragment.path


def _return_freed_memory() -> None:
    """Freed Arrow buffers go back to the system at once: a table is converted to pandas
    column by column, and each column's Arrow copy must be gone before the next is made for the
    peak to stay near one copy. Measured: without this, the rank's part of the table stays
    resident 1.4 times over (pyarrow's docstring says 0 is jemalloc's default; here it is not).
    Builds of pyarrow without jemalloc (see hvd_cpu/__init__.py) keep their default."""
    with contextlib.suppress(NotImplementedError):
        pa.jemalloc_set_decay_ms(0)


def unreadable(path: Path, exc: Exception) -> InputError:
    what = "every file in it is" if path.is_dir() else "the file is complete and"
    return InputError(
        f"cannot read {path} as parquet: {type(exc).__name__}: {' '.join(str(exc).split())}; "
        f"check that {what} parquet"
    )


def assign_pieces(rows: list[int], size: int) -> list[range]:
    """Split pieces (given their row counts) into `size` contiguous, non-empty runs of about
    equal rows. Needs at least `size` pieces."""
    starts = list(itertools.accumulate(rows, initial=0))
    bounds = [0]
    for rank in range(1, size):
        first = bisect.bisect_left(starts, rank * starts[-1] / size)
        bounds.append(min(max(first, bounds[-1] + 1), len(rows) - (size - rank)))
    bounds.append(len(rows))
    return [range(bounds[r], bounds[r + 1]) for r in range(size)]
