"""Option values as they are typed: comma-separated lists and JSON objects, read by click types,
"module:Name" specs of the user's code, and any value written back as text (bench's
recommended command, a --config file's lists).

The types also take a value already parsed (a TrainConfig default such as `(32,)`), so an
option's default is its field's default, not a second spelling of it.
"""

from __future__ import annotations

import json
from typing import Any

import click


class Names(click.ParamType):
    """A comma-separated list of column (or controller) names: `a, b` is ("a", "b")."""

    name = "names"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, tuple):
            return value
        return tuple(n.strip() for n in value.split(",") if n.strip())


class Sizes(click.ParamType):
    """A comma-separated list of integers (layer sizes, process counts): `64,32` is (64, 32)."""

    name = "sizes"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, tuple):
            return value
        try:
            return tuple(int(n) for n in value.split(",") if n.strip())
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of integers", param, ctx)


class JsonObject(click.ParamType):
    """A JSON object, as a dict."""

    name = "json"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, dict):
            return value
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            self.fail(f"{value!r} is not JSON ({exc})", param, ctx)
        if not isinstance(parsed, dict):
            self.fail(f"{value!r} is not a JSON object like '{{\"name\": 1}}'", param, ctx)
        return parsed


NAMES = Names()
SIZES = Sizes()
JSON_OBJECT = JsonObject()


def is_spec(text: str) -> bool:
    """Whether `text` names code (MODULE:NAME or FILE.py:NAME: --model, --loss) rather than a
    built-in choice."""
    return ":" in text


def spelled(value: Any) -> str:
    """A value as typed after its option: lists joined by commas, mappings as JSON."""
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return ",".join(map(spelled, value))
    return str(value)
