"""Import the user's own code named on the command line: `package.module:NAME` or
`path/to/file.py:NAME` (a model class or factory for --model, a loss for --loss)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from hvd_cpu.errors import InputError


def import_object(spec: str, option: str) -> Any:
    """The object `spec` names; every way that can fail is one line naming `option`."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise InputError(f"{option} {spec!r} is not MODULE:NAME or FILE.py:NAME")
    if where.endswith(".py") and not Path(where).is_file():
        raise InputError(f"{option} file not found: {where}; check the path on every host")
    # What the module prints while it imports is held back: when the import fails, each rank
    # would print it, and the error is what the user needs to see.
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            module = _import(where)
    except SystemExit as exc:  # a training script's own argument parsing or exit
        said = [line for line in (out.getvalue() + err.getvalue()).splitlines() if line.strip()]
        raise InputError(
            f"{option} {spec!r}: importing {where} ended the program (exit code {exc.code}"
            + (f": {said[-1].strip()}" if said else "")
            + "); put the file's own code under `if __name__ == '__main__':` or keep "
            f"{name} in a file of its own"
        ) from exc
    except Exception as exc:  # the user's code can fail in any way while importing
        raise InputError(
            f"{option} {spec!r}: cannot import {where}: {type(exc).__name__}: {exc}; "
            "check that it imports on its own (python -c 'import ...') on every host"
        ) from exc
    sys.stdout.write(out.getvalue())
    sys.stderr.write(err.getvalue())
    if not hasattr(module, name):
        raise InputError(f"{option} {spec!r}: {where} has no {name!r}")
    return getattr(module, name)


def _import(where: str) -> ModuleType:
    """The module `where` names: a dotted module path, or a FILE.py."""
    if not where.endswith(".py"):
        return importlib.import_module(where)
    path = Path(where)
    module_spec = importlib.util.spec_from_file_location(f"hvd_cpu_user.{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
    return module


def portable_spec(spec: str) -> str:
    """A spec that still works from another working directory (FILE.py made absolute)."""
    where, _, name = spec.rpartition(":")
    return f"{Path(where).absolute()}:{name}" if where.endswith(".py") else spec
