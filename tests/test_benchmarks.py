"""The benchmark suite runs end to end (on a small frame: its numbers are not checked here,
they are measured on a quiet machine and written in docs/measurements.md)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from .jobs import REPO, Run, mpirun_command, run

# Their numbers are not checked: they may run beside another test.
pytestmark = [pytest.mark.slow, pytest.mark.beside]


def benchmark(script: str, *args: str, timeout: float, launcher: Sequence[str] = ()) -> Run:
    """`benchmarks/SCRIPT ARGS` under this Python (after `launcher`, if any), which must end 0."""
    command = [*launcher, sys.executable, str(REPO / "benchmarks" / script), *args]
    done = run(command, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_benchmark_suite_runs_every_contender(tmp_path: Path) -> None:
    benchmark(
        "run.py", "--rows", "2000", "--flights-rows", "3000", "--output", str(tmp_path), timeout=900
    )
    rows = json.loads((tmp_path / "results.json").read_text())
    kinds = {row["name"].split(" ")[0] for row in rows}
    assert kinds == {"(a)", "(b)", "(c)"}
    assert {(row["model"], row["table"]) for row in rows} == {
        ("seed", "synthetic"),
        ("wide", "synthetic"),
        ("seed", "flights"),
    }
    assert {row["controller"] for row in rows if row["name"].startswith("(c)")} == {"gloo", "mpi"}
    for row in rows:
        assert row["samples_per_s"] > 0 and row["final_val_loss"] > 0
        assert 0 < row["launch_seconds"] < row["wall_seconds"]
    # Time to loss, from each run's own epoch records: the training seconds until its
    # validation loss first reaches the loss the seed's loop (a) ends with on that table.
    folders = sorted(path for path in tmp_path.iterdir() if path.name[:2].isdigit())
    reference: dict[tuple[str, str], float] = {}
    for row, folder in zip(rows, folders, strict=True):
        epochs = epoch_records(folder)
        group = (row["model"], row["table"])
        if row["name"].startswith("(a)"):
            reference[group] = epochs[-1]["val_loss"]
        assert row["threshold"] == reference[group], row["name"]
        assert row["time_to_loss_s"] == time_to(reference[group], epochs), row["name"]
    assert "| contender |" in (tmp_path / "results.md").read_text()


def epoch_records(folder: Path) -> list[dict]:
    """What a contender's run wrote of its epochs: hvd-cpu's metrics.jsonl, or the seed loop's
    and DDP's epochs.jsonl."""
    hvd_cpu = folder / "run" / "metrics.jsonl"
    record = hvd_cpu if hvd_cpu.exists() else folder / "epochs.jsonl"
    return [json.loads(line) for line in record.read_text().splitlines()]


def time_to(loss: float, epochs: list[dict]) -> float | None:
    """Training seconds until the first epoch whose validation loss is at most `loss`."""
    elapsed = 0.0
    for epoch in epochs:
        elapsed += epoch["seconds"]
        if epoch["val_loss"] <= loss:
            return elapsed
    return None


def test_memory_benchmark_writes_its_table(tmp_path: Path) -> None:
    results = tmp_path / "memory.md"
    benchmark(
        "memory.py", "--rows", "20000", "--row-group-size", "2000", "--np", "1,2", "--cache",
        str(tmp_path / "cache"), "--results", str(results), timeout=600
    )  # fmt: skip
    text = results.read_text()
    assert "20,000 rows x 25 float32 columns in 10 row groups" in text
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| 1 ")]
    rows += [line.split("|") for line in text.splitlines() if line.startswith("| 2 ")]
    assert [row[2].strip() for row in rows] == ["20,000", "10,000, 10,000"]
    assert all(float(peak.replace(",", "")) > 0 for row in rows for peak in row[5].split(", "))
    assert len(list((tmp_path / "cache").glob("*.parquet"))) == 1  # the table, cached


