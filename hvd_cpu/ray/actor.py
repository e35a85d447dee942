"""What each Ray actor of a job does: one Horovod rank over Gloo, on its block of the Dataset.

The driver (ray/train_job.py) starts one actor per bundle of the job's placement group, asks
each where it runs, lays the ranks out over those nodes as horovodrun would, and has rank 0's
actor hold the Gloo rendezvous, on its node's address (the driver may be a Ray Client the
cluster cannot reach). Each actor then starts its rank as a process of its own
(clusters/worker.py) on its block, which Ray hands it from the object store.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hvd_cpu.clusters.relay import Link
from hvd_cpu.clusters.worker import RankEnd, import_check, interface_of, run_rank

if TYPE_CHECKING:  # Horovod itself is imported by the actors only
    from hvd_cpu.runtime.horovod import Slot

# What a rank's process imports (clusters/rank.py): an actor's Python is its node's Ray's.
RANK_NEEDS = ("torch", "horovod.torch")


class RankActor:
    """One rank's worker (made a Ray actor by ray/train_job.py: ray.remote(RankActor))."""

    def __init__(self) -> None:
        self._stop_rendezvous: Callable[[], None] | None = None

    def place(self) -> tuple[str, str, list[str]]:
        """Where this actor runs (its node's address, where the other ranks reach it), its
        Python, and what of a rank's needs that Python cannot import (with why)."""
        import ray

        python, missing = import_check(RANK_NEEDS)()
        return ray.util.get_node_ip_address(), python, missing

    def serve(self, hosts: list[tuple[str, int]], key: bytes, address: str) -> int:
        """Rank 0's actor: hold the rendezvous of the ranks of `hosts` on `address`; its port."""
        from hvd_cpu.runtime import horovod

        self._stop_rendezvous, port = horovod.serve_rendezvous(hosts, key, address)
        return port

    def run(
        self,
        slot: Slot,
        rendezvous: tuple[str, int],
        job: bytes,
        block: Any,
        relay: tuple[str, int] | None,
        key: bytes,
    ) -> RankEnd:
        """Run the rank at `slot` on `block` (a pyarrow Table) and say how it ended."""
        import ray

        from hvd_cpu.runtime import horovod

        address = ray.util.get_node_ip_address()
        env = horovod.gloo_environment(slot, *rendezvous, interface_of(address), key)
        link = Link(relay, key) if relay else None
        try:
            return run_rank(slot.rank, job, [block.to_pandas()], env, link)
        finally:
            if link:
                link.close()
            if self._stop_rendezvous:
                self._stop_rendezvous()
