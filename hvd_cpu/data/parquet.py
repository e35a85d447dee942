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
# holds a compressed row group beside the decoded batches: measured, 40 MB more at the peak).
SCAN = ds.ParquetFragmentScanOptions(pre_buffer=False)


@dataclass(frozen=True)
class Piece:
    """One row group of one file, with its row count from the file's footer."""

    fragment: ds.ParquetFileFragment
    rows: int


def to_pandas(table: pa.Table) -> pd.DataFrame:
    """Convert without holding the Arrow and pandas copies at once (peak memory ~1x, not 3x).

    The pandas columns come from the system allocator, which hands a column's memory back
    when the frame is dropped; from jemalloc a third of the frame stayed resident (measured).
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
            pieces = [
                Piece(group, group.row_groups[0].num_rows)
                for fragment in dataset.get_fragments()
                for group in fragment.split_by_row_group()
            ]
        except InputError:
            raise
        except Exception as exc:  # any reader failure means a file is not what it claims
            raise unreadable(path, exc) from exc
        return cls(path, dataset.schema, [p for p in pieces if p.rows])

    @property
    def rows(self) -> int:
        return sum(piece.rows for piece in self.pieces)

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
