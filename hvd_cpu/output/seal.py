"""The seal on a model file: how predict knows that the code a model.pt names was recorded by
one of this user's own runs, and may run without asking.

A seal is an HMAC-SHA256 over the file's architecture record (the code's spec, its source
file's sha256, its arguments), made with a key only this user can read:
`~/.config/hvd-cpu/model-seal.key` (under XDG_CONFIG_HOME if set), 32 random bytes made by
the first training that names code. A file from someone else, another host or an older
hvd-cpu has no seal this key makes, so predict asks before running its code (--trust-code).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import stat
import sys
from pathlib import Path
from typing import Any

from hvd_cpu.atomic import NO_LINK
from hvd_cpu.errors import InputError
from hvd_cpu.lines import say

KEY_FILE = "model-seal.key"
KEY_BYTES = 32
# What a seal signs besides the record: a key made for one purpose signs nothing else.
PURPOSE = b"hvd-cpu model seal 1\0"


def key_path() -> Path:
    """Where this user's key lives: XDG_CONFIG_HOME's hvd-cpu folder, else ~/.config's."""
    config = os.environ.get("XDG_CONFIG_HOME", "")
    base = Path(config) if os.path.isabs(config) else Path.home() / ".config"
    return base / "hvd-cpu" / KEY_FILE


def read_key() -> bytes | None:
    """This user's key, or None when there is none yet. A key that others could read or
    replace is refused: whoever knows it can seal code for this user to run."""
    path = key_path()
    try:
        fd = os.open(path, os.O_RDONLY | NO_LINK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InputError(
            f"cannot read the model seal key {path}: {exc.strerror}; remove it (the next "
            "training makes a new one) or make it a file of yours"
        ) from exc
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if info.st_uid != os.geteuid():
            raise InputError(
                f"the model seal key {path} belongs to another user (uid {info.st_uid}); "
                "remove it, and the next training makes one of yours"
            )
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise InputError(
                f"the model seal key {path} is open to other users (mode "
                f"{stat.S_IMODE(info.st_mode):04o}); chmod 600 {path}"
            )
        key = handle.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise InputError(
            f"the model seal key {path} is damaged; remove it (the next training makes a new "
            "one; models sealed with it then ask for --trust-code)"
        )
    return key


def ready_key() -> None:
    """Before a training that names code: make this user's key if there is none, and refuse
    an unsafe one now rather than at the end. The key is written whole under a name of its
    own (created O_EXCL, mode 0600), then linked into place, which fails if another process
    got there first: a reader never sees half a key. A home that cannot hold it is said once,
    and the run's model is then unsealed (predict asks for --trust-code)."""
    path = key_path()
    if not os.path.lexists(path):
        _make_key(path)
    read_key()


def _make_key(path: Path) -> None:
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        draft = path.parent / f".{KEY_FILE}.{secrets.token_hex(8)}"
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NO_LINK, 0o600)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(secrets.token_bytes(KEY_BYTES))
                handle.flush()
                os.fsync(handle.fileno())
            with contextlib.suppress(FileExistsError):
                os.link(draft, path)
        finally:
            draft.unlink()
    except OSError as exc:
        say(
            f"hvd-cpu: note: cannot make the model seal key {path} ({exc.strerror}); model.pt "
            "is not sealed, and predict will ask for --trust-code before running your model's "
            "code (set XDG_CONFIG_HOME to a folder of yours to seal it)",
            sys.stderr,
        )


def seal(record: dict[str, Any]) -> str:
    """The seal of `record` with this user's key ("" when there is no key: unsealed)."""
    key = read_key()
    return _mac(key, record) if key else ""


def verify(record: dict[str, Any], tag: Any) -> bool:
    """Whether `tag` is the seal this user's key makes of `record`."""
    key = read_key()
    return bool(key and isinstance(tag, str) and hmac.compare_digest(_mac(key, record), tag))


def _mac(key: bytes, record: dict[str, Any]) -> str:
    # One spelling of the record: its keys sorted, every value as JSON (repr for the rest).
    text = json.dumps(record, sort_keys=True, separators=(",", ":"), default=repr)
    return hmac.new(key, PURPOSE + text.encode(), hashlib.sha256).hexdigest()
