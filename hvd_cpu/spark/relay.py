"""The line between the driver and its Spark tasks: what each task's rank prints reaches the
driver's own stdout and stderr (a notebook cell, a terminal), not an executor's log file.

    driver: Relay()            a TCP server, one thread per task
    task:   Link(host, port)   relay(process): its stdout and stderr, line by line
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import subprocess
import sys
import threading
from typing import IO, Any

STREAMS = {b"1": "stdout", b"2": "stderr"}


class Relay:
    """The driver's end: each line a task sends, tagged with its stream, written there."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        relay = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                relay._copy(self.rfile)

        self._server = socketserver.ThreadingTCPServer(("", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="spark-relay", daemon=True).start()

    def _copy(self, reader: IO[bytes]) -> None:
        for line in reader:
            stream = getattr(sys, STREAMS.get(line[:1], "stderr"))
            with self._lock:
                stream.write(line[1:].decode("utf-8", "replace"))
                stream.flush()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


class Link:
    """A task's end."""

    def __init__(self, host: str, port: int) -> None:
        self._socket = socket.create_connection((host, port), timeout=60)
        self._socket.settimeout(None)
        self._file = self._socket.makefile("wb")
        self._lock = threading.Lock()

    def relay(self, process: subprocess.Popen[bytes]) -> list[threading.Thread]:
        """Copy `process`'s stdout and stderr to the driver, line by line, in threads."""
        copies = [
            threading.Thread(target=self._copy, args=(pipe, tag), daemon=True)
            for pipe, tag in ((process.stdout, b"1"), (process.stderr, b"2"))
        ]
        for copy in copies:
            copy.start()
        return copies

    def _copy(self, pipe: Any, tag: bytes) -> None:
        for line in pipe:
            with self._lock, contextlib.suppress(OSError):
                self._file.write(tag + (line if line.endswith(b"\n") else line + b"\n"))
                self._file.flush()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()
            self._socket.close()
