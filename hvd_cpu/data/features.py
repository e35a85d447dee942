"""From DataFrame columns to float32 matrices: typing, encoding, filling, scaling.

Statistics (means, standard deviations, category levels, classes, counts) are summed over the
rows of all ranks through the `Collectives` passed in, so `-np 4` fits the transformation
that one process would fit on the whole table: the same columns, levels and classes, and
means and deviations equal beyond float rounding. The fitted `FeatureTransform`
is plain data (JSON), saved next to the model and applied again by `predict`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pandas as pd
from pandas.api import types

from hvd_cpu.config.options import Task
from hvd_cpu.data.columns import check_unique_columns, row_batches
from hvd_cpu.errors import InputError

if TYPE_CHECKING:  # the interface only: fitting needs no torch
    from hvd_cpu.runtime.collectives import Collectives


class Kind(StrEnum):
    """How an input column becomes numbers (features.json keeps the value)."""

    NUMERIC = "numeric"
    BOOL = "bool"
    DATETIME = "datetime"
    TIMEDELTA = "timedelta"
    CATEGORY = "category"
    EMPTY = "empty"  # no value on any rank: a column of NaN, filled like a number


MISSING_LEVEL = "<missing>"
DATETIME_PARTS = ("year", "month", "day", "day_of_week", "hour")
NUMBERS = ("integer", "floating", "mixed-integer-float", "decimal", "empty")
# What a classification target may hold: values that name a class and survive features.json.
LABELS = (
    "string",
    "integer",
    "floating",
    "mixed-integer",
    "mixed-integer-float",
    "boolean",
    "categorical",
    "empty",
)


@dataclass(frozen=True)
class Arrays:
    """Features and targets as contiguous matrices, one row per sample."""

    x: np.ndarray  # float32 (rows, features)
    y: np.ndarray  # float32 (rows, targets) for regression, int64 (rows,) class indices
    feature_names: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.x)


@dataclass(frozen=True)
class Selection:
    """Which columns are targets and which are features, as the user named them."""

    targets: tuple[str, ...] = ("target",)
    features: tuple[str, ...] | None = None  # None: every column that is not a target
    drop: tuple[str, ...] = ()


@dataclass(frozen=True)
class InputColumn:
    """One input column and how it becomes numbers."""

    name: str
    kind: Kind
    levels: tuple[str, ...] = ()  # one-hot levels of a category column

    def expand(self, series: pd.Series) -> Iterator[tuple[str, np.ndarray]]:
        """(output name, float64 values with NaN where missing) for each derived column."""
        if self.kind in (Kind.NUMERIC, Kind.BOOL, Kind.EMPTY):
            yield self.name, _floats(_numbers(series, self.name))
        elif self.kind == Kind.TIMEDELTA:
            seconds = _parsed(pd.to_timedelta, series, self.name, "durations")
            yield self.name, _floats(seconds / pd.Timedelta(seconds=1))
        elif self.kind == Kind.DATETIME:
            stamps = _parsed(partial(pd.to_datetime, utc=True), series, self.name, "timestamps")
            # In the column's own unit: a date before 1677 has no nanosecond timestamp.
            epoch = pd.Timestamp(0, tz="UTC").as_unit(stamps.dt.unit)
            yield self.name, _floats((stamps - epoch) / pd.Timedelta(seconds=1))
            for part in DATETIME_PARTS:
                yield f"{self.name}.{part}", _floats(getattr(stamps.dt, part))
        else:
            labels = _labels(series).fillna(MISSING_LEVEL)
            for level in self.levels:
                yield f"{self.name}={level}", (labels == level).to_numpy(np.float64)


@dataclass(frozen=True)
class OutputColumn:
    """One column of the feature matrix: filled with `mean`, then scaled by (x - mean) / std."""

    name: str
    mean: float
    std: float


@dataclass
class FitReport:
    """What the fit changed in the data, for the user to see."""

    rows: int = 0
    dropped_rows: int = 0  # target missing or not finite
    filled: dict[str, int] = field(default_factory=dict)  # input column -> missing values
    dropped_columns: dict[str, str] = field(default_factory=dict)  # output column -> why

    def lines(self) -> list[str]:
        """One line per change, each starting with 'note:' or, for dropped columns, 'warning:'."""
        out = []
        if self.dropped_rows:
            out.append(
                f"note: dropped {self.dropped_rows} of {self.rows} rows whose target is missing"
            )
        if self.filled:
            counts = ", ".join(f"{name}: {count}" for name, count in self.filled.items())
            out.append(
                f"note: filled {sum(self.filled.values())} missing feature values ({counts})"
            )
        out += [f"warning: column {n} is {why}; dropped" for n, why in self.dropped_columns.items()]
        return out


@dataclass(frozen=True)
class FeatureTransform:
    """The fitted transformation: apply it to any frame with the same input columns."""

    task: Task
    targets: tuple[str, ...]
    inputs: tuple[InputColumn, ...]
    outputs: tuple[OutputColumn, ...]
    classes: tuple[Any, ...] = ()  # classification: label of each class index
    target_scale: tuple[OutputColumn, ...] = ()  # regression with --standardize-target
    report: FitReport = field(default_factory=FitReport)
    ignored: tuple[str, ...] = ()  # columns the training data had but did not use

    @property
    def n_features(self) -> int:
        return len(self.outputs)

    @property
    def n_outputs(self) -> int:
        return len(self.classes) if self.task == Task.CLASSIFICATION else len(self.targets)

    def features(self, frame: pd.DataFrame, out: np.ndarray | None = None) -> np.ndarray:
        """The float32 feature matrix, filled and scaled, written column by column (into
        `out`, rows of a bigger matrix, if given)."""
        missing = [c.name for c in self.inputs if c.name not in frame.columns]
        if missing:
            raise InputError(f"the data lacks feature column(s) {', '.join(missing)}")
        scale = {c.name: c for c in self.outputs}
        x = np.empty((len(frame), len(self.outputs)), np.float32) if out is None else out
        index = {c.name: i for i, c in enumerate(self.outputs)}
        for column in self.inputs:
            for name, values in column.expand(frame[column.name]):
                if name in scale:
                    out = scale[name]
                    values = np.where(np.isnan(values), out.mean, values)
                    x[:, index[name]] = (values - out.mean) / out.std
        return x

    def targets_of(self, frame: pd.DataFrame, out: np.ndarray | None = None) -> np.ndarray:
        """Targets as the loss wants them: scaled float32 columns or int64 class indices
        (written into `out`, rows of a bigger array, if given)."""
        out = np.empty(self._target_shape(len(frame)), self._target_type) if out is None else out
        if self.task == Task.CLASSIFICATION:
            out[:] = pd.Categorical(frame[self.targets[0]], categories=list(self.classes)).codes
            return out
        y = frame[list(self.targets)].to_numpy(np.float64, na_value=np.nan, copy=True)
        for i, scale in enumerate(self.target_scale):
            y[:, i] = (y[:, i] - scale.mean) / scale.std
        out[:] = y
        return out

    @property
    def _target_type(self) -> type:
        return np.int64 if self.task == Task.CLASSIFICATION else np.float32

    def _target_shape(self, rows: int) -> tuple[int, ...]:
        return (rows,) if self.task == Task.CLASSIFICATION else (rows, len(self.targets))

    def valid_rows(self, frame: pd.DataFrame) -> np.ndarray:
        """Rows whose targets can be trained on: present, and finite for regression."""
        if self.task == Task.CLASSIFICATION:
            return frame[self.targets[0]].notna().to_numpy()
        y = frame[list(self.targets)].to_numpy(np.float64, na_value=np.nan)
        return np.isfinite(y).all(axis=1)

    def arrays(self, frame: pd.DataFrame) -> Arrays:
        """The training matrices of this frame, rows with an unusable target left out."""
        return self.encode(row_batches(frame), len(frame))

    def encode(self, batches: Iterable[pd.DataFrame], rows: int) -> Arrays:
        """The training matrices of `rows` rows that come in batches, rows with an unusable
        target left out. Each batch is written into matrices made once, so memory holds them
        and one batch: neither the whole frame nor whole-column temporaries beside them."""
        x = np.empty((rows, self.n_features), np.float32)
        y = np.empty(self._target_shape(rows), self._target_type)
        filled = 0
        for batch in batches:
            valid = self.valid_rows(batch)
            if not valid.all():  # filtering copies the batch: only when there is something to drop
                batch = batch[valid]
            end = filled + len(batch)
            self.features(batch, x[filled:end])
            self.targets_of(batch, y[filled:end])
            filled = end
        if filled < rows:  # in place: the freed tail goes back to the system, nothing is copied
            x.resize((filled, self.n_features), refcheck=False)
            y.resize(self._target_shape(filled), refcheck=False)
        return Arrays(x, y, tuple(c.name for c in self.outputs))

    def to_dict(self) -> dict[str, Any]:
        """Plain values (kinds as their text), for features.json and checkpoints, which load
        only plain types."""
        return asdict(self, dict_factory=_plain)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FeatureTransform:
        return cls(
            task=data["task"],
            targets=tuple(data["targets"]),
            inputs=tuple(
                InputColumn(c["name"], Kind(c["kind"]), tuple(c["levels"])) for c in data["inputs"]
            ),
            outputs=tuple(OutputColumn(**c) for c in data["outputs"]),
            classes=tuple(data["classes"]),
            target_scale=tuple(OutputColumn(**c) for c in data["target_scale"]),
            report=FitReport(**data["report"]),
            ignored=tuple(data["ignored"]),
        )


def fit(
    frame: pd.DataFrame,
    selection: Selection,
    task: Task,
    max_categories: int,
    standardize_target: bool,
    collectives: Collectives,
) -> FeatureTransform:
    """Fit on this rank's part of the rows; the parts of all ranks must not overlap."""
    feature_names = _select(frame, selection)
    _check_targets(frame, selection.targets, task, collectives)
    draft = FeatureTransform(task, selection.targets, (), ())
    valid = draft.valid_rows(frame)
    rows, dropped = collectives.sum_numbers(
        np.array([len(frame), (~valid).sum()], dtype=np.float64)
    )
    frame = frame[valid]
    report = FitReport(rows=int(rows), dropped_rows=int(dropped))
    classes: tuple[Any, ...] = ()
    target_scale: tuple[OutputColumn, ...] = ()
    if task == Task.CLASSIFICATION:
        classes = _classes(frame, selection.targets[0], collectives)
    else:
        scale = _target_scale(frame, selection.targets, collectives)
        target_scale = scale if standardize_target else ()
    inputs, outputs = _fit_inputs(frame, feature_names, max_categories, report, collectives)
    chosen = {*feature_names, *selection.targets}
    ignored = tuple(str(c) for c in frame.columns if str(c) not in chosen)
    return FeatureTransform(
        task,
        selection.targets,
        inputs,
        outputs,
        classes,
        target_scale,
        report,
        ignored,
    )


