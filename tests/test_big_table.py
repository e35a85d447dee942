"""A table bigger than one rank's memory: under a memory cap one process cannot read it whole,
and two hosts with --shard-read each read only their half and train.

Each process runs in its own cgroup (v1 memory controller) whose limit is the cap: over it,
the kernel kills the process, as a host with that much memory would. A job that ends well
therefore stayed under the cap on every rank.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from .hosts import SSH_PORT, Hosts, assert_ranks_numbered_by_host, needs_namespaces
from .jobs import BIN, SLOW, ranks, run

CGROUPS = Path("/sys/fs/cgroup/memory")
needs_memory_cgroups = pytest.mark.skipif(
    not os.access(CGROUPS, os.W_OK), reason="needs a writable cgroup v1 memory controller"
)
pytestmark = [needs_namespaces, needs_memory_cgroups, SLOW]

ROWS, FEATURES = 2_000_000, 24  # 191 MB as a DataFrame, 100 row groups
# What a cgroup is charged for is a process's own memory, not the shared libraries another
# process loaded first (so less than its RSS). Measured on this VM: 459 MB for one process
# reading the table whole, 334-340 MB for a rank reading its half with --shard-read.
CAP_MB = 400


@pytest.fixture
def capped(tmp_path: Path) -> Iterator[Path]:
    """A wrapper, `capped.sh COMMAND...`, that runs COMMAND in a cgroup of its own capped at
    CAP_MB; the cgroups go when the test ends."""
    parent = CGROUPS / f"hvd-cpu-test-{os.getpid()}"
    parent.mkdir()
    script = tmp_path / "capped.sh"
    # A host's `ip netns exec` mounts a /sys of its own, without cgroups: there the wrapper
    # mounts the same memory hierarchy again, in the host's own mount namespace.
    mount = tmp_path / "cgroup"
    mount.mkdir()
    script.write_text(
        "#!/bin/sh\nset -e\n"
        f"root={CGROUPS}\n"
        f'if [ ! -d "$root/{parent.name}" ]; then\n'
        f'  root={mount}; mountpoint -q "$root" || mount -t cgroup -o memory cgroup "$root"\n'
        "fi\n"
        f'group="$root/{parent.name}/$$"; mkdir "$group"\n'
        f'echo {CAP_MB * 2**20} > "$group/memory.limit_in_bytes"\n'
        'echo $$ > "$group/cgroup.procs"\nexec "$@"\n'
    )
    script.chmod(0o755)
    yield script
    for group in [*parent.iterdir(), parent]:
        if group.is_dir():
            remove_when_empty(group)


def remove_when_empty(group: Path, timeout: float = 10) -> None:
    """Remove a cgroup once the processes in it are gone (a rank's last moments may outlast
    the job's end by a little)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            group.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                procs = group / "cgroup.procs"
                raise AssertionError(f"{group} still holds {procs.read_text().split()}") from None
            time.sleep(0.1)


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Hosts]:
    (tmp_path / "hosts").mkdir()
    with Hosts(tmp_path / "hosts", ["hvdhosta", "hvdhostb"]) as made:
        yield made


def big_table(path: Path) -> Path:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, FEATURES), dtype=np.float32)
    frame = pd.DataFrame(x, columns=[f"x{i}" for i in range(FEATURES)])
    frame["target"] = x @ rng.uniform(-1, 1, FEATURES).astype(np.float32)
    frame.to_parquet(path, row_group_size=20_000)
    return path


def test_two_hosts_train_on_a_table_one_capped_rank_cannot_read(
    tmp_path: Path, capped: Path, hosts: Hosts
) -> None:
    table = big_table(tmp_path / "big.parquet")
    train = [str(BIN / "hvd-cpu"), "train", "--epochs", "1", "--batch-size", "65536"]

    whole = run([str(capped), *train, "--data", str(table), "--output", str(tmp_path / "whole")],
                timeout=600)  # fmt: skip
    assert whole.returncode == -9, whole.stdout + whole.stderr  # killed over the cap

    launcher = [str(BIN / "horovodrun"), "--gloo", "-np", "2", "--disable-cache", "--hostfile",
                str(hosts.hostfile(1)), "-p", str(SSH_PORT), "-i", str(hosts.key)]  # fmt: skip
    data = hosts.place(table)  # a copy on each host's disk
    output = hosts.local / "sharded"
    sharded = run([*launcher, str(capped), *train, "--data", str(data), "--shard-read",
                   "--output", str(output)], timeout=900)  # fmt: skip
    assert sharded.returncode == 0, sharded.stdout + sharded.stderr  # none went over the cap
    report = ranks(hosts.hosts[0].path(output))  # on rank 0's host
    assert_ranks_numbered_by_host(report, ["hvdhosta", "hvdhostb"], 1)
    assert [r["rows_read"] for r in report] == [ROWS // 2, ROWS // 2]
