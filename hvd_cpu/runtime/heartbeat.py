"""The heartbeat datagram (runtime/watchdog.py), signed: what a rank tells a peer, and how the
peer knows that the rank said it, to it, and said it now.

Each datagram carries its sender's sequence number (one above the last it sent) and a MAC
(runtime/secret.py) over all its fields under the heartbeat key, never the key itself. The key
is new for each watch: rank 0 draws a salt and broadcasts it over the job's collectives;
where the launcher gave every rank the same job secret (HOROVOD_JOB_KEY) the key is the
secret's heartbeat key mixed with the salt, else the salt itself (a user's own mpirun: the
collectives are then the one channel of the job no one else speaks on). A receiver takes a
datagram only whole, from the sender's address and port, addressed to itself, from a peer,
signed under that key and numbered above the last one it took from that sender: a forged one,
one of another job or watch, a replay and an old one overtaken by a newer are dropped
without a word.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from hvd_cpu.runtime import secret

# The fields: the sender's rank, the addressee's rank, what the sender says, how many
# collectives it has entered and whether it is inside one, its sequence number. It says: a
# heartbeat, that it leaves normally (stop watching it), that it has named the stall that ends
# the job, or that it failed and has said so (both: the others end without a word; under
# --elastic the failed one is a lost rank).
FIELDS = struct.Struct("!IIBQ?Q")
SIZE = FIELDS.size + secret.MAC_BYTES
BEAT, LEAVING, NAMED, FAILED = 0, 1, 2, 3
SALT_BYTES = 16


class Beat(NamedTuple):
    sender: int
    addressee: int
    what: int
    entered: int
    inside: bool
    sequence: int


def key_of(salt: bytes, job: bytes | None) -> bytes:
    """The heartbeat key of a watch whose salt is `salt`, under the job's secret if any."""
    return secret.salted(secret.channel_key(job, "heartbeat"), salt) if job else salt


def fingerprint(key: bytes) -> bytes:
    """What the ranks compare to know they hold the same key (shown over the collectives
    only: it signs no datagram)."""
    return secret.mac(key, b"heartbeat key")


class Signed:
    """One rank's heartbeats under one key: numbered and signed out, checked in."""

    def __init__(self, key: bytes, rank: int, peers: dict[int, tuple[str, int]]) -> None:
        self.key, self.rank = key, rank
        self.peers = peers  # each peer's rank: the address and port its datagrams come from
        self.sequence = secret.Sequence()
        self.latest = secret.Latest()

    def pack(self, addressee: int, what: int, entered: int, inside: bool) -> bytes:
        """The next datagram (number it and send it under one lock: in the order of numbers)."""
        fields = FIELDS.pack(self.rank, addressee, what, entered, inside, self.sequence.next())
        return fields + secret.mac(self.key, fields)

    def open(self, data: bytes, source: tuple[str, int]) -> Beat | None:
        """What a peer said, or None for anything else (see the module's docstring)."""
        if len(data) != SIZE:
            return None
        fields, tag = data[: FIELDS.size], data[FIELDS.size :]
        beat = Beat(*FIELDS.unpack(fields))
        if beat.addressee != self.rank or self.peers.get(beat.sender) != source[:2]:
            return None
        if not secret.verify(self.key, tag, fields):
            return None
        return beat if self.latest.take(beat.sender, beat.sequence) else None
