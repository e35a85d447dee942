"""Preemption and retries (docs/usage.md, "Preemption and retries"): a SIGTERM stops every rank
after one agreed step, rank 0 saves that exact point and the job exits 75; the same command,
with --auto-resume, run again after a SIGTERM to every process, to the launcher alone, or after
the launcher was killed (a Job's retry), ends with the parameters of a run never stopped, bit
for bit (the Gloo job's allreduce through shared memory sums in rank order, so the
uninterrupted run is bit-exact run to run)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from horovod.runner.common.util import safe_shell_exec

from hvd_cpu.output.model_files import CHECKPOINT, load

from .jobs import (
    LiveJob,
    assert_same_history,
    demo_file,
    horovodrun_command,
    processes_naming,
    ranks,
    run,
)

# Beside another test: the 30 s they allow a stop is Kubernetes' grace, far beyond the
# second or two it takes.
pytestmark = [pytest.mark.slow, pytest.mark.beside]

EPOCHS = 4
# Some 0.6 s an epoch on 2 ranks of a fast CPU (2026-12-06's AMD EPYC; 2.3 s on an older VM):
# the SIGTERM sent once epoch 1 is printed lands well inside the three left. At 60,000 rows the
# whole job took 0.5 s after that line there, and once ended before the signal arrived.
ROWS = 200_000
STOPS_WITHIN = 30  # Kubernetes' default grace between SIGTERM and SIGKILL
PREEMPTED = 75


@pytest.fixture(scope="module")
def frame(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_file(tmp_path_factory.mktemp("data") / "frame.parquet", rows=ROWS)


def command(frame: Path, output: Path) -> list[str]:
    """The one command of a job, for its first run and every retry."""
    return [*horovodrun_command(2), "train", "--data", str(frame), "--epochs", str(EPOCHS),
            "--output", str(output), "--auto-resume"]  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(frame: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output folder of the job never stopped."""
    output = tmp_path_factory.mktemp("uninterrupted") / "out"
    done = run(command(frame, output))
    assert done.returncode == 0, done.stdout + done.stderr
    return output


def digests(output: Path) -> list[str]:
    return [entry["param_sha256"] for entry in ranks(output)]


def job_tree(job: LiveJob) -> list[psutil.Process]:
    """horovodrun and every process under it (its middlemen, shells and ranks)."""
    launcher = psutil.Process(job.process.pid)
    return [launcher, *launcher.children(recursive=True)]


def everyone(job: LiveJob) -> None:
    """What Kubernetes does to a job whose pods all go: SIGTERM to each of its processes."""
    for process in job_tree(job):
        with contextlib.suppress(psutil.NoSuchProcess):  # (a short-lived helper gone since)
            process.send_signal(signal.SIGTERM)


def launcher_alone(job: LiveJob) -> None:
    """The launcher's pod (or SLURM's batch step) alone: horovodrun stops its ranks itself."""
    job.process.send_signal(signal.SIGTERM)


def ranks_alone(job: LiveJob) -> None:
    """The workers' pods: their PID 1 passes the kubelet's SIGTERM on to the ranks."""
    for process in job_tree(job):
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.name() == "hvd-cpu":
                process.send_signal(signal.SIGTERM)


# What horovodrun exits with: stopped by the signal itself (128 + SIGTERM), or rank 0's code.
LAUNCHER_CODES = {everyone: 143, launcher_alone: 143, ranks_alone: PREEMPTED}


@pytest.mark.parametrize("strike", LAUNCHER_CODES, ids=lambda s: s.__name__)
def test_a_sigterm_saves_the_step_it_stopped_at_and_the_retry_ends_as_if_never_stopped(
    strike: Callable[[LiveJob], None], frame: Path, tmp_path: Path, uninterrupted: Path
) -> None:
    output = tmp_path / "out"
    job = LiveJob(command(frame, output))
    job.wait_for(r"Epoch 1:", timeout=120)
    struck = time.monotonic()
    strike(job)
    assert job.finish(STOPS_WITHIN + 10) == LAUNCHER_CODES[strike], job.summary()
    assert time.monotonic() - struck < STOPS_WITHIN, job.summary()
    said = [line for line in job.output.splitlines() if "hvd-cpu:" in line]
    assert len(said) == 1, job.summary()
    assert "hvd-cpu: rank 0: stopped by SIGTERM after step " in said[0], said
    if strike is not everyone:  # (Horovod's middlemen that report it got the SIGTERM too)
        assert f"Process 0 exit with status code {PREEMPTED}." in job.output or (
            f"Exit code: {PREEMPTED}" in job.output
        ), job.summary()
    assert "Traceback" not in job.output, job.summary()
    assert processes_naming(output, grace=10) == []
    loop = load(output / CHECKPOINT, "checkpoint")["loop"]
    assert loop["epoch"] < EPOCHS and 0 < loop["epoch_rows"] < ROWS, loop  # the very step

    again = run(command(frame, output))
    assert again.returncode == 0, again.stdout + again.stderr
    assert digests(output) == digests(uninterrupted)
    assert_same_history(output, uninterrupted)  # the stopped epoch's loss and rows: all of it


def test_horovods_stop_of_a_worker_keeps_the_workers_exit_code() -> None:
    """The worker-exit-codes patch: horovodrun's stop of a worker reaped the worker's shell in
    a thread of its own, and the middleman's wait then read the shell's code as 0; the
    launcher-alone SIGTERM above lost rank 0's 75 in 4 of 24 runs on a loaded machine. The
    shell's child (the rank) ends on the SIGTERM, the shell with code 75."""
    shell = subprocess.Popen(["/bin/sh", "-c", "sleep 60; exit 75"])
    deadline = time.monotonic() + 10
    while not psutil.Process(shell.pid).children() and time.monotonic() < deadline:
        time.sleep(0.01)
    safe_shell_exec.terminate_executor_shell_and_children(shell.pid)
    assert shell.wait(10) == 75


def test_a_killed_launcher_run_again_goes_on_from_the_last_checkpoint(
    frame: Path, tmp_path: Path, uninterrupted: Path
) -> None:
    """kill -9 of horovodrun (a node lost under the launcher's pod): its ranks end with it,
    and the retry goes on from the last epoch saved."""
    output = tmp_path / "out"
    job = LiveJob(command(frame, output))
    job.wait_for(r"Epoch 1:", timeout=120)
    os.kill(job.process.pid, signal.SIGKILL)
    job.finish(30)
    assert processes_naming(output, grace=15) == []
    again = run(command(frame, output))
    assert again.returncode == 0, again.stdout + again.stderr
    resumed = [text for _, text in again.rank_lines(0) if text.startswith("Epoch")]
    assert resumed and not resumed[0].startswith("Epoch 1:"), again.stdout
    assert digests(output) == digests(uninterrupted)
    assert_same_history(output, uninterrupted)


def test_the_same_command_after_the_job_ended_changes_nothing(
    frame: Path, tmp_path: Path, uninterrupted: Path
) -> None:
    """A retry of a job that had finished (its pod lost after the end): it ends at once, with
    the same model."""
    output = tmp_path / "out"
    assert run(command(frame, output)).returncode == 0
    again = run(command(frame, output))
    assert again.returncode == 0, again.stdout + again.stderr
    assert not [text for _, text in again.rank_lines(0) if text.startswith("Epoch")]
    assert digests(output) == digests(uninterrupted)
