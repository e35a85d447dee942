"""Apply a unified diff to a source tree, in Python: the install must not need `patch`.

Only what our own patches use: `--- a/PATH` / `+++ b/PATH` headers (`/dev/null` for a new
file), `@@ -l,n +l,m @@` hunks, and "\\ No newline at end of file". A hunk's old lines must
match exactly; like GNU patch without fuzz, it may sit some lines away from where the header
says (the nearest match wins), which keeps a patch working when an earlier hunk of another
patch moved the lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(ValueError):
    """A patch that does not parse or does not apply; the message names the file and hunk."""


@dataclass
class Hunk:
    start: int  # 0-based line of the old text where the header says it starts
    old: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)


@dataclass
class FilePatch:
    path: str  # relative to the tree's root, the a/ or b/ prefix removed
    created: bool
    hunks: list[Hunk] = field(default_factory=list)


def parse(text: str) -> list[FilePatch]:
    """The files and hunks of a unified diff."""
    files: list[FilePatch] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        if not (lines[i].startswith("--- ") and i + 1 < len(lines)):
            i += 1
            continue
        old_name, new_name = _name(lines[i][4:]), _name(lines[i + 1][4:])
        if not lines[i + 1].startswith("+++ "):
            raise PatchError(f"'---' without '+++' at line {i + 1}")
        created = old_name == "/dev/null"
        current = FilePatch(_strip_prefix(new_name), created)
        files.append(current)
        i += 2
        while i < len(lines) and (match := HUNK.match(lines[i])):
            old_count = int(match[2]) if match[2] is not None else 1
            new_count = int(match[4]) if match[4] is not None else 1
            hunk = Hunk(max(int(match[1]) - 1, 0))
            i += 1
            while (old_count or new_count) and i < len(lines):
                tag, body = lines[i][:1], lines[i][1:]
                if lines[i] in ("\n", "\r\n"):  # an empty context line whose space was lost
                    tag, body = " ", lines[i]
                if tag in (" ", "-"):
                    hunk.old.append(body)
                    old_count -= 1
                if tag in (" ", "+"):
                    hunk.new.append(body)
                    new_count -= 1
                if tag not in (" ", "-", "+"):
                    raise PatchError(f"{current.path}: unexpected line {i + 1}: {lines[i]!r}")
                i += 1
                if i < len(lines) and lines[i].startswith("\\"):  # \ No newline at end of file
                    sides = {"-": [hunk.old], "+": [hunk.new], " ": [hunk.old, hunk.new]}[tag]
                    for side in sides:
                        side[-1] = side[-1].rstrip("\r\n")
                    i += 1
            if old_count > 0 or new_count > 0:
                raise PatchError(f"{current.path}: the last hunk is cut short")
            current.hunks.append(hunk)
    if not files:
        raise PatchError("no file headers ('--- a/...', '+++ b/...') found")
    return files


def _name(header: str) -> str:
    return header.rstrip("\r\n").split("\t")[0].strip()


def _strip_prefix(name: str) -> str:
    return name.split("/", 1)[1] if "/" in name else name


def apply(patch_text: str, root: Path) -> list[str]:
    """Apply `patch_text` to the tree at `root`; the paths it changed.

    Every file is patched in memory first and written only when all its hunks applied, so a
    patch that does not fit leaves no half-patched file.
    """
    results: dict[Path, str] = {}
    for file_patch in parse(patch_text):
        path = root / file_patch.path
        if file_patch.created:
            if path.exists():
                raise PatchError(f"{file_patch.path}: the patch creates it, but it exists")
            lines: list[str] = []
        else:
            try:
                lines = path.read_text().splitlines(keepends=True)
            except FileNotFoundError:
                raise PatchError(f"{file_patch.path}: no such file in the tree") from None
        results[path] = "".join(_apply_hunks(file_patch, lines))
    for path, text in results.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return [str(path.relative_to(root)) for path in results]


def _apply_hunks(file_patch: FilePatch, lines: list[str]) -> list[str]:
    offset = 0  # how far earlier hunks moved the lines after them
    for number, hunk in enumerate(file_patch.hunks, 1):
        at = _find(lines, hunk.old, hunk.start + offset)
        if at is None:
            raise PatchError(
                f"{file_patch.path}: hunk {number} (line {hunk.start + 1}) does not match the "
                "file; is this the source the patch was made for?"
            )
        lines[at : at + len(hunk.old)] = hunk.new
        offset = at - hunk.start + len(hunk.new) - len(hunk.old)
    return lines


def _find(lines: list[str], old: list[str], near: int) -> int | None:
    """The start of `old` in `lines` nearest to line `near`, or None."""
    if not old:
        return min(max(near, 0), len(lines))
    for distance in range(len(lines) + 1):
        for at in (near - distance, near + distance) if distance else (near,):
            if 0 <= at <= len(lines) - len(old) and lines[at : at + len(old)] == old:
                return at
    return None
