"""The user's own code: named on the command line (`package.module:NAME` or
`path/to/file.py:NAME`, a model class or factory for --model, a loss for --loss), or passed to
`fit()` as the object itself, shipped to the ranks by value (cloudpickle, as Horovod's own
`horovod.run` ships functions) and found there under its name."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import io
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import cloudpickle

from hvd_cpu.errors import InputError

# The package FILE.py modules are imported under (as hvd_cpu_user.FILE).
USER_PACKAGE = "hvd_cpu_user"
# The user's objects shipped to this rank by value, by the name they are asked for with.
_received: dict[str, Any] = {}


def split_spec(spec: str, option: str) -> tuple[str, str]:
    """(where, NAME) of a spec that could name importable code; refuses, naming `option`, one
    that cannot (a notebook's own class is only ever the object itself)."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise InputError(f"{option} {spec!r} is not MODULE:NAME or FILE.py:NAME")
    if where == "__main__":
        raise InputError(
            f"{option} {spec!r} was defined in a notebook or script, which cannot be imported "
            f"here: from Python pass the object itself ({option.strip('-')}={name}), or move it "
            f"into a file and name it FILE.py:{name}"
        )
    return where, name


def check_file(where: str, option: str) -> None:
    """A FILE.py spec's file must be there."""
    if where.endswith(".py") and not Path(where).is_file():
        raise InputError(f"{option} file not found: {where}; check the path on every host")


def given(spec: str) -> bool:
    """Whether this process was handed the object `spec` names (fit()'s or predict()'s
    caller's own, or shipped to this rank): the caller's code, found without importing."""
    return spec in _received


def import_object(spec: str, option: str) -> Any:
    """The object `spec` names; every way that can fail is one line naming `option`."""
    if spec in _received:
        return _received[spec]
    where, name = split_spec(spec, option)
    check_file(where, option)
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
    try:  # a nested class's name is dotted: Outer.Inner
        return functools.reduce(getattr, name.split("."), module)
    except AttributeError:
        raise InputError(f"{option} {spec!r}: {where} has no {name!r}") from None


def _import(where: str) -> ModuleType:
    """The module `where` names: a dotted module path, or a FILE.py."""
    if not where.endswith(".py"):
        return importlib.import_module(where)
    path = Path(where).resolve()
    name, version = f"{USER_PACKAGE}.{path.stem}", path.stat().st_mtime_ns
    # Imported once while the file is unchanged: --model and --loss from one file share its
    # classes (a second import would make the model's class a stranger to pickle).
    known = sys.modules.get(name)
    if getattr(known, "__file__", None) == str(path) and known.__version_ns__ == version:
        return known
    # Under a package of its own, so that pickle finds its classes again (a trained model
    # coming back to fit(), torch.save of it): pickle imports the package first.
    sys.modules.setdefault(USER_PACKAGE, ModuleType(USER_PACKAGE))
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    module.__version_ns__ = version
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:  # half a module is never found again
        del sys.modules[name]
        raise
    return module


def label_of(obj: Any, option: str) -> str:
    """The name the user's object is asked for by (MODULE:QUALNAME, as a spec reads), which
    the model file records (`__main__:Network` for a class defined in a notebook)."""
    if not callable(obj):
        raise InputError(
            f"{option}= takes a class, a function or a 'MODULE:NAME' string, got a "
            f"{type(obj).__name__}"
        )
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{getattr(obj, '__module__', None) or '__main__'}:{name}"


@contextlib.contextmanager
def provided(objects: dict[str, Any]) -> Iterator[None]:
    """While inside, this process finds each object under its label (what fit(comm=) or
    predict() was given), and afterwards no longer: a class redefined in a later cell wins."""
    before = dict(_received)
    _received.update(objects)
    try:
        yield
    finally:
        _received.clear()
        _received.update(before)


def ship(obj: Any, label: str, option: str) -> bytes:
    """`obj`'s bytes for the ranks; what cannot be pickled (an open file, a lock it closes
    over) is one line."""
    try:
        return cloudpickle.dumps(obj)
    except Exception as exc:  # whatever the user's object holds
        raise InputError(
            f"{option}={label.rpartition(':')[2]} cannot be sent to the ranks: "
            f"{type(exc).__name__}: {exc}; create what it holds (files, locks, connections) "
            "inside it, not around it"
        ) from exc


def receive(shipped: dict[str, bytes]) -> None:
    """On a rank: unpickle the user's shipped objects, found from now on by their names."""
    for label, payload in shipped.items():
        try:
            _received[label] = cloudpickle.loads(payload)
        except Exception as exc:  # e.g. a module it needs is missing on this host
            raise InputError(
                f"{label.rpartition(':')[2]} cannot be rebuilt on this rank: "
                f"{type(exc).__name__}: {exc}; what it needs must import on every host"
            ) from exc


def portable_spec(spec: str) -> str:
    """A spec that still works from another working directory (FILE.py made absolute)."""
    where, _, name = spec.rpartition(":")
    return f"{Path(where).absolute()}:{name}" if where.endswith(".py") else spec