def _classes(frame: pd.DataFrame, target: str, collectives: Collectives) -> tuple[Any, ...]:
    """The labels of a classification target over all ranks, in the order of class indices."""
    classes = _union(collectives, frame[target].unique().tolist())
    fractional = [c for c in classes if isinstance(c, float) and not c.is_integer()]
    if fractional:
        raise InputError(
            f"target {target!r} holds fractional numbers (e.g. {fractional[0]:g}), not class "
            "labels; pass --task regression to predict the number, or round or bin it into "
            "classes"
        )
    if len(classes) < 2:
        raise InputError(
            f"target {target!r} has {len(classes)} class(es); classification needs at least 2"
        )
    return classes


def _target_scale(
    frame: pd.DataFrame, targets: tuple[str, ...], collectives: Collectives
) -> tuple[OutputColumn, ...]:
    """Each regression target's mean and std over all ranks (the scale --standardize-target
    applies); a target that is empty or constant is refused, standardized or not."""
    stats = _statistics(frame, [InputColumn(t, Kind.NUMERIC) for t in targets], collectives)
    for name, column in stats.items():
        if column.count == 0:
            raise InputError(
                f"target column {name!r} is empty: every value is missing or not finite; "
                "check --target and the data"
            )
        if column.std == 0:
            raise InputError(
                f"target column {name!r} is constant ({column.mean:g}); nothing to learn"
            )
    return tuple(OutputColumn(name, c.mean, c.std) for name, c in stats.items())


