"""Someone else on the machine, attacking a running job's own channels from a process of its
own: it finds the job's ports from /proc, as any local user could, and sends them what it can
make up.

    python -m tests.hostile heartbeats MARKER   the ranks' UDP heartbeats (runtime/watchdog.py)
    python -m tests.hostile relay PID           the Spark driver's relay (clusters/relay.py)

MARKER names the ranks' command lines (their output folder), PID the driver's process. It
prints `ready ...` once it has its targets (heartbeats: and, as root, has listened to the
job's own datagrams for --capture seconds), attacks until the targets are gone or --seconds
have passed, and prints `sent N`. As root it does what root can: it listens on loopback
(AF_PACKET) and replays what the ranks sent each other from their own address and port (a
raw socket), as it was and changed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import struct
import sys
import time

import psutil

from hvd_cpu.runtime import secret
from hvd_cpu.runtime.heartbeat import FAILED, FIELDS, LEAVING, NAMED

# The old datagram (a 16-byte token in clear, then the fields) and the new one's fields.
OLD = struct.Struct("!16sIIBQ?")
WHATS = (LEAVING, NAMED, FAILED)
RANKS = range(4)  # ranks guessed as senders and addressees
NUMBERS = (1, 2**32, 2**64 - 1)  # sequence numbers guessed, the largest to lock a sender out
PACKET_OUTGOING = 4  # AF_PACKET's pkttype of a packet leaving (loopback shows each twice)
# Text the relay attack sends: the job's output must hold none of it.
MARK = "HOSTILE-WAS-HERE"
ROOT = os.geteuid() == 0
Address = tuple[str, int]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target", choices=["heartbeats", "relay"])
    parser.add_argument("where", help="the ranks' marker (heartbeats) or the driver's pid")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--capture", type=float, default=2)
    args = parser.parse_args()
    deadline = time.monotonic() + args.seconds
    if args.target == "heartbeats":
        sent = Heartbeats(args.where, args.capture).attack(deadline)
    else:
        sent = relay(int(args.where), deadline)
    print(f"sent {sent}", flush=True)


def udp_ports(pid: int) -> list[Address]:
    """The process's UDP sockets (one bound to every address is reached on loopback)."""
    sockets = psutil.Process(pid).net_connections(kind="udp4")
    return [(c.laddr.ip.replace("0.0.0.0", "127.0.0.1"), c.laddr.port) for c in sockets]


class Heartbeats:
    """The ranks of a job, their heartbeat ports, and what can be forged against them."""

    def __init__(self, marker: str, capture: float) -> None:
        self.ranks = ranks_naming(marker)
        self.ports = {rank: udp_ports(pid) for rank, pid in self.ranks.items()}
        targets = {port for ports in self.ports.values() for port in ports}
        environ = psutil.Process(self.ranks[0]).environ()
        job = bytes.fromhex(environ.get(secret.JOB_KEY, "")) or None
        self.captured = sniff(targets, capture) if ROOT else []
        self.forged = forgeries(job) + learned(self.captured)
        print(f"ready ranks {sorted(self.ranks)} ports {sorted(targets)} job key "
              f"{job is not None} captured {len(self.captured)}", flush=True)  # fmt: skip

    def attack(self, deadline: float) -> int:
        plain = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW) if ROOT else None
        sent = 0
        while time.monotonic() < deadline and any(map(psutil.pid_exists, self.ranks.values())):
            for rank, ports in self.ports.items():
                others = [p for r, ps in self.ports.items() if r != rank for p in ps]
                for target in ports:
                    for data in self.forged:
                        sent += send(plain, data, target)
                        for source in others if raw else []:
                            sent += spoof(raw, data, source, target)
            for source, target, data in self.captured if raw else []:
                sent += spoof(raw, data, source, target)  # replayed: an old number
                for what in WHATS:  # the same, saying something else
                    sent += spoof(raw, changed(data, what), source, target)
            time.sleep(0.05)
        return sent


