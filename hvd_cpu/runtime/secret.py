"""The job's secret: what every channel a job opens asks of whoever speaks to it.

A job's secret is made where the job starts (horovodrun, `fit()`, the Spark driver, SLURM's
script) and reaches its ranks the way their launcher carries the environment, never on a
command line: the variable `HOROVOD_JOB_KEY` (64 hex digits). Our Horovod build's
authenticated-rendezvous patch signs its rendezvous and KVStore requests with it; hvd-cpu's
own channels (the heartbeats, the Spark relay) each sign with a key of their own derived from
it, so that what one channel shows never serves another. Messages carry an HMAC, never the key.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import secrets
import struct
from collections.abc import Hashable

JOB_KEY = "HOROVOD_JOB_KEY"
KEY_BYTES = 32
# A message's HMAC-SHA256, cut to its first 16 bytes: a forgery still takes 2^128 tries.
MAC_BYTES = 16


def new_key() -> str:
    """A fresh secret for a job, as its environment variable holds it."""
    return secrets.token_hex(KEY_BYTES)


def job_key() -> bytes | None:
    """This job's secret, where its launcher gave it one (else None: a user's own mpirun)."""
    text = os.environ.get(JOB_KEY, "")
    try:
        key = bytes.fromhex(text)
    except ValueError:
        return None
    return key if len(key) == KEY_BYTES else None


def channel_key(key: bytes, channel: str) -> bytes:
    """The key one channel signs with, derived from the job's: a channel's key known (a
    relay's, say) tells nothing of another's."""
    return hmac.new(key, b"hvd-cpu channel " + channel.encode(), hashlib.sha256).digest()


def mac(key: bytes, *fields: bytes) -> bytes:
    """The MAC over `fields`, each length-prefixed so that no two lists of fields sign alike."""
    signed = hmac.new(key, digestmod=hashlib.sha256)
    for field in fields:
        signed.update(struct.pack("!I", len(field)) + field)
    return signed.digest()[:MAC_BYTES]


def verify(key: bytes, tag: bytes, *fields: bytes) -> bool:
    """Whether `tag` is the MAC of `fields` (compared in constant time)."""
    return hmac.compare_digest(mac(key, *fields), tag)


def salted(key: bytes, salt: bytes) -> bytes:
    """`key` made new with `salt`: each run of a channel (each watch of the heartbeats) signs
    with a key of its own, so what one run showed serves no other."""
    return hmac.new(key, b"hvd-cpu salt " + salt, hashlib.sha256).digest()


class Sequence:
    """A sender's message numbers, each one above the last: a receiver that keeps the last one
    it took from each sender (`Latest`) refuses a replay or a late old one. Number and send
    under one lock, so that the messages leave in the order of their numbers."""

    def __init__(self) -> None:
        self._numbers = itertools.count(1)

    def next(self) -> int:
        return next(self._numbers)


class Latest:
    """The last number taken from each sender: a message numbered at or below it is a replay,
    or an old one overtaken by a newer (dropped). Take a number only once its MAC is checked."""

    def __init__(self) -> None:
        self._last: dict[Hashable, int] = {}

    def take(self, sender: Hashable, number: int) -> bool:
        """Whether `number` is new from `sender` (and now the last taken)."""
        if number <= self._last.get(sender, 0):
            return False
        self._last[sender] = number
        return True
