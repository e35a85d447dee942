"""Ranks that read different data: every rank reads --data itself, on its own host, and the
copies there (or the files of a folder) can disagree. They compare what they read before
anything is fitted on it."""

from __future__ import annotations

import socket
from pathlib import Path

from hvd_cpu.data.frames import InMemory
from hvd_cpu.data.parquet import Pieces
from hvd_cpu.errors import InputError
from hvd_cpu.runtime.collectives import Collectives


def check_same_data(
    data: Path | None, rows: Pieces | InMemory, collectives: Collectives, whole: bool
) -> None:
    """Every rank read the same columns, each as the same kind of value, and (when each
    reads the `whole` of it) the same number of rows. Copies of --data that differ between
    hosts would otherwise fit statistics that do not line up (a hang, or a wrong model), or
    share out rows that are not the same. Every rank raises the same error, so rank 0 says it
    once."""
    if data is None:
        return
    mine = (rows.columns, rows.rows if whole else None, socket.gethostname())
    seen = collectives.gather(mine, "what each rank read")
    (columns, count, host), where = seen[0], f"where rank 0 on {seen[0][2]}"
    for rank, (their_columns, their_count, their_host) in enumerate(seen):
        ours, theirs = dict(columns), dict(their_columns)
        if their_columns == columns and their_count == count:
            continue
        if missing := [name for name in ours if name not in theirs]:
            what = f"has no column {missing[0]!r} {where} has it"
        elif extra := [name for name in theirs if name not in ours]:
            what = f"has a column {extra[0]!r} {where} has none"
        elif changed := [name for name in ours if ours[name] != theirs[name]]:
            name = changed[0]
            what = f"reads column {name!r} as {theirs[name]} {where} reads {ours[name]}"
        elif their_columns != columns:
            what = f"has the columns in another order than rank 0 on {host}"
        else:
            what = f"has {their_count} rows {where} has {count}"
        raise InputError(
            f"the ranks read different data from {data}: rank {rank} on {their_host} "
            f"{what}; give every host the same copy of it (or one shared folder)"
        )