def _fit_inputs(
    frame: pd.DataFrame,
    names: list[str],
    max_categories: int,
    report: FitReport,
    collectives: Collectives,
) -> tuple[tuple[InputColumn, ...], tuple[OutputColumn, ...]]:
    """(input columns, the output columns they expand to) over all ranks; output columns that
    are missing or constant everywhere are left out, which `report` records with the values
    the kept ones fill in."""
    inputs = [_input_column(frame, name, max_categories, collectives) for name in names]
    outputs, used = [], set()
    for name, column in _statistics(frame, inputs, collectives).items():
        if column.count == 0:
            report.dropped_columns[name] = "entirely missing"
        elif column.std == 0:
            report.dropped_columns[name] = "constant"
        else:
            outputs.append(OutputColumn(name, column.mean, column.std))
            used.add(column.source)
    if not outputs:
        raise InputError("no usable feature columns: every feature is constant or missing")
    missing = collectives.sum_numbers(
        np.array([_to_fill(frame[c.name], c) for c in inputs], np.float64)
    )
    report.filled = {
        c.name: int(n) for c, n in zip(inputs, missing, strict=True) if n and c.name in used
    }
    return tuple(inputs), tuple(outputs)


def _select(frame: pd.DataFrame, selection: Selection) -> list[str]:
    """The feature column names; every named column must exist, names must be unique, and a
    target can be neither an input nor left out."""
    names = [str(c) for c in frame.columns]
    check_unique_columns(names)
    shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
    for option, wanted in (
        ("--target", selection.targets),
        ("--features", selection.features or ()),
        ("--drop", selection.drop),
    ):
        unknown = [n for n in wanted if n not in names]
        if unknown:
            kind = "target" if option == "--target" else "feature"
            raise InputError(
                f"{kind} column {', '.join(map(repr, unknown))} not in the data "
                f"(columns: {shown}); check {option}"
            )
    repeated = sorted(n for n, count in Counter(selection.targets).items() if count > 1)
    if repeated:
        raise InputError(f"--target {repeated[0]!r} is given more than once; name each target once")
    for option, named, why in (
        ("--features", selection.features or (), "a model cannot take what it predicts as input"),
        ("--drop", selection.drop, "a column cannot be both predicted and left out"),
    ):
        both = [t for t in selection.targets if t in named]
        if both:
            raise InputError(
                f"target column {both[0]!r} is also in {option}: {why}; leave it out of {option}"
            )
    chosen = selection.features if selection.features is not None else names
    features = [n for n in chosen if n not in selection.targets and n not in selection.drop]
    if not features:
        raise InputError("no feature columns left after --target, --features and --drop")
    return features


