"""Each default is written twice, in a click option and in TrainConfig (or the Python API):
the command line and `fit`/`benchmark` must train the same way when nothing is given."""

from __future__ import annotations

import inspect
from dataclasses import fields
from pathlib import Path
from typing import Any

from hvd_cpu.api import benchmark
from hvd_cpu.cli import bench, train
from hvd_cpu.config.options import TrainConfig

CONFIG_DEFAULTS = {field.name: field.default for field in fields(TrainConfig)}


def parsed_defaults(command: Any) -> dict[str, Any]:
    """What the command passes on when given no options (after types and callbacks)."""
    return command.make_context(command.name, []).params


def test_every_train_option_defaults_to_its_train_config_field() -> None:
    assert parsed_defaults(train) == CONFIG_DEFAULTS


def test_bench_options_default_to_benchmark_and_train_config() -> None:
    """`hvd-cpu bench` passes its options to hvd_cpu.benchmark, which passes those of the
    data and model on to TrainConfig."""
    api = {
        name: parameter.default
        for name, parameter in inspect.signature(benchmark).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }
    api["targets"] = (api.pop("target"),)  # the command line's --target, repeatable
    api["output"] = Path(api["output"])
    passed_on = {
        name: default
        for name, default in CONFIG_DEFAULTS.items()
        if name in parsed_defaults(bench) and name not in api
    }
    assert parsed_defaults(bench) == {**passed_on, **api}
