"""Bad input ends the job with one line from rank 0, exit code 2, no rank left behind."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pandas as pd
import pytest

from .conftest import RANK_PREFIX, horovodrun, hvd_cpu


def missing_file(tmp: Path, demo: Path) -> list[str]:
    return ["--data", str(tmp / "absent.parquet")]


def unknown_extension(tmp: Path, demo: Path) -> list[str]:
    path = tmp / "frame.xlsx"
    path.write_bytes(demo.read_bytes())
    return ["--data", str(path)]


def missing_target(tmp: Path, demo: Path) -> list[str]:
    return ["--data", str(demo), "--target", "price"]


def non_numeric_features(tmp: Path, demo: Path) -> list[str]:
    frame = pd.read_parquet(demo)
    frame["city"] = "Oslo"
    path = tmp / "strings.parquet"
    frame.to_parquet(path)
    return ["--data", str(path)]


CASES: dict[str, tuple[Callable[[Path, Path], list[str]], str]] = {
    "missing file": (missing_file, r"data file not found: .*absent\.parquet; check the path"),
    "unknown extension": (unknown_extension, r"unknown data format '\.xlsx' .*; save the frame as"),
    "missing target": (missing_target, r"target column 'price' not in the data .*--target"),
    "non-numeric": (non_numeric_features, r"non-numeric feature columns: city; convert them"),
}


def prepare(tmp_path: Path, demo: Path, case: str) -> tuple[list[str], str, Path]:
    make_args, pattern = CASES[case]
    output = tmp_path / "previous-run"
    output.mkdir()
    (output / "metrics.jsonl").write_text("good results\n")
    return [*make_args(tmp_path, demo), "--output", str(output)], pattern, output


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


@pytest.mark.parametrize("case", CASES)
def test_four_ranks_end_with_one_line_from_rank_0(case: str, demo_parquet: Path, tmp_path: Path):
    args, pattern, output = prepare(tmp_path, demo_parquet, case)
    job = horovodrun(4, "train", *args, launcher=("--prefix-output-with-timestamp",))
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
