"""`--config FILE`: options from TOML or YAML under the command line's, bad files in one line,
and OUTPUT/config.toml repeating a run bit for bit."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import click
import pytest
import torch

from hvd_cpu.cli import bench, train

from .jobs import horovodrun, hvd_cpu, slow_except, weights

# Slow tests here may run beside another test (launch/test.sh's first stage, two workers).
pytestmark = pytest.mark.beside

TOML = """
epochs = 3
batch_size = 32
target = "y"
features = ["a", "b"]
hidden = [16, 8]
scale-lr = false
lr = 0.01
"""
YAML = """
epochs: 3
batch_size: 32
target: y
features: [a, b]
hidden: [16, 8]
scale-lr: false
lr: 0.01
"""
GIVEN = {
    "epochs": 3,
    "batch_size": 32,
    "targets": ("y",),
    "features": ("a", "b"),
    "hidden": (16, 8),
    "scale_lr": False,
    "lr": 0.01,
}


def parsed(command: click.Command, *args: str) -> dict[str, Any]:
    """What the command would run with: the values after types and callbacks."""
    return command.make_context(command.name, list(args)).params


def write(tmp: Path, name: str, text: str) -> Path:
    (tmp / name).write_text(text)
    return tmp / name


@pytest.mark.parametrize(("name", "text"), [("run.toml", TOML), ("run.yaml", YAML)])
def test_a_file_gives_options_as_the_command_line_would(name: str, text: str, tmp_path: Path):
    file = write(tmp_path, name, text)
    options = parsed(train, "--config", str(file))
    assert {name: options[name] for name in GIVEN} == GIVEN
    typed = ["--epochs", "3", "--batch-size", "32", "--target", "y", "--features", "a,b"]
    typed += ["--hidden", "16,8", "--no-scale-lr", "--lr", "0.01"]
    assert options == parsed(train, *typed)


def test_the_command_line_overrides_the_file_wherever_it_stands(tmp_path: Path) -> None:
    file = write(tmp_path, "run.yml", YAML)
    after = parsed(train, "--config", str(file), "--epochs", "5", "--target", "z")
    before = parsed(train, "--epochs", "5", "--target", "z", "--config", str(file))
    assert after == before
    assert (after["epochs"], after["targets"], after["batch_size"]) == (5, ("z",), 32)


def test_lists_and_tables_take_their_command_line_forms(tmp_path: Path) -> None:
    """A repeatable option takes a list, a comma option the comma string, a JSON option a
    table."""
    text = """
target = ["y1", "y2"]
drop = "id,leak"
model = "my_model.py:Model"
[model-args]
width = 3
"""
    options = parsed(train, "--config", str(write(tmp_path, "run.toml", text)))
    assert options["targets"] == ("y1", "y2")
    assert options["drop"] == ("id", "leak")
    assert options["model_args"] == {"width": 3}


def test_bench_takes_a_file_too(tmp_path: Path) -> None:
    file = write(tmp_path, "bench.toml", 'batch-size = [64, 256]\ncontroller = "mpi"\n')
    options = parsed(bench, "--config", str(file))
    assert (options["batch_sizes"], options["controllers"]) == ((64, 256), ("mpi",))


@pytest.mark.parametrize("np", slow_except([1, 2], [1]))
def test_the_recorded_config_repeats_the_run_bit_for_bit(
    np: int, demo_parquet: Path, tmp_path: Path
) -> None:
    """Started the same way (the number of ranks is the launcher's, not an option)."""

    def train(*args: str) -> None:
        job = hvd_cpu("train", *args) if np == 1 else horovodrun(np, "train", *args)
        assert job.returncode == 0, job.stdout + job.stderr

    file = write(tmp_path, "run.toml", f'data = "{demo_parquet}"\nepochs = 2\nhidden = [16, 8]\n')
    train("--config", str(file), "--seed", "7", "--output", str(tmp_path / "a"))
    recorded = tomllib.loads((tmp_path / "a" / "config.toml").read_text())
    assert (recorded["seed"], recorded["hidden"], recorded["epochs"]) == (7, [16, 8], 2)

    train("--config", str(tmp_path / "a" / "config.toml"), "--output", str(tmp_path / "b"))
    first_weights, again_weights = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert first_weights.keys() == again_weights.keys()
    assert all(torch.equal(first_weights[k], again_weights[k]) for k in first_weights)


# file name, its text; what the one line must say
BAD = {
    "unknown key": (
        "run.toml",
        "epochs = 2\nbatchsize = 8\n",
        r"run\.toml: unknown option 'batchsize' \(did you mean 'batch-size'\?\)",
    ),
    "not a number": (
        "run.toml",
        'epochs = "ten"\n',
        r"run\.toml: epochs: 'ten' is not a valid integer",
    ),
    "out of range": (
        "run.yaml",
        "batch-size: -1\n",
        r"run\.yaml: batch-size: -1 is not in the range x>=1",
    ),
    "not sizes": (
        "run.toml",
        'hidden = "a,b"\n',
        r"run\.toml: hidden: 'a,b' is not a comma-separated list of integers",
    ),
    "not a flag value": ("run.yaml", "quiet: 1\n", r"run\.yaml: quiet: takes true or false, not 1"),
    "no value": ("run.yaml", "features:\n", r"run\.yaml: features: has no value"),
    "bad TOML": (
        "run.toml",
        "epochs = 2\nlr = \n",
        r"run\.toml: not valid TOML: .*\(at line 2, column 6\)",
    ),
    "bad YAML": (
        "run.yaml",
        "epochs: 2\n  lr: 0.1\n",
        r"run\.yaml: not valid YAML: .*\(at line 2, column 5\)",
    ),
    "other extension": (
        "run.json",
        "{}",
        r"run\.json: a config file ends in \.toml, \.yaml or \.yml",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_file_is_one_line_and_exit_2(case: str, tmp_path: Path) -> None:
    name, text, pattern = BAD[case]
    job = hvd_cpu("train", "--config", str(write(tmp_path, name, text)))
    assert job.returncode == 2
    assert job.stdout == ""
    assert len(job.stderr.splitlines()) == 1, job.stderr
    assert job.stderr.startswith("hvd-cpu: error: ")
    assert re.search(pattern, job.stderr), job.stderr


def test_a_missing_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    job = hvd_cpu("train", "--config", str(tmp_path / "run.toml"), "--epochs", "1")
    assert job.returncode == 2
    assert job.stderr.splitlines() == [
        f"hvd-cpu: error: Invalid value for '--config': File '{tmp_path / 'run.toml'}' does not "
        "exist. (see hvd-cpu train --help)"
    ]


def test_every_rank_of_a_job_ends_on_a_bad_file_with_one_line_from_rank_0(tmp_path: Path):
    job = horovodrun(2, "train", "--config", str(write(tmp_path, "run.toml", "epoch = 2\n")))
    assert job.returncode == 2, job.stdout + job.stderr
    lines = [(rank, text) for rank, text in job.rank_lines() if text.strip()]
    assert len(lines) == 1, lines
    assert lines[0][0] == 0
    assert re.search(r"unknown option 'epoch' \(did you mean 'epochs'\?\)", lines[0][1])
    assert "Traceback" not in job.stdout + job.stderr