def _check_targets(
    frame: pd.DataFrame, targets: tuple[str, ...], task: Task, collectives: Collectives
) -> None:
    """Numbers for regression, labels for classification; decided from the values of every
    rank, since one rank's rows may look right by chance."""
    if task == Task.CLASSIFICATION:
        if len(targets) != 1:
            raise InputError("classification takes exactly one --target column")
        name = targets[0]
        kinds = sorted(
            {k for k in collectives.gather(_infer(frame[name]), "statistics") if k not in LABELS}
        )
        if kinds:
            raise InputError(
                f"target column {name!r} holds {kinds[0]} values, which cannot be class labels; "
                f"convert it to text or integers (e.g. frame[{name!r}].astype(str))"
            )
        return
    local = [_real_numbers(frame[t]) for t in targets]
    for name, *numeric in zip(targets, *collectives.gather(local, "statistics"), strict=True):
        if not all(numeric):
            raise InputError(
                f"target column {name!r} is not numeric ({frame[name].dtype}); convert it to "
                "numbers, or pass --task classification to predict its classes"
            )


def _real_numbers(series: pd.Series) -> bool:
    """Whether a column holds real numbers: pandas counts complex ones as numeric too, and
    turning them into floats would silently drop their imaginary part."""
    if types.is_complex_dtype(series.dtype):
        return False
    return types.is_numeric_dtype(series.dtype) or _infer(series) in NUMBERS


