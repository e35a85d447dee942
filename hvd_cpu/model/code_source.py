"""The source file of the user's model code, found and read without running any of it.

Training records the sha256 of the file its --model came from; before predict imports code
that a model file names, it checks here that the file is unchanged since then, that NAME is
a class or def written at the top of that very file (not a name it imports, such as
`os:system`, and not a builtin), and that the file is not Python's own library (no model is
defined there, while gadgets such as `subprocess:call` are). Finding a module's file runs
nothing: a dotted path is walked package by package through the path finder, which reads
folders, never a package's `__init__.py` (importlib.util.find_spec would import the parents).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.machinery
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hvd_cpu.errors import InputError
from hvd_cpu.model.user_code import check_file, import_object, split_spec

OPTION = "--model"
# Folders of Python's own library that hold installed packages, which are not its own.
INSTALLED = {"site-packages", "dist-packages"}


@dataclass(frozen=True)
class Source:
    """The file a model spec's code is in, and the NAME it defines there."""

    spec: str
    name: str
    path: Path  # resolved

    @classmethod
    def find(cls, spec: str) -> Source:
        """Where `spec` has its code, found without running it; code that is no Python source
        file here (a builtin, an extension, a module not installed) is refused."""
        where, name = split_spec(spec, OPTION)
        check_file(where, OPTION)
        path = Path(where).resolve() if where.endswith(".py") else module_file(where)
        if path is None:
            raise InputError(
                f"the model's code {spec} is no Python source file here ({where} is not "
                "installed, or is built into Python); install the code the model was trained with"
            )
        return cls(spec, name, path)

    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()

    def check(self, recorded: str | None, model_file: Path) -> None:
        """Before anything of it runs: the file as `model_file` recorded it (when it recorded
        it), defining NAME itself, and not Python's own library."""
        source = self.path.read_bytes()
        if recorded is not None and hashlib.sha256(source).hexdigest() != recorded:
            raise InputError(
                f"{self.path} changed since {model_file} was trained with it (its sha256 is not "
                "the one recorded); restore the file as it was, or train the model again"
            )
        try:
            tree = ast.parse(source, filename=str(self.path))
        except (SyntaxError, ValueError) as exc:
            raise InputError(
                f"{model_file} names {self.spec}, but {self.path} is not Python source ({exc}); "
                "restore the file the model was trained with"
            ) from exc
        if not defines(tree, self.name):
            raise InputError(
                f"{model_file} names {self.spec}, but {self.name} is not a class or def written "
                f"at the top of {self.path}; a model file may only name model code defined in "
                "the file it names: train the model from where its class is defined"
            )
        if in_standard_library(self.path):
            raise InputError(
                f"{model_file} names {self.spec}, which is Python's own library, not model code; "
                "predict only runs your model's code: train the model again"
            )

    def load(self) -> Any:
        """Import the module and take NAME: the very class or function its file defines, not
        an object it was rebound to."""
        found = import_object(self.spec, OPTION)
        module = sys.modules.get(getattr(found, "__module__", None) or "")
        where = getattr(module, "__file__", None)
        if (
            getattr(found, "__qualname__", None) != self.name
            or not where
            or Path(where).resolve() != self.path
        ):
            raise InputError(
                f"{self.spec}: once imported, {self.name} is not the class or function written "
                f"in {self.path} but an object bound to its name; define the model there under "
                "a name of its own"
            )
        return found


def module_file(dotted: str) -> Path | None:
    """The .py file of module `dotted`, found package by package through the path finder,
    which looks into folders without executing any `__init__.py`; None when there is none."""
    parts = dotted.split(".")
    if not all(part.isidentifier() for part in parts):
        return None
    locations = None  # sys.path
    spec = None
    for depth in range(1, len(parts) + 1):
        if spec is not None:
            locations = spec.submodule_search_locations
            if locations is None:  # a module where a package should be
                return None
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth]), locations)
        if spec is None:
            return None
    origin = spec.origin if spec.has_location else None
    if not origin or not origin.endswith(".py") or not Path(origin).is_file():
        return None
    return Path(origin).resolve()


def defines(tree: ast.Module, name: str) -> bool:
    """Whether `name` (dotted for a nested class: Outer.Inner) is a class or def statement of
    the module's top level, or of the classes named before it."""
    body: list[ast.stmt] = tree.body
    *outer, last = name.split(".")
    for part in outer:
        found = [n for n in body if isinstance(n, ast.ClassDef) and n.name == part]
        if not found:
            return False
        body = found[-1].body
    return any(isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == last for n in body)


def in_standard_library(path: Path) -> bool:
    """Whether `path` is a module of Python's own library (not a package installed into it)."""
    roots = {Path(sysconfig.get_path(name)).resolve() for name in ("stdlib", "platstdlib")}
    return any(path.is_relative_to(root) for root in roots) and not INSTALLED & set(path.parts)


def recorded_sha256(spec: str) -> str | None:
    """The sha256 a model file records of `spec`'s source file, or None when it has none here
    (a notebook's class, given to fit() as the object)."""
    try:
        return Source.find(spec).sha256()
    except (InputError, OSError):
        return None
