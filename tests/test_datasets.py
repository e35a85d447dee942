"""Folders of parquet files as Spark, Dask and pyarrow write them, read whole or shard by shard
(--shard-read), and encoded batch by batch exactly as a frame read whole."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hvd_cpu.data.demo import make_demo_frame
from hvd_cpu.data.features import Selection, fit
from hvd_cpu.data.frames import parquet_rows, read_frame
from hvd_cpu.errors import InputError
from hvd_cpu.runtime.alone import Alone

from .jobs import (
    BIN,
    SLOW,
    horovodrun,
    hvd_cpu,
    metrics,
    ranks,
    run,
    skip_without_mpi,
    slow_except,
)

# Slow tests here may run beside another test (launch/test.sh's first stage, two workers).
pytestmark = pytest.mark.beside


def spark_folder(path: Path, frame: pd.DataFrame, files: int, row_group_size: int) -> Path:
    """`frame` in `files` part files, with Spark's _SUCCESS marker and hidden .crc checksums."""
    path.mkdir()
    for i, part in enumerate(np.array_split(np.arange(len(frame)), files)):
        name = f"part-{i:05d}-c000.snappy.parquet"
        frame.iloc[part].to_parquet(path / name, index=False, row_group_size=row_group_size)
        (path / f".{name}.crc").write_bytes(b"\x00crc")
    (path / "_SUCCESS").touch()
    return path


def hive_folder(path: Path, frame: pd.DataFrame) -> Path:
    """`frame` partitioned as year=.../city=.../part-0.parquet."""
    table = pa.Table.from_pandas(frame, preserve_index=False)
    pq.write_to_dataset(table, path, partition_cols=["year", "city"])
    return path


def dask_folder(path: Path, frame: pd.DataFrame, files: int) -> Path:
    """`frame` in `files` part files as Dask writes them (part.N.parquet), with the
    `_metadata` file that holds every part's row groups and `_common_metadata` (the schema)."""
    path.mkdir()
    parts: list[pq.FileMetaData] = []
    for i, rows in enumerate(np.array_split(np.arange(len(frame)), files)):
        table = pa.Table.from_pandas(frame.iloc[rows], preserve_index=False)
        pq.write_table(table, path / f"part.{i}.parquet", metadata_collector=parts)
        parts[-1].set_file_path(f"part.{i}.parquet")
    schema = pa.Schema.from_pandas(frame, preserve_index=False)
    pq.write_metadata(schema, path / "_common_metadata")
    pq.write_metadata(schema, path / "_metadata", metadata_collector=parts)
    return path


def test_a_spark_folder_reads_as_its_part_files_in_order(tmp_path: Path) -> None:
    frame = make_demo_frame(rows=1000, features=3)
    folder = spark_folder(tmp_path / "out.parquet", frame, files=3, row_group_size=100)
    pd.testing.assert_frame_equal(read_frame(folder), frame)
    assert len(parquet_rows(folder).pieces) == 3 * 4  # 334/333/333 rows in 4 row groups each


def test_hive_partition_keys_become_columns(tmp_path: Path) -> None:
    frame = make_demo_frame(rows=400, features=2).assign(
        year=np.repeat([2013, 2014], 200), city=np.tile(["oslo", "rome"], 200)
    )
    read = read_frame(hive_folder(tmp_path / "flights", frame))
    assert list(read.columns) == ["x0", "x1", "target", "year", "city"]
    assert read["year"].dtype.kind == "i"
    assert len(read) == 400
    expected = frame.sort_values(["year", "city"], kind="stable").reset_index(drop=True)
    pd.testing.assert_frame_equal(read, expected, check_dtype=False)
    transform = fit(read, Selection(), "regression", 32, False, Alone())
    names = [c.name for c in transform.outputs]
    assert names == ["x0", "x1", "year", "city=oslo", "city=rome"]  # integers stay numbers


