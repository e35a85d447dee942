"""A rank that stops answering without dying (stopped by a debugger or SIGSTOP, swapping to
death, cut off by a network that drops packets while its TCP connections stay open), or whose
training makes no progress while the others wait for it (its main thread deadlocked in the
user's code, a read that never returns), ends the job within `--stall-seconds`, with one line
naming it; under --elastic it is dropped as a lost rank. A rank that fails on its own
(runtime/failure.py) tells the others here, and they end at once, quietly.

Why heartbeats and not timeouts on the collectives: MPI has none, Horovod's stall inspector
only warns by default and sees only Horovod's own collectives, and a collective that waits
long is normal while rank 0 writes a big checkpoint. A heartbeat thread beats while its
rank computes, saves or waits, and falls silent only when the whole process stops or its
network does. Each rank sends a small UDP datagram to every other rank each `interval` from
a daemon thread, and watches the others' datagrams:

- a peer silent for a quarter of the bound: one warning line, once;
- silent for the whole bound: the lowest rank that still hears from everyone else but the
  silent ones says so in one line and, if the silent process is on this machine's kernel,
  kills it (its launcher kills it otherwise); every rank that sees the silence exits with 1.
  Under --elastic the silent rank is killed, and the others go on without it.

A live thread is not progress, so each heartbeat also carries how many collectives its rank
has entered, and whether it is inside one (runtime/collectives.py's Counted). A rank behind
the others and inside none is the one they wait for: they have entered a collective it has
not reached. So for the bound without moving on, it is stalled as a silent one is (killed on
this kernel under --elastic). A rank whose own work (rank 0 writing a checkpoint) outlasts
the bound needs a larger --stall-seconds.

A peer is watched only once its first heartbeat has arrived: a network that blocks UDP
between hosts turns the watch off for that peer (with one line) instead of ending healthy
jobs. A rank that leaves normally says so with a last datagram, and the rank that names a
stall tells the others before it exits, so that none of them names its exit a second time.

A rank hears its own job only. Its socket listens on one address, the one its peers send to:
127.0.0.1 when every rank is on one host, else its address on the job's network
(runtime/reach.py says which). Each datagram is numbered and signed under a key of the watch's
own (runtime/heartbeat.py): a datagram forged, replayed, of another job or from anyone but
the peer is dropped unread, so no one outside the job can end it (FAILED, NAMED), switch the
watch of a rank off (LEAVING) or hide a rank's silence (an old BEAT again). The thread takes
in DRAIN datagrams at most per wake-up, so a flood of them cannot keep it from beating.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import signal
import socket
import threading
import time
from dataclasses import dataclass

import psutil

from hvd_cpu.lines import say
from hvd_cpu.runtime import heartbeat, reach, secret
from hvd_cpu.runtime.heartbeat import BEAT, FAILED, LEAVING, NAMED
from hvd_cpu.runtime.lifecycle import ending, exit_now
from hvd_cpu.runtime.reach import BOOT_ID, LOOPBACK
from hvd_cpu.runtime.world import World

# Times a rank that fails sends it: a datagram may be lost between hosts.
FAILED_SENDS = 3
# Datagrams taken in at most per wake-up of the thread: a flood of them (forged, dropped)
# cannot keep it from beating.
DRAIN = 32
# Seconds the ranks that see a stall but do not report it wait before they exit too (the
# launcher usually ends them first, when the reporting rank exits).
REPORTER_LEAD = 5.0
# What became of a silent peer: on this kernel stopped (or swapping) or running, no longer
# there, or on another machine (nothing here can tell).
STOPPED_HERE, RUNNING_HERE, GONE, ELSEWHERE = "stopped here", "running here", "gone", "elsewhere"
# A process held by a signal, a debugger, or the kernel's wait (swapping in).
HELD = {psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_DISK_SLEEP}


@dataclass(frozen=True)
class Peer:
    """Where a rank listens for heartbeats and how to recognise its process."""

    host: str
    address: str | None  # the one address it is sent to (runtime/reach.py); None: not sent to
    port: int
    pid: int
    started: float  # the process's start time: a pid reused later is not the same process
    kernel: str  # boot id and pid namespace: equal means the pid names the same process here
    fingerprint: bytes  # of the heartbeat key it holds (runtime/heartbeat.py)

    def describe(self, rank: int) -> str:
        return f"rank {rank} on {self.host} (pid {self.pid})"


def this_kernel() -> str:
    """Which kernel and pid namespace this process lives in (hosts made of network namespaces
    share one; real machines do not)."""
    try:
        return f"{BOOT_ID.read_text().strip()}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return f"unknown:{secrets.token_hex(8)}"  # never equal to another's: never kill


def listening_address(world: World) -> str | None:
    """The one address this rank hears its peers on, and they send to (runtime/reach.py):
    loopback when every rank is on this host, else a collective that chooses one for each."""
    if world.local_size == world.size:
        return LOOPBACK
    networks = world.collectives.gather(reach.this_network(), "watchdog_networks")
    return reach.addresses(networks)[world.rank]


class Progress:
    """How far the peers have come, as their heartbeats say: the collectives each has entered
    and whether it is inside one; which of them the others wait for, and since when."""

    def __init__(self) -> None:
        self.entered: dict[int, int] = {}  # peer: the collectives it had entered, last heard
        self.waiting: set[int] = set()  # peers inside a collective, last heard
        self.behind_since: dict[int, float] = {}  # peer: behind the others, not moving, since

    def heard(self, peer: int, entered: int, inside: bool) -> None:
        (self.waiting.add if inside else self.waiting.discard)(peer)
        if self.entered.get(peer) != entered:
            self.entered[peer] = entered
            self.behind_since.pop(peer, None)  # it moved on

    def restart(self) -> None:
        """This process stood still: how long the others waited is not known."""
        self.behind_since.clear()

    def forget(self, peer: int) -> None:
        self.entered.pop(peer, None)
        self.waiting.discard(peer)
        self.behind_since.pop(peer, None)

    def stuck(self, now: float, mine: int) -> dict[int, float]:
        """Seconds each peer has been behind the others (this rank, at `mine`, among them),
        inside no collective, without moving on: they wait for it."""
        furthest = max([mine, *self.entered.values()])
        for peer, count in self.entered.items():
            if count < furthest and peer not in self.waiting:
                self.behind_since.setdefault(peer, now)
            else:
                self.behind_since.pop(peer, None)
        return {p: now - since for p, since in self.behind_since.items()}


class Watchdog:
    """This rank's heartbeats to, and watch over, every other rank of its job."""

    def __init__(self, world: World, bound: float, elastic: bool) -> None:
        self.rank, self.bound, self.elastic = world.rank, bound, elastic
        collectives = self.collectives = world.collectives  # how far this rank has come
        self.interval = min(1.0, bound / 10)
        salt = secrets.token_bytes(heartbeat.SALT_BYTES) if world.rank == 0 else None
        salt = collectives.broadcast_object(salt, "watchdog_salt")
        key = heartbeat.key_of(salt, secret.job_key())
        address = listening_address(world)
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.bind((address or LOOPBACK, 0))
        self.socket.setblocking(False)  # the thread and a failed collective both read it
        self.receiving, self.sending = threading.Lock(), threading.Lock()
        me = psutil.Process()
        here = Peer(
            socket.gethostname(), address, self.socket.getsockname()[1], me.pid,
            me.create_time(), this_kernel(), heartbeat.fingerprint(key),
        )  # fmt: skip
        everyone = collectives.gather(here, "watchdog_peers")
        if len({peer.fingerprint for peer in everyone}) > 1:
            key = salt  # not every rank holds the job's secret: the collectives' salt alone
        self.peers = dict(enumerate(everyone))
        del self.peers[world.rank]
        sources = {rank: (peer.address, peer.port) for rank, peer in self.peers.items()}
        self.signed = heartbeat.Signed(key, world.rank, sources)
        now = time.monotonic()
        self.started = self.last_tick = now
        self.heard: dict[int, float] = {}  # peer: when last heard (watched from the first)
        self.progress = Progress()
        self.gone: set[int] = set()  # peers that left normally (or failed, under --elastic)
        self.named_by: int | None = None  # the peer that said why the job ends
        self.warned: set[int] = set()
        self.unheard_said = False
        self.stop_event = threading.Event()
        self.ending = threading.Lock()
        self.resumed = False  # this process stood stopped and was let go on
        self.thread = threading.Thread(target=self._run, name="hvd-cpu-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop watching and tell the others this rank leaves normally. Never waits (it runs
        on the way out of the process): the thread ends by itself within an interval."""
        if self.stop_event.is_set():
            return
        self.stop_event.set()
        self._send(LEAVING)

    def tell_failed(self) -> None:
        """This rank failed and has said so: the others end at once without a word (under
        --elastic they go on without it). Never waits."""
        for _ in range(FAILED_SENDS):
            self._send(FAILED)
        self.stop_event.set()

    # The thread

    def _run(self) -> None:
        next_beat = 0.0
        while not self.stop_event.is_set():
            now = time.monotonic()
            if self._was_stopped(now):
                # This process was the one stopped (and is resumed, perhaps by the launcher
                # that ends it): the others' silence is its own, not theirs.
                self.resumed = True
                self.heard = dict.fromkeys(self.heard, now)
                self.progress.restart()
                self.warned.clear()
            self.last_tick = now
            if now >= next_beat:
                self._send(BEAT)
                next_beat = now + self.interval
                self._check(now)
            with contextlib.suppress(OSError, ValueError):
                ready, _, _ = select.select([self.socket], [], [], max(0.0, next_beat - now))
                if ready:
                    self._receive()
        self.socket.close()

    def stood_stopped(self) -> bool:
        """Whether this process was stopped at some point (its launcher's SIGTERM after a
        stall is no news: a live rank named it)."""
        return self.resumed or self._was_stopped(time.monotonic())

    def told_named(self) -> bool:
        """Whether another rank has said why this job ends (a stall it named, or its own
        failure), reading what has arrived: a failed collective may get here before this
        rank's thread has."""
        self._receive()
        return self.named_by is not None

    def _was_stopped(self, now: float) -> bool:
        """Whether this thread missed several beats: the whole process stood still."""
        return now - self.last_tick > max(3 * self.interval, self.bound / 4)

    def _send(self, what: int) -> None:
        entered, inside = self.collectives.entered, self.collectives.inside > 0
        with self.sending:  # numbered in the order they leave (the thread, a failure, the end)
            for rank, peer in self.peers.items():
                if peer.address is None:
                    continue
                datagram = self.signed.pack(rank, what, entered, inside)
                with contextlib.suppress(OSError):  # unreachable: its silence is said
                    self.socket.sendto(datagram, (peer.address, peer.port))

    def _receive(self) -> None:
        """Take in what has arrived, DRAIN datagrams at most."""
        with self.receiving:
            for _ in range(DRAIN):
                try:
                    data, source = self.socket.recvfrom(heartbeat.SIZE + 1)
                except OSError:  # nothing more has arrived (or the socket is closed)
                    return
                beat = self.signed.open(data, source)
                if beat is not None:
                    self._take(beat.sender, beat.what, beat.entered, beat.inside)

    def _take(self, sender: int, what: int, entered: int, inside: bool) -> None:
        if what == BEAT:
            if sender not in self.gone:
                self.heard[sender] = time.monotonic()
                self.progress.heard(sender, entered, inside)
            return
        self._forget(sender)
        if what == NAMED or (what == FAILED and not self.elastic):
            # The job ends, and the rank that said why has said it: end now, whatever this
            # rank's main thread is stuck in (MPI's collectives have no timeout).
            self.named_by = sender
            if not ending():
                exit_now(1)

    def _forget(self, peer: int) -> None:
        """`peer` is gone: left, failed (--elastic) or dropped; watch it no more."""
        self.gone.add(peer)
        self.heard.pop(peer, None)
        self.progress.forget(peer)

    def _check(self, now: float) -> None:
        unheard = set(self.peers) - set(self.heard) - self.gone
        if unheard and now - self.started > self.bound and not self.unheard_said:
            self.unheard_said = True
            unheard = {p for p in unheard if self._fate(p) != GONE}  # ended: a lost rank
            if unheard:
                names = ", ".join(self.peers[p].describe(p) for p in sorted(unheard))
                say(
                    f"hvd-cpu: rank {self.rank}: no heartbeat from {names} reached this rank "
                    f"in {self.bound:g} s (UDP blocked between hosts?); a stalled rank there "
                    "will not be noticed"
                )
        silence = {p: now - last for p, last in self.heard.items()}
        # Stuck only while its heartbeats still come: a silent process (stopped, say) is named
        # as silent, however long it was behind before.
        stuck = self.progress.stuck(now, self.collectives.entered)
        stuck = {p: s for p, s in stuck.items() if silence[p] < 1.5 * self.interval}
        lag = {p: max(silence[p], stuck.get(p, 0.0)) for p in silence}
        for peer, seconds in sorted(lag.items()):
            if seconds >= self.bound / 4 and peer not in self.warned and seconds < self.bound:
                self.warned.add(peer)
                # A peer whose process has ended is a lost rank, not a stall: its collective
                # fails (at the latest after Gloo's timeout) and the job ends or goes on.
                if self._reporter(lag) and self._fate(peer) != GONE:
                    how, state = (("answered", "silent"), ("moved on", "stuck"))[peer in stuck]
                    waiting = " while the others wait for it" if peer in stuck else ""
                    say(
                        f"hvd-cpu: rank {self.rank}: {self.peers[peer].describe(peer)} has not "
                        f"{how} for {seconds:.1f} s{waiting}; the job ends if it stays {state} "
                        f"for {self.bound:g} s (--stall-seconds)"
                    )
        stalled = sorted(p for p, seconds in lag.items() if seconds >= self.bound)
        if stalled:
            self._end(stalled, lag, stuck)

    def _give_the_reporter_its_lead(self) -> None:
        """Wait REPORTER_LEAD seconds for the rank that speaks, beating meanwhile: a silent
        wait here would make the others name this live rank as silent too."""
        until = time.monotonic() + REPORTER_LEAD
        while (left := until - time.monotonic()) > 0:
            self._send(BEAT)
            self.last_tick = time.monotonic()
            time.sleep(min(self.interval, left))

    def _reporter(self, lag: dict[int, float]) -> bool:
        """Whether this rank is the lowest of those that still answer and move on (the one
        that speaks)."""
        quiet = {p for p, seconds in lag.items() if seconds >= self.bound / 4}
        return all(p > self.rank for p in self.peers if p not in quiet and p not in self.gone)

    def _end(self, stalled: list[int], lag: dict[int, float], stuck: dict[int, float]) -> None:
        with self.ending:  # the thread and a failed collective may both get here: one speaks
            self._end_once(stalled, lag, stuck)

    def _end_once(self, stalled: list[int], lag: dict[int, float], stuck: dict[int, float]) -> None:
        reporter = self._reporter(lag)
        fates = {p: self._fate(p) for p in stalled}
        if self.elastic and ELSEWHERE not in fates.values():
            self._drop(stalled, fates, reporter, stuck)
            return
        # Otherwise this rank's exit ends the job, and the launcher kills the rest, the stopped
        # one included, with this rank's exit code.
        said = "; ".join(
            f"{self.peers[p].describe(p)} "
            + ("ended without a word (killed?)" if fates[p] == GONE else self._why(p in stuck))
            for p in stalled
        )
        elsewhere = (
            " (--elastic drops a stalled rank only on this machine's kernel)"
            if self.elastic
            else ""
        )
        if not reporter:
            # The rank that speaks goes first: an exit here could make the launcher stop it
            # before its line is out. Still here after that, this rank speaks: that one
            # could not (its own heartbeat stood still too).
            self._give_the_reporter_its_lead()
        if not ending() and not self.told_named():
            # Not told to end meanwhile (by the launcher ending the job, or by a rank that
            # named the stall): say why the job ends, then tell the others it is said (they
            # end at once, the stalled one too, whatever its main thread is stuck in).
            say(
                f"hvd-cpu: rank {self.rank}: {said}; ending the job{elsewhere} "
                f"(--stall-seconds {self.bound:g}); run the same command with --resume to go "
                "on from the last checkpoint"
            )
            self._send(NAMED)
        exit_now(1)

    def _why(self, stuck: bool) -> str:
        if stuck:
            return (
                f"has not moved on for {self.bound:g} s while the others wait for it (its "
                "training is stuck: a deadlock in its code, a read that never returns)"
            )
        return (
            f"has not answered for {self.bound:g} s (stopped by a signal or a debugger, "
            "swapping, or cut off from the network)"
        )

    def end_as_stall(self) -> None:
        """A collective failed while peers were silent: the silence is the cause, so end
        as the bound would have (another rank got there first)."""
        now = time.monotonic()
        silence = {p: now - last for p, last in self.heard.items()}
        stalled = sorted(
            p
            for p, seconds in silence.items()
            if seconds >= self.bound / 4 and self._fate(p) != GONE
        )  # a peer gone is the lost rank the caller names
        if self.told_named():
            exit_now(1)  # another rank said why the job ends, and its exit failed the collective
        if stalled and not self._was_stopped(now):
            self._end(stalled, silence, {})

    def _drop(
        self,
        stalled: list[int],
        fates: dict[int, str],
        reporter: bool,
        stuck: dict[int, float],
    ) -> None:
        """--elastic: kill the stalled ranks here that stand stopped (or in the kernel's wait:
        swapping) or stuck, and the others go on without them as without a killed rank. One
        already gone is Horovod's lost rank; a silent one that runs is not killed (during
        elastic's reset a rank's heartbeat may pause): it is watched again from now."""
        now = time.monotonic()

        def killable(peer: int) -> bool:
            fate = self._fate(peer)
            return fate == STOPPED_HERE or (fate == RUNNING_HERE and peer in stuck)

        for peer in stalled:
            if not killable(peer) and fates[peer] == RUNNING_HERE:
                self.heard[peer] = now
            else:
                self._forget(peer)
        ended = [p for p in stalled if killable(p)]
        if ended and not reporter:
            self._give_the_reporter_its_lead()  # the rank that speaks kills them; if it could not
            ended = [p for p in ended if killable(p)]
        for peer in ended:
            self._kill(peer)
        if ended:
            names = "; ".join(f"{self.peers[p].describe(p)} {self._why(p in stuck)}" for p in ended)
            say(f"hvd-cpu: rank {self.rank}: {names}; dropped as a lost rank")

    def _fate(self, rank: int) -> str:
        """What became of a silent peer, as far as this rank can see."""
        peer = self.peers[rank]
        if peer.kernel != this_kernel():
            return ELSEWHERE
        try:
            process = psutil.Process(peer.pid)
            if abs(process.create_time() - peer.started) >= 0.01:
                return GONE  # the pid was reused: the peer ended
            status = process.status()
        except psutil.Error:
            return GONE
        if status == psutil.STATUS_ZOMBIE:
            return GONE
        return STOPPED_HERE if status in HELD else RUNNING_HERE

    def _kill(self, rank: int) -> None:
        """Kill a stalled peer on this kernel (SIGKILL ends a stopped process too)."""
        with contextlib.suppress(psutil.Error):
            psutil.Process(self.peers[rank].pid).send_signal(signal.SIGKILL)
