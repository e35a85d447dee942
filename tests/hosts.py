"""Several real "hosts" on one machine, for the multi-host tests.

Each host is a network namespace with its own address, joined to the test machine (the
launching machine: horovodrun, the Spark driver) by a bridge, and a mount and UTS namespace of
its own, held by one process per host (`init`): its own hostname, its own `/dev/shm` (a fresh
tmpfs: a segment one host's ranks make is not there for another's) and its own disk at
`Hosts.local`, the same path on every host (a folder of the host's own bound there: data one
host holds is not on another, and a run's output is on rank 0's host only). Its sshd, and so
every ssh session, rank and orted started there, and `Host.exec` run in all three namespaces.
The launching machine places data on a host and reads a run's files from it through
`Host.path` (as scp would); it sees its own folder at `Hosts.local`.

What a cluster installs at the same path on every host stays one: the file system outside
`local` (the repository, the venv, Python) is the machine's, and so are /tmp and a test's
tmp_path, which serve as the shared storage a cluster mounts (Spark's `--output` must be one).
One kernel and one pid namespace remain: a test may signal a host's processes by pid.

The NIC inside every namespace and the bridge share one name (`hvd0`): horovodrun looks for an
interface of the same name on the driver and the workers. Addresses come from 198.18.0.0/24
(the benchmarking range) and there are no default routes: nothing leaves the machine.
Everything lives under a temporary folder; on exit the namespaces, links and processes go,
and the hosts' disks stay there to be read.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

# What namespace hosts need here; the tests that use them skip without it.
needs_namespaces = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not Path("/usr/sbin/sshd").exists(),
    reason="multi-host tests need root (network namespaces), iproute2 and openssh-server",
)

BRIDGE = "hvd0"
SSH_PORT = 2222
SUBNET = "198.18.0"


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    folder: Path

    @property
    def pid_file(self) -> Path:
        return self.folder / f"sshd-{self.name}.pid"

    @property
    def init_pid_file(self) -> Path:
        """The pid of the process that holds this host's mount and UTS namespaces."""
        return self.folder / f"init-{self.name}.pid"

    @property
    def local(self) -> Path:
        """This host's own disk, at the path every host and the launching machine share."""
        return self.folder / "local"

    @property
    def disk(self) -> Path:
        """What this host sees at `local`."""
        return self.folder / "disks" / self.name

    def path(self, path: Path) -> Path:
        """Where the launching machine reads or writes `path`, under `local`, on this host."""
        return self.disk / path.relative_to(self.local)

    def exec(self, *command: str) -> list[str]:
        """A command line that runs `command` on this host (its network, hostname and mounts),
        in the directory it is built in."""
        init = self.init_pid_file.read_text().strip()
        enter = ["nsenter", "--target", init, "--net", "--uts", "--mount", f"--wdns={Path.cwd()}"]
        return [*enter, "--", *command]


def sh(*command: str) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


