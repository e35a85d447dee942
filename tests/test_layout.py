"""The rooms of hvd_cpu/ import one way (docs/design.md): each module imports only its own
room and the rooms below it, so what comes next lands in its own room without a circle."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

from .jobs import REPO

# Bottom first. The floor: one-line errors, how a line is printed, whole-file writes, every
# option. Then the job (runtime), then the data flow: data -> model -> output -> training, what
# the cluster engines share, and on top the commands.
ROOMS = [
    {"errors", "lines", "atomic", "config"},
    {"runtime"},
    {"data"},
    {"model"},
    {"output"},
    {"training"},
    {"clusters"},
    {"tools", "api", "cli", "spark", "ray", "horovod_build", "__init__"},
]
LEVEL = {room: level for level, rooms in enumerate(ROOMS) for room in rooms}
# The loop's state and epoch metrics import nothing of hvd-cpu; output reads them.
LEAVES = {"hvd_cpu.training.state"}


def room_of(module: str) -> str:
    return module.split(".")[1].removesuffix(".py") if "." in module else "__init__"


def is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or path.is_dir()


def imported(path: ast.AST) -> set[str]:
    """Every hvd_cpu module a file imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(path):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hvd_cpu"):
            names = {f"{node.module}.{alias.name}" for alias in node.names}
            found |= {n for n in names if is_module(n)} or {node.module}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("hvd_cpu")}
    return {name for name in found if name != "hvd_cpu"}


MODULES = sorted((REPO / "hvd_cpu").rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO / "hvd_cpu")))
def test_a_module_imports_only_its_room_and_the_rooms_below(path: Path) -> None:
    name = ".".join(path.relative_to(REPO).with_suffix("").parts)
    room = (
        room_of(name) if path.name != "__init__.py" or path.parent.name != "hvd_cpu" else "__init__"
    )
    level = LEVEL[room]
    upward = [
        other
        for other in imported(ast.parse(path.read_text()))
        if other not in LEAVES
        and room_of(other) in LEVEL  # `from hvd_cpu.x import name`: name is not a room
        and LEVEL[room_of(other)] > level
    ]
    assert not upward, f"{name} ({room}) imports rooms above it: {sorted(upward)}"


def test_the_leaves_import_nothing_of_hvd_cpu() -> None:
    for leaf in LEAVES:
        path = REPO / (leaf.replace(".", "/") + ".py")
        assert not imported(ast.parse(path.read_text())), leaf


def test_no_module_comes_back_to_itself_through_its_imports() -> None:
    """No import circle between modules of one room either, type-only imports (under
    TYPE_CHECKING) included: a circle is two modules that cannot be read one after the
    other (prepare and membership were one: membership now implements prepare's Joining)."""
    graph = {}
    for path in MODULES:
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = imported(ast.parse(path.read_text())) - {name}
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        pytest.fail(f"an import circle: {' -> '.join(exc.args[1])}")