def ranks_naming(marker: str) -> dict[int, int]:
    """The pids of the ranks whose command line names `marker`, once each has a UDP socket."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = {}
        for process in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if marker in " ".join(process.info["cmdline"] or []):
                    rank = process.environ().get("HOROVOD_RANK")
                    if rank is not None and udp_ports(process.pid):
                        found[int(rank)] = process.pid
        if len(found) >= 2:
            return found
        time.sleep(0.2)
    sys.exit("no two ranks with a UDP socket")


def forgeries(job: bytes | None) -> list[bytes]:
    """Datagrams in every layout an attacker could guess, saying LEAVING, NAMED or FAILED:
    the old one with a zero or a random token; the new one with made-up MACs, and MACs under
    the job's secret and its heartbeat key without the watch's salt."""
    made = []
    keys = [secret.channel_key(job, "heartbeat"), job] if job else []
    for what in WHATS:
        for sender in RANKS:
            for addressee in RANKS:
                for token in (bytes(16), os.urandom(16)):
                    made.append(OLD.pack(token, sender, addressee, what, 0, False))
                for number in NUMBERS:
                    fields = FIELDS.pack(sender, addressee, what, 0, False, number)
                    tags = [bytes(16), os.urandom(16), *(secret.mac(k, fields) for k in keys)]
                    made += [fields + tag for tag in tags]
    return made


def learned(captured: list[tuple[Address, Address, bytes]]) -> list[bytes]:
    """What the job's own datagrams teach: their first 16 bytes (the old layout's token, in
    clear) put before forged fields."""
    tokens = {data[:16] for _, _, data in captured}
    return [
        OLD.pack(token, sender, addressee, what, 0, False)
        for token in tokens
        for what in WHATS
        for sender in RANKS
        for addressee in RANKS
    ]


def changed(data: bytes, what: int) -> bytes:
    """A captured datagram saying `what` instead (its MAC left as it was)."""
    at = 24 if len(data) == OLD.size else 8
    return data[:at] + bytes([what]) + data[at + 1 :]


def sniff(ports: set[Address], seconds: float) -> list[tuple[Address, Address, bytes]]:
    """The UDP datagrams sent to `ports` on loopback for `seconds`: (source, target, payload)."""
    sniffer = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    sniffer.bind(("lo", 0))
    sniffer.settimeout(0.2)
    captured, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            frame, place = sniffer.recvfrom(65536)
        except TimeoutError:
            continue
        ip = frame[14:]
        if place[2] == PACKET_OUTGOING or len(ip) < 28 or ip[9] != socket.IPPROTO_UDP:
            continue
        header = (ip[0] & 0x0F) * 4
        source_port, target_port, length, _ = struct.unpack("!HHHH", ip[header : header + 8])
        source = (socket.inet_ntoa(ip[12:16]), source_port)
        target = (socket.inet_ntoa(ip[16:20]), target_port)
        if target in ports:
            captured.append((source, target, ip[header + 8 : header + length]))
    sniffer.close()
    return captured


def send(sock: socket.socket, data: bytes, target: Address) -> int:
    with contextlib.suppress(OSError):
        sock.sendto(data, target)
        return 1
    return 0


def spoof(raw: socket.socket, data: bytes, source: Address, target: Address) -> int:
    """`data` sent to `target` as if from `source` (a rank's own address and port)."""
    udp = struct.pack("!HHHH", source[1], target[1], 8 + len(data), 0) + data
    ip = struct.pack(
        "!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, socket.IPPROTO_UDP, 0,
        socket.inet_aton(source[0]), socket.inet_aton(target[0]),
    )  # fmt: skip
    return send(raw, ip + udp, (target[0], 0))


def relay(pid: int, deadline: float) -> int:
    """Connect to every TCP port the driver listens on, again and again, more connections at
    once than the job has tasks, and send lines: unsigned, after a made-up answer to the
    relay's greeting, in frames with made-up MACs; with escape sequences, and a long line
    without an end."""
    ports: list[Address] = []
    while not ports and time.monotonic() < deadline:
        ports = [c.laddr[:2] for c in psutil.Process(pid).net_connections("tcp4")
                 if c.status == psutil.CONN_LISTEN]  # fmt: skip
        time.sleep(0.1)
    print(f"ready ports {sorted(ports)}", flush=True)
    sent = 0
    while time.monotonic() < deadline and psutil.pid_exists(pid):
        held = []
        for address in ports:
            for speech in relay_speeches():
                with contextlib.suppress(OSError):
                    sock = socket.create_connection(address, timeout=1)
                    held.append(sock)
                    sock.sendall(speech)
                    sent += 1
        time.sleep(0.1)
        for sock in held:
            sock.close()
    return sent


def relay_speeches() -> list[bytes]:
    """What one connection says to the relay, from its first byte."""
    text = [
        f"{MARK} plain line\n".encode(),
        f"\x1b]0;{MARK}\x07\x1b[2J{MARK} escapes\n".encode(),
        MARK.encode() * 10_000,
    ]
    header = struct.Struct("!cQI")  # a frame's, as the relay reads it
    framed = b"".join(
        header.pack(tag, number, len(line)) + line + os.urandom(secret.MAC_BYTES)
        for number, line in enumerate(text, 1)
        for tag in (b"1", b"2")
    )
    answer = os.urandom(secret.MAC_BYTES)
    return [b"1" + b"1".join(text), answer + b"".join(text), answer + framed, bytes(16) + framed]


if __name__ == "__main__":
    main()
