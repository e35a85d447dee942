"""The frame formats are named once (hvd_cpu.config.formats); the readers, the writers, the
options' check and the command line's choices and help all follow that list."""

from __future__ import annotations

import subprocess
import sys

import click

from hvd_cpu.cli import cli
from hvd_cpu.config.formats import EXTENSIONS, FORMATS, extensions_text
from hvd_cpu.config.options import CHOICES
from hvd_cpu.data.frames import READERS, WRITERS


def test_every_format_is_read_written_and_has_an_extension() -> None:
    assert tuple(READERS) == tuple(WRITERS) == FORMATS
    assert set(EXTENSIONS.values()) == set(FORMATS)
    assert CHOICES["format"] == (None, *FORMATS)


def test_the_command_line_lists_them() -> None:
    assert extensions_text() == ".parquet/.pq, .pkl/.pickle, .feather or .csv"
    for name in ("train", "bench", "predict"):
        options = {o.name: o for o in cli.commands[name].params}
        assert isinstance(options["format"].type, click.Choice)
        assert tuple(options["format"].type.choices) == FORMATS
    data = {o.name: o for o in cli.commands["train"].params}["data"]
    assert data.help is not None and extensions_text() in data.help


def test_listing_them_does_not_load_pandas() -> None:
    """formats.py is apart from frames.py so that `hvd-cpu --help` stays fast."""
    code = "import sys, hvd_cpu.cli; print('pandas' in sys.modules, 'pyarrow' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]
