"""`hvd_cpu.ray.fit`: train on a Ray cluster's CPUs, from a Ray Dataset, a pandas DataFrame or
parquet.

The driver (this process) never holds the table: the Dataset is cut into `num_proc` blocks in
the object store before the ranks take their CPUs (so Ray Data's own tasks never wait behind
them), and one actor per bundle of a placement group runs one rank on its block
(ray/actor.py), as `--shard-read` ranks train on their own pieces of a parquet file. The
bundles are packed onto as few nodes as they fit (ranks of a node share memory) unless
placement="spread". Rank 0 writes the run's folder as `hvd-cpu train` does and hands its model
back. A lost node, actor or rank process ends the job; with elastic=True it starts again by
itself from its last checkpoint on the CPUs there are then (clusters/restarts.py).
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import cloudpickle

from hvd_cpu.api import FitResult, cluster_config, fit_result, shipped_code
from hvd_cpu.clusters.relay import Relay
from hvd_cpu.clusters.restarts import RankLost, Restarts, first_killed, had_their_say, result_of
from hvd_cpu.config.options import TrainConfig
from hvd_cpu.errors import InputError
from hvd_cpu.ray import cluster
from hvd_cpu.ray.actor import RankActor
from hvd_cpu.runtime import secret

# What config.toml records as --data for data that was no parquet path.
DATASET = Path("ray-dataset")
PLACEMENTS = {"pack": "PACK", "spread": "SPREAD"}
# How long a placement group gets to be placed (the cluster's CPUs may be busy a while), and
# how long a job going on (elastic) waits for the cluster to replace a lost node.
PLACE_SECONDS = 60.0
REPLACE_SECONDS = 30.0
# How long the other ranks get to end by themselves once one was lost (they lose it at their
# next collective, or by its silence: --stall-seconds), before their actors are ended.
LOST_GRACE_SECONDS = 10.0


def fit(
    data: Any,
    target: str | tuple[str, ...] = "target",
    num_proc: int | None = None,
    model: Any = None,
    loss: Any = None,
    address: str | None = None,
    placement: str = "pack",
    **options: Any,
) -> FitResult:
    """Train on `data` (a Ray Dataset, a pandas DataFrame, or the path of parquet every node
    reads) with `num_proc` ranks (None: one per CPU of the cluster), each a Ray actor on its
    own part of the rows. `address`: the cluster's (default: the one this process is connected
    to, else as ray.init finds one). `placement`: "pack" (ranks on as few nodes as they fit)
    or "spread". `model`, `loss` and `options` are hvd_cpu.fit's. Returns what hvd_cpu.fit
    returns.

    Raises InputError for bad input (Ray missing, no cluster at the address, fewer CPUs than
    ranks, workers whose Python cannot run a rank, a missing column); the exception a rank's
    code raised, as hvd_cpu.fit does; RunFailed when a rank was lost (a node or actor ended):
    the checkpoint stays, and `resume=True` goes on from it. With elastic=True the job goes
    on by itself instead, up to `max_restarts` times.
    """
    cluster.require_ray()
    config, code, elastic = cluster_config(data, target, num_proc, model, loss, options, DATASET)
    if placement not in PLACEMENTS:
        raise InputError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    cluster.connect(address)
    num_proc = num_proc or cluster.cpus()
    cluster.check_cpus(num_proc)
    dataset = cluster.dataset_of(data)
    cluster.check_columns(dataset, [*config.targets, *(config.features or ())])
    training = Training(dataset, config, shipped_code(config, code), PLACEMENTS[placement])
    ends = training.going_on(num_proc) if elastic else training.once(num_proc)
    return fit_result(result_of(ends), config.output)


class Training(Restarts):
    """One training job on the cluster: a placement group of one CPU per rank, an actor in
    each bundle. The Dataset is cut again for each run, from its lineage: no rows are lost
    with a node."""

    resume = "resume=True (ray-train --resume)"

    def __init__(
        self, dataset: Any, config: TrainConfig, code: dict[str, bytes], strategy: str
    ) -> None:
        super().__init__(config)
        self.dataset, self.code, self.strategy = dataset, code, strategy

    def _room_after(self, wanted: int, lost: RankLost) -> int:
        """The cluster's CPUs once it has had time to replace a lost node."""
        deadline = time.monotonic() + REPLACE_SECONDS
        while (have := cluster.cpus()) < wanted and time.monotonic() < deadline:
            time.sleep(0.5)
        return have

    def _run(self, config: TrainConfig, num_proc: int) -> list[Any]:
        """One run of `num_proc` ranks, each an actor of a placement group; how each ended."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # Ray Data's tasks run here, while every CPU is free; the blocks stay in the store.
        # to_arrow_refs converts blocks that are not Arrow yet (a pandas frame's) in tasks of
        # a CPU each, which would wait forever behind a group that holds every CPU: they end
        # first (the job hung at random without this wait).
        blocks = self.dataset.repartition(num_proc).materialize().to_arrow_refs()
        ray.wait(blocks, num_returns=len(blocks), fetch_local=False)
        group = placement_group([{"CPU": 1}] * num_proc, strategy=self.strategy)
        actors: list[Any] = []
        try:
            if not group.wait(PLACE_SECONDS):
                raise RankLost(
                    f"the cluster did not give {num_proc} CPUs to the job within "
                    f"{PLACE_SECONDS:.0f} s (ray status shows what holds them)"
                )
            worker = ray.remote(RankActor)
            actors = [
                worker.options(
                    num_cpus=1,
                    max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, bundle),
                ).remote()
                for bundle in range(num_proc)
            ]
            return self._ranks(config, actors, blocks)
        finally:
            for actor in actors:
                ray.kill(actor)
            remove_placement_group(group)

    def _ranks(self, config: TrainConfig, actors: list[Any], blocks: list[Any]) -> list[Any]:
        """The ranks, laid out over the actors' nodes as horovodrun would (a node's together),
        rank 0's actor holding the rendezvous; how each ended."""
        import ray

        from hvd_cpu.runtime import horovod

        addresses = _places(actors)
        nodes = list(dict.fromkeys(addresses))
        order = sorted(range(len(actors)), key=lambda i: nodes.index(addresses[i]))
        hosts = [(node, addresses.count(node)) for node in nodes]
        key = bytes.fromhex(secret.new_key())  # this run's: its actors get it in their call
        first = actors[order[0]]
        port = ray.get(first.serve.remote(hosts, key, addresses[order[0]]))
        job = cloudpickle.dumps((config, self.code))
        where = cluster.relay_address()
        # No relay for a Ray Client's driver: the ranks' lines come through Ray's own logs.
        with Relay(where, len(actors), key) if where else contextlib.nullcontext() as relay:
            back = relay.address if relay else None
            runs = [
                actors[i].run.remote(
                    slot, (addresses[order[0]], port), job, blocks[slot.rank], back, key
                )
                for slot, i in zip(horovod.lay_out(hosts), order, strict=True)
            ]
            ends = _ends(runs, [addresses[i] for i in order])
        if not had_their_say(ends):
            raise RankLost(first_killed(ends))
        return ends


