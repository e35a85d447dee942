"""Cores and torch threads per rank: the cgroup CPU quota of the process's own groups (v1 and
v2, from fake /proc files; and for real, a job in a cgroup made here), CPU affinity, SLURM's
per-task CPUs, and whether a waiting MPI rank yields its core."""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hvd_cpu.runtime import cores
from hvd_cpu.runtime.mpi import YIELD_WHEN_IDLE, yield_when_oversubscribed

from .jobs import BIN, ranks, run, slow_except

# Mount lines as /proc/self/mountinfo has them, {mnt} standing for the test's own folder.
V2 = "30 23 0:26 / {mnt}/unified rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"
V1_CPU = "32 31 0:29 / {mnt}/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct"
V1_CPUSET = "34 31 0:31 / {mnt}/cpuset rw,relatime - cgroup cgroup rw,cpuset"
HYBRID = "0::/job\n4:cpuset:/job\n1:cpu,cpuacct:/job\n"


def fake_proc(tmp_path: Path, cgroup: str, mounts: list[str], files: dict[str, str]) -> Path:
    """A /proc/self of `cgroup` and `mounts`, whose cgroup files (named below the mounts'
    folder) hold `files`."""
    mnt = tmp_path / "mnt"
    for name, text in files.items():
        (mnt / name).parent.mkdir(parents=True, exist_ok=True)
        (mnt / name).write_text(text)
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text("".join(m.format(mnt=mnt) + "\n" for m in mounts))
    return proc


QUOTA_V1 = {"cpu.cfs_quota_us": "50000\n", "cpu.cfs_period_us": "100000\n"}


def inside(folder: str, files: dict[str, str]) -> dict[str, str]:
    return {f"{folder}/{name}": text for name, text in files.items()}


@pytest.mark.parametrize(
    ("cgroup", "mounts", "files", "quota"),
    [
        # cgroup v2: the process's own group, as docker --cpus 1.5 or a slice's CPUQuota=150%
        ("0::/a/job\n", [V2], {"unified/a/job/cpu.max": "150000 100000\n"}, 1.5),
        ("0::/a/job\n", [V2], {"unified/a/job/cpu.max": "max 100000\n"}, None),
        # the parent caps, its child sets nothing: the parent's quota counts
        (
            "0::/a/job\n",
            [V2],
            {"unified/a/cpu.max": "50000 100000\n", "unified/a/job/cpu.max": "max 100000\n"},
            0.5,
        ),
        # both cap (v2 lets a child ask for more than its parent gets): the tightest
        (
            "0::/a/job\n",
            [V2],
            {"unified/a/cpu.max": "50000 100000\n", "unified/a/job/cpu.max": "200000 100000\n"},
            0.5,
        ),
        # a process in the top group: the top's own file
        ("0::/\n", [V2], {"unified/cpu.max": "100000 100000\n"}, 1.0),
        # cgroup v1 (hybrid: the cpu controller is v1's; the v2 hierarchy has none)
        (HYBRID, [V2, V1_CPU, V1_CPUSET], inside("cpu,cpuacct/job", QUOTA_V1), 0.5),
        (
            HYBRID,
            [V2, V1_CPU],
            inside("cpu,cpuacct/job", {**QUOTA_V1, "cpu.cfs_quota_us": "-1\n"}),
            None,
        ),
        (HYBRID, [V2, V1_CPU], inside("cpu,cpuacct", QUOTA_V1), 0.5),  # on the parent
        (HYBRID, [V2, V1_CPU], {"cpu,cpuacct/job/cpu.cfs_quota_us": "50000\n"}, None),  # no period
        # a quota in another controller's folder is not the cpu controller's
        (HYBRID, [V2, V1_CPUSET], inside("cpuset/job", QUOTA_V1), None),
        # a v2 file that does not parse: the v1 files decide
        (
            HYBRID,
            [V2, V1_CPU],
            {"unified/job/cpu.max": "garbage\n", **inside("cpu,cpuacct/job", QUOTA_V1)},
            0.5,
        ),
        # a container's mount shows its own group (/docker/c1) as the top of the folder
        (
            "1:cpu,cpuacct:/docker/c1\n",
            [V1_CPU.replace(" / ", " /docker/c1 ")],
            inside("cpu,cpuacct", QUOTA_V1),
            0.5,
        ),
        # ... and nothing of a group outside what the mount shows
        (
            "1:cpu,cpuacct:/other\n",
            [V1_CPU.replace(" / ", " /docker/c1 ")],
            inside("cpu,cpuacct", QUOTA_V1),
            None,
        ),
        # a mount point with a space, which mountinfo writes as \040
        (
            "0::/job\n",
            [V2.replace("unified", "my\\040cgroups")],
            {"my cgroups/job/cpu.max": "50000 100000\n"},
            0.5,
        ),
        ("0::/job\n", [], {}, None),  # no cgroup mounted
    ],
    ids=[
        "v2",
        "v2 max",
        "v2 parent caps",
        "v2 tightest",
        "v2 root",
        "v1 hybrid",
        "v1 -1",
        "v1 parent caps",
        "v1 no period",
        "v1 cpuset",
        "v2 garbage v1 decides",
        "v1 container",
        "v1 outside the mount",
        "escaped mount point",
        "nothing mounted",
    ],
)
def test_cgroup_cpu_quota_of_the_process_own_groups(
    tmp_path: Path, cgroup: str, mounts: list[str], files: dict[str, str], quota: float | None
) -> None:
    assert cores.cgroup_cpu_quota(fake_proc(tmp_path, cgroup, mounts, files)) == quota


