"""The click options of TrainConfig's fields, made from each field's declaration (options.option)
so that a training option is written once: `hvd-cpu train` takes them all, `bench` and
`predict` the ones they share with it, a --config file their long names, and bench's
recommended command spells a value back with the same flag.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import Field, fields
from typing import Any

import click

from hvd_cpu.config.options import OPTION, TrainConfig
from hvd_cpu.config.values import spelled

_FIELDS = {field.name: field for field in fields(TrainConfig)}


def _flag(field: Field) -> str:
    """The long option: --batch-size for batch_size, unless the declaration names another."""
    return field.metadata[OPTION].flag or "--" + field.name.replace("_", "-")


def _negated(flag: str) -> str:
    return f"--no-{flag[2:]}"


def _is_bool(field: Field) -> bool:
    return isinstance(field.default, bool) or field.metadata[OPTION].type is click.BOOL


def _click_option(field: Field) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """The field's click option, with the field's default (shown in --help when it has one)."""
    declared = field.metadata[OPTION]
    flag = _flag(field)
    settings: dict[str, Any] = {
        "default": field.default,
        "show_default": True,
        "help": declared.help,
        "metavar": declared.metavar,
        "multiple": declared.repeat,
    }
    if not _is_bool(field):
        return click.option(flag, field.name, type=declared.type, **settings)
    if field.default is False:
        return click.option(flag, field.name, is_flag=True, **settings)
    return click.option(f"{flag}/{_negated(flag)}", field.name, **settings)


def train_options(*names: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """One decorator adding the options of these TrainConfig fields (all when none are named),
    in that order in --help."""
    options = [_click_option(_FIELDS[name]) for name in names or _FIELDS]

    def apply(command: Callable[..., None]) -> Callable[..., None]:
        for option in reversed(options):
            command = option(command)
        return command

    return apply


def command_words(name: str, value: Any) -> list[str]:
    """The words that give field `name` this value on the `hvd-cpu train` command line."""
    field = _FIELDS[name]
    flag = _flag(field)
    if _is_bool(field):
        if value:
            return [flag]
        return [] if field.default is False else [_negated(flag)]
    if field.metadata[OPTION].repeat:
        return [word for item in value for word in (flag, spelled(item))]
    return [flag, spelled(value)]
