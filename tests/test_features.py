"""Fitting and applying the feature transformation in one process (ranks: see test_messy.py)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from hvd_cpu.data.demo import NOISE_STD, make_demo_frame
from hvd_cpu.data.features import FeatureTransform, Selection, fit
from hvd_cpu.errors import InputError
from hvd_cpu.runtime.alone import Alone

from .messy import messy_frame


def fit_one(frame: pd.DataFrame, task: str = "regression", max_categories: int = 32, **sel):
    selection = Selection(**sel) if sel else Selection()
    return fit(frame, selection, task, max_categories, False, Alone())


def test_demo_target_is_linear_in_the_features_plus_noise_of_known_size() -> None:
    frame = make_demo_frame(rows=20_000, features=4, seed=0)
    arrays = fit_one(frame).arrays(frame)
    design = np.hstack([arrays.x, np.ones((len(arrays), 1), np.float32)])
    coef, *_ = np.linalg.lstsq(design, arrays.y, rcond=None)
    assert (arrays.y - design @ coef).std() == pytest.approx(NOISE_STD, rel=0.05)


def test_a_messy_frame_becomes_clean_standardised_numbers() -> None:
    frame = messy_frame()
    transform = fit_one(frame, drop=("id",))
    kinds = {c.name: c.kind for c in transform.inputs}
    assert kinds == {
        "size": "numeric",
        "city": "category",
        "when": "datetime",
        "flag": "bool",
        "grade": "category",
        "constant": "numeric",
        "empty": "empty",
    }
    names = [c.name for c in transform.outputs]
    assert "city=<missing>" in names and "city=Oslo" in names and "grade=c" in names
    assert {"when", "when.month", "when.day_of_week"} <= set(names)
    assert "id" not in names
    report = transform.report
    assert report.dropped_columns == {
        "when.year": "constant",  # all of 2024
        "when.hour": "constant",
        "constant": "constant",
        "empty": "entirely missing",
    }
    assert report.rows == len(frame)
    assert report.dropped_rows == int(frame["target"].isna().sum()) > 0
    valid = frame[frame["target"].notna()]
    assert report.filled == {
        "size": int(valid["size"].isna().sum()),
        "city": int(valid["city"].isna().sum()),
        "when": int(valid["when"].isna().sum()),
    }

    arrays = transform.arrays(frame)
    assert arrays.x.dtype == np.float32 and arrays.y.dtype == np.float32
    assert arrays.x.shape == (len(valid), len(names)) and not np.isnan(arrays.x).any()
    np.testing.assert_allclose(arrays.x.mean(axis=0), 0, atol=1e-5)
    np.testing.assert_allclose(arrays.x.std(axis=0), 1, atol=1e-4)
    flag = arrays.x[:, names.index("flag")]
    assert len(np.unique(flag)) == 2  # booleans stay two values, scaled


def test_the_transform_survives_json_and_gives_the_same_matrix() -> None:
    frame = messy_frame()
    transform = fit_one(frame, drop=("id",))
    again = FeatureTransform.from_dict(json.loads(json.dumps(transform.to_dict())))
    assert again == transform
    np.testing.assert_array_equal(again.features(frame), transform.features(frame))


def test_classification_finds_classes_and_encodes_them() -> None:
    frame = pd.DataFrame({"x": np.arange(6.0), "label": ["b", "a", "c", "a", None, "b"]})
    transform = fit_one(frame, "classification", targets=("label",))
    assert transform.classes == ("a", "b", "c") and transform.n_outputs == 3
    arrays = transform.arrays(frame)
    assert arrays.y.tolist() == [1, 0, 2, 0, 1] and arrays.y.dtype == np.int64


def test_features_and_drop_choose_the_inputs() -> None:
    frame = messy_frame()
    transform = fit_one(frame, features=("size", "flag", "id"), drop=("id",))
    assert [c.name for c in transform.inputs] == ["size", "flag"]


@pytest.mark.parametrize(
    ("change", "options", "message"),
    [
        (lambda f: f.drop(columns="target"), {}, r"target column 'target' not in the data"),
        (lambda f: f.assign(target="x"), {}, r"target column 'target' is not numeric .*--task"),
        (lambda f: f.assign(target=1.0), {}, r"target column 'target' is constant"),
        (lambda f: f, {"features": ("nope",)}, r"feature column 'nope' not in .*--features"),
        (lambda f: f, {"drop": ("nope",)}, r"feature column 'nope' not in .*--drop"),
        (
            lambda f: f.set_axis([*f.columns[:-2], "size", "target"], axis=1),
            {},
            r"duplicate column names in the data: size",
        ),
        (
            lambda f: f.assign(city=[f"c{i}" for i in range(len(f))]),
            {},
            r"column 'city' has 390 distinct values, more than --max-categories 32",
        ),
        (
            lambda f: f.assign(size=[[1]] * len(f)),
            {},
            r"column 'size' holds values of an unsupported \(mixed\) type",
        ),
    ],
)
def test_bad_frames_are_named(change, options, message) -> None:
    with pytest.raises(InputError, match=message):
        fit_one(change(messy_frame()), **options)


def test_one_class_is_not_a_classification() -> None:
    frame = pd.DataFrame({"x": [1.0, 2.0], "target": ["a", "a"]})
    with pytest.raises(InputError, match="has 1 class"):
        fit_one(frame, "classification")
