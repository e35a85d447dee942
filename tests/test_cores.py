"""Cores and torch threads per rank, checked without Horovod: cgroup quotas in both forms,
CPU affinity, SLURM's per-task CPUs, and whether a waiting MPI rank yields its core."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_cpu.runtime import cores
from hvd_cpu.runtime.mpi import YIELD_WHEN_IDLE, yield_when_oversubscribed


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(
    ("files", "quota"),
    [
        ({"cpu.max": "150000 100000\n"}, 1.5),  # cgroup v2, docker --cpus 1.5
        ({"cpu.max": "max 100000\n"}, None),  # v2, no limit
        ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 0.5),  # v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1, none
        # A v2 file that does not parse: the v1 files decide.
        (
            {
                "cpu.max": "garbage\n",
                "cpu/cpu.cfs_quota_us": "200000\n",
                "cpu/cpu.cfs_period_us": "100000\n",
            },
            2.0,
        ),
        ({"cpu/cpu.cfs_quota_us": "50000\n"}, None),  # v1 without its period
        ({}, None),  # no cgroup files at all (not Linux, or not mounted)
    ],
)
def test_cgroup_cpu_quota(tmp_path: Path, files: dict[str, str], quota: float | None) -> None:
    assert cores.cgroup_cpu_quota(write(tmp_path, files)) == quota


@pytest.mark.parametrize(
    ("affinity", "quota", "usable"),
    [(4, None, 4), (4, 1.5, 2), (4, 0.5, 1), (4, 8.0, 4), (1, None, 1)],
)
def test_usable_cores_are_the_affinity_capped_by_the_quota(
    monkeypatch: pytest.MonkeyPatch, affinity: int, quota: float | None, usable: int
) -> None:
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda _: set(range(affinity)))
    monkeypatch.setattr(cores, "cgroup_cpu_quota", lambda: quota)
    assert cores.usable_cores() == usable


@pytest.mark.parametrize(
    ("slurm", "local_size", "threads"),
    [
        (None, 1, 4),
        (None, 2, 2),
        (None, 3, 1),  # cores left over are not handed out
        (None, 8, 1),  # more ranks than cores: still one thread each
        ("3", 2, 3),  # SLURM's --cpus-per-task wins over the share
        ("0", 2, 2),  # not a usable count: the share
        ("two", 2, 2),
        ("", 2, 2),
    ],
)
def test_default_threads(
    monkeypatch: pytest.MonkeyPatch, slurm: str | None, local_size: int, threads: int
) -> None:
    monkeypatch.setattr(cores, "usable_cores", lambda: 4)
    if slurm is None:
        monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    else:
        monkeypatch.setenv("SLURM_CPUS_PER_TASK", slurm)
    assert cores.default_threads(local_size) == threads


def test_doctor_and_cores_load_neither_horovod_nor_torch() -> None:
    """`hvd-cpu doctor` asks for cores before it (maybe) probes Horovod, which may be broken."""
    code = (
        "import sys, hvd_cpu.runtime.cores, hvd_cpu.tools.doctor; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'horovod', 'torch'}))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("ranks_here", "already", "want"),
    [("more", None, "1"), ("as many", None, None), ("more", "0", "0"), (None, None, None)],
    ids=["more ranks than cores", "one rank per core", "the user's own choice", "not Open MPI"],
)
def test_mpi_ranks_yield_only_when_they_outnumber_the_cores(
    monkeypatch: pytest.MonkeyPatch, ranks_here: str | None, already: str | None, want: str | None
) -> None:
    """Before MPI starts: Open MPI busy-polls unless told the host is oversubscribed
    (benchmarks/oversubscribed.py measures the difference)."""
    here = cores.usable_cores()
    sizes = {"more": str(here + 1), "as many": str(here), None: None}
    for name, value in (("OMPI_COMM_WORLD_LOCAL_SIZE", sizes[ranks_here]),
                        (YIELD_WHEN_IDLE, already)):  # fmt: skip
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    yield_when_oversubscribed()
    assert os.environ.get(YIELD_WHEN_IDLE) == want
