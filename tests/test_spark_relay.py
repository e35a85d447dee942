"""The Spark driver's relay answers its own tasks only (clusters/relay.py): in one process, a real
Relay and Link over TCP and attacker sockets beside them (nothing of theirs is written, the
relay holds little, the link's lines arrive whole, control characters taken out); then a
real Spark job whose relay another process attacks (tests/hostile.py)."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from hvd_cpu.clusters.relay import FRAME, GREETING, HEADER, MARGIN, NONCE_BYTES, Link, Relay
from hvd_cpu.runtime import reach, secret

from .jobs import REPO, SLOW
from .spark_cluster import COMMAND, needs_spark, table

MARK = "HOSTILE-WAS-HERE"
TASKS = 1


class Sink:
    """A stream the relay writes to: what it got, up to a bound, and how much."""

    def __init__(self) -> None:
        self.text, self.size = "", 0

    def write(self, text: str) -> None:
        self.size += len(text)
        if len(self.text) < 1_000_000:
            self.text += text

    def flush(self) -> None:
        pass


def sinks(monkeypatch: pytest.MonkeyPatch) -> dict[str, Sink]:
    """The driver's stdout and stderr as the relay finds them (set in the test itself:
    pytest sets its own capture again between a fixture and its test)."""
    written = {"stdout": Sink(), "stderr": Sink()}
    for name, sink in written.items():
        monkeypatch.setattr(sys, name, sink)
    return written


@pytest.fixture
def key() -> bytes:
    return bytes.fromhex(secret.new_key())


@pytest.fixture
def relay(key: bytes) -> Iterator[Relay]:
    with Relay(reach.LOOPBACK, TASKS, key) as running:
        yield running


def wait_for(condition: object, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.02)


def tell(sock: socket.socket, data: bytes) -> None:
    """Send `data`, or as much of it as the relay takes before it closes the connection."""
    with contextlib.suppress(OSError):
        sock.sendall(data)


def closed_by(sock: socket.socket) -> bool:
    """Whether the relay has closed `sock` (within 5 s)."""
    sock.settimeout(5)
    with contextlib.suppress(ConnectionResetError):
        while sock.recv(65536):
            pass
    return True


def greeted(relay: Relay) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(relay.address)
    sock.settimeout(5)
    nonce = b""
    while len(nonce) < NONCE_BYTES:
        nonce += sock.recv(NONCE_BYTES - len(nonce))
    return sock, nonce


def frame(key: bytes, tag: bytes, number: int, payload: bytes, nonce: bytes) -> bytes:
    """A frame as a task signs it (`key`: the job's), for the connection greeted with `nonce`."""
    header = HEADER.pack(tag, number, len(payload))
    return header + payload + secret.mac(secret.channel_key(key, "relay"), header, payload, nonce)


def let_in(key: bytes, relay: Relay) -> tuple[socket.socket, bytes]:
    sock, nonce = greeted(relay)
    sock.sendall(secret.mac(secret.channel_key(key, "relay"), GREETING, nonce))
    return sock, nonce


def test_the_links_lines_arrive_whole_without_control_characters(
    relay: Relay, key: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task's rank prints lines with escape sequences and a line longer than a frame: each
    stream's lines arrive on the driver's stream, whole, the controls (but tab) taken out."""
    written = sinks(monkeypatch)
    long = "x" * (3 * FRAME + 5)
    script = (
        "import sys\n"
        "print('epoch 1\\tloss \\x1b[2J\\x1b]0;title\\x07done\\r')\n"
        f"print('x' * {len(long)})\n"
        "print('bell\\x07 and C1 \\x9b31m', file=sys.stderr)\n"
        "sys.stdout.write('no end')\n"
    )
    link = Link(relay.address, key)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=-1, stderr=-1)
    for copy in link.relay(process):
        copy.join()
    process.wait()
    link.close()
    wait_for(lambda: "no end" in written["stdout"].text)
    lines = written["stdout"].text.splitlines()
    assert lines[0] == "epoch 1\tloss [2J]0;titledone"
    assert "".join(lines[1:-1]) == long and all(len(line) <= FRAME for line in lines[1:-1])
    assert lines[-1] == "no end"
    wait_for(lambda: written["stderr"].text)
    assert written["stderr"].text == "bell and C1 31m\n"


def test_nothing_an_attacker_sends_is_written_and_the_relay_holds_little(
    relay: Relay, key: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines with no answer to the greeting, after a wrong answer, in frames with a wrong MAC,
    and a 100 MB line without an end: each connection is closed, nothing of it written, and
    the relay's memory does not grow with what was sent; the link beside them is heard."""
    written = sinks(monkeypatch)
    sock, _ = greeted(relay)
    tell(sock, f"1{MARK}\n".encode())
    assert closed_by(sock)
    sock, nonce = greeted(relay)
    tell(sock, os.urandom(16) + frame(os.urandom(32), b"1", 1, MARK.encode(), nonce))
    assert closed_by(sock)
    sock, nonce = let_in(os.urandom(32), relay)  # a key of its own
    tell(sock, frame(os.urandom(32), b"1", 1, f"{MARK}\n".encode(), nonce))
    assert closed_by(sock)
    sock, nonce = let_in(key, relay)  # the right answer, then a frame with a wrong MAC
    tell(sock, frame(os.urandom(32), b"1", 1, f"{MARK}\n".encode(), nonce))
    assert closed_by(sock)
    sock, nonce = let_in(key, relay)  # the right answer, then a frame far too long
    tell(sock, HEADER.pack(b"1", 1, 2**31) + MARK.encode() * 100_000)
    assert closed_by(sock)

    tracemalloc.start()
    try:
        sock, _ = greeted(relay)
        chunk = b"1" + MARK.encode() * (1024 * 1024 // len(MARK))
        with pytest.raises(OSError):
            for _ in range(100):
                sock.sendall(chunk)
        sock.close()
        held = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert held < 8 * 1024 * 1024, held

    link = Link(relay.address, key)
    link.send(b"1", b"the link is heard\n")
    wait_for(lambda: "the link is heard" in written["stdout"].text)
    link.close()
    assert MARK not in written["stdout"].text + written["stderr"].text


def test_a_frame_is_taken_once_in_its_own_connection_only(
    relay: Relay, key: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signed frame replayed in another connection (another nonce), the same frame again,
    and one out of order: the connection is closed there, nothing after it written."""
    written = sinks(monkeypatch)
    first, nonce = let_in(key, relay)
    one = frame(key, b"1", 1, b"one\n", nonce)
    first.sendall(one)
    wait_for(lambda: "one" in written["stdout"].text)
    second, _ = let_in(key, relay)
    tell(second, one)  # signed for the first connection's nonce
    assert closed_by(second)
    tell(first, one)  # the same number again
    assert closed_by(first)
    third, nonce = let_in(key, relay)
    tell(third, frame(key, b"1", 2, f"{MARK}\n".encode(), nonce))  # number 1 skipped
    assert closed_by(third)
    assert written["stdout"].text == "one\n"


def test_connections_beyond_the_tasks_are_closed_at_once_and_a_link_gets_in_later(
    relay: Relay, key: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TASKS + MARGIN connections are held at once; the next is closed before any greeting.
    A link that finds the relay full tries again, and gets in once one lets go."""
    written = sinks(monkeypatch)
    held = [greeted(relay)[0] for _ in range(TASKS + MARGIN)]
    extra = socket.create_connection(relay.address)
    assert closed_by(extra)
    links: list[Link] = []
    waiting = threading.Thread(target=lambda: links.append(Link(relay.address, key)))
    waiting.start()
    time.sleep(1)
    assert not links
    held.pop().close()
    waiting.join(10)
    links[0].send(b"2", b"in at last\n")
    wait_for(lambda: written["stderr"].text == "in at last\n")
    for sock in held:
        sock.close()
    links[0].close()


def test_the_relay_listens_on_its_address_only(relay: Relay) -> None:
    others = [address for address, _ in reach.this_network().addresses]
    if not others:
        pytest.skip("this machine has no IPv4 address but loopback")
    assert relay.address[0] == reach.LOOPBACK
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((others[0], relay.address[1]), timeout=5)


@SLOW
@needs_spark
def test_a_spark_job_whose_relay_is_attacked_prints_only_its_own_lines(tmp_path: Path) -> None:
    """`hvd-cpu spark-train --master local[2]`: while it trains, another process finds the
    driver's listening port in /proc and sends it lines, unsigned and in forged frames, more
    connections than the job has tasks. The job succeeds and prints none of it."""
    parquet = tmp_path / "t.parquet"
    table(2000).to_parquet(parquet)
    words = [*COMMAND, "--master", "local[2]", "--np", "2", "--data", str(parquet),
             "--output", str(tmp_path / "run"), "--epochs", "30"]  # fmt: skip
    driver = subprocess.Popen(words, stdout=-1, stderr=-1, text=True)
    hostile = subprocess.Popen(
        [sys.executable, "-m", "tests.hostile", "relay", str(driver.pid), "--seconds", "240"],
        cwd=REPO, stdout=-1, text=True,
    )  # fmt: skip
    out, err = driver.communicate(timeout=300)
    attack = hostile.communicate(timeout=30)[0]
    assert driver.returncode == 0, err
    assert re.search(r"ready ports \[\('127\.0\.0\.1', \d+\)\]", attack), attack
    assert int(attack.split()[-1]) > 0, attack
    assert "Epoch 30:" in out, out
    assert MARK not in out + err
