"""Files that must never be seen half-written: checkpoints, models, records, predictions.

Each is written to a temporary file in its own folder and renamed over the old one, so a
crash at any moment leaves either the old file or the new one, never a torn mix; a record
that grows (metrics.jsonl) is appended to. Nothing is written through a link planted in the
folder (the rename replaces the link itself, an append refuses it), and a folder another user
owns or may write to is refused before anything is written into it.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from hvd_cpu.errors import InputError

# Opened for writing, a name in the folder never leads elsewhere: a link there fails the open.
NO_LINK = os.O_NOFOLLOW | os.O_CLOEXEC


def check_own_folder(folder: Path) -> None:
    """Refuse an existing `folder` that another user owns or may write to: they could plant
    names in it (a checkpoint to resume, links to files of yours) between our writes. A
    folder that does not exist yet is made later with the umask, as any program makes one."""
    try:
        info = folder.stat()
    except OSError:  # none yet, or not ours to look into: the write says why
        return
    if not stat.S_ISDIR(info.st_mode):  # a file where the folder should be: the write says so
        return
    if info.st_uid != os.geteuid():
        raise InputError(
            f"the folder {folder} belongs to another user (uid {info.st_uid}), who could plant "
            "files in it for hvd-cpu to write through; choose a folder of your own"
        )
    if info.st_mode & stat.S_IWOTH:
        raise InputError(
            f"the folder {folder} is writable by other users (mode "
            f"{stat.S_IMODE(info.st_mode):04o}), who could plant files in it for hvd-cpu to write "
            f"through; chmod o-w {folder}, or choose a folder of your own"
        )


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write through a temporary file in the same folder, then rename it over `path`; the
    temporary files of earlier crashes are removed after the next successful write.

    The temporary file is created with mode 0666, as open() would, so the kernel applies the
    umask (reading the umask would mean changing it, for every thread of the process).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NO_LINK, 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)


def append(path: Path, data: bytes) -> None:
    """Add `data` at the end of `path` (made if missing, with the umask); a link planted there
    fails with the OSError ELOOP instead of leading the bytes into another file."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | NO_LINK, 0o666)
    with os.fdopen(fd, "ab") as handle:
        handle.write(data)
