"""`--config FILE`: a command's options from a TOML or YAML file, under the command line's.

The file is read before any other option (an eager option) into click's default_map, so each
value goes through the option's own type, range and callback, exactly as if it had been typed,
and whatever the command line gives wins. A run records its options in the same form in
OUTPUT/config.toml, so `hvd-cpu train --config OUTPUT/config.toml` trains the same run again.
"""

from __future__ import annotations

import difflib
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import tomli_w
import yaml

from hvd_cpu.atomic import atomic_write
from hvd_cpu.config.values import spelled

if TYPE_CHECKING:
    from hvd_cpu.config.options import TrainConfig

RECORD = "config.toml"
# Left out of the record: a rerun starts afresh, and into the same OUTPUT only when the
# command line says --overwrite (or goes on: --resume, --auto-resume).
NOT_RECORDED = ("resume", "overwrite", "auto_resume")
SUFFIXES = (".toml", ".yaml", ".yml")


def _key(name: str) -> str:
    """One spelling for `batch-size`, `batch_size` and `--batch-size`."""
    return name.lstrip("-").replace("_", "-")


def _options(command: click.Command) -> dict[str, click.Option]:
    """What a file may set: every option the command passes on, by its long names and its
    parameter name (`target` and `targets`); not --config or --help themselves."""
    found = {}
    for param in command.params:
        if isinstance(param, click.Option) and param.expose_value and not param.is_eager:
            for name in [param.name or "", *param.opts]:
                if not name.startswith("-") or name.startswith("--"):
                    found[_key(name)] = param
    return found


def _read(path: Path) -> dict[Any, Any]:
    """The file's top-level mapping; a file that does not parse is one line with its place."""
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise click.UsageError(f"{path}: a config file ends in .toml, .yaml or .yml")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise click.UsageError(f"{path}: not UTF-8 text") from None
    if suffix == ".toml":
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise click.UsageError(f"{path}: not valid TOML: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (at line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or exc
        raise click.UsageError(f"{path}: not valid YAML: {problem}{where}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise click.UsageError(f"{path}: holds a {type(data).__name__}, not option: value lines")
    return data


def _text(value: Any) -> str:
    """One value as it would be typed: a mapping as JSON (--model-args)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float, dict)):
        raise ValueError(f"{value!r} is not a value this option takes")
    return spelled(value)


def _as_typed(option: click.Option, value: Any) -> Any:
    """The file's value in the command line's form, so click checks it the same way: flags
    take true or false; a repeatable option a list or one value; others a list joins with
    commas (--hidden [64, 32] is --hidden 64,32)."""
    if value is None:
        raise ValueError("has no value; leave the key out for the default")
    if option.is_bool_flag or isinstance(option.type, click.types.BoolParamType):
        if not isinstance(value, bool):
            raise ValueError(f"takes true or false, not {value!r}")
        return value
    if option.multiple:
        return tuple(_text(item) for item in (value if isinstance(value, list) else [value]))
    if isinstance(value, list):
        return ",".join(_text(item) for item in value)
    return _text(value)


def load(ctx: click.Context, param: click.Parameter, path: Path | None) -> None:
    """--config's callback: check every key and value of the file, then make them the
    defaults of the other options (which the command line overrides)."""
    if path is None:
        return
    options = _options(ctx.command)
    given = _read(path)
    unknown = [str(key) for key in given if _key(str(key)) not in options]
    if unknown:
        names = sorted({_key(option.opts[0]) for option in options.values()})
        raise click.UsageError(
            f"{path}: unknown option{'s' if len(unknown) > 1 else ''} "
            + ", ".join(f"{key!r}{_suggestion(key, names)}" for key in unknown)
        )
    defaults: dict[str, Any] = {}
    for key, value in given.items():
        option = options[_key(str(key))]
        if option.name in defaults:
            raise click.UsageError(f"{path}: {option.opts[0]} is given twice (as {key!r})")
        try:
            typed = _as_typed(option, value)
            option.process_value(ctx, typed)
        except ValueError as exc:
            raise click.UsageError(f"{path}: {key}: {exc}") from None
        except click.BadParameter as exc:
            raise click.UsageError(f"{path}: {key}: {exc.message}") from None
        defaults[option.name or ""] = typed
    ctx.default_map = {**(ctx.default_map or {}), **defaults}


def _suggestion(key: str, names: list[str]) -> str:
    close = difflib.get_close_matches(_key(key), names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


config_option = click.option(
    "--config",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    is_eager=True,
    expose_value=False,
    callback=load,
    metavar="FILE",
    help="Take options from a TOML or YAML file (option = value, names as the long options); "
    "the command line overrides them. A run's OUTPUT/config.toml repeats the run.",
)


def record(config: TrainConfig, path: Path) -> None:
    """Write `config` as a --config file: every option set (TOML has no None), paths as
    given (relative to where the run started), mappings as the JSON the command line takes
    (which, unlike TOML, has null), and not --resume or --overwrite."""
    values = {
        _key(name): spelled(value) if isinstance(value, dict) else value
        for name, value in config.to_dict().items()
        if value is not None and name not in NOT_RECORDED
    }
    text = "# hvd-cpu train --config this-file repeats the run\n" + tomli_w.dumps(values)
    atomic_write(path, lambda handle: handle.write(text.encode()))