def test_startup_benchmark_times_each_phase_in_order(tmp_path: Path) -> None:
    done = benchmark(
        "startup.py", "--np", "2", "--runs", "1", "--output", str(tmp_path), timeout=300
    )
    rows = [line.split("|")[1:3] for line in done.stdout.splitlines()[2:]]
    seconds = {name.strip(): float(value) for name, value in rows}
    launch, *phases = seconds
    assert launch == "launch to first step" and seconds[launch] > 0, seconds
    reached = [seconds[phase] for phase in phases]
    assert len(reached) == 4 and reached[0] > 0 and reached == sorted(reached), seconds


def test_step_levers_benchmark_compares_each_lever_with_the_direct_path() -> None:
    """Overlap and ZeRO-1 end where the direct path ends after a few steps (their times are
    docs/measurements.md's)."""
    done = benchmark(
        "step_levers.py", "--batch", "16", "--steps", "5", "--rounds", "1", timeout=300,
        launcher=mpirun_command(2)
    )  # fmt: skip
    rows = [
        [cell.strip() for cell in line.split("|")[1:-1]]
        for _, line in done.rank_lines(0)
        if line.startswith("| ") and not line.startswith("| 2 ranks")
    ]
    assert [row[0] for row in rows] == [
        "direct allreduce (hvd-cpu)", "overlap, buckets of 64 k floats",
        "overlap, buckets of 256 k floats", "ZeRO-1",
    ]  # fmt: skip
    for _, median, _, gap in rows:
        assert float(median) > 0 and float(gap) < 1e-6, rows


def test_the_gloo_benchmark_runs_every_setting(tmp_path: Path) -> None:
    done = benchmark(
        "gloo.py", "--rounds", "1", "--rows", "3000", "--output", str(tmp_path), timeout=900
    )
    runs = json.loads((tmp_path / "results.json").read_text())
    assert len(runs) == 8 and all(len(r) == 1 and r[0] > 0 for r in runs.values())
    assert "| hvd-cpu train, one process |" in done.stdout


def test_the_precision_benchmark_runs_both_precisions_side_by_side(tmp_path: Path) -> None:
    from hvd_cpu.training.precision import native_bf16

    if native_bf16() is None:
        pytest.skip("--precision bf16 is refused on a CPU without native bfloat16")
    done = benchmark(
        "precision.py", "--rows", "2048", "--speed-only", "--seeds", "2", "--output",
        str(tmp_path), timeout=900
    )  # fmt: skip
    report = json.loads((tmp_path / "precision.json").read_text())
    assert [(r["seed"], r["name"], r["precision"]) for r in report["runs"]] == [
        (seed, name, precision)
        for seed in (0, 1)
        for name in ("np 1, 1 thread", "np 1, all cores' threads", "np 2 Gloo", "np 2 MPI")
        for precision in ("fp32", "bf16")
    ]
    assert all(len(r["epochs"]) == 8 for r in report["runs"])
    assert set(report["steps"]) == {"this CPU", "AVX512_CORE", "AVX2"}
    assert all(v > 0 for v in report["averaging"].values())
    assert "| np 2 MPI | bf16 |" in done.stdout
    assert re.search(r"^\| 1 \| [\d.]+ \| ", done.stdout, re.MULTILINE), done.stdout
    ceiling = benchmark(
        "precision.py", "--ceiling", "1", "--ceiling-seconds", "0.3", "--output", str(tmp_path),
        timeout=300
    )  # fmt: skip
    measured = json.loads((tmp_path / "ceiling.json").read_text())
    assert [(m["precision"], m["adam"]) for m in measured] == [
        (precision, adam) for precision in ("fp32", "bf16") for adam in (True, False)
    ]
    assert all(m["np 1, 2 threads"] > 0 and m["2 x np 1, 1 thread"] > 0 for m in measured)
    assert "| bf16 | forward, backward, Adam |" in ceiling.stdout