def test_no_proc_files_no_quota(tmp_path: Path) -> None:
    """Not Linux, or /proc not mounted."""
    assert cores.cgroup_cpu_quota(tmp_path) is None


def cpu_controller() -> tuple[int, Path]:
    """(cgroup version, mount point) of the hierarchy that holds the cpu controller here; the
    calling test skips where there is none, or where it cannot make groups in it."""
    if os.geteuid() != 0:
        pytest.skip("making a cgroup needs root")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, filesystem = line.partition(" - ")
        point = Path(fields.split()[4])
        kind, _, options = filesystem.split()[:3]
        if kind == "cgroup" and "cpu" in options.split(","):
            return 1, point
        if kind == "cgroup2" and "cpu" in (point / "cgroup.controllers").read_text().split():
            return 2, point
    pytest.skip("no cpu controller mounted (cgroup v1 or v2)")


def limit(group: Path, version: int, cpus: float | None) -> None:
    """Cap `group` at `cpus` CPUs (None: unlimited) over a 100 ms period."""
    quota = None if cpus is None else round(cpus * 100_000)
    if version == 2:
        (group / "cpu.max").write_text(f"{quota or 'max'} 100000")
    else:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(quota or -1))


def remove_when_empty(group: Path, timeout: float = 10) -> None:
    """rmdir a cgroup once the processes in it are gone."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            group.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                left = (group / "cgroup.procs").read_text().split()
                raise AssertionError(f"{group} still holds {left}") from None
            time.sleep(0.1)


def enable_cpu(group: Path) -> bool:
    """cgroup v2: enable the cpu controller for the groups below `group`; whether it was off."""
    controls = group / "cgroup.subtree_control"
    if "cpu" in controls.read_text().split():
        return False
    controls.write_text("+cpu")
    return True


@pytest.fixture
def nested_groups() -> Iterator[tuple[int, Path, Path]]:
    """(cgroup version, a group, its child group), made in the real cpu hierarchy and removed
    when the test ends, however it ends."""
    version, top = cpu_controller()
    parent = top / f"hvd-cpu-test-{os.getpid()}"
    enabled = False
    try:
        try:
            enabled = version == 2 and enable_cpu(top)
            parent.mkdir()
            if version == 2:
                enable_cpu(parent)
            (parent / "job").mkdir()
        except OSError as exc:
            pytest.skip(f"cannot make a cgroup with the cpu controller in {top}: {exc}")
        yield version, parent, parent / "job"
    finally:
        for group in (parent / "job", parent):
            if group.is_dir():
                remove_when_empty(group)
        if enabled:  # as it was, unless another group has taken it up since
            with contextlib.suppress(OSError):
                (top / "cgroup.subtree_control").write_text("-cpu")


CAP = 0.5  # CPUs


@pytest.mark.parametrize("capped", slow_except(["job", "parent", "none"], ["job"]))
def test_a_job_in_a_capped_cgroup_gets_threads_for_its_quota(
    capped: str, nested_groups: tuple[int, Path, Path], demo_parquet: Path, tmp_path: Path
) -> None:
    """A real cgroup, as a systemd slice or a batch system makes outside any container: a job
    started in its child group takes the quota of the group that caps it (the child itself, or
    its parent with the child unlimited) into its torch threads, as usable_cores() says:
    the affinity capped by the quota rounded up, shared among the host's ranks (1 here)."""
    version, parent, job = nested_groups
    affinity = len(os.sched_getaffinity(0))
    if affinity < 2:
        pytest.skip("one core: no quota can lower the threads below 1")
    limit(parent, version, CAP if capped == "parent" else None)
    limit(job, version, CAP if capped == "job" else None)
    out = tmp_path / "out"
    command = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(job)]
    command += [str(BIN / "hvd-cpu"), "train", "--data", str(demo_parquet), "--epochs", "1"]
    done = run([*command, "--output", str(out)])
    assert done.returncode == 0, done.stderr
    cores_here = affinity if capped == "none" else min(affinity, math.ceil(CAP))
    ranks_here = 1
    assert [r["threads"] for r in ranks(out)] == [max(1, cores_here // ranks_here)]
    if capped != "none":  # the cap was real: the kernel held the job back
        stat = (parent if capped == "parent" else job) / "cpu.stat"
        throttled = dict(line.split() for line in stat.read_text().splitlines())
        assert int(throttled["nr_throttled"]) > 0


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
