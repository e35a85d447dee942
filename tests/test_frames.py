"""Reading frames by extension and turning them into arrays; bad input names its fix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from hvd_cpu.data.demo import NOISE_STD, make_demo_frame
from hvd_cpu.data.features import to_arrays
from hvd_cpu.data.frames import read_frame, write_frame
from hvd_cpu.errors import InputError

from .conftest import hvd_cpu


@pytest.mark.parametrize("suffix", [".parquet", ".pkl", ".pickle", ".feather", ".csv"])
def test_every_format_round_trips(tmp_path: Path, suffix: str) -> None:
    frame = make_demo_frame(rows=50, features=3, seed=1)
    path = tmp_path / f"frame{suffix}"
    write_frame(frame, path)
    back = read_frame(path)
    pd.testing.assert_frame_equal(back, frame, check_dtype=suffix != ".csv", atol=1e-6)


def test_demo_target_is_linear_in_the_features_plus_noise_of_known_size() -> None:
    frame = make_demo_frame(rows=20_000, features=4, seed=0)
    arrays = to_arrays(frame, "target")
    design = np.hstack([arrays.x, np.ones((len(arrays), 1), np.float32)])
    coef, *_ = np.linalg.lstsq(design, arrays.y, rcond=None)
    residual = arrays.y - design @ coef
    assert residual.std() == pytest.approx(NOISE_STD, rel=0.05)


def test_arrays_are_float32_with_the_target_split_off() -> None:
    frame = pd.DataFrame({"a": [1, 2], "flag": [True, False], "target": [0.5, 1.5]})
    arrays = to_arrays(frame, "target")
    assert arrays.feature_names == ("a", "flag")
    assert arrays.x.dtype == np.float32 and arrays.x.tolist() == [[1, 1], [2, 0]]
    assert arrays.y.tolist() == [[0.5], [1.5]]


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
    with pytest.raises(InputError, match=r"cannot read .*frame\.parquet as \.parquet"):
        read_frame(path)


def test_missing_target_names_the_option() -> None:
    frame = pd.DataFrame({"a": [1.0], "b": [2.0]})
    with pytest.raises(InputError, match=r"target column 'y' not in the data .*--target"):
        to_arrays(frame, "y")


def test_non_numeric_features_are_named() -> None:
    frame = pd.DataFrame(
        {"a": [1.0], "city": ["Oslo"], "when": pd.to_datetime(["2024-01-01"]), "target": [1.0]}
    )
    with pytest.raises(InputError, match="non-numeric feature columns: city, when"):
        to_arrays(frame, "target")


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
