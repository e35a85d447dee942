"""What this machine lets a process use: cores, and each rank's share of them as torch threads.

Plain facts about the system, with no Horovod or torch import, so `doctor` and `bench` can ask
them without loading either.
"""

from __future__ import annotations

import math
import os
import posixpath
import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

PROC_SELF = Path("/proc/self")


def usable_cores() -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup CPU quota (a
    container's --cpus, a systemd slice's CPUQuota, a batch job's group) when one is set."""
    cores = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota()
    return min(cores, max(1, math.ceil(quota))) if quota else cores


def cgroup_cpu_quota(proc: Path = PROC_SELF) -> float | None:
    """CPUs this process's cgroups let it use (1.5 for docker's --cpus 1.5), None when none
    sets a quota or none can be read. Its own group (`proc`/cgroup) and every group above it
    that a mount shows (`proc`/mountinfo), in cgroup v2 (cpu.max) and v1 (the cpu controller's
    cfs files) alike: the tightest counts, since a group may set none under a parent that caps
    it (a systemd slice, a batch system's job, a container)."""
    try:
        mounts = (proc / "mountinfo").read_text().splitlines()
        groups = (proc / "cgroup").read_text().splitlines()
    except OSError:
        return None
    quotas = [
        quota
        for version, group in _cpu_groups(groups)
        for folder in _folders(mounts, version, group)
        if (quota := _quota(folder, version)) is not None
    ]
    return min(quotas, default=None)


def _cpu_groups(lines: list[str]) -> Iterator[tuple[int, str]]:
    """(cgroup version, the group's path in its hierarchy) of each hierarchy that may hold this
    process's CPU quota: v2's one (`0::/path`) and v1's with the cpu controller."""
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if not controllers:
            yield 2, group
        elif "cpu" in controllers.split(","):
            yield 1, group


def _folders(mounts: list[str], version: int, group: str) -> Iterator[Path]:
    """The folder of `group` and of each group above it, in every mount of its hierarchy that
    shows it (a mount may show only a subtree: a container's own group)."""
    for line in mounts:
        fields, _, filesystem = line.partition(" - ")
        root, point = fields.split()[3:5]
        kind, _, options = filesystem.split()[:3]
        if (version, kind) == (2, "cgroup2") or (
            (version, kind) == (1, "cgroup") and "cpu" in options.split(",")
        ):
            below = PurePosixPath(posixpath.relpath(group, _unescaped(root))).parts
            if ".." in below:  # outside what this mount shows
                continue
            top = Path(_unescaped(point))
            yield from (top.joinpath(*below[:n]) for n in range(len(below), -1, -1))


def _unescaped(field: str) -> str:
    """A mountinfo path field: the kernel writes space, tab, newline and backslash as octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def _quota(folder: Path, version: int) -> float | None:
    """CPUs the group at `folder` may use, None when unlimited or unreadable."""
    try:
        if version == 2:
            quota, period = (folder / "cpu.max").read_text().split()
            return None if quota == "max" else int(quota) / int(period)
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
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
