"""What this machine lets a process use: cores, and each rank's share of them as torch threads.

Plain facts about the system, with no Horovod or torch import, so `doctor` and `bench` can ask
them without loading either.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cores() -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup CPU quota (a
    container's --cpus) when one is set, in cgroup v2 or v1 form."""
    cores = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota()
    return min(cores, max(1, math.ceil(quota))) if quota else cores


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs the cgroup under `root` may use (1.5 for --cpus 1.5), None when unlimited or unknown."""
    try:
        quota, period = (root / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def default_threads(local_size: int, cores: int | None = None) -> int:
    """Torch threads per rank: what SLURM gave each task, else this host's cores (`cores`, or
    the usable ones) shared out among the `local_size` ranks on it (N ranks of N threads each
    on N cores would thrash)."""
    given = os.environ.get("SLURM_CPUS_PER_TASK")
    if given and given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, (cores or usable_cores()) // local_size)
