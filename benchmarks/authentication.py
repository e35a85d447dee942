"""What keeping strangers out costs, per message: the signed-rendezvous patch's signing of a
request, and a heartbeat signed and checked. What it costs a whole job (its start, an epoch)
beside a build without it: benchmarks/builds.py.

Usage (from the repository, after launch/install.sh):
    .venv/bin/python benchmarks/authentication.py

One KVStore GET round trip on loopback, signed (this build's server and client) against
the same request to Python's plain HTTP server, unsigned; the signing alone (client signs,
server checks, server signs its answer, client checks); and a heartbeat signed and checked
(each rank sends one to each peer every second). Medians of many; prints a Markdown table.
"""

from __future__ import annotations

import http.client
import http.server
import os
import threading
from collections.abc import Callable

from common import median_seconds
from horovod.runner.http import http_auth
from horovod.runner.http.http_server import KVStoreServer

from hvd_cpu.runtime import heartbeat

KEY = os.urandom(32)


def _median_us(call: Callable[[], object], repeats: int) -> float:
    return median_seconds(call, repeats) * 1e6


def requests(repeats: int = 2000) -> dict[str, float]:
    """µs per request: a signed GET of this build's KVStore, the same GET of Python's plain
    HTTP server unsigned, and the signing alone."""
    server = KVStoreServer(verbose=0, key=KEY)
    port = server.start_server(address="127.0.0.1")
    server.httpd.cache["scope"] = {"key": b"x" * 700}

    class Plain(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"x" * 700
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    plain = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Plain)
    threading.Thread(target=plain.serve_forever, daemon=True).start()

    def get(port: int, signer: http_auth.Signer | None) -> None:
        """A GET over http.client, signed and its answer checked when `signer` is given."""
        header, mac = signer.request("GET", port, "/scope/key", b"") if signer else ("", "")
        connection = http.client.HTTPConnection("127.0.0.1", port)
        connection.request("GET", "/scope/key", headers={http_auth.AUTH_HEADER: header})
        response = connection.getresponse()
        body = response.read()
        if signer:
            signer.check_response(mac, 200, body, response.getheader(http_auth.AUTH_HEADER))
        connection.close()

    signer, checker, body = http_auth.Signer(KEY), http_auth.Checker(KEY), b"x" * 700

    def sign_and_check() -> None:
        header, mac = signer.request("GET", port, "/scope/key", b"")
        checked = checker.request("GET", port, "/scope/key", header)
        signer.check_response(mac, 200, body, checker.response(checked[0], 200, body))

    found = {
        "GET, signed and checked (this build's KVStore)": _median_us(
            lambda: get(port, signer), repeats
        ),
        "GET, unsigned (Python's plain HTTP server)": _median_us(
            lambda: get(plain.server_address[1], None), repeats
        ),
        "signing alone (sign, check, sign the answer, check it)": _median_us(
            sign_and_check, repeats
        ),
    }
    server.shutdown_server()
    plain.shutdown()
    return found


def heartbeats(repeats: int = 200_000) -> dict[str, float]:
    """µs to number and sign one heartbeat, and to check one that arrives (runtime/heartbeat.py)."""
    sender = heartbeat.Signed(KEY, 0, {1: ("127.0.0.1", 2)})
    receiver = heartbeat.Signed(KEY, 1, {0: ("127.0.0.1", 1)})
    datagrams = [sender.pack(1, heartbeat.BEAT, n, False) for n in range(repeats)]
    arriving = iter(datagrams)
    return {
        "a heartbeat: number and sign": _median_us(
            lambda: sender.pack(1, heartbeat.BEAT, 7, False), repeats
        ),
        "a heartbeat: check (MAC, sender, number)": _median_us(
            lambda: receiver.open(next(arriving), ("127.0.0.1", 1)), repeats
        ),
    }


def main() -> None:
    print("| one message | µs (median) |\n|---|---:|")
    for name, value in (requests() | heartbeats()).items():
        print(f"| {name} | {value:.1f} |")


if __name__ == "__main__":
    main()
