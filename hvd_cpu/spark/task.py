"""What each Spark task runs, on an executor: one Horovod rank over Gloo, on the rows of the
task's own partition.

The tasks run in barrier mode (all start together or none). They tell each other where they
run (BarrierTaskContext.allGather), lay the ranks out over those hosts as horovodrun would,
and the task of rank 0 holds the Gloo rendezvous. Each task then starts its rank as a process
of its own (clusters/worker.py), its output relayed to the driver (clusters/relay.py); the
task's one row back says how the rank ended.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pandas as pd

from hvd_cpu.clusters.relay import Link
from hvd_cpu.clusters.worker import address_towards, interface_of, run_rank

if TYPE_CHECKING:  # Horovod itself is imported by the tasks only
    from hvd_cpu.runtime.horovod import Slot

# What a task hands back: clusters/worker.py's RankEnd.
OUTCOME_SCHEMA = "rank int, code int, outcome binary, failure binary"


def rank_task(
    job: bytes, columns: pd.DataFrame, driver: tuple[str, int], key: bytes
) -> Callable[[Iterator[pd.DataFrame]], Iterator[pd.DataFrame]]:
    """The function mapInPandas runs on each partition: `job` is clusters/rank.py's (config and
    the user's code, pickled), `columns` the frame's columns (a partition may have no rows),
    `driver` the relay's address, `key` the job's secret (runtime/secret.py): the relay, the
    rendezvous and the ranks' heartbeats answer only what is signed with it."""

    def run(batches: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        from pyspark import BarrierTaskContext

        context = BarrierTaskContext.get()
        partition = context.partitionId()
        link = Link(driver, key)
        try:
            address = address_towards(driver[0])
            # The partition's rows, in a list run_rank empties: it lets go once they are written.
            yield _run_rank(
                context,
                partition,
                address,
                job,
                [pd.concat([columns, *batches], ignore_index=True)],
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
    own: list[pd.DataFrame],
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
        env = horovod.gloo_environment(slot, server, int(ports[0]), interface_of(address), key)
        ended = run_rank(slot.rank, job, own, env, link)
        return pd.DataFrame({name: [value] for name, value in ended._asdict().items()})
    finally:
        if stop_server:
            stop_server()


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
