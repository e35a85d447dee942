"""SLURM for real: a one-machine cluster (tests/slurm.py) runs `sbatch launch/slurm.sbatch`.

The job's ranks must train as MPI ranks with SLURM's CPUs per task as their threads, end with
the parameters a Gloo job of the same arguments ends with, and bad input (an allocation
smaller than asked, a missing file) must end the job with one error line and status 2,
leaving no process behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch

from hvd_cpu.data.demo import make_demo_frame

from .jobs import BIN, REPO, horovodrun, metrics
from .slurm import SlurmCluster, missing_tools

SCRIPT = REPO / "launch" / "slurm.sbatch"
JOB_SECONDS = 240  # sbatch --wait's own limit; a hung job is SLURM's to end (--time)

# The tests marked beside may run beside another test (the cluster's ports are free ones);
# not the stopped rank's, whose --stall-seconds 6 a live rank starved by a second worker
# could outlast, nor the preempted jobs' (below).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the test SLURM cluster runs its daemons as root"),
    pytest.mark.skipif(
        bool(missing_tools()),
        reason=f"SLURM/munge not installed ({', '.join(missing_tools())} missing): "
        "run launch/install.sh --test (Debian: apt-get install slurmd slurmctld munge "
        "slurm-client libpmix-dev)",
    ),
]


@dataclass
class Job:
    job_id: str
    returncode: int
    output: str  # what the batch script and its ranks printed (sbatch --output)
    seconds: float


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """One cluster for the module: it starts in about a second, but 2 cores are shared."""
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as started:
        yield started


def sbatch(
    cluster: SlurmCluster,
    folder: Path,
    *train_args: str,
    options: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    during: Callable[[], None] | None = None,
) -> Job:
    """`sbatch --wait [OPTIONS] launch/slurm.sbatch TRAIN_ARGS`, submitted from `folder` (not
    the repository: the script must find its venv from the path it was submitted by); `during`
    runs while it waits."""
    log = folder / "job-%j.out"
    command = ["sbatch", "--wait", "--parsable", f"--output={log}", "--time=5", *options]
    extra = dict(env or {})
    if BIN.parent != REPO / ".venv":  # the venv running these tests, if not the default one
        extra.setdefault("HVD_CPU_VENV", str(BIN.parent))
    start = time.monotonic()
    with subprocess.Popen(
        [*command, str(SCRIPT), *train_args],
        cwd=folder,
        env={**cluster.env, **extra},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as submitted:
        if during:
            during()
        stdout, stderr = submitted.communicate(timeout=JOB_SECONDS)
    seconds = time.monotonic() - start
    job_id = stdout.strip().split(";")[0]
    assert job_id.isdigit(), f"sbatch refused the job: {stderr}"
    output = Path(str(log).replace("%j", job_id))
    return Job(job_id, submitted.returncode, output.read_text() if output.exists() else "", seconds)


def assert_nothing_left(cluster: SlurmCluster, job: Job, marker: Path) -> None:
    """No process of the job remains (its tasks, its slurmstepd), nor any hvd-cpu whose
    command line names this test's folder."""
    deadline = time.monotonic() + 20  # slurmstepd ends a moment after sbatch --wait returns
    while (left := cluster.job_processes(job.job_id)) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert left == [], f"job {job.job_id} left processes {left}"
    pgrep = subprocess.run(["pgrep", "-f", str(marker)], capture_output=True, text=True)
    assert pgrep.stdout.split() == [], f"processes still running for {marker}"


