"""Each training option is declared once, on its TrainConfig field (config/options.py); the
command line, --config files and bench's recommended command are made from that declaration,
so whatever one of them says must read back as the same TrainConfig."""

from __future__ import annotations

import inspect
import shlex
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import click
import pytest

from hvd_cpu.api import benchmark
from hvd_cpu.cli import bench, train
from hvd_cpu.config.cli_options import command_words
from hvd_cpu.config.files import record
from hvd_cpu.config.options import TrainConfig
from hvd_cpu.runtime.cores import default_threads
from hvd_cpu.tools import bench as bench_tool

DEFAULTS = TrainConfig()
# Between them every option set to something other than its default (one config cannot:
# --elastic refuses --shard-read and --sync-every; --resume, --overwrite).
CONFIGS = (
    TrainConfig(
        data=Path("frame.parquet"),
        format="csv",
        encoding="latin-1",
        targets=("y1", "y2"),
        features=("a", "b"),
        drop=("id",),
        task="classification",
        max_categories=5,
        standardize_target=True,
        shard_read=True,
        model="my_model.py:Model",
        model_args={"width": 3, "scale": 0.5, "norm": None},
        hidden=(64, 32),
        activation="relu",
        epochs=3,
        batch_size=16,
        lr=3e-4,
        scale_lr=False,
        shuffle=False,
        seed=7,
        threads=2,
        sync_every=4,
        allreduce="direct",
        precision="auto",
        output=Path("runs/x"),
        warmup_epochs=2,
        plateau_patience=3,
        val_fraction=0.25,
        patience=2,
        checkpoint_every=2,
        overwrite=True,
        progress=False,
        quiet=True,
        tensorboard=Path("runs/board"),
        mlflow=True,
        mlflow_experiment="experiment",
        mlflow_run_name="run one",
    ),
    TrainConfig(
        features=(),
        hidden=(),
        loss="huber",
        resume=True,
        elastic=True,
        precision="bf16",
        commit_every=5,
        max_restarts=0,
        stall_seconds=2.5,
        val_fraction=0.0,
        progress=True,
    ),
    TrainConfig(auto_resume=True),  # a job's one command for its retries
)
IDS = ["most", "elastic", "retry"]


def parsed(command: click.Command, *args: str) -> dict[str, Any]:
    """What the command would run with: the values after types and callbacks."""
    return command.make_context(command.name, list(args)).params


def changed(config: TrainConfig) -> dict[str, Any]:
    return {
        f.name: getattr(config, f.name)
        for f in fields(TrainConfig)
        if getattr(config, f.name) != f.default
    }


def test_the_configs_here_set_every_option() -> None:
    """So that each test below covers a new option too, once it is added here."""
    unset = {f.name for f in fields(TrainConfig)} - {n for c in CONFIGS for n in changed(c)}
    assert not unset, f"set these in CONFIGS: {sorted(unset)}"


def test_train_takes_every_field_in_order_and_its_default() -> None:
    """The order is --help's; no option given is TrainConfig()."""
    assert list(parsed(train)) == [f.name for f in fields(TrainConfig)]
    assert TrainConfig(**parsed(train)) == DEFAULTS


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_each_option_spelled_back_parses_to_its_value(config: TrainConfig) -> None:
    words = [w for name, value in changed(config).items() for w in command_words(name, value)]
    assert TrainConfig(**parsed(train, *words)) == config


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_a_recorded_config_file_reads_back_as_the_config(
    config: TrainConfig, tmp_path: Path
) -> None:
    """--resume, --overwrite and --auto-resume are left out of the record: a rerun starts
    afresh."""
    record(config, tmp_path / "config.toml")
    read = TrainConfig(**parsed(train, "--config", str(tmp_path / "config.toml")))
    assert read == replace(config, resume=False, overwrite=False, auto_resume=False)


@pytest.mark.parametrize(
    ("config", "setting", "allreduce"),
    [
        (CONFIGS[0], bench_tool.Setting(4, 1, 128, 1, "mpi", "direct"), "auto"),
        (CONFIGS[0], bench_tool.Setting(2, 1, 128, 1, "mpi", "horovod"), "horovod"),
        (CONFIGS[1], bench_tool.Setting(2, 3, 64, 1, "gloo", "direct"), "auto"),
        (CONFIGS[1], bench_tool.Setting(2, 3, 64, 1, "gloo"), "horovod"),
        (CONFIGS[1], bench_tool.Setting(1, 1, 32, 1), "auto"),
        (CONFIGS[0], bench_tool.Setting(2, 1, 128, 1, "gloo", precision="bf16"), "horovod"),
    ],
)
def test_bench_s_recommended_command_trains_as_measured(
    config: TrainConfig, setting: bench_tool.Setting, allreduce: str
) -> None:
    """Its `hvd-cpu train` words parse back to the benchmarked config with the setting's batch,
    sync, allreduce, precision and threads (left out when train picks the same: --allreduce auto is
    direct under MPI and under Gloo through shared memory), and the output, progress,
    validation and epoch
    lines of a plain run."""
    words = shlex.split(bench_tool.command_line(setting, config, cores=4))
    launcher = ["horovodrun", f"--{setting.controller}", "-np", str(setting.processes)]
    start = words.index("hvd-cpu")
    assert words[:start] == (launcher if setting.processes > 1 else [])
    assert words[start + 1] == "train"
    expected = replace(
        config,
        batch_size=setting.batch_size,
        sync_every=setting.sync_every,
        allreduce=allreduce,
        precision=setting.precision,
        threads=None
        if setting.threads == default_threads(setting.processes, 4)
        else setting.threads,
        output=DEFAULTS.output,
        progress=DEFAULTS.progress,
        val_fraction=DEFAULTS.val_fraction,
        quiet=False,
    )
    assert TrainConfig(**parsed(train, *words[start + 2 :])) == expected


def test_bench_takes_train_s_data_and_model_options() -> None:
    """From the same declaration: the same option, the same default. Bench's own --epochs,
    --output and --overwrite mean something else."""
    own = {"epochs", "output", "overwrite"}
    names = {f.name for f in fields(TrainConfig)} - own
    shared = {p.name: p for p in bench.params if p.name in names}
    of_train = {p.name: p for p in train.params}
    assert {"data", "targets", "hidden", "model_args", "lr"} <= set(shared)
    for name, option in shared.items():
        assert option.to_info_dict() == of_train[name].to_info_dict(), name


def test_bench_s_own_options_default_to_the_api_s() -> None:
    """`hvd-cpu bench` passes its options to hvd_cpu.benchmark, which has its own defaults for
    those that are not TrainConfig's (rows, processes, batch sizes, ...): the same ones."""
    api = {
        name: parameter.default
        for name, parameter in inspect.signature(benchmark).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }
    api["targets"] = (api.pop("target"),)  # the command line's --target, repeatable
    api["output"] = Path(api["output"])
    given = parsed(bench)
    assert {name: given[name] for name in api} == api
    assert {name: value for name, value in given.items() if name not in api} == {
        name: getattr(DEFAULTS, name) for name in given if name not in api
    }
