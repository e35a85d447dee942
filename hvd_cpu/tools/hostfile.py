"""Host files, "host slots=N" lines with # comments: the one reader of them.

`hvd-cpu doctor` checks the hosts of one, launch/run-hosts.sh turns one into horovodrun's -np
and -H (horovodrun's own --hostfile reader takes no comment, blank line or line without
slots=), and launch/discover-hosts.sh lists one to horovodrun's elastic mode. One reader, so a
bad file is the same one line and exit code 2 from each of them:

    python -m hvd_cpu.tools.hostfile total|hosts|discovery FILE

Horovod's elastic mode runs discover-hosts.sh every second, so this module imports only small
parts of the standard library (no torch, Horovod or pandas): a call costs about what starting
Python does.
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

from hvd_cpu.errors import InputError

FORMAT = "'host slots=N' lines (N >= 1, slots=1 if omitted), # for comments"
# The characters horovodrun's -H takes in a host (its pattern is [\w.-]+).
HOST_PUNCTUATION = frozenset("._-")
FORMS = ("total", "hosts", "discovery")


class HostSlots(NamedTuple):
    """One host of the file and the ranks it runs."""

    host: str
    slots: int


def read_hostfile(path: str | os.PathLike[str]) -> list[HostSlots]:
    """The hosts of the file at `path`; InputError (one line: where and what) if it is bad."""
    if not os.path.isfile(path):
        raise InputError(f"host file not found: {path}")
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{path} is not a text file of 'host slots=N' lines; pass the host file you will "
            "give horovodrun (see launch/hostfile.example)"
        ) from exc
    except OSError as exc:
        raise InputError(f"cannot read host file {path}: {exc.strerror or exc}") from exc
    return parse(text, str(path))


def parse(text: str, source: str) -> list[HostSlots]:
    """The hosts of a host file's `text`; `source` names it in errors."""
    hosts: list[HostSlots] = []
    first_line: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{number}"
        host, *rest = line.split()
        if not all(c.isalnum() or c in HOST_PUNCTUATION for c in host):
            raise InputError(
                f"{where}: {host!r} is not a host name or IPv4 address: letters, digits, '.', "
                "'-' and '_' only (horovodrun takes no user@ or :port in a host)"
            )
        if host in first_line:
            raise InputError(
                f"{where}: {host} is listed again (first on line {first_line[host]}); give "
                "each host one line with all its slots"
            )
        hosts.append(HostSlots(host, _slots(rest, raw, where)))
        first_line[host] = number
    if not hosts:
        raise InputError(f"{source} lists no hosts; expected {FORMAT}")
    return hosts


def _slots(words: list[str], raw: str, where: str) -> int:
    """N of the `slots=N` after the host, 1 without one."""
    if not words:
        return 1
    key, _, value = words[0].partition("=")
    digits = value.isascii() and value.isdigit()
    if len(words) > 1 or key != "slots" or not digits or int(value) < 1:
        raise InputError(f"{where}: expected 'host slots=N' with N >= 1, got {raw.strip()!r}")
    return int(value)


def render(hosts: list[HostSlots], form: str) -> str:
    """What the launch scripts need: the sum of the slots (-np), horovodrun's -H list, or
    the "host:slots" lines a host discovery script prints."""
    if form == "total":
        return str(sum(h.slots for h in hosts))
    pairs = [f"{h.host}:{h.slots}" for h in hosts]
    return ",".join(pairs) if form == "hosts" else "\n".join(pairs)


def main(argv: list[str]) -> int:
    """`python -m hvd_cpu.tools.hostfile FORM FILE`: print the file as FORM, or one line and 2."""
    if len(argv) != 2 or argv[0] not in FORMS:
        print(f"usage: python -m hvd_cpu.tools.hostfile {'|'.join(FORMS)} FILE", file=sys.stderr)
        return 2
    try:
        print(render(read_hostfile(argv[1]), argv[0]))
    except InputError as exc:
        print(f"hvd-cpu: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
