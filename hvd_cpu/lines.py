"""How hvd-cpu prints a line: whole lines in one write each, from any room."""

from __future__ import annotations

import sys
from typing import TextIO


def say(text: str, stream: TextIO | None = None) -> None:
    """Print `text` (stdout unless `stream`) as one write of whole lines: with
    PYTHONUNBUFFERED, print() writes the newline separately, and Open MPI's --tag-output then
    tags it as a line of its own."""
    stream = stream or sys.stdout
    stream.write(text + "\n")
    stream.flush()