def _places(actors: list[Any]) -> list[str]:
    """Each actor's node address; InputError when a node's Python cannot run a rank."""
    import ray

    try:
        places = ray.get([actor.place.remote() for actor in actors])
    except ray.exceptions.RayActorError as exc:  # hvd-cpu itself missing: no actor starts
        raise InputError(
            f"Ray could not start a rank's actor ({_reason(exc)}); start the cluster's Ray from "
            f"the environment hvd-cpu is installed in ({sys.executable} here)"
        ) from None
    for address, python, missing in places:
        if missing:
            raise cluster.unfit_workers(address, python, missing)
    return [address for address, _, _ in places]


def _ends(runs: list[Any], addresses: list[str]) -> list[Any]:
    """How each rank ended, by rank; RankLost naming the first whose actor or node was lost
    (the others get LOST_GRACE_SECONDS to end by themselves)."""
    import ray

    ends: dict[int, Any] = {}
    lost: str | None = None
    pending = list(runs)
    deadline = None
    while pending:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not done:
            break  # the grace is over: the actors still running are ended with the group
        rank = runs.index(done[0])
        try:
            ends[rank] = ray.get(done[0])
        except ray.exceptions.RayError as exc:
            if lost is None:
                lost = f"rank {rank}'s Ray actor on {addresses[rank]} was lost ({_reason(exc)})"
                deadline = time.monotonic() + LOST_GRACE_SECONDS
    if lost:
        raise RankLost(lost)
    return [ends[rank] for rank in range(len(runs))]


def _reason(exc: Exception) -> str:
    """Ray's reason for a lost actor: its first sentence."""
    text = str(getattr(exc, "cause", None) or exc)
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    return first.split(". ")[0].rstrip(".")
