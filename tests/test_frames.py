"""Reading frames by extension and turning them into arrays; bad input names its fix."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from hvd_cpu.data.demo import make_demo_frame
from hvd_cpu.data.frames import parquet_rows, read_frame, write_frame
from hvd_cpu.data.parquet import assign_pieces
from hvd_cpu.errors import InputError

from .jobs import hvd_cpu


@pytest.mark.parametrize("suffix", [".parquet", ".pkl", ".pickle", ".feather", ".csv"])
def test_every_format_round_trips(tmp_path: Path, suffix: str) -> None:
    frame = make_demo_frame(rows=50, features=3, seed=1)
    path = tmp_path / f"frame{suffix}"
    write_frame(frame, path)
    back = read_frame(path)
    pd.testing.assert_frame_equal(back, frame, check_dtype=suffix != ".csv", atol=1e-6)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("frame.xlsx", "unknown data format '.xlsx'"),
        ("frame", "unknown data format '(no extension)'"),
        ("missing.parquet", "data file not found"),
    ],
)
def test_bad_paths_say_what_is_wrong(tmp_path: Path, name: str, expected: str) -> None:
    with pytest.raises(InputError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        read_frame(tmp_path / name)


def test_a_corrupt_file_is_an_input_error(tmp_path: Path) -> None:
    path = tmp_path / "frame.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match=r"cannot read .*frame\.parquet as parquet: ArrowInvalid"):
        read_frame(path)


def test_make_demo_data_never_overwrites_without_asking(tmp_path: Path) -> None:
    path = tmp_path / "frame.csv"
    path.write_text("precious\n")
    refused = hvd_cpu("make-demo-data", str(path), "--rows", "10")
    assert refused.returncode == 2
    assert (
        refused.stderr.strip()
        == f"hvd-cpu: error: {path} exists; pass --overwrite to replace it or choose another path"
    )
    assert path.read_text() == "precious\n"

    made = hvd_cpu("make-demo-data", str(path), "--rows", "10", "--features", "2", "--overwrite")
    assert made.returncode == 0, made.stderr
    assert list(read_frame(path).columns) == ["x0", "x1", "target"]


@pytest.mark.parametrize("suffix", [".parquet", ".pkl", ".csv"])
def test_an_empty_frame_is_an_input_error(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"frame{suffix}"
    write_frame(make_demo_frame(rows=5, features=2).iloc[:0], path)
    with pytest.raises(InputError, match="the data has no rows"):
        read_frame(path)
    if suffix == ".parquet":
        with pytest.raises(InputError, match="the data has no rows"):
            parquet_rows(path)


def test_format_option_overrides_the_extension(tmp_path: Path) -> None:
    path = tmp_path / "frame.data"
    make_demo_frame(rows=5, features=2).to_parquet(path)
    assert len(read_frame(path, "parquet")) == 5


@pytest.mark.parametrize(
    ("rows", "size", "expected"),
    [
        ([10] * 8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        ([100, 1, 1, 1], 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),  # never an empty rank
        ([5, 5, 100, 5, 5], 2, [(0, 3), (3, 5)]),
        ([7], 1, [(0, 1)]),
    ],
)
def test_pieces_split_into_contiguous_non_empty_runs(rows, size, expected) -> None:
    assert [(r.start, r.stop) for r in assign_pieces(rows, size)] == expected


def test_shard_reads_give_each_rank_its_own_rows(tmp_path: Path) -> None:
    path = tmp_path / "frame.parquet"
    frame = make_demo_frame(rows=1000, features=2)
    frame.to_parquet(path, row_group_size=100)
    shards = [parquet_rows(path).shard(rank, 3).frame() for rank in range(3)]
    pd.testing.assert_frame_equal(pd.concat(shards, ignore_index=True), frame)
    assert [len(s) for s in shards] == [400, 300, 300]
    with pytest.raises(InputError, match="has 10 row group"):
        parquet_rows(path).shard(0, 11)
