"""The driver's side of a Ray cluster: Ray being there, a cluster that answers, CPUs enough for
every rank, workers whose Python can run a rank, and the Dataset to train on.

Each check turns what would be a hang or a page of Ray's log into one line: a placement group
asking for more CPUs than the cluster has waits for ever, ray.init on an address nobody listens
on retries for a minute, and a worker whose Python lacks Horovod would fail as a rank, once
per rank (ray/actor.py's actors check it first).
"""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from hvd_cpu.errors import InputError

RAY_EXTRA = "pip install 'hvd-cpu[ray]'"
# How long a Ray cluster's address gets to answer.
CONNECT_SECONDS = 5.0


def require_ray() -> None:
    """Ray (with Ray Data), or one line saying what to install."""
    try:
        import ray.data  # noqa: F401
    except ImportError:
        raise InputError(f"Ray is not installed: {RAY_EXTRA}") from None


def connect(address: str | None) -> None:
    """This process as a driver of the Ray cluster at `address` ("HOST:PORT", "auto", or None:
    the one it is connected to already, else RAY_ADDRESS's or a new one on this machine, as
    ray.init does); an address nobody listens on is one line."""
    import ray

    _quiet_ray_data()
    if ray.is_initialized():
        return
    if address and ":" in address and "://" not in address:
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), CONNECT_SECONDS).close()
        except (OSError, ValueError) as exc:
            raise InputError(
                f"no Ray cluster answers at {address} ({getattr(exc, 'strerror', exc)}); start "
                "one (ray start --head) or pass its address (the head's HOST:6379)"
            ) from None
    try:
        ray.init(address=address, logging_level=logging.WARNING, configure_logging=True)
    except ConnectionError as exc:
        raise InputError(f"no Ray cluster at {address}: {exc}") from None


def _quiet_ray_data() -> None:
    """Ray Data's progress lines and logs say nothing a training's user needs."""
    import ray.data

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)


def cpus() -> int:
    """The CPUs of the cluster's nodes, in all."""
    import ray

    return int(ray.cluster_resources().get("CPU", 0))


def check_cpus(num_proc: int) -> None:
    """Every rank takes one CPU, all at once: fewer CPUs than ranks would wait, not run."""
    have = cpus()
    if have < num_proc:
        raise InputError(
            f"the Ray cluster has {have} CPU(s), fewer than num_proc={num_proc} (every rank takes "
            f"one CPU, all at once); use num_proc={have} or fewer, or add nodes"
        )


def unfit_workers(address: str, python: str, missing: list[str]) -> InputError:
    """What to say of a node whose Ray workers run a Python that cannot run a rank: they run
    the Python their node was started with (`ray start`), which need not be this one."""
    return InputError(
        f"Ray's workers on {address} run {python}, which cannot import {'; '.join(missing)}: "
        f"start that node's Ray (ray start) from the environment hvd-cpu is installed in "
        f"({sys.executable} here)"
    )


def dataset_of(data: Any) -> Any:
    """`data` as a Ray Dataset: itself, a pandas DataFrame put in the object store, or the
    parquet at a path every node reads."""
    import ray.data

    if isinstance(data, ray.data.Dataset):
        return data
    if isinstance(data, pd.DataFrame):
        return ray.data.from_pandas(data)
    if isinstance(data, (str, Path)):
        return ray.data.read_parquet(str(data))
    raise InputError(
        f"data is a {type(data).__name__}; pass a Ray Dataset, a pandas DataFrame or the path "
        "of parquet every node can read"
    )


def check_columns(dataset: Any, names: list[str]) -> None:
    """Columns the options name that the Dataset lacks, before any rank starts."""
    have = list(dataset.schema().names)
    for name in names:
        if name not in have:
            raise InputError(
                f"the Dataset has no column {name!r} (it has {', '.join(have)}); name one of "
                "those, or add it"
            )


def relay_address() -> str | None:
    """The address the ranks reach this driver at, which the relay of their lines
    (clusters/relay.py) listens on alone: this node's, as Ray knows it. None for a Ray Client
    (ray://), which the cluster cannot reach: the ranks' lines then come through Ray's own."""
    import ray

    if ray.util.client.ray.is_connected():
        return None
    return ray.util.get_node_ip_address()