class Hosts:
    """`with Hosts(folder, ["hosta", "hostb"]) as hosts:` two hosts, sshd on port 2222.

    `sshd=False` makes the namespaces only (e.g. for containers that bring their own sshd);
    another `bridge` and `subnet` keep such a set-up apart from one a concurrent test made
    with the defaults (the NIC inside every namespace is still named `hvd0`).
    """

    def __init__(
        self,
        folder: Path,
        names: list[str],
        *,
        sshd: bool = True,
        bridge: str = BRIDGE,
        subnet: str = SUBNET,
    ) -> None:
        self.folder = folder
        self.hosts = [Host(n, f"{subnet}.{i + 2}", folder) for i, n in enumerate(names)]
        self.local = folder / "local"
        self.key = folder / "id_ed25519"
        self.sshd = sshd
        self.bridge = bridge
        self.subnet = subnet
        self.inits: dict[str, subprocess.Popen[bytes]] = {}

    def __enter__(self) -> Hosts:
        try:
            self._create()
        except BaseException:
            self._tear_down()
            raise
        return self

    def _create(self) -> None:
        self._remove_leftovers()
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.folder / "host_key"))
        shutil.copy(f"{self.key}.pub", self.folder / "authorized_keys")
        Path("/run/sshd").mkdir(exist_ok=True)
        self.local.mkdir(exist_ok=True)
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for host in self.hosts:
            veth = f"veth-{host.name}"
            sh("ip", "netns", "add", host.name)
            sh(
                "ip",
                "link",
                "add",
                veth,
                "type",
                "veth",
                "peer",
                "name",
                BRIDGE,
                "netns",
                host.name,
            )
            sh("ip", "link", "set", veth, "master", self.bridge, "up")
            sh("ip", "-n", host.name, "addr", "add", f"{host.address}/24", "dev", BRIDGE)
            sh("ip", "-n", host.name, "link", "set", BRIDGE, "up")
            sh("ip", "-n", host.name, "link", "set", "lo", "up")
            self.resolve(host, host.address)  # before init: `ip netns exec` binds the file
            self._start_init(host)
        for host in self.hosts:
            self._wait_for_init(host)
            if self.sshd:
                self.start_sshd(host)
        if self.sshd:
            for host in self.hosts:
                self.wait_for_ssh(host)

    def _start_init(self, host: Host) -> None:
        """The host's own namespaces, held by a process that sleeps until the host goes.

        Private propagation: the host's mounts stay its own, and later mounts on this machine
        do not appear on the host.
        """
        host.disk.mkdir(parents=True)
        script = (
            f"hostname {host.name} && mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm"
            f" && mount --bind {host.disk} {host.local} && echo $$ > {host.init_pid_file}"
            " && exec sleep infinity"
        )
        self.inits[host.name] = subprocess.Popen(
            ["ip", "netns", "exec", host.name, "unshare", "--uts", "--mount",
             "--propagation", "private", "sh", "-c", script],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip

    def _wait_for_init(self, host: Host) -> None:
        init = self.inits[host.name]
        while not host.init_pid_file.exists() or not host.init_pid_file.read_text().strip():
            if init.poll() is not None:
                said = init.stderr.read().decode() if init.stderr else ""
                raise RuntimeError(f"the namespaces of {host.name} were not made: {said}")
            time.sleep(0.02)

    def resolve(self, host: Host, address: str) -> None:
        """Make `host`'s own name resolve to `address` inside its namespace.

        Written in place: the host's mount namespace has /etc/hosts bound to this very file.
        """
        etc = Path("/etc/netns") / host.name
        etc.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost"] + [
            f"{address if h == host else h.address} {h.name}" for h in self.hosts
        ]
        with (etc / "hosts").open("w") as handle:
            handle.write("\n".join(lines) + "\n")

    def start_sshd(self, host: Host, extra: str = "") -> None:
        """sshd for `host`; `extra` config lines change it (e.g. `SetEnv PATH=...`)."""
        config = self.folder / f"sshd-{host.name}.conf"
        config.write_text(
            f"Port {SSH_PORT}\nListenAddress {host.address}\n"
            f"HostKey {self.folder / 'host_key'}\nPidFile {host.pid_file}\n"
            f"AuthorizedKeysFile {self.folder / 'authorized_keys'}\n"
            "PermitRootLogin yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "UsePAM no\nStrictModes no\nMaxStartups 200\nMaxSessions 200\nLogLevel ERROR\n" + extra
        )
        sh(*host.exec(shutil.which("sshd") or "/usr/sbin/sshd", "-f", str(config)))

    def stop_sshd(self, host: Host) -> None:
        if host.pid_file.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(host.pid_file.read_text()), signal.SIGTERM)
            host.pid_file.unlink(missing_ok=True)

    def disconnect(self, host: Host) -> None:
        """Cut `host` off the network, as a pulled cable or a host gone down: nothing it sends
        arrives, nothing reaches it (its sshd included)."""
        sh("ip", "link", "set", f"veth-{host.name}", "down")

    def reconnect(self, host: Host) -> None:
        """Plug `host` back in: its sshd answers again, and connections TCP has not given up
        on go on."""
        sh("ip", "link", "set", f"veth-{host.name}", "up")

    def place(self, source: Path, on: Sequence[Host] | None = None) -> Path:
        """Copy a file of this machine to `local` on the hosts `on` (all unless named), as a
        user copies data to each host; the path the hosts see it at."""
        placed = self.local / source.name
        for host in self.hosts if on is None else on:
            shutil.copy(source, host.path(placed))
        return placed

    def ssh(self, host: Host, command: str, timeout: float = 20) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ssh", *self.ssh_options(), host.address, command],
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip

    def ssh_options(self) -> list[str]:
        return [
            "-p", str(SSH_PORT), "-i", str(self.key), "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=5",
        ]  # fmt: skip

    def forget_host_keys(self) -> None:
        """Remove the hosts from ~/.ssh/known_hosts, as on a machine that never reached them."""
        known = Path.home() / ".ssh" / "known_hosts"
        for host in self.hosts:
            if known.exists():
                subprocess.run(
                    ["ssh-keygen", "-R", f"[{host.address}]:{SSH_PORT}", "-f", str(known)],
                    capture_output=True,
                )

    def wait_for_ssh(self, host: Host) -> None:
        deadline = time.monotonic() + 20
        while self.ssh(host, "true").returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {host.name} ({host.address}) did not come up")
            time.sleep(0.2)

    def hostfile(self, slots: int) -> Path:
        path = self.folder / "hostfile"
        path.write_text("".join(f"{h.address} slots={slots}\n" for h in self.hosts))
        return path

    def processes(self, pattern: str) -> list[int]:
        """Pids (in every namespace: they share the pid namespace) whose command has `pattern`."""
        found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
        return [int(pid) for pid in found.stdout.split()]

    def segments_left(self) -> list[str]:
        """hvd-cpu's shared-memory segments in the hosts' own /dev/shm: conftest.py looks only
        in this machine's, and a host's goes with it."""
        left = []
        for host in self.hosts:
            if host.name in self.inits and self.inits[host.name].poll() is None:
                shm = Path(f"/proc/{self.inits[host.name].pid}/root/dev/shm")
                left += [f"{host.name}:{segment.name}" for segment in shm.glob("hvd-cpu-*")]
        return left

    def _remove_leftovers(self) -> None:
        """What a test run killed before its clean-up may have left."""
        for host in self.hosts:
            self._kill_everything_on(host)
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True)
            # A process left in it keeps its end of the link: the link outlives the namespace.
            subprocess.run(["ip", "link", "del", f"veth-{host.name}"], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / host.name, ignore_errors=True)
            host.init_pid_file.unlink(missing_ok=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.forget_host_keys()  # horovodrun's ssh records host keys; ours change every run

    def _kill_everything_on(self, host: Host) -> None:
        """Every process in the host's network namespace: its init, sshd, sessions, ranks."""
        found = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True)
        for pid in found.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)

    def _tear_down(self) -> None:
        for host in self.hosts:
            self.stop_sshd(host)
        self._remove_leftovers()
        for init in self.inits.values():
            init.kill()
            init.communicate()

    def __exit__(self, failed: type[BaseException] | None = None, *_: object) -> None:
        left = self.segments_left()
        self._tear_down()
        if failed is None:
            assert left == [], f"hvd-cpu's shared-memory segments left on the hosts: {left}"


def assert_ranks_numbered_by_host(ranks: list[dict], names: Sequence[str], per_host: int) -> None:
    """ranks.json of a job over the hosts `names`: `per_host` consecutive ranks on each (in
    any order), numbered 0.. there (local_rank). Ranks of two hosts grouped as one, or one
    host's split in two, fail, though either trains to the same parameters."""
    ordered = sorted(ranks, key=lambda r: r["rank"])
    hosts = list(dict.fromkeys(r["host"] for r in ordered))
    assert sorted(hosts) == sorted(names), hosts
    placed = [(r["host"], r["local_rank"]) for r in ordered]
    assert placed == [(host, local) for host in hosts for local in range(per_host)], placed
