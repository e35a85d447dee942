"""The frame file formats hvd-cpu reads and writes: their names (--format's values) and
extensions.

Apart from data/frames.py, which reads and writes them, so that the command line can list them
in its choices and help without importing pandas and pyarrow (seconds, for `hvd-cpu --help`).
"""

from __future__ import annotations

import codecs

from hvd_cpu.errors import InputError

FORMATS = ("parquet", "pickle", "feather", "csv")
EXTENSIONS = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".pkl": "pickle",
    ".pickle": "pickle",
    ".feather": "feather",
    ".csv": "csv",
}


def extensions_text() -> str:
    """The extensions, grouped by format, as help text says them (".parquet/.pq, ... or .csv")."""
    groups = ["/".join(e for e, f in EXTENSIONS.items() if f == name) for name in FORMATS]
    return ", ".join(groups[:-1]) + " or " + groups[-1]


def check_encoding(encoding: str | None) -> None:
    """--encoding names a text encoding Python knows (before any file is opened)."""
    if encoding is None:
        return
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise InputError(
            f"--encoding {encoding!r} is not an encoding Python knows; name one such as "
            "utf-8, latin-1 or cp1252"
        ) from None
