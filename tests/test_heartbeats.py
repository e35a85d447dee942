"""The heartbeats answer their own job only (runtime/watchdog.py, heartbeat.py, reach.py): a
datagram forged, replayed, from a stranger or of another job is dropped, and a peer's
datagrams go to its one address. In one process with two real watchdogs and their sockets;
then a real job that another process attacks from outside (tests/hostile.py): it trains as
it would undisturbed, and a stopped rank is still named while the attacker replays its
heartbeats."""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from hvd_cpu.runtime import heartbeat, reach, secret
from hvd_cpu.runtime.collectives import Collectives
from hvd_cpu.runtime.heartbeat import BEAT, Signed
from hvd_cpu.runtime.reach import Network
from hvd_cpu.runtime.watchdog import Watchdog
from hvd_cpu.runtime.world import World

from .jobs import (
    REPO,
    SLOW,
    LiveJob,
    demo_file,
    horovodrun_command,
    processes_naming,
    slow_model,
    weights,
)

HOST = socket.gethostname()
ROOT = os.geteuid() == 0


class Threads(Collectives):
    """Two ranks' collectives as two threads of this process: what a watchdog's start asks."""

    def __init__(self, rank: int, shared: list[Any], barrier: threading.Barrier) -> None:
        self.rank, self.shared, self.barrier = rank, shared, barrier

    def gather(self, obj: Any, name: str) -> list[Any]:
        self.shared[self.rank] = obj
        self.barrier.wait()
        everyone = list(self.shared)
        self.barrier.wait()
        return everyone

    def broadcast_object(self, obj: Any, name: str) -> Any:
        return self.gather(obj, name)[0]

    def sum(self, values: torch.Tensor, name: str) -> torch.Tensor:
        raise NotImplementedError

    def average_(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        raise NotImplementedError

    def broadcast_(self, tensors: Mapping[str, torch.Tensor]) -> None:
        raise NotImplementedError


def two_watchdogs(one_host: bool) -> list[Watchdog]:
    """Rank 0's and rank 1's watchdogs of a job of two, made together (not started); on one
    host, or on two host names (one network stack: this process's)."""
    shared, barrier, made = [None, None], threading.Barrier(2, timeout=10), [None, None]

    def make(rank: int) -> None:
        world = World(rank, 2, rank if one_host else 0, 2 if one_host else 1, 1,
                      Threads(rank, shared, barrier))  # fmt: skip
        made[rank] = Watchdog(world, 60, elastic=False)

    threads = [threading.Thread(target=make, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return made  # type: ignore[return-value]


@pytest.fixture
def local_pair() -> Iterator[list[Watchdog]]:
    watchdogs = two_watchdogs(one_host=True)
    yield watchdogs
    for watchdog in watchdogs:
        watchdog.stop()
        watchdog.socket.close()


def test_a_datagram_replayed_forged_or_from_a_stranger_is_dropped(
    local_pair: list[Watchdog],
) -> None:
    """Through rank 0's real socket: rank 1's datagrams are taken in order; the same again (a
    valid MAC, an old number), one with its MAC changed, one signed under another key, and one
    signed right but sent from another socket are dropped, and none of them locks rank 1 out."""
    zero, one = local_pair
    target = (one.peers[0].address, one.peers[0].port)
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    def heard(data: bytes, sender: socket.socket = one.socket) -> int | None:
        """What rank 0 knows of rank 1's progress once `data` has arrived."""
        sender.sendto(data, target)
        assert select.select([zero.socket], [], [], 5)[0], "nothing arrived"
        zero.told_named()  # takes in what has arrived
        return zero.progress.entered.get(1)

    first = one.signed.pack(0, BEAT, 100, False)
    assert heard(first) == 100
    assert heard(one.signed.pack(0, BEAT, 200, False)) == 200
    assert heard(first) == 200  # replayed
    tampered = bytearray(one.signed.pack(0, BEAT, 300, False))
    tampered[-1] ^= 1
    assert heard(bytes(tampered)) == 200
    other_key = Signed(secret.salted(os.urandom(32), b"salt"), 1, {})
    other_key.sequence = one.signed.sequence
    assert heard(other_key.pack(0, BEAT, 400, False)) == 200
    huge = heartbeat.FIELDS.pack(1, 0, BEAT, 500, False, 2**64 - 1)
    assert heard(huge + os.urandom(secret.MAC_BYTES)) == 200  # a number that would lock out
    assert heard(one.signed.pack(0, BEAT, 600, False), stranger) == 200
    assert heard(one.signed.pack(1, BEAT, 700, False)) == 200  # addressed to rank 1
    assert heard(one.signed.pack(0, BEAT, 800, False)) == 800
    assert zero.named_by is None and not zero.gone


def test_signed_datagrams_are_taken_once_each_in_order() -> None:
    """Signed alone: a valid MAC with a replayed or older sequence number is dropped."""
    key = heartbeat.key_of(os.urandom(16), bytes.fromhex(secret.new_key()))
    source = ("127.0.0.1", 5000)
    sender, receiver = Signed(key, 1, {}), Signed(key, 0, {1: source})
    first, second = (sender.pack(0, BEAT, n, False) for n in (1, 2))
    assert receiver.open(second, source) is not None
    assert receiver.open(second, source) is None  # replayed
    assert receiver.open(first, source) is None  # older, overtaken
    third = receiver.open(sender.pack(0, BEAT, 3, True), source)
    assert third is not None and (third.sender, third.entered, third.inside) == (1, 3, True)


def test_the_heartbeat_key_needs_the_salt_and_the_job_secret() -> None:
    """The key is the job's heartbeat key mixed with the watch's salt: either alone signs
    nothing the other would take; without a job secret, the salt itself."""
    job, salt = bytes.fromhex(secret.new_key()), os.urandom(16)
    key = heartbeat.key_of(salt, job)
    assert key not in (salt, job, secret.channel_key(job, "heartbeat"))
    assert key != heartbeat.key_of(os.urandom(16), job)
    assert heartbeat.key_of(salt, None) == salt


def trap_ports(port: int, addresses: list[str]) -> list[socket.socket]:
    """Sockets on `port` at each of `addresses`: a datagram sent there was sent astray."""
    traps = []
    for address in addresses:
        trap = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        trap.bind((address, port))
        traps.append(trap)
    return traps


def machine_addresses() -> list[str]:
    return [address for address, _ in reach.this_network().addresses]


@pytest.mark.parametrize("one_host", [True, False], ids=["one host", "two host names"])
def test_a_peers_datagrams_go_to_its_one_address(one_host: bool) -> None:
    """Each watchdog listens on one address and its peer sends there only: loopback when every
    rank is on this host, under one name or several (one network stack), and nothing reaches
    the same port on this machine's other addresses. (Across hosts, tests/test_hosts.py's
    stopped remote rank is named only if its peers' heartbeats reach it there.)"""
    watchdogs = two_watchdogs(one_host)
    bound = {w.socket.getsockname()[0] for w in watchdogs}
    assert bound == {w.peers[1 - w.rank].address for w in watchdogs} == {reach.LOOPBACK}
    traps = [
        trap
        for watchdog in watchdogs
        for trap in trap_ports(watchdog.socket.getsockname()[1], machine_addresses())
    ]
    try:
        for watchdog in watchdogs:
            watchdog.start()
        deadline = time.monotonic() + 5
        while not all(w.heard for w in watchdogs):
            assert time.monotonic() < deadline, "the watchdogs did not hear each other"
            time.sleep(0.05)
        assert select.select(traps, [], [], 0.5)[0] == []
    finally:
        for watchdog in watchdogs:
            watchdog.stop()
            watchdog.socket.close()
        for trap in traps:
            trap.close()


def network(stack: str, *addresses: str, named: str | None = None) -> Network:
    return Network(stack, named, tuple((a.split("/")[0], mask(a)) for a in addresses))


def mask(address: str) -> str:
    bits = int(address.split("/")[1])
    return socket.inet_ntoa(((1 << 32) - (1 << (32 - bits))).to_bytes(4, "big"))


def test_each_rank_is_reached_at_its_address_on_the_network_the_hosts_share() -> None:
    """The rule across hosts: the interface the launcher names; else the address whose
    subnet holds the other hosts' addresses, never one every host holds (a container
    bridge), never loopback; the first when no subnet is shared; none without an address.
    Loopback when every rank is in one network stack."""
    a = network("a", "172.17.0.1/16", "10.1.0.5/24", "198.18.0.2/24")
    assert reach.addresses([a, a]) == [reach.LOOPBACK, reach.LOOPBACK]
    b = network("b", "172.17.0.1/16", "198.18.0.3/24")
    assert reach.addresses([a, a, b]) == ["198.18.0.2", "198.18.0.2", "198.18.0.3"]
    named = network("b", "172.17.0.1/16", "198.18.0.3/24", named="10.9.9.9")
    assert reach.addresses([a, named]) == ["198.18.0.2", "10.9.9.9"]
    routed = [network("a", "10.1.0.5/24", "10.2.0.5/24"), network("b", "10.3.0.7/24")]
    assert reach.addresses(routed) == ["10.1.0.5", "10.3.0.7"]
    assert reach.addresses([a, network("c")]) == ["172.17.0.1", None]


# The real job: 2 ranks under horovodrun --gloo, each step paced (asleep) so that it lasts
# about 10 s, the same seed attacked and undisturbed.
PACE, EPOCHS = 0.02, 25


@pytest.fixture(scope="module")
def frame(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_file(tmp_path_factory.mktemp("data") / "frame.parquet", rows=2000)


def job(frame: Path, output: Path, epochs: int = EPOCHS, *extra: str) -> LiveJob:
    model = slow_model(output.parent, PACE, busy=False)
    args = ["train", "--data", str(frame), "--epochs", str(epochs), "--model", model,
            "--output", str(output), *extra]  # fmt: skip
    # A job secret of its own, which the attacker reads from a rank's /proc/PID/environ.
    return LiveJob([*horovodrun_command(2), *args], {secret.JOB_KEY: secret.new_key()})


def attacker(marker: Path, *extra: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "tests.hostile", "heartbeats", str(marker), *extra]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True)


def said(running: LiveJob, output: Path) -> set[str]:
    """What a job printed, but its output folder, its numbers (times, throughput) and the line
    on waiting, which comes or not with the machine's load."""
    return {
        re.sub(r"[\d.,]+", "#", line.replace(str(output), "OUTPUT"))
        for line in running.output.splitlines()
        if "waited for each other" not in line
    }


def test_an_attacker_on_the_machine_changes_nothing_in_a_running_job(
    frame: Path, tmp_path: Path
) -> None:
    """Another process finds the ranks' heartbeat ports in /proc and sends them forged FAILED,
    NAMED and LEAVING datagrams in every layout it can guess (the old one with a zero or a
    random token, or the token it overheard; the new one with made-up MACs, or MACs under the
    job's secret read from a rank's environment), and, as root, the ranks' own datagrams
    replayed from their own address and port, as they were and changed. The job ends as an
    undisturbed one with the same seed does: exit 0, the same parameters, the same lines."""
    quiet, attacked = tmp_path / "quiet" / "out", tmp_path / "attacked" / "out"
    for output in (quiet, attacked):
        output.parent.mkdir()
    undisturbed, target = job(frame, quiet), job(frame, attacked)
    hostile = attacker(attacked, "--seconds", "120")
    ready = hostile.stdout.readline()
    assert ready.startswith("ready ranks [0, 1]") and "job key True" in ready, ready
    assert target.finish(120) == 0, target.summary()
    assert undisturbed.finish(120) == 0, undisturbed.summary()
    sent = hostile.communicate(timeout=30)[0]
    assert int(sent.split()[-1]) > 10_000, sent
    if ROOT:
        assert int(ready.split("captured ")[1]) > 0, ready  # so replayed too
    assert said(target, attacked) == said(undisturbed, quiet), target.output
    for name, value in weights(quiet).items():
        assert torch.equal(weights(attacked)[name], value), name


def rank_process(output: Path, rank: int) -> psutil.Process:
    """The Python process of `rank` (not the shell horovodrun starts it through)."""
    for process in map(psutil.Process, processes_naming(output)):
        python = "python" in Path(process.exe()).name
        if python and process.environ().get("HOROVOD_RANK") == str(rank):
            return process
    raise AssertionError(f"no process of rank {rank}")


@SLOW
@pytest.mark.skipif(not ROOT, reason="replaying a rank's datagrams from its address needs root")
def test_a_stopped_rank_is_named_while_an_attacker_replays_its_heartbeats(
    frame: Path, tmp_path: Path
) -> None:
    """The attacker overhears rank 1's heartbeats, then while rank 1 stands stopped (SIGSTOP)
    replays them to rank 0 from rank 1's own address and port, and forges LEAVING from it in
    every layout: were any taken, rank 0 would go on hearing rank 1, or stop watching it. The
    job ends as it does undisturbed, rank 0 naming rank 1 after --stall-seconds."""
    output = tmp_path / "out"
    stall = 4
    running = job(frame, output, 1000, "--stall-seconds", str(stall))
    hostile = attacker(output, "--seconds", "60")
    ready = hostile.stdout.readline()
    assert int(ready.split("captured ")[1]) > 0, ready
    stopped = rank_process(output, 1)
    stopped.send_signal(signal.SIGSTOP)
    assert running.finish(stall + 30) == 1, running.summary()
    hostile.kill()
    hostile.wait()
    named = f"hvd-cpu: rank 0: rank 1 on {HOST} (pid {stopped.pid}) has not answered for {stall} s"
    assert named in running.output, running.summary()
    assert processes_naming(output, grace=10) == []
