"""Bad input ends the job with one line from rank 0, exit code 2, no rank left behind."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pandas as pd
import pytest
import torch

from .conftest import RANK_PREFIX, horovodrun, hvd_cpu


def data(frame: pd.DataFrame, tmp: Path, name: str = "frame.pkl") -> list[str]:
    frame.to_pickle(tmp / name)
    return ["--data", str(tmp / name)]


def bad_model(tmp: Path, body: str) -> str:
    (tmp / "user_model.py").write_text(f"import torch\n{body}\n")
    return f"{tmp / 'user_model.py'}:Model"


WRONG_SHAPE = """
class Model(torch.nn.Module):
    def __init__(self, n_features, n_outputs):
        super().__init__()
        self.layer = torch.nn.Linear(n_features, 3)

    def forward(self, x):
        return self.layer(x)
"""

# name -> (arguments after `train`, built in a temporary folder from the demo frame; pattern)
Case = tuple[Callable[[Path, pd.DataFrame], list[str]], str]
CASES: dict[str, Case] = {
    "missing file": (
        lambda tmp, demo: ["--data", str(tmp / "absent.parquet")],
        r"data file not found: .*absent\.parquet; check the path",
    ),
    "corrupt file": (
        lambda tmp, demo: ["--data", str(_write(tmp / "torn.parquet", b"PAR1 torn"))],
        r"cannot read .*torn\.parquet as parquet: .*check that the file is complete",
    ),
    "unknown format": (
        lambda tmp, demo: ["--data", str(_write(tmp / "frame.xlsx", b"xlsx"))],
        r"unknown data format '\.xlsx' .*--format",
    ),
    "empty frame": (lambda tmp, demo: data(demo.iloc[:0], tmp), r"the data has no rows"),
    "missing target": (
        lambda tmp, demo: [*data(demo, tmp), "--target", "price"],
        r"target column 'price' not in the data .*--target",
    ),
    "constant target": (
        lambda tmp, demo: data(demo.assign(target=3.0), tmp),
        r"target column 'target' is constant",
    ),
    "empty target": (
        lambda tmp, demo: data(demo.assign(target=float("nan")), tmp),
        r"target column 'target' is empty: every value is missing or not finite",
    ),
    "multiindex columns": (
        lambda tmp, demo: data(
            demo.set_axis(pd.MultiIndex.from_tuples([("a", c) for c in demo.columns]), axis=1), tmp
        ),
        r"frame\.pkl has MultiIndex columns \(e\.g\. \('a', 'x0'\)\); flatten them",
    ),
    "text target": (
        lambda tmp, demo: data(demo.assign(target="high"), tmp),
        r"target column 'target' is not numeric .*--task classification",
    ),
    "unknown feature": (
        lambda tmp, demo: [*data(demo, tmp), "--features", "x0,x99"],
        r"feature column 'x99' not in the data .*--features",
    ),
    "duplicate columns": (
        lambda tmp, demo: data(demo.set_axis([*demo.columns[:-2], "x0", "target"], axis=1), tmp),
        r"duplicate column names in the data: x0",
    ),
    "too many categories": (
        lambda tmp, demo: data(demo.assign(city=[f"c{i % 40}" for i in range(len(demo))]), tmp),
        r"column 'city' has 40 distinct values, more than --max-categories 32",
    ),
    "model does not import": (
        lambda tmp, demo: [*data(demo, tmp), "--model", bad_model(tmp, "import no_such_pkg")],
        r"--model .*cannot import .*No module named 'no_such_pkg'",
    ),
    "model output shape": (
        lambda tmp, demo: [*data(demo, tmp), "--model", bad_model(tmp, WRONG_SHAPE)],
        r"--model .*forward returned \(2, 3\) .*expected shape \(batch, n_outputs\) = \(2, 1\)",
    ),
}
# Only a job of several ranks can have fewer rows than ranks.
RANK_CASES: dict[str, Case] = {
    "fewer rows than ranks": (
        lambda tmp, demo: data(demo.iloc[:1], tmp),
        r"the data has 1 row\(s\), fewer than the 2 ranks",
    ),
}


def _write(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


def prepare(tmp_path: Path, demo: Path, case: str) -> tuple[list[str], str, Path]:
    make_args, pattern = (CASES | RANK_CASES)[case]
    output = tmp_path / "previous-run"
    output.mkdir()
    (output / "metrics.jsonl").write_text("good results\n")
    args = make_args(tmp_path, pd.read_parquet(demo))
    return [*args, "--output", str(output)], pattern, output


def assert_untouched(output: Path) -> None:
    assert sorted(p.name for p in output.iterdir()) == ["metrics.jsonl"]
    assert (output / "metrics.jsonl").read_text() == "good results\n"


@pytest.mark.parametrize("case", CASES)
def test_plain_process_prints_one_line_and_exits_2(case: str, demo_parquet: Path, tmp_path: Path):
    args, pattern, output = prepare(tmp_path, demo_parquet, case)
    job = hvd_cpu("train", *args)
    assert job.returncode == 2
    assert job.stdout == ""
    assert len(job.stderr.splitlines()) == 1, job.stderr
    assert job.stderr.startswith("hvd-cpu: error: ")
    assert re.search(pattern, job.stderr), job.stderr
    assert_untouched(output)


@pytest.mark.parametrize(
    ("np", "case"),
    [(2, case) for case in CASES | RANK_CASES]
    + [(4, case) for case in ("missing file", "missing target", "too many categories")],
)
def test_every_rank_ends_with_one_line_from_rank_0(
    np: int, case: str, demo_parquet: Path, tmp_path: Path
):
    args, pattern, output = prepare(tmp_path, demo_parquet, case)
    job = horovodrun(np, "train", *args, launcher=("--prefix-output-with-timestamp",))
    finished = datetime.now()

    assert job.returncode == 2, job.stdout + job.stderr
    errors = [(rank, text) for rank, text in job.rank_lines() if text.strip()]
    assert len(errors) == 1, errors
    rank, text = errors[0]
    assert rank == 0
    assert text.startswith("hvd-cpu: error: ")
    assert re.search(pattern, text), text
    assert "Traceback" not in job.stdout + job.stderr

    error_line = next(
        line for line in (job.stdout + job.stderr).splitlines() if "hvd-cpu: error" in line
    )
    printed_at = datetime.strptime(RANK_PREFIX.match(error_line)["time"], "%a %b %d %H:%M:%S %Y")
    assert (finished - printed_at).total_seconds() < 11, "every rank gone within 10 s"
    time.sleep(0.5)
    leftover = subprocess.run(["pgrep", "-f", str(output)], capture_output=True, text=True)
    assert leftover.stdout == "", "no rank outlives the job"
    assert_untouched(output)


@pytest.mark.parametrize("np", [1, 2])
def test_a_run_stopped_by_bad_input_leaves_no_folder_behind(
    np: int, demo_parquet: Path, tmp_path: Path
):
    args = ["train", "--data", str(demo_parquet), "--target", "price"]
    args += ["--output", str(tmp_path / "new" / "run")]
    job = hvd_cpu(*args) if np == 1 else horovodrun(np, *args)
    assert job.returncode == 2
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("np", [1, 2])
def test_a_diverging_run_stops_with_one_line_and_exports_nothing(
    np: int, demo_parquet: Path, tmp_path: Path
):
    """Targets near float32's limit: the squared error overflows to inf in the first epoch."""
    frame = pd.read_parquet(demo_parquet)
    args = ["train", *data(frame.assign(target=frame["target"] * 1e25), tmp_path)]
    args += ["--epochs", "3", "--output", str(tmp_path / "out")]
    job = hvd_cpu(*args) if np == 1 else horovodrun(np, *args)
    assert job.returncode == 2
    lines = [text for _, text in job.rank_lines()] if np > 1 else job.stderr.splitlines()
    lines = [line for line in lines if line.strip()]
    assert len(lines) == 1, lines
    assert re.match(
        r"hvd-cpu: error: training diverged in epoch 1 \(train loss (inf|nan)\); no checkpoint "
        r"of this run was written; lower --lr \(now [\d.e-]+\), add --warmup-epochs, or "
        r"--standardize-target",
        lines[0],
    ), lines[0]
    assert not (tmp_path / "out" / "model.pt").exists()
    assert not (tmp_path / "out" / "checkpoint.pt").exists()