def state_dict(output: Path) -> dict[str, torch.Tensor]:
    return torch.load(output / "model.pt", weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def gloo_reference(demo_parquet: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same training under `horovodrun --gloo -np 2`, to compare the SLURM job with."""
    out = tmp_path_factory.mktemp("gloo") / "out"
    job = horovodrun(
        2,
        "train",
        "--data",
        str(demo_parquet),
        "--epochs",
        "2",
        "--output",
        str(out),
        launcher=("--gloo",),
    )
    assert job.returncode == 0, job.stdout + job.stderr
    return out


@pytest.mark.beside
@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_sbatch_trains_two_mpi_ranks_like_gloo(
    launcher: str,
    cluster: SlurmCluster,
    demo_parquet: Path,
    gloo_reference: Path,
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    job = sbatch(
        cluster,
        tmp_path,
        *("--data", str(demo_parquet), "--epochs", "2", "--output", str(out)),
        env={"HVD_CPU_LAUNCHER": launcher},
    )
    assert job.returncode == 0, f"{job.output}\n{cluster.log()}"
    assert job.output.count("Epoch ") == 2, job.output

    ranks = json.loads((out / "ranks.json").read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    assert {r["controller"] for r in ranks} == {"mpi"}
    assert {r["threads"] for r in ranks} == {1}, "threads per rank = SLURM_CPUS_PER_TASK"
    assert len({r["param_sha256"] for r in ranks}) == 1, "the ranks end identical"

    slurm, gloo = state_dict(out), state_dict(gloo_reference)
    assert slurm.keys() == gloo.keys()
    for name, value in gloo.items():
        torch.testing.assert_close(slurm[name], value, rtol=0, atol=1e-6, msg=name)
    assert_nothing_left(cluster, job, out)


@pytest.mark.beside
def test_threads_per_rank_come_from_slurm(
    cluster: SlurmCluster, demo_parquet: Path, tmp_path: Path
) -> None:
    """One task of one CPU: SLURM_CPUS_PER_TASK (1) wins over the cores the rank could use
    (task/none binds nothing, so it sees all of them: the default would be 2 threads)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 usable cores to tell SLURM's 1 CPU from the default")
    out = tmp_path / "out"
    job = sbatch(
        cluster,
        tmp_path,
        *("--data", str(demo_parquet), "--epochs", "1", "--output", str(out), "--quiet"),
        options=("--ntasks=1", "--cpus-per-task=1"),
    )
    assert job.returncode == 0, f"{job.output}\n{cluster.log()}"
    ranks = json.loads((out / "ranks.json").read_text())
    assert [(r["rank"], r["threads"], r["controller"]) for r in ranks] == [(0, 1, "mpi")]


@pytest.mark.beside
def test_allocation_smaller_than_asked_ends_with_one_line(
    cluster: SlurmCluster, demo_parquet: Path, tmp_path: Path
) -> None:
    """Two ranks asked (HVD_CPU_NP=2) of a one-task allocation: no rank starts."""
    out = tmp_path / "out"
    job = sbatch(
        cluster,
        tmp_path,
        *("--data", str(demo_parquet), "--epochs", "2", "--output", str(out)),
        options=("--ntasks=1",),
        env={"HVD_CPU_NP": "2"},
    )
    assert job.returncode == 2, job.output
    lines = job.output.splitlines()
    assert len(lines) == 1, job.output
    assert lines[0].startswith("hvd-cpu: error: "), job.output
    assert "sbatch --ntasks=2" in lines[0], "the line names the fix"
    assert not out.exists(), "no rank started"
    assert_nothing_left(cluster, job, out)


@pytest.mark.beside
def test_bad_input_in_a_job_ends_it_with_status_2(cluster: SlurmCluster, tmp_path: Path) -> None:
    """A missing --data file, then a frame without its target (found after MPI started, so
    the ranks must leave MPI properly for the job's status to be rank 0's 2, every time):
    every rank sees it, rank 0 says so once, the job ends with 2."""
    missing = tmp_path / "nowhere.parquet"
    no_target = tmp_path / "no-target.parquet"
    make_demo_frame(rows=256, features=3).drop(columns="target").to_parquet(no_target)
    cases = [(missing, str(missing)), (no_target, "target column 'target' not in the data")]
    for data, said in [*cases, cases[1]]:
        job = sbatch(cluster, tmp_path, "--data", str(data), "--output", str(tmp_path / "out"))
        assert job.returncode == 2, job.output
        lines = job.output.splitlines()
        assert len(lines) == 1 and lines[0].startswith("hvd-cpu: error: "), job.output
        assert said in lines[0]
        assert_nothing_left(cluster, job, data)


def test_a_stopped_rank_ends_the_job_with_status_1_naming_it(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    """SIGSTOP of rank 1 of 2 under srun: rank 0 names it after --stall-seconds, the job ends
    with 1 and SLURM takes the stopped task too."""
    output = tmp_path / "out"
    stopped: list[int] = []

    def stop_rank_1() -> None:
        deadline = time.monotonic() + 120
        while not (output / "metrics.jsonl").exists() or len(metrics(output)) < 2:
            assert time.monotonic() < deadline, "the job did not train"
            time.sleep(0.2)
        for process in psutil.process_iter(["cmdline", "environ", "exe"]):
            environ = process.info["environ"] or {}
            if str(output) in " ".join(process.info["cmdline"] or []) and (
                environ.get("SLURM_PROCID") == "1" and "python" in (process.info["exe"] or "")
            ):
                stopped.append(process.pid)
                process.suspend()
                return

    job = sbatch(cluster, tmp_path, "--epochs", "1000", "--output", str(output),
                 "--stall-seconds", "6", during=stop_rank_1)  # fmt: skip
    assert stopped, "no rank 1 found"
    assert job.returncode == 1, job.output
    assert "hvd-cpu: rank 0: rank 1 on " in job.output
    assert f"(pid {stopped[0]}) has not answered for 6 s" in job.output, job.output
    assert "Traceback" not in job.output
    assert_nothing_left(cluster, job, output)


@pytest.fixture(scope="module")
def long_frame(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rows enough for an epoch of about a second here (MPI, 2 ranks): a stop lands inside
    one."""
    path = tmp_path_factory.mktemp("long") / "frame.parquet"
    make_demo_frame(rows=200_000, features=8).to_parquet(path)
    return path


def train_long(frame: Path, output: Path) -> tuple[str, ...]:
    return ("--data", str(frame), "--epochs", "4", "--output", str(output))


@pytest.fixture(scope="module")
def never_stopped(
    cluster: SlurmCluster, long_frame: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[str]:
    """Each rank's parameter digest at the end of the same job, never stopped."""
    folder = tmp_path_factory.mktemp("never-stopped")
    job = sbatch(cluster, folder, *train_long(long_frame, folder / "out"))
    assert job.returncode == 0, f"{job.output}\n{cluster.log()}"
    return [r["param_sha256"] for r in json.loads((folder / "out" / "ranks.json").read_text())]


# One at a time: SLURM kills the job KillWait (5 s here) after its SIGTERM, and beside another
# test the ranks' stop and checkpoint once took longer (no "stopped by SIGTERM" line).
@pytest.mark.parametrize("stop", ["scontrol requeue", "scancel --signal=TERM"])
def test_a_job_slurm_stops_comes_back_by_itself_and_ends_as_if_never_stopped(
    stop: str, cluster: SlurmCluster, long_frame: Path, never_stopped: list[str], tmp_path: Path
) -> None:
    """`scontrol requeue` (what preemption with PreemptMode=REQUEUE does): SLURM sends the
    job SIGTERM and runs it again. `scancel --signal=TERM` (as `sbatch --signal=TERM@120`
    before a time limit): only the ranks get it, and the script requeues the job itself.
    Either way the ranks save the step they stopped at, and the job's next run goes on from
    it (--auto-resume, which the script adds) to the parameters of a run never stopped.
    SLURM holds a requeued job for about two minutes (its BeginTime); the test lets it go at
    once (`scontrol update StartTime=now`, as an administrator may)."""
    output = tmp_path / "out"
    stopped: list[str] = []

    def stop_after_epoch_1() -> None:
        deadline = time.monotonic() + 120
        while (
            not (logs := list(tmp_path.glob("job-*.out"))) or "Epoch 1:" not in logs[0].read_text()
        ):
            assert time.monotonic() < deadline, "the job did not train"
            time.sleep(0.1)
        job_id = logs[0].name.removeprefix("job-").removesuffix(".out")
        done = cluster.run(*stop.split(), job_id)
        assert done.returncode == 0, done.stderr
        stopped.append(job_id)
        # Held, and its first run's processes gone (a run started while they end fails)
        while "BeginTime" not in cluster.run(
            "squeue", "-h", "-j", job_id, "-o", "%r"
        ).stdout or cluster.job_processes(job_id):
            assert time.monotonic() < deadline, "the job was not requeued"
            time.sleep(0.2)
        cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    job = sbatch(cluster, tmp_path, *train_long(long_frame, output),
                 options=("--open-mode=append",), during=stop_after_epoch_1)  # fmt: skip
    assert stopped and job.returncode == 0, f"{job.output}\n{cluster.log()}"
    # sbatch --wait may return as the job requeues itself: its second run ends later.
    deadline = time.monotonic() + JOB_SECONDS
    while cluster.run("squeue", "-h", "-j", stopped[0], "-o", "%T").stdout.strip() not in (
        "COMPLETED",
        "",
    ):
        assert time.monotonic() < deadline, "the requeued job did not end"
        time.sleep(0.2)
    printed = (tmp_path / f"job-{stopped[0]}.out").read_text()
    first, _, second = printed.partition("hvd-cpu: rank 0: stopped by SIGTERM after step ")
    assert "Epoch 1:" in first and "Epoch 4:" in second, printed
    if stop.startswith("scancel"):
        assert "hvd-cpu: the job requeues itself to go on from its checkpoint" in second
    assert "Traceback" not in printed, printed
    assert [r["param_sha256"] for r in json.loads((output / "ranks.json").read_text())] == (
        never_stopped
    )
    assert_nothing_left(cluster, job, output)


@pytest.mark.beside
def test_the_script_outside_slurm_says_how_to_submit() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(
        [shutil.which("bash") or "bash", str(SCRIPT), "--epochs", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith("hvd-cpu: error: ") and "sbatch" in done.stderr
    assert len(done.stderr.splitlines()) == 1