def _infer(series: pd.Series) -> str:
    return types.infer_dtype(series, skipna=True)


def _plain(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return {name: str(v) if isinstance(v, StrEnum) else v for name, v in pairs}


def _local_kind(series: pd.Series) -> str:
    """The kind this rank's values suggest: 'empty' when it holds no values at all, and
    'unsupported (TYPE)' for what cannot be turned into numbers, so that every rank can see
    every rank's verdict before any of them gives up."""
    dtype = series.dtype
    if types.is_bool_dtype(dtype):
        return Kind.BOOL
    if types.is_datetime64_any_dtype(dtype):
        return Kind.DATETIME
    if types.is_timedelta64_dtype(dtype):
        return Kind.TIMEDELTA
    if isinstance(dtype, pd.CategoricalDtype):
        return Kind.CATEGORY
    if types.is_numeric_dtype(dtype) and not types.is_complex_dtype(dtype):
        return Kind.EMPTY if series.isna().all() else Kind.NUMERIC
    inferred = _infer(series)
    kinds: dict[str, Kind] = {
        "empty": Kind.EMPTY,
        "boolean": Kind.BOOL,
        "integer": Kind.NUMERIC,
        "floating": Kind.NUMERIC,
        "mixed-integer-float": Kind.NUMERIC,
        "decimal": Kind.NUMERIC,
        "datetime64": Kind.DATETIME,
        "datetime": Kind.DATETIME,
        "date": Kind.DATETIME,
        "timedelta64": Kind.TIMEDELTA,
        "timedelta": Kind.TIMEDELTA,
        "string": Kind.CATEGORY,
        "categorical": Kind.CATEGORY,
    }
    return kinds.get(inferred, f"unsupported ({inferred})")


def _input_column(
    frame: pd.DataFrame, name: str, max_categories: int, collectives: Collectives
) -> InputColumn:
    """Agree with the other ranks on the column's kind (and levels), then describe it."""
    kinds = {
        k for k in collectives.gather(_local_kind(frame[name]), "statistics") if k != Kind.EMPTY
    }
    unsupported = sorted(k for k in kinds if k.startswith("unsupported"))
    if unsupported:
        raise InputError(
            f"column {name!r} holds values of an {unsupported[0]} type; convert it to numbers, "
            "strings or timestamps, or leave it out with --drop"
        )
    if len(kinds) > 1:
        raise InputError(
            f"column {name!r} holds different types in different parts of the data "
            f"({', '.join(sorted(kinds))}); give it one type"
        )
    kind = Kind(kinds.pop()) if kinds else Kind.EMPTY
    if kind != Kind.CATEGORY:
        return InputColumn(name, kind)
    labels = _labels(frame[name])
    levels = _union(collectives, labels.dropna().unique().tolist())
    if len(levels) > max_categories:
        raise InputError(
            f"column {name!r} has {len(levels)} distinct values, more than --max-categories "
            f"{max_categories}; raise --max-categories, convert it to numbers, or --drop it"
        )
    if collectives.sum_numbers(np.array([labels.isna().sum()], np.float64))[0]:
        levels = (*levels, MISSING_LEVEL)
    return InputColumn(name, kind, levels)


def _to_fill(series: pd.Series, column: InputColumn) -> int:
    """Values the fit stands in for: missing ones, and infinite numbers, filled alike."""
    if column.kind == Kind.NUMERIC:
        _, values = next(column.expand(series))
        return int(np.isnan(values).sum())
    return int(series.isna().sum())


class ColumnStatistics(NamedTuple):
    """One output column's statistics over all ranks."""

    source: str  # the input column it was expanded from
    count: int  # values present (not missing, finite)
    mean: float
    std: float  # after filling the missing values with the mean


def _statistics(
    frame: pd.DataFrame, inputs: list[InputColumn], collectives: Collectives
) -> dict[str, ColumnStatistics]:
    """The statistics of each output column of `inputs`, by its name.

    Two passes (sums, then squared deviations from the global mean) so that the result does
    not depend on how the rows are split between ranks beyond float rounding. Columns are
    expanded one at a time, twice, rather than held: memory stays at one column.
    """

    def over_columns(reduce: Callable[[np.ndarray, int], Any]) -> list[tuple[str, str, Any]]:
        """(input column, output column, reduce(its float64 values, its index)) for each."""
        results: list[tuple[str, str, Any]] = []
        for column in inputs:
            for name, values in column.expand(frame[column.name]):
                results.append((column.name, name, reduce(values, len(results))))
                del values  # before the next is expanded: one column in memory, not two
        return results

    firsts = over_columns(lambda values, _: (np.isfinite(values).sum(), _nansum(values)))
    names = [(source, name) for source, name, _ in firsts]
    sums_in = np.array([first for *_, first in firsts], np.float64).reshape(-1)
    counts, sums = collectives.sum_numbers(sums_in).reshape(-1, 2).T
    means = np.divide(sums, counts, out=np.zeros_like(sums), where=counts > 0)
    squares = [
        square
        for *_, square in over_columns(
            lambda v, i: _nansum(np.square(np.subtract(v, means[i], out=v), out=v))
        )
    ]
    squares = collectives.sum_numbers(np.array(squares, np.float64))
    rows = collectives.sum_numbers(np.array([len(frame)], np.float64))[0]
    stds = np.sqrt(squares / rows) if rows else np.zeros_like(squares)
    return {
        name: ColumnStatistics(source, int(count), float(mean), float(std))
        for (source, name), count, mean, std in zip(names, counts, means, stds, strict=True)
    }


def _nansum(values: np.ndarray) -> float:
    """np.nansum(values), the same sum, but in place: `values` (a fresh copy) is overwritten
    rather than copied again, which on a long column is a column's worth of memory."""
    values[np.isnan(values)] = 0
    return values.sum()


def _numbers(series: pd.Series, name: str) -> pd.Series:
    """A column that was numbers in training, as numbers; text that reads as numbers is fine
    (a CSV), anything else (words, timestamps) is the user's to fix, named in one line."""
    if types.is_datetime64_any_dtype(series) or types.is_timedelta64_dtype(series):
        raise InputError(
            f"column {name!r} holds {series.dtype} values but held numbers in training; "
            "convert it to numbers, or train on it as it is"
        )
    if types.is_complex_dtype(series):
        raise InputError(
            f"column {name!r} holds complex numbers but held real numbers in training; "
            "convert it to real numbers"
        )
    if types.is_numeric_dtype(series) or types.is_bool_dtype(series):
        return series
    numbers = pd.to_numeric(series.astype(object), errors="coerce")
    bad = series.notna() & numbers.isna()
    if bad.any():
        raise InputError(
            f"column {name!r} held numbers in training but has {int(bad.sum())} value(s) that "
            f"are not numbers here (e.g. {series[bad].iloc[0]!r}); fix or blank them"
        )
    return numbers


def _parsed(parse: Callable[[pd.Series], Any], series: pd.Series, name: str, what: str) -> Any:
    """`parse(series)`, or one line naming the column whose values are not `what`."""
    try:
        return parse(series)
    except (ValueError, TypeError) as exc:
        raise InputError(
            f"column {name!r} held {what} in training but not all its values here are "
            f"({' '.join(str(exc).split())[:120]}); fix or blank them"
        ) from exc


def _floats(values: pd.Series) -> np.ndarray:
    """float64 values; missing and infinite both become NaN, to be filled with the mean."""
    floats = pd.Series(values).to_numpy(np.float64, na_value=np.nan, copy=True)
    floats[np.isinf(floats)] = np.nan
    return floats


def _labels(series: pd.Series) -> pd.Series:
    """Category values as strings, missing kept missing."""
    return series.astype(object).where(series.notna()).map(str, na_action="ignore")


def _union(collectives: Collectives, values: list[Any]) -> tuple[Any, ...]:
    """The sorted union of every rank's values (plain Python scalars, so JSON can hold them)."""
    merged = {
        v.item() if hasattr(v, "item") else v
        for part in collectives.gather(values, "statistics")
        for v in part
    }
    return tuple(sorted(merged, key=lambda v: (type(v).__name__, v)))