def test_shards_of_a_folder_are_contiguous_disjoint_balanced_and_cover_it(tmp_path: Path) -> None:
    frame = make_demo_frame(rows=1200, features=2)
    folder = spark_folder(tmp_path / "data", frame, files=4, row_group_size=100)
    shards = [parquet_rows(folder).shard(rank, 3) for rank in range(3)]
    pd.testing.assert_frame_equal(pd.concat([s.frame() for s in shards], ignore_index=True), frame)
    assert [s.rows for s in shards] == [400, 400, 400]
    assert [len(s.pieces) for s in shards] == [4, 4, 4]
    with pytest.raises(InputError, match=r"has 12 row group\(s\), fewer than the 13 ranks"):
        parquet_rows(folder).shard(0, 13)


@pytest.mark.parametrize("start, stop", [(0, 1200), (0, 0), (250, 750), (299, 301), (1199, 1200)])
def test_a_part_of_a_folder_reads_only_its_rows(tmp_path: Path, start: int, stop: int) -> None:
    frame = make_demo_frame(rows=1200, features=2)
    rows = parquet_rows(spark_folder(tmp_path / "data", frame, files=4, row_group_size=100))
    part = rows.frame(start, stop).reset_index(drop=True)
    pd.testing.assert_frame_equal(part, frame.iloc[start:stop].reset_index(drop=True))


def test_encoding_batch_by_batch_equals_encoding_the_whole_frame(tmp_path: Path) -> None:
    frame = make_demo_frame(rows=3000, features=3).assign(
        kind=np.tile(["a", "b", None], 1000), flag=np.tile([True, False, True], 1000)
    )
    frame.loc[::7, "target"] = np.nan  # rows without a target are left out of both
    frame.loc[::5, "x1"] = np.nan
    folder = spark_folder(tmp_path / "data", frame, files=3, row_group_size=256)
    transform = fit(frame, Selection(), "regression", 32, False, Alone())
    whole = transform.arrays(frame)
    rows = parquet_rows(folder)
    streamed = transform.encode(rows.batches(), rows.rows)
    assert len(streamed) == len(whole) < len(frame)
    np.testing.assert_array_equal(streamed.x, whole.x)
    np.testing.assert_array_equal(streamed.y, whole.y)


BAD_FOLDERS = {
    "empty": (lambda p: p.mkdir(), (), "holds no parquet files (names starting with _ or ."),
    "only-success": (
        lambda p: (p.mkdir(), (p / "_SUCCESS").touch()),
        (),
        "holds no parquet files",
    ),
    "format-csv": (
        lambda p: spark_folder(p, make_demo_frame(rows=10, features=2), 1, 10),
        ("--format", "csv"),
        "is a folder, which hvd-cpu reads as a parquet dataset, not as csv",
    ),
    "not-parquet": (
        lambda p: (p.mkdir(), (p / "part-0.csv").write_text("a,b\n1,2\n")),
        (),
        "as parquet: ArrowInvalid",
    ),
}


@pytest.mark.parametrize("case", slow_except(BAD_FOLDERS, ["empty"]))
def test_bad_folders_are_one_line_from_rank_0(tmp_path: Path, case: str) -> None:
    make, args, expected = BAD_FOLDERS[case]
    make(tmp_path / "data")
    done = horovodrun(
        2, "train", "--data", str(tmp_path / "data"), *args, "--output", str(tmp_path)
    )
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [(rank, text) for rank, text in done.rank_lines() if "hvd-cpu: error:" in text]
    assert len(errors) == 1 and errors[0][0] == 0 and expected in errors[0][1], done.stderr


