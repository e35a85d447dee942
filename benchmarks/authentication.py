"""What keeping strangers out costs (issue 39): the signed-rendezvous patch's request signing,
and a whole Gloo job's start and training beside an earlier Horovod build without it.

Usage (from the repository, after launch/install.sh):
    .venv/bin/python benchmarks/authentication.py [--compare DIR] [--runs 5]

- requests: one KVStore GET round trip on loopback, signed (this build's server and client)
  against the same request to Python's plain HTTP server, unsigned; and the signing alone
  (client signs, server checks, server signs its answer, client checks), median of many;
  and a heartbeat signed and checked (each rank sends one to each peer every second).
- with `--compare DIR` (an earlier Horovod wheel unzipped into DIR, e.g. one from
  ~/.cache/hvd-cpu/wheels/ built before the patch), alternated run by run, this build against
  that one: a `horovodrun --gloo -np 2` job that starts Horovod and makes one allreduce (start
  to end: the rendezvous' requests and Gloo's pairs proving the key), and a 2-rank `hvd-cpu
  train` of the seed's MLP (an epoch's seconds: the training step, which neither touches).
Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from horovod.runner.http import http_auth
from horovod.runner.http.http_server import KVStoreServer

from hvd_cpu.runtime import heartbeat

BIN = Path(sys.executable).parent
KEY = os.urandom(32)
START = "import horovod.torch as hvd, torch; hvd.init(); hvd.allreduce(torch.ones(4))"


def _median_us(call: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


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


def _environment(build: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if build is not None:
        env["PYTHONPATH"] = f"{build}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def job_start(build: Path | None) -> float:
    """Seconds for `horovodrun --gloo -np 2` to start Horovod on both ranks and allreduce."""
    command = [str(BIN / "horovodrun"), "--gloo", "-np", "2", "--disable-cache",
               sys.executable, "-c", START]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(command, env=_environment(build), check=True, capture_output=True)
    return time.perf_counter() - started


def epoch_seconds(build: Path | None, frame: Path, output: Path) -> float:
    """The median epoch of a 2-rank `hvd-cpu train` of the seed's MLP (5 epochs)."""
    command = [str(BIN / "horovodrun"), "--gloo", "-np", "2", "--disable-cache",
               str(BIN / "hvd-cpu"), "train", "--data", str(frame), "--epochs", "5",
               "--overwrite", "--quiet", "--output", str(output)]  # fmt: skip
    subprocess.run(command, env=_environment(build), check=True, capture_output=True)
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["seconds"] for r in records)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compare", type=Path, help="an earlier Horovod wheel, unzipped")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print("| one message | µs (median) |\n|---|---:|")
    for name, value in (requests() | heartbeats()).items():
        print(f"| {name} | {value:.1f} |")
    if args.compare is None:
        return
    with tempfile.TemporaryDirectory() as folder:
        frame = Path(folder) / "frame.parquet"
        subprocess.run([str(BIN / "hvd-cpu"), "make-demo-data", str(frame), "--rows", "100000"],
                       check=True, capture_output=True)  # fmt: skip
        builds = {"this build": None, f"{args.compare}": args.compare}
        starts: dict[str, list[float]] = {name: [] for name in builds}
        epochs: dict[str, list[float]] = {name: [] for name in builds}
        for _ in range(args.runs):
            for name, build in builds.items():  # alternated: the noise falls on both alike
                starts[name].append(job_start(build))
                epochs[name].append(epoch_seconds(build, frame, Path(folder) / "run"))
    print(f"\n| median of {args.runs}, alternated | " + " | ".join(builds) + " |")
    print("|---|" + "---:|" * len(builds))
    print("| `horovodrun --gloo -np 2`: init + one allreduce, s | "
          + " | ".join(f"{statistics.median(starts[n]):.2f}" for n in builds) + " |")  # fmt: skip
    print("| 2-rank `hvd-cpu train`, seed MLP, 100 000 rows: an epoch, s | "
          + " | ".join(f"{statistics.median(epochs[n]):.3f}" for n in builds) + " |")  # fmt: skip


if __name__ == "__main__":
    main()
