"""Where each rank's heartbeats reach it (runtime/watchdog.py): one IPv4 address per rank, on
the network the job itself uses. A rank's watchdog listens on that address alone, and its
peers send there alone: not to every address it has, and never to a loopback address when it
is on another host.

The rule, worked out alike on every rank from what the ranks gathered:

- every rank on one host (local_size == size, or one machine under several host names: all
  in one network stack): 127.0.0.1, and nothing leaves the host;
- else a rank's address on the job's network interface where its launcher names one
  (HOROVOD_GLOO_IFACE: horovodrun --gloo, Spark), the interface Gloo's own traffic takes;
- else (MPI, a launcher of the user's) the rank's address whose IPv4 subnet (its interface's
  netmask) holds addresses of the most ranks in other network stacks (other hosts): the
  network the hosts share; ties go to the interface listed first, and with no subnet shared
  (hosts on routed networks) the first is taken. An address some other host holds too (a
  container bridge's 172.17.0.1 on every host) names no one host and is never taken.

A rank left without an address (no IPv4 address but loopback, in a job across hosts) hears
no one and no one hears it: after the bound each side says so in one line, as for UDP blocked
between hosts, and the watch of it is off.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import psutil

LOOPBACK = "127.0.0.1"
# The network interface horovodrun --gloo (and hvd-cpu's Spark tasks) give Gloo.
INTERFACE = "HOROVOD_GLOO_IFACE"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class Network:
    """A rank's network, as its peers need to know it to choose its address."""

    stack: str  # the kernel and network namespace: equal on ranks that share one loopback
    named: str | None  # its address on the interface its launcher named
    addresses: tuple[tuple[str, str], ...]  # (address, netmask) of each IPv4 but loopback


def this_network() -> Network:
    """This rank's network."""
    try:
        stack = f"{BOOT_ID.read_text().strip()}:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        stack = f"unknown:{os.getpid()}:{socket.gethostname()}"
    interface = os.environ.get(INTERFACE)
    named, addresses = None, []
    for name, entries in psutil.net_if_addrs().items():
        for entry in entries:
            if entry.family != socket.AF_INET or ipaddress.ip_address(entry.address).is_loopback:
                continue
            addresses.append((entry.address, entry.netmask or "255.255.255.255"))
            if name == interface and named is None:
                named = entry.address
    return Network(stack, named, tuple(addresses))


def addresses(networks: list[Network]) -> list[str | None]:
    """The address each rank (in rank order) is reached at, in a job across hosts."""
    if len({network.stack for network in networks}) == 1:
        return [LOOPBACK] * len(networks)
    return [_address(network, networks) for network in networks]


def _address(mine: Network, networks: list[Network]) -> str | None:
    if mine.named:
        return mine.named
    others = [n for n in networks if n.stack != mine.stack]
    held = {address for other in others for address, _ in other.addresses}
    best, most = None, -1
    for address, netmask in mine.addresses:
        if address in held:
            continue
        subnet = ipaddress.ip_network(f"{address}/{netmask}", strict=False)
        near = sum(any(ipaddress.ip_address(a) in subnet for a, _ in n.addresses) for n in others)
        if near > most:
            best, most = address, near
    return best