@SLOW
def test_shard_read_over_a_folder_gives_each_rank_its_own_rows(tmp_path: Path) -> None:
    frame = make_demo_frame(rows=4000, features=4)
    folder = spark_folder(tmp_path / "data", frame, files=5, row_group_size=400)
    output = tmp_path / "out"
    args = ("--epochs", "1", "--val-fraction", "0", "--output", str(output))
    done = horovodrun(2, "train", "--data", str(folder), "--shard-read", *args)
    assert done.returncode == 0, done.stdout + done.stderr
    read = [r["rows_read"] for r in ranks(output)]
    assert sum(read) == 4000 and abs(read[0] - read[1]) <= 400  # whole row groups, balanced
    predicted = tmp_path / "predictions.parquet"
    done = horovodrun(2, "predict", "--model", str(output), "--data", str(folder),
                      "--output", str(predicted))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    one = hvd_cpu("predict", "--model", str(output), "--data", str(folder),
                  "--output", str(tmp_path / "one.parquet"))  # fmt: skip
    assert one.returncode == 0, one.stderr
    pd.testing.assert_frame_equal(
        pd.read_parquet(predicted), pd.read_parquet(tmp_path / "one.parquet")
    )  # the input's order, whichever rank predicted a row


@pytest.mark.parametrize("shard_read", slow_except([False, True], [False]))
def test_a_dask_folder_with_metadata_files_trains_on_its_rows_once(
    tmp_path: Path, shard_read: bool
) -> None:
    """README: --data may be a folder as Dask writes it; its _metadata (every part's row
    groups again) and _common_metadata are not read as rows."""
    folder = dask_folder(tmp_path / "data", make_demo_frame(rows=1000, features=4), files=4)
    assert pq.read_metadata(folder / "_metadata").num_rows == 1000  # a footer pyarrow can read
    output = tmp_path / "out"
    args = ["--epochs", "1", "--val-fraction", "0", "--output", str(output)]
    args += ["--shard-read"] if shard_read else []
    done = horovodrun(2, "train", "--data", str(folder), *args)
    assert done.returncode == 0, done.stdout + done.stderr
    read = [r["rows_read"] for r in ranks(output)]
    assert read == ([500, 500] if shard_read else [1000, 1000])  # parts of 250 rows each
    [epoch] = metrics(output)
    assert epoch["samples"] == 1000  # 500 each: no rank pads its shard


def test_too_few_pieces_for_the_ranks_is_one_line_from_rank_0(tmp_path: Path) -> None:
    folder = spark_folder(tmp_path / "data", make_demo_frame(rows=100, features=2), 1, 100)
    done = horovodrun(2, "train", "--data", str(folder), "--shard-read", "--output", str(tmp_path))
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [(rank, text) for rank, text in done.rank_lines() if "hvd-cpu: error:" in text]
    assert len(errors) == 1 and errors[0][0] == 0, done.stderr
    assert "has 1 row group(s), fewer than the 2 ranks" in errors[0][1]


def parts_that_disagree(path: Path, change: str) -> Path:
    """Two part files of one dataset, the second changed as the case says."""
    path.mkdir()
    frame = make_demo_frame(rows=600, features=3, seed=5)
    frame.iloc[:300].to_parquet(path / "part-0.parquet", index=False, row_group_size=100)
    second = frame.iloc[300:].copy()
    if change == "text":  # numbers in one file, text in the other (not even numeric text)
        second["x1"] = "level-" + second["x1"].round(1).astype(str)
    elif change == "missing":
        second = second.drop(columns="x2")
    elif change == "extra":
        second["note"] = "late"
    elif change == "order":
        second = second[second.columns[::-1]]
    elif change == "wider":  # whole numbers in one file, floats in the other
        second["x1"] = (second["x1"] * 100).round().astype("int64")
    elif change == "all-missing":
        second["x2"] = None
    second.to_parquet(path / "part-1.parquet", index=False, row_group_size=100)
    return path


DISAGREEING = {
    "text": "column 'x1' holds numbers in part-0.parquet but text in part-1.parquet",
    "missing": "column 'x2' is in part-0.parquet but not in part-1.parquet",
    "extra": "column 'note' is in part-1.parquet but not in part-0.parquet",
}


