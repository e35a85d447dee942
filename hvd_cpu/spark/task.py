"""What each Spark task runs, on an executor: one Horovod rank over Gloo, on the rows of the
task's own partition.

The tasks run in barrier mode (all start together or none). They tell each other where they
run (BarrierTaskContext.allGather), lay the ranks out over those hosts as horovodrun would,
and the task of rank 0 holds the Gloo rendezvous. Each task then starts its rank as a process
of its own (spark/rank.py): Horovod, its signal handling and a failing rank's exit stay out of
Spark's Python worker, which Spark reuses for later tasks. The rank's output goes to the
driver (spark/relay.py); the task's one row back says how the rank ended.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import psutil

from hvd_cpu.runtime.failure import FAILURES, failure_record_in
from hvd_cpu.spark.relay import Link

if TYPE_CHECKING:  # Horovod itself is imported by the tasks only
    from hvd_cpu.runtime.horovod import Slot

# What a task hands back: its rank, the rank process's exit code, rank.py's outcome (pickled)
# and the failure the rank left (runtime/failure.py's record), each null when there is none.
OUTCOME_SCHEMA = "rank int, code int, outcome binary, failure binary"


def rank_task(
    job: bytes, columns: pd.DataFrame, driver: tuple[str, int], key: bytes
) -> Callable[[Iterator[pd.DataFrame]], Iterator[pd.DataFrame]]:
    """The function mapInPandas runs on each partition: `job` is spark/rank.py's (config and
    the user's code, pickled), `columns` the frame's columns (a partition may have no rows),
    `driver` the relay's address, `key` the job's secret (runtime/secret.py): the relay, the
    rendezvous and the ranks' heartbeats answer only what is signed with it."""

    def run(batches: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        from pyspark import BarrierTaskContext

        context = BarrierTaskContext.get()
        partition = context.partitionId()
        link = Link(driver, key)
        try:
            address = _address_towards(driver[0])
            # The partition's rows, held by _run_rank alone: it lets go once they are written.
            yield _run_rank(
                context,
                partition,
                address,
                job,
                pd.concat([columns, *batches], ignore_index=True),
                link,
                key,
            )
        finally:
            link.close()

    return run


def _run_rank(
    context: Any,
    partition: int,
    address: str,
    job: bytes,
    own: pd.DataFrame,
    link: Link,
    key: bytes,
) -> pd.DataFrame:
    from hvd_cpu.runtime import horovod

    hosts = context.allGather(address)
    slot = _slots(hosts)[partition]
    stop_server, port = (
        horovod.serve_rendezvous(_counts(hosts), key, address) if slot.rank == 0 else (None, 0)
    )
    try:
        ports = context.allGather(str(port))
        server = hosts[0]  # partition 0 is rank 0: the first task on the first host
        # The rank's environment holds the job's secret (HOROVOD_JOB_KEY), as under horovodrun.
        env = horovod.gloo_environment(slot, server, int(ports[0]), _interface(address), key)
        with tempfile.TemporaryDirectory(prefix="hvd-cpu-spark-") as folder:
            (Path(folder) / "job.pkl").write_bytes(job)
            own.to_pickle(Path(folder) / "rows.pkl")
            del own
            code = _start(folder, env, link)
            outcome = Path(folder) / "outcome.pkl"
            return _outcome(
                slot.rank,
                code,
                outcome.read_bytes() if outcome.exists() else None,
                failure_record_in(Path(folder)),
            )
    finally:
        if stop_server:
            stop_server()


def _start(folder: str, env: dict[str, str], link: Link) -> int:
    """The rank's process, its output relayed; its exit code."""
    env = {**os.environ, **env, FAILURES: folder, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(
        [sys.executable, "-m", "hvd_cpu.spark.rank", folder],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    ) as process:
        copies = link.relay(process)
        code = process.wait()
        for copy in copies:
            copy.join()
    return code


def _counts(hosts: list[str]) -> list[tuple[str, int]]:
    """(host, tasks there), in the order the hosts first appear among the partitions."""
    return [(host, hosts.count(host)) for host in dict.fromkeys(hosts)]


def _slots(hosts: list[str]) -> list[Slot]:
    """Each partition's rank place: the k-th task on a host takes that host's k-th slot."""
    from hvd_cpu.runtime import horovod

    by_host: dict[str, list[Slot]] = {}
    for slot in horovod.lay_out(_counts(hosts)):
        by_host.setdefault(slot.host, []).append(slot)
    return [by_host[host].pop(0) for host in hosts]


def _address_towards(host: str) -> str:
    """This executor's address on the network towards the driver, where the other tasks
    reach it too (Spark's own name for an executor's host may resolve nowhere else)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # a datagram socket's connect sends nothing: it routes
        return probe.getsockname()[0]


def _interface(address: str) -> str | None:
    """The network interface holding `address`."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.address == address for entry in addresses):
            return name
    return None


def _outcome(rank: int, code: int, outcome: bytes | None, failure: bytes | None) -> pd.DataFrame:
    return pd.DataFrame(
        {"rank": [rank], "code": [code], "outcome": [outcome], "failure": [failure]}
    )
