"""Several real "hosts" on one machine, for the multi-host tests.

Each host is a network namespace with its own address, hostname and sshd, joined to the test
machine by a bridge. The NIC inside every namespace and the bridge share one name (`hvd0`):
horovodrun looks for an interface of the same name on the driver and the workers. Addresses
come from 198.18.0.0/24 (the benchmarking range) and there are no default routes: nothing
leaves the machine. Everything lives under a temporary folder and is removed on exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
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

    def exec(self, *command: str) -> list[str]:
        """A command line that runs `command` inside this host's network namespace."""
        return ["ip", "netns", "exec", self.name, *command]


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
        self.key = folder / "id_ed25519"
        self.sshd = sshd
        self.bridge = bridge
        self.subnet = subnet

    def __enter__(self) -> Hosts:
        try:
            self._create()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _create(self) -> None:
        self._remove_leftovers()
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.folder / "host_key"))
        shutil.copy(f"{self.key}.pub", self.folder / "authorized_keys")
        Path("/run/sshd").mkdir(exist_ok=True)
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
            sh(*host.exec("ip", "addr", "add", f"{host.address}/24", "dev", BRIDGE))
            sh(*host.exec("ip", "link", "set", BRIDGE, "up"))
            sh(*host.exec("ip", "link", "set", "lo", "up"))
            self.resolve(host, host.address)
            if self.sshd:
                self.start_sshd(host)
        if self.sshd:
            for host in self.hosts:
                self.wait_for_ssh(host)

    def resolve(self, host: Host, address: str) -> None:
        """Make `host`'s own name resolve to `address` inside its namespace.

        Written in place: sshd's mount namespace has /etc/hosts bound to this very file.
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
        # unshare --uts: a hostname of the namespace's own, which sshd's sessions inherit.
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        sh(
            *host.exec(
                "unshare", "--uts", "sh", "-c", f"hostname {host.name} && {sshd} -f {config}"
            )
        )

    def stop_sshd(self, host: Host) -> None:
        if host.pid_file.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(host.pid_file.read_text()), signal.SIGTERM)
            host.pid_file.unlink(missing_ok=True)

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

    def _remove_leftovers(self) -> None:
        """What a test run killed before its clean-up may have left."""
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True)
            # A process left in it keeps its end of the link: the link outlives the namespace.
            subprocess.run(["ip", "link", "del", f"veth-{host.name}"], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / host.name, ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.forget_host_keys()  # horovodrun's ssh records host keys; ours change every run

    def __exit__(self, *_: object) -> None:
        for host in self.hosts:
            self.stop_sshd(host)
            for pid in self.processes(f"ip netns exec {host.name}"):
                os.kill(pid, signal.SIGKILL)
        self._remove_leftovers()