@pytest.mark.parametrize("change", [*DISAGREEING, "order", "wider", "all-missing"])
def test_files_of_a_folder_that_disagree_are_refused_and_those_that_agree_read_alike(
    tmp_path: Path, change: str
) -> None:
    folder = parts_that_disagree(tmp_path / "data", change)
    if change in DISAGREEING:
        with pytest.raises(InputError, match=DISAGREEING[change]):
            parquet_rows(folder)
        return
    rows = parquet_rows(folder)  # read by name, numbers as float64, empty columns as missing
    second = rows.frame(300, 600)
    assert list(second.columns) == ["x0", "x1", "x2", "target"]
    first = rows.frame(0, 300)
    assert list(first.columns) == list(second.columns)
    assert (second.dtypes == first.dtypes).all()
    assert second.dtypes["x1"] == (np.float64 if change == "wider" else np.float32)
    expected = pd.read_parquet(folder / "part-1.parquet")[list(second.columns)]
    pd.testing.assert_frame_equal(second.reset_index(drop=True), expected.astype(second.dtypes))


JOBS_THAT_READ = [(2, False, "train"), (3, True, "train"), (2, False, "predict")]


@pytest.mark.parametrize(
    "np_, shard_read, command", slow_except(JOBS_THAT_READ, JOBS_THAT_READ[:1])
)
def test_ranks_reading_files_that_disagree_stop_with_one_line(
    tmp_path: Path, np_: int, shard_read: bool, command: str
) -> None:
    """Each rank reads other files of the folder (fitting on its part, or --shard-read): the
    files are compared before anything is fitted, and no rank hangs in a collective."""
    folder = parts_that_disagree(tmp_path / "data", "text")
    args = ["--data", str(folder), "--output", str(tmp_path / "out")]
    if command == "predict":
        trained = tmp_path / "model"
        good = spark_folder(tmp_path / "good", make_demo_frame(rows=600, features=3), 2, 100)
        assert hvd_cpu("train", "--data", str(good), "--epochs", "1", "--quiet",
                       "--output", str(trained)).returncode == 0  # fmt: skip
        args = ["--model", str(trained), "--data", str(folder), "--output", str(tmp_path / "p.csv")]
    done = horovodrun(np_, command, *args, *(["--shard-read"] if shard_read else []), timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [(rank, text) for rank, text in done.rank_lines() if "hvd-cpu: error:" in text]
    assert len(errors) == 1 and errors[0][0] == 0, done.stderr
    assert DISAGREEING["text"] in errors[0][1]
    assert "Traceback" not in done.stdout + done.stderr


def test_copies_that_differ_between_hosts_are_named_by_rank_and_host(tmp_path: Path) -> None:
    """Each rank of a real MPI job reads its own copy of --data (mpirun's rank-by-rank
    command lines stand for two hosts with different files at one path)."""
    skip_without_mpi()
    frame = make_demo_frame(rows=400, features=3, seed=6)
    copies = {
        "rows": frame.iloc[:300],
        "order": frame[frame.columns[::-1]],
        "kind": frame.assign(x2=np.where(frame["x2"] > 0, "high", "low")),
    }
    frame.to_csv(tmp_path / "ours.csv", index=False)
    expected = {
        "rows": "rank 1 on {host} has 300 rows where rank 0 on {host} has 400",
        "order": "rank 1 on {host} has the columns in another order than rank 0 on {host}",
        "kind": "rank 1 on {host} reads column 'x2' as text where rank 0 on {host} reads numbers",
    }
    for case, copy in copies.items():
        copy.to_csv(tmp_path / f"{case}.csv", index=False)
        rank = ["--allow-run-as-root", "--tag-output", "-np", "1", str(BIN / "hvd-cpu"), "train",
                "--epochs", "1", "--output", str(tmp_path / case), "--data"]  # fmt: skip
        done = run(["mpirun", *rank, str(tmp_path / "ours.csv"), ":", *rank[2:],
                    str(tmp_path / f"{case}.csv")], timeout=120)  # fmt: skip
        assert done.returncode == 2, done.stdout + done.stderr
        errors = [(r, text) for r, text in done.rank_lines() if "hvd-cpu: error:" in text]
        assert len(errors) == 1 and errors[0][0] == 0, done.stderr
        assert expected[case].format(host=socket.gethostname()) in errors[0][1], errors
