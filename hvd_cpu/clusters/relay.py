"""The line between the driver and its cluster workers (Spark's tasks, Ray's actors): what
each one's rank prints reaches the driver's own stdout and stderr (a notebook cell, a
terminal), not a worker's log file.

    driver: Relay(address, tasks, key)   a TCP server, one thread per task
    task:   Link(address, key)           relay(process): its stdout and stderr, in frames

Only the job's own tasks get a word in. The relay listens on the address the executors reach
the driver at (spark/cluster.py's relay_address, ray/cluster.py's), and holds at most `tasks` +
MARGIN connections at once: any more are closed at once. It greets each with a fresh nonce; the
task answers with a MAC of it under the job's relay key (runtime/secret.py: the job's key
reaches the tasks inside the function Spark ships them, the actors in their call), then sends
frames: its stream, a sequence number one above the last, at most FRAME bytes of output and a
MAC over those and the nonce. A connection whose answer or any frame does not check out is
closed, and nothing it sent is written. Output is written line by line (a line longer than
FRAME in pieces), the control characters taken out (ESC and the other C0 and C1 controls but
tab and newline), so that what a rank prints cannot move the terminal's cursor, rename its
window or hide text.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
from typing import IO, Any

from hvd_cpu.runtime import secret

STREAMS = {b"1": "stdout", b"2": "stderr"}
NONCE_BYTES = 16
GREETING = b"greeting"  # what a task's answer signs, with the nonce
# A frame: its stream, sequence number and length, then that many bytes and the MAC.
HEADER = struct.Struct("!cQI")
FRAME = 64 * 1024
# Connections beyond one per task the relay holds at once (a task's link being replaced).
MARGIN = 2
# Seconds a connection has to answer the greeting, and a link to be let in.
GREETING_SECONDS = 10.0
CONNECT_SECONDS = 60.0
# What the terminal must not get: the C0 controls but tab and newline, DEL and the C1 controls.
CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


class Relay:
    """The driver's end: each line a task sends, tagged with its stream, written there."""

    def __init__(self, address: str, tasks: int, key: bytes) -> None:
        self._lock = threading.Lock()
        self._key = secret.channel_key(key, "relay")
        slots = threading.BoundedSemaphore(tasks + MARGIN)
        relay = self

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True

            def verify_request(self, request: Any, client_address: Any) -> bool:
                return slots.acquire(blocking=False)  # refused: closed at once

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    relay._serve(self.request)
                finally:
                    slots.release()

        self._server = Server((address, 0), Handler)
        self.address = self._server.server_address[:2]
        serving = threading.Thread(target=self._server.serve_forever, name="relay", daemon=True)
        serving.start()

    def _serve(self, connection: socket.socket) -> None:
        """Let a task in and write what it sends, until it ends or fails a check."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        with contextlib.suppress(OSError):
            connection.settimeout(GREETING_SECONDS)
            connection.sendall(nonce)
            answer = _read(connection, secret.MAC_BYTES, time.monotonic() + GREETING_SECONDS)
            if not secret.verify(self._key, answer, GREETING, nonce):
                return
            connection.settimeout(None)
            with connection.makefile("rb") as reader:
                self._copy(reader, nonce)

    def _copy(self, reader: IO[bytes], nonce: bytes) -> None:
        """Each frame checked, then its lines written; at the link's end, the last lines if
        they had no end of their own."""
        held = dict.fromkeys(STREAMS, b"")  # each stream's line so far
        expected = 1
        while header := reader.read(HEADER.size):
            if len(header) < HEADER.size:
                return
            tag, number, length = HEADER.unpack(header)
            if tag not in STREAMS or number != expected or length > FRAME:
                return
            payload = reader.read(length)
            mac = reader.read(secret.MAC_BYTES)
            if len(payload) < length or not secret.verify(self._key, mac, header, payload, nonce):
                return
            expected += 1
            *lines, held[tag] = (held[tag] + payload).split(b"\n")
            if len(held[tag]) >= FRAME:  # a long line: out in pieces
                lines, held[tag] = [*lines, held[tag]], b""
            self._write(tag, lines)
        for tag, line in held.items():
            self._write(tag, [line] if line else [])

    def _write(self, tag: bytes, lines: list[bytes]) -> None:
        if not lines:
            return
        text = "".join(CONTROLS.sub("", line.decode("utf-8", "replace")) + "\n" for line in lines)
        stream = getattr(sys, STREAMS[tag])
        with self._lock:
            stream.write(text)
            stream.flush()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


class Link:
    """A task's end: let in by the relay, then its rank's output in signed frames."""

    def __init__(self, address: tuple[str, int], key: bytes) -> None:
        self._key = secret.channel_key(key, "relay")
        self._socket, self._nonce = self._connect(address)
        self._sequence = secret.Sequence()
        self._lock = threading.Lock()

    def _connect(self, address: tuple[str, int]) -> tuple[socket.socket, bytes]:
        """A connection the relay has greeted, and its nonce; tried again while the relay
        turns connections away (held by others, for their greeting's seconds at most)."""
        deadline = time.monotonic() + CONNECT_SECONDS
        while True:
            connection = socket.create_connection(address, timeout=CONNECT_SECONDS)
            try:
                nonce = _read(connection, NONCE_BYTES, deadline)
                connection.sendall(secret.mac(self._key, GREETING, nonce))
                connection.settimeout(None)
                return connection, nonce
            except OSError:
                connection.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def relay(self, process: subprocess.Popen[bytes]) -> list[threading.Thread]:
        """Copy `process`'s stdout and stderr to the driver, in threads."""
        copies = [
            threading.Thread(target=self._copy, args=(pipe, tag), daemon=True)
            for pipe, tag in ((process.stdout, b"1"), (process.stderr, b"2"))
        ]
        for copy in copies:
            copy.start()
        return copies

    def _copy(self, pipe: Any, tag: bytes) -> None:
        """A line at a time, a long one FRAME bytes at a time."""
        while chunk := pipe.readline(FRAME):
            self.send(tag, chunk)

    def send(self, tag: bytes, payload: bytes) -> None:
        """One frame of `tag`'s stream (FRAME bytes at most)."""
        with self._lock, contextlib.suppress(OSError):
            header = HEADER.pack(tag, self._sequence.next(), len(payload))
            mac = secret.mac(self._key, header, payload, self._nonce)
            self._socket.sendall(header + payload + mac)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._socket.close()


def _read(connection: socket.socket, size: int, deadline: float) -> bytes:
    """Exactly `size` bytes by time.monotonic()'s `deadline`, or OSError (the other end closed
    the connection, or was too slow: it is not let in, or in)."""
    data = b""
    while len(data) < size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no answer in time")
        connection.settimeout(left)
        more = connection.recv(size - len(data))
        if not more:
            raise ConnectionError("the connection was closed")
        data += more
    return data