def test_integer_column_names_train_as_their_text(demo_parquet: Path, tmp_path: Path) -> None:
    """A frame built from a matrix has column names 0, 1, ...: `--target 8` names the last."""
    frame = pd.read_parquet(demo_parquet)
    args = ["train", *data(frame.set_axis(range(frame.shape[1]), axis=1), tmp_path)]
    job = horovodrun(2, *args, "--target", "8", "--epochs", "1", "--output", str(tmp_path / "o"))
    assert job.returncode == 0, job.stdout + job.stderr
    features = json.loads((tmp_path / "o" / "features.json").read_text())
    assert [c["name"] for c in features["inputs"]] == [str(i) for i in range(8)]


@pytest.mark.parametrize("kind", ["a tensor", "torn bytes", "a model.pt"])
def test_resuming_from_a_file_that_is_not_a_checkpoint_is_one_line(
    kind: str, demo_parquet: Path, tmp_path: Path
):
    output = tmp_path / "run"
    output.mkdir()
    saved = output / "checkpoint.pt"
    if kind == "a tensor":
        torch.save(torch.ones(3), saved)
    elif kind == "torn bytes":
        saved.write_bytes(b"PK\x03\x04 not a torch file")
    else:
        trained = hvd_cpu("train", "--data", str(demo_parquet), "--epochs", "1",
                          "--output", str(tmp_path / "trained"))  # fmt: skip
        assert trained.returncode == 0, trained.stderr
        saved.write_bytes((tmp_path / "trained" / "model.pt").read_bytes())
    before = saved.read_bytes()
    args = ["train", "--data", str(demo_parquet), "--resume", "--output", str(output)]
    job = horovodrun(2, *args)
    assert job.returncode == 2
    lines = [(rank, text) for rank, text in job.rank_lines() if text.strip()]
    assert len(lines) == 1 and lines[0][0] == 0, lines
    expected = (
        "is not a checkpoint written by hvd-cpu train"
        if kind != "torn bytes"
        else ("cannot load the checkpoint to resume")
    )
    assert expected in lines[0][1]
    assert "Traceback" not in job.stdout + job.stderr
    assert saved.read_bytes() == before


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        (
            lambda f: f.assign(x0=f["x0"].astype(str).where(f.index != 3, "abc")),
            r"column 'x0' held numbers in training but has 1 value\(s\) that are not numbers "
            r"here \(e\.g\. 'abc'\)",
        ),
        (
            lambda f: f.assign(x1=pd.Timestamp("2024-01-01")),
            r"column 'x1' holds datetime64\[\w+\] values but held numbers in training",
        ),
    ],
    ids=["words", "timestamps"],
)
def test_predict_on_values_of_another_type_is_one_line(
    change: Callable[[pd.DataFrame], pd.DataFrame],
    pattern: str,
    demo_parquet: Path,
    tmp_path: Path,
):
    trained = hvd_cpu("train", "--data", str(demo_parquet), "--epochs", "1",
                      "--output", str(tmp_path / "model"))  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    args = ["predict", "--model", str(tmp_path / "model")]
    args += [*data(change(pd.read_parquet(demo_parquet)), tmp_path), "--output"]
    alone = hvd_cpu(*args, str(tmp_path / "alone.csv"))
    assert alone.returncode == 2
    assert len(alone.stderr.splitlines()) == 1 and re.search(pattern, alone.stderr), alone.stderr
    two = horovodrun(2, *args, str(tmp_path / "two.csv"))
    assert two.returncode == 2
    lines = [(rank, text) for rank, text in two.rank_lines() if text.strip()]
    assert len(lines) == 1 and lines[0][0] == 0 and re.search(pattern, lines[0][1]), lines
    assert not (tmp_path / "alone.csv").exists() and not (tmp_path / "two.csv").exists()
