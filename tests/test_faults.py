"""Faults of a running `horovodrun --gloo` job: a rank killed, Ctrl-C, SIGTERM, a kill in the
middle of a checkpoint save; and a rank stopped (SIGSTOP) under each launcher. Each ends the
job within seconds with a non-zero exit, one line saying what happened, no traceback and no
process left behind (docs/hosts.md, "When a rank or a host dies"), and the checkpoint it
leaves continues with --resume (docs/usage.md, "Validation, early stopping, checkpoints")."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from hvd_cpu.output.lock import HOLDER
from hvd_cpu.output.model_files import CHECKPOINT, load

from .jobs import (
    BIN,
    LiveJob,
    Run,
    demo_file,
    horovodrun,
    horovodrun_command,
    metrics,
    mpirun_command,
    processes_naming,
    run,
    slow_model,
)

pytestmark = pytest.mark.slow

ENDS_WITHIN = 30  # seconds from the fault to horovodrun's exit
TORN = f".{CHECKPOINT}.*.tmp"  # atomic_write's temporary file: a save under way, or cut short
# Horovod's background thread logs its own view of a lost connection, on most runs, before
# hvd-cpu's line on the same rank.
HOROVOD_LOG = re.compile(r"\[.*\] \[\d+\]: Horovod background loop uncaught exception: ")


@pytest.fixture(scope="module")
def frame(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_file(tmp_path_factory.mktemp("data") / "frame.parquet", rows=2000)


def train_args(frame: Path, output: Path, epochs: int, *extra: str) -> list[str]:
    return ["train", "--data", str(frame), "--epochs", str(epochs), "--output", str(output),
            *extra]  # fmt: skip


def epochs_written(output: Path) -> int:
    metrics = output / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


@dataclass
class Job:
    """`horovodrun --gloo -np NP hvd-cpu train ... --epochs 1000` in the background (in a
    session of its own, as a terminal's foreground job would be), its output in a file."""

    np: int
    output: Path
    extra: tuple[str, ...]
    process: subprocess.Popen
    log: Path
    launcher: str

    def wait_for(self, ready: Callable[[Path], bool], what: str, poll: float = 0.05) -> None:
        """Until `ready(output folder)`, while the job runs."""
        deadline = time.monotonic() + 120
        while not ready(self.output):
            assert self.process.poll() is None, f"the job ended before {what}: {self.printed()}"
            assert time.monotonic() < deadline, f"no {what} within 120 s"
            time.sleep(poll)

    def rank(self, rank: int) -> psutil.Process:
        """The Python process of `rank` (not the shell horovodrun starts it through)."""
        for child in psutil.Process(self.process.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                python = "python" in Path(child.exe()).name
                environ = child.environ()
                launched = environ.get("HOROVOD_RANK", environ.get("OMPI_COMM_WORLD_RANK"))
                if python and launched == str(rank):
                    return child
        raise AssertionError(f"no process of rank {rank} under horovodrun")

    def printed(self) -> str:
        return self.log.read_text()


# The command lines a job is started with, up to hvd-cpu's arguments.
LAUNCHERS: dict[str, Callable[[int], list[str]]] = {
    "horovodrun --gloo": lambda np: horovodrun_command(np, "gloo"),
    "horovodrun --mpi": lambda np: horovodrun_command(np, "mpi"),
    "mpirun": lambda np: [*mpirun_command(np), str(BIN / "hvd-cpu")],
}


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    """Starts jobs; any process of theirs still running at the end of the test is killed."""
    jobs: list[Job] = []

    def launch(
        np: int, frame: Path, output: Path, *extra: str, launcher: str = "horovodrun --gloo"
    ) -> Job:
        log = tmp_path / f"{output.name}.log"
        command = [*LAUNCHERS[launcher](np), *train_args(frame, output, 1000, *extra)]
        env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
        with log.open("w") as handle:
            process = subprocess.Popen(
                command, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
            )
        jobs.append(Job(np, output, extra, process, log, launcher))
        return jobs[-1]

    yield launch
    for job in jobs:
        for pid in processes_naming(job.output):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        job.process.wait()


def lost(rank: int) -> str:
    return f"hvd-cpu: rank {rank}: lost another rank of the job ("


def ended_as_said(
    job: Job,
    fault_at: float,
    says: dict[int, str | tuple[str, ...]],
    killed: int | None = None,
    may_stay_quiet: frozenset[int] = frozenset(),
) -> None:
    """The job ends within ENDS_WITHIN s of the fault, non-zero, without a traceback; each
    rank in `says` prints one line starting with its text (or one of its texts), except those
    that `may_stay_quiet`; the shell of a `killed` rank says "Killed", and nothing else is
    printed but epoch lines and Horovod's own log of the lost connection; no process of the
    job is left."""
    try:
        job.process.wait(timeout=ENDS_WITHIN - (time.monotonic() - fault_at))
    except subprocess.TimeoutExpired:
        pytest.fail(f"horovodrun still runs {ENDS_WITHIN} s after the fault: {job.printed()}")
    printed = job.printed()
    assert job.process.returncode != 0, printed
    assert "Traceback" not in printed, printed
    lines = Run(job.process.returncode, printed, "", 0).rank_lines()
    said = [(rank, text) for rank, text in lines if text.startswith("hvd-cpu:")]
    ranks_said = [rank for rank, _ in said]
    assert len(ranks_said) == len(set(ranks_said)), printed  # one line each
    assert set(ranks_said) <= set(says) and set(says) - set(ranks_said) <= may_stay_quiet, printed
    assert all(text.startswith(says[rank]) for rank, text in said), said
    others = [
        (rank, text) for rank, text in lines
        if text.strip() and not text.startswith(("hvd-cpu:", "Epoch "))
        and not HOROVOD_LOG.match(text) and (rank, text) != (killed, "Killed")
    ]  # fmt: skip
    assert others == [], printed

    assert processes_naming(job.output, grace=10) == [], "a process of the job outlived it"


def resumes(job: Job, frame: Path) -> int:
    """The checkpoint left behind continues with --resume to the end; its epoch."""
    saved = load(job.output / CHECKPOINT, "checkpoint")["loop"]["epoch"]
    assert saved >= 1
    args = train_args(frame, job.output, saved + 2, *job.extra)
    resumed = run([*LAUNCHERS[job.launcher](job.np), *args, "--resume"])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    epochs = [text.split(":")[0] for _, text in resumed.rank_lines(0) if text.startswith("Epoch")]
    assert epochs == [f"Epoch {saved + 1}", f"Epoch {saved + 2}"]
    metrics = (job.output / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in metrics] == list(range(1, saved + 3))
    assert list(job.output.glob(TORN)) == []
    return saved


def kill_rank(rank: int) -> Callable[[Job], None]:
    return lambda job: job.rank(rank).kill()


def ctrl_c(job: Job) -> None:
    """What a terminal does: SIGINT to the foreground process group, horovodrun's."""
    os.killpg(job.process.pid, signal.SIGINT)


def sigterm(job: Job) -> None:
    job.process.terminate()


@dataclass(frozen=True)
class Fault:
    np: int
    strike: Callable[[Job], None]
    says: dict[int, str | tuple[str, ...]]  # rank: the start of the one line it prints
    killed: int | None = None  # the rank killed, if any
    may_stay_quiet: frozenset[int] = frozenset()
    code: int | None = None  # the job's exit code, where it is fixed (docs/usage.md's table)
    launcher: str = "horovodrun --gloo"


# horovodrun stops its ranks with SIGTERM on Ctrl-C as on SIGTERM.
STOPPED = {0: "hvd-cpu: rank 0: stopped by SIGTERM"}
FAULTS = {
    "kill -9 of rank 1 of 2": Fault(2, kill_rank(1), {0: lost(0)}, killed=1),
    # With 4 ranks horovodrun may stop the survivors (SIGTERM) before their collective fails:
    # rank 0 then says it was stopped, and the others, stopped quietly, may say nothing.
    "kill -9 of rank 2 of 4": Fault(
        4,
        kill_rank(2),
        {0: (lost(0), STOPPED[0]), 1: lost(1), 3: lost(3)},
        killed=2,
        may_stay_quiet=frozenset({1, 3}),
    ),
    "Ctrl-C": Fault(2, ctrl_c, STOPPED, code=130),
    "SIGTERM to horovodrun": Fault(2, sigterm, STOPPED, code=143),
    # horovodrun --mpi runs mpirun and exits as the signal says; plain mpirun exits 1.
    "Ctrl-C, horovodrun --mpi": Fault(2, ctrl_c, STOPPED, code=130, launcher="horovodrun --mpi"),
    "Ctrl-C, mpirun": Fault(2, ctrl_c, STOPPED, code=1, launcher="mpirun"),
}


@pytest.mark.parametrize("fault", FAULTS.values(), ids=FAULTS.keys())
def test_a_fault_mid_training_ends_the_job_in_one_line_and_it_resumes(
    fault: Fault, frame: Path, tmp_path: Path, start: Callable[..., Job]
) -> None:
    job = start(fault.np, frame, tmp_path / "run", launcher=fault.launcher)
    job.wait_for(lambda output: epochs_written(output) >= 2, "two epochs")
    fault_at = time.monotonic()
    fault.strike(job)
    ended_as_said(job, fault_at, fault.says, fault.killed, fault.may_stay_quiet)
    if fault.code is not None:
        assert job.process.returncode == fault.code, job.printed()
    resumes(job, frame)


def test_a_kill_during_a_checkpoint_save_leaves_the_previous_one_to_resume_from(
    frame: Path, tmp_path: Path, start: Callable[..., Job]
) -> None:
    """A 1024 x 1024 layer makes a checkpoint of 13 MB, some 30 ms to save: rank 0 is killed
    as soon as the save's temporary file appears. The kill may still come after the rename
    (then no temporary file is left): up to three jobs are tried for one that cuts it short."""
    for attempt in range(3):
        job = start(2, frame, tmp_path / f"attempt{attempt}", "--hidden", "1024,1024")
        job.wait_for(lambda output: (output / CHECKPOINT).exists(), "a first checkpoint")
        rank_0 = job.rank(0)
        job.wait_for(lambda output: any(output.glob(TORN)), "a second save", poll=0.0005)
        fault_at = time.monotonic()
        rank_0.kill()
        ended_as_said(job, fault_at, {1: lost(1)}, killed=0)
        if list(job.output.glob(TORN)):
            break
    else:
        pytest.fail("three kills all came after the save had finished")

    saved = load(job.output / CHECKPOINT, "checkpoint")["loop"]["epoch"]
    assert saved == epochs_written(job.output) - 1  # the epoch before the one being saved
    assert resumes(job, frame) == saved


def test_a_second_job_on_a_running_jobs_folder_is_refused_and_a_killed_one_blocks_nothing(
    tmp_path: Path,
) -> None:
    """One job writes a folder at a time: a second one (--overwrite or --resume) is one line
    naming the first while it lives; kill -9 of the first's rank 0 leaves nothing that stops
    the next job."""
    data = demo_file(tmp_path / "big.parquet", rows=200_000)
    output = tmp_path / "run"
    first = LiveJob([*horovodrun_command(2), "train", "--data", str(data), "--epochs", "50",
                     "--output", str(output)])  # fmt: skip
    first.wait_for(r"Epoch 1: Train Loss", timeout=120)
    holder = json.loads((output / HOLDER).read_text())
    assert holder["host"] == socket.gethostname() and psutil.pid_exists(holder["pid"])
    for flag in ("--overwrite", "--resume"):
        second = horovodrun(2, "train", "--data", str(data), "--epochs", "1", flag,
                            "--output", str(output), timeout=120)  # fmt: skip
        assert second.returncode == 2, second.stdout + second.stderr
        errors = [(r, text) for r, text in second.rank_lines() if "hvd-cpu: error:" in text]
        assert len(errors) == 1 and errors[0][0] == 0, second.stdout + second.stderr
        assert f"is being written by another job (pid {holder['pid']} on {holder['host']}, " \
            f"started {holder['started']})" in errors[0][1]  # fmt: skip
    assert first.process.poll() is None, "the first job trains on"
    os.kill(holder["pid"], signal.SIGKILL)  # rank 0: nothing of its own runs after this
    assert first.finish(timeout=ENDS_WITHIN) != 0
    assert (output / HOLDER).exists(), "a killed job's name stays, but not its lock"
    after = horovodrun(2, "train", "--data", str(data), "--epochs", "1", "--overwrite",
                       "--output", str(output), timeout=300)  # fmt: skip
    assert after.returncode == 0, after.stdout + after.stderr
    assert not (output / HOLDER).exists(), "a job that ended leaves no name behind"
    assert processes_naming(output, grace=5) == []


@dataclass(frozen=True)
class Stall:
    launcher: str
    np: int
    stopped: int  # the rank stopped
    reporter: int  # the rank that names it
    allreduce: str = "horovod"


STALL_SECONDS = 6
STALLS = {
    "gloo, rank 1 of 2": Stall("horovodrun --gloo", 2, stopped=1, reporter=0),
    "gloo, rank 0 of 4": Stall("horovodrun --gloo", 4, stopped=0, reporter=1),
    "mpi horovod, rank 1 of 2": Stall("horovodrun --mpi", 2, stopped=1, reporter=0),
    "mpi direct, rank 2 of 4": Stall("horovodrun --mpi", 4, 2, 0, "direct"),
    "mpirun direct, rank 0 of 2": Stall("mpirun", 2, 0, 1, "direct"),
}


@pytest.mark.parametrize("stall", STALLS.values(), ids=STALLS.keys())
def test_a_stopped_rank_ends_the_job_naming_it_within_the_bound(
    stall: Stall, frame: Path, tmp_path: Path, start: Callable[..., Job]
) -> None:
    """SIGSTOP: the process lives and keeps its connections open, but answers nothing. A live
    rank warns once, then names it in one line after --stall-seconds; the job exits 1, the
    launcher takes the stopped process too, and the checkpoint resumes."""
    extra = ("--stall-seconds", str(STALL_SECONDS), "--allreduce", stall.allreduce)
    job = start(stall.np, frame, tmp_path / "run", *extra, launcher=stall.launcher)
    job.wait_for(lambda output: epochs_written(output) >= 2, "two epochs")
    stopped = job.rank(stall.stopped)
    stopped.suspend()
    stopped_at = time.monotonic()
    try:
        job.process.wait(timeout=STALL_SECONDS + ENDS_WITHIN)
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"still running {STALL_SECONDS + ENDS_WITHIN} s after the stop: {job.printed()}"
        )
    # silence counts from the last heartbeat heard, up to one interval (0.6 s) before the stop
    assert time.monotonic() - stopped_at >= STALL_SECONDS - 0.6
    printed = job.printed()
    assert job.process.returncode == 1, printed
    assert "Traceback" not in printed, printed
    said = [
        (rank, text)
        for rank, text in Run(1, printed, "", 0).rank_lines()
        if text.startswith("hvd-cpu:")
    ]
    named = f"hvd-cpu: rank {stall.reporter}: rank {stall.stopped} on {socket.gethostname()} " \
        f"(pid {stopped.pid}) has not answered for "  # fmt: skip
    assert [rank for rank, _ in said] == [stall.reporter, stall.reporter], printed
    (_, warning), (_, ending) = said
    assert warning.startswith(named) and "the job ends if it stays silent for 6 s" in warning
    assert ending.startswith(f"{named}6 s (stopped by a signal or a debugger, ")
    assert "ending the job (--stall-seconds 6)" in ending
    assert processes_naming(job.output, grace=10) == [], "a process of the job outlived it"
    with contextlib.suppress(psutil.NoSuchProcess):  # gone, or dead and not yet reaped
        assert stopped.status() == psutil.STATUS_ZOMBIE
    resumes(job, frame)


def test_slow_steps_are_no_stall(frame: Path, tmp_path: Path) -> None:
    """The heartbeat beats beside the work: steps of Python far longer than a --stall-seconds
    of 2 end no job."""
    output = tmp_path / "slow"
    model = slow_model(tmp_path)
    job = horovodrun(2, *train_args(frame, output, 2, "--stall-seconds", "2",
                                    "--batch-size", "1000", "--model", model))  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr
    assert "has not answered" not in job.stdout + job.stderr
    # 2000 rows less the held-out, 1000 a batch: one step per epoch, slower than the bound
    assert min(record["seconds"] for record in metrics(output)) > 2
