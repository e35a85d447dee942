"""One rank fails, the job ends: the user's code failing on one rank (forward, loss,
backward, validation, rank 0's checkpoint, a bad row of its shard, sys.exit, a MemoryError)
or stuck there for ever, under every launcher (horovodrun --gloo, horovodrun --mpi with either
--allreduce, mpirun, srun, fit(), --elastic), at 2 and 4 ranks. Each job ends within 15 s of
the failure (of --stall-seconds, stuck) with exit code 1, the failing rank's traceback once and
one hvd-cpu line naming it, its host and its exception (stuck: the rank that waited names it),
no process left; then the same command with --resume trains to the end (docs/hosts.md, "When
a rank fails"). The failing code is tests/failing_code.py's."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hvd_cpu.output.model_files import CHECKPOINT, load
from hvd_cpu.runtime.watchdog import Progress

from . import failing_code
from .jobs import (
    BIN,
    REPO,
    SLOW,
    LiveJob,
    Run,
    demo_file,
    horovodrun_command,
    metrics,
    mpirun_command,
    processes_naming,
    run,
)
from .slurm import SlurmCluster, missing_tools

BOUND = 15  # seconds from the failure to the job's end
STALL = 4  # --stall-seconds for the stuck main thread
STEP = 20  # the failing step: in epoch 2 or 3, after the first checkpoint
EPOCHS = 6
HOST = socket.gethostname()
TRACEBACK = "Traceback (most recent call last):"
# What the failing rank's line says of each kind's exception.
SAYS = {
    "exit": "its code called sys.exit(3)",
    "memory": "MemoryError: cannot allocate the activations",
    "data": "ValueError: row out of range in this rank's shard",
}


@dataclass(frozen=True)
class Case:
    launcher: str  # gloo, mpi, mpi-horovod, mpirun, srun, fit, elastic
    kind: str  # failing_code.KINDS
    rank: int
    np: int = 2

    @property
    def id(self) -> str:
        return f"{self.launcher}-{self.kind}-rank{self.rank}-np{self.np}"


# Every launcher with failures of several kinds on rank 0 and on another, stuck once at least,
# at 2 and 4 ranks; every kind under three launchers or more.
CASES = [
    Case("gloo", "forward", 1),
    Case("gloo", "loss", 0, np=4),
    Case("gloo", "checkpoint", 0),
    Case("gloo", "exit", 3, np=4),
    Case("gloo", "stuck", 1),
    Case("mpi", "forward", 1),  # the issue's own: MPI, --allreduce auto (direct)
    Case("mpi", "backward", 0, np=4),
    Case("mpi", "data", 1),
    Case("mpi", "memory", 1),
    Case("mpi", "validation", 1, np=4),
    Case("mpi", "stuck", 2, np=4),
    Case("mpi-horovod", "backward", 1),
    Case("mpi-horovod", "loss", 1, np=4),
    Case("mpi-horovod", "exit", 0),
    Case("mpi-horovod", "stuck", 0),
    Case("mpirun", "forward", 0),
    Case("mpirun", "checkpoint", 0, np=4),
    Case("mpirun", "memory", 0, np=4),
    Case("mpirun", "data", 3, np=4),
    Case("mpirun", "stuck", 1),
    Case("srun", "forward", 1),
    Case("srun", "checkpoint", 0),
    Case("srun", "stuck", 1),
    Case("fit", "forward", 1),
    Case("fit", "validation", 0, np=4),
    Case("fit", "exit", 1),
    Case("fit", "stuck", 1),
    Case("elastic", "forward", 1),
    Case("elastic", "stuck", 1),
]
needs_slurm = pytest.mark.skipif(
    os.geteuid() != 0 or bool(missing_tools()),
    reason="the test SLURM cluster needs root, SLURM and munge (launch/install.sh --test)",
)


@pytest.fixture(scope="module")
def frame(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_file(tmp_path_factory.mktemp("data") / "frame.parquet", rows=2000)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@dataclass
class Ended:
    returncode: int
    printed: str
    at: float  # time.time() when the launcher returned
    raised: str = ""  # fit(): what the caller got
    went_on: float = 0.0  # --elastic: when the others went on without the failed rank


class Launch:
    """`hvd-cpu train` of the failing code as `case` launches it, waited for; called again
    with "--resume" once `step` is failing_code.NEVER, the same command with the code fixed."""

    def __init__(self, case: Case, frame: Path, folder: Path, request: pytest.FixtureRequest):
        self.case, self.frame, self.folder = case, frame, folder
        self.output = folder / "out"
        self.step = STEP  # failing_code.NEVER: the code fixed, for --resume
        self.slurm = request.getfixturevalue("slurm") if case.launcher == "srun" else None

    def train_args(self, *extra: str) -> list[str]:
        epochs = "40" if self.case.launcher == "elastic" else str(EPOCHS)
        stall = ("--stall-seconds", str(STALL))
        return ["--data", str(self.frame), "--epochs", epochs, "--output", str(self.output),
                *stall, *self.code, *extra]  # fmt: skip

    def __call__(self, *extra: str) -> Ended:
        case, args = self.case, self.train_args(*extra)
        if case.launcher == "fit":
            return self._fit(*extra)
        if case.launcher == "srun":
            return self._srun(args)
        if case.launcher == "elastic":
            return self._elastic(args)
        if case.launcher == "mpirun":
            command = [*mpirun_command(case.np), str(BIN / "hvd-cpu"), "train", *args]
        else:
            controller = "gloo" if case.launcher == "gloo" else "mpi"
            command = [*horovodrun_command(case.np, controller), "train", *args]
            if case.launcher == "mpi-horovod":
                command += ["--allreduce", "horovod"]
        return self._run(command)

    @property
    def code(self) -> tuple[str, ...]:
        """--model and --loss of the failing code (written again: disarmed, once `step` is)."""
        pace = 0.02 if self.case.launcher == "elastic" else 0.0  # outlasts a host's return
        return failing_code.write(self.folder, self.case.kind, self.case.rank, self.step, pace)

    def _run(self, command: list[str]) -> Ended:
        done = run(command, timeout=180)
        return Ended(done.returncode, done.stdout + done.stderr, time.time())

    def _elastic(self, args: list[str]) -> Ended:
        """launch/elastic.sh, its lines timed (`went_on`: when the others went on without
        the failed rank, by the wall clock)."""
        command = [str(REPO / "launch" / "elastic.sh"), *args, "--max-restarts", "1"]
        env = {"HVD_CPU_VENV": str(BIN.parent), "NP": str(self.case.np), "COOLDOWN": "1 1"}
        job, clock = LiveJob(command, env), time.time() - time.monotonic()
        returncode = job.finish(180)
        going_on = [at for at, line in job.lines if re.search(r"\d+ -> \d+ ranks; going on", line)]
        went_on = clock + going_on[0] if going_on else float("inf")
        return Ended(returncode, job.output, time.time(), went_on=went_on)

    def _srun(self, args: list[str]) -> Ended:
        log = self.folder / f"job-{time.monotonic_ns()}.out"
        command = ["sbatch", "--wait", f"--output={log}", "--time=5",
                   str(REPO / "launch" / "slurm.sbatch"), *args]  # fmt: skip
        env = {**self.slurm.env, "HVD_CPU_VENV": str(BIN.parent)}
        done = subprocess.run(command, cwd=self.folder, env=env, capture_output=True,
                              text=True, timeout=180, check=False)  # fmt: skip
        printed = log.read_text() if log.exists() else done.stderr
        return Ended(done.returncode, printed, time.time())

    def _fit(self, *extra: str) -> Ended:
        """fit() in a script of the user's: what it raised, and its type's name."""
        model, loss = self.code[1], self.code[3]
        resume = "--resume" in extra
        script = self.folder / "fit_script.py"
        script.write_text(FIT_SCRIPT.format(
            frame=str(self.frame), np=self.case.np, model=model, loss=loss, epochs=EPOCHS,
            output=str(self.output), stall=STALL, resume=resume,
        ))  # fmt: skip
        done = run([str(BIN / "python"), str(script)], timeout=180)
        raised = "\n".join(re.findall(r"^raised: .*$", done.stdout, re.M))
        return Ended(done.returncode, done.stdout + done.stderr, time.time(), raised)


FIT_SCRIPT = """
import pandas as pd

import hvd_cpu

frame = pd.read_parquet({frame!r})
try:
    hvd_cpu.fit(frame, np={np}, model={model!r}, loss={loss!r}, epochs={epochs},
                output={output!r}, stall_seconds={stall}, resume={resume})
except Exception as exc:
    print(f"raised: {{type(exc).__name__}}: {{exc}}", flush=True)
    print(f"raised: cause {{type(exc.__cause__).__name__}}", flush=True)
    print(f"raised: cause says {{str(exc.__cause__).strip().splitlines()[-1]}}", flush=True)
else:
    print("raised: nothing", flush=True)
"""


# In the main suite: the issue's own case (it hung until killed from outside).
MAIN = {"mpi-forward-rank1-np2"}


def marks(case: Case) -> list[pytest.MarkDecorator]:
    """Beside another test, as the main suite's case runs (BOUND is several times what a job
    takes to end), under horovodrun and mpirun; not srun's (a task launch failed once so),
    --elastic's (its going on within BOUND leaves less room) nor fit()'s (a test of fit() or
    of notebooks takes any driver and rank left on the machine for its own)."""
    beside = case.launcher in ("gloo", "mpi", "mpi-horovod", "mpirun")
    return [
        *([] if case.id in MAIN else [SLOW]),
        *([pytest.mark.beside] if beside else []),
        *([needs_slurm] if case.launcher == "srun" else []),
    ]


@pytest.mark.parametrize("case", [pytest.param(c, marks=marks(c), id=c.id) for c in CASES])
def test_a_rank_that_fails_ends_the_job_at_once_and_it_resumes(
    case: Case, frame: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    launch = Launch(case, frame, tmp_path, request)
    ended = launch()
    failed_at = float((tmp_path / "failed_at").read_text())
    took = ended.at - failed_at
    printed = ended.printed
    print(f"{case.id}: ended {took:.1f} s after the failure")
    assert processes_naming(launch.output, grace=10) == [], f"a process outlived the job\n{printed}"
    if case.launcher == "elastic":
        gave_up_after_the_second_failure(ended, ended.went_on - failed_at)
    elif case.kind == "stuck":
        named_as_stuck(case, ended, took)
    else:
        said_once_by_the_failing_rank(case, ended, took)
    resumes(launch)


def said_once_by_the_failing_rank(case: Case, ended: Ended, took: float) -> None:
    printed = ended.printed
    assert took < BOUND, printed
    assert printed.count(TRACEBACK) == 1, printed
    ours = [line for line in printed.splitlines() if "hvd-cpu:" in line]
    assert len(ours) == 1, printed
    what = SAYS.get(case.kind, f"RuntimeError: {case.kind} failed on rank {case.rank} at step")
    line = f"hvd-cpu: rank {case.rank} on {HOST} failed: {what}"
    assert line in ours[0], printed
    assert "; the job ends; " in ours[0] and "checkpoint.pt holds epoch" in ours[0], ours[0]
    tagged = Run(ended.returncode, printed, "", 0)
    if case.launcher != "srun":  # srun's output carries no rank tags
        where = {
            rank for rank, text in tagged.rank_lines() if TRACEBACK in text or "hvd-cpu:" in text
        }
        assert where == {case.rank}, printed
    if case.launcher == "fit":
        assert ended.returncode == 0, printed
        if case.kind == "exit":  # no Exception to raise in the caller: its line instead
            assert ended.raised.startswith(f"raised: RunFailed: rank {case.rank} on {HOST}")
        else:
            assert ended.raised.startswith(f"raised: RuntimeError: {case.kind} failed on rank")
        assert "raised: cause RankTraceback" in ended.raised, ended.raised
    else:
        assert ended.returncode == 1, printed


def named_as_stuck(case: Case, ended: Ended, took: float) -> None:
    printed = ended.printed
    assert STALL - 1 < took < STALL + BOUND, printed
    assert TRACEBACK not in printed, printed
    ours = [line for line in printed.splitlines() if "hvd-cpu:" in line]
    reporter = 1 if case.rank == 0 else 0
    named = f"hvd-cpu: rank {reporter}: rank {case.rank} on {HOST} (pid "
    assert len(ours) == 2 and all(named in line for line in ours), printed
    assert "has not moved on for" in ours[0] and "the job ends if it stays stuck" in ours[0]
    assert f"has not moved on for {STALL} s while the others wait for it" in ours[1], printed
    if case.launcher == "fit":
        assert ended.raised.startswith("raised: RunFailed: the job ended"), ended.raised
    else:
        assert ended.returncode == 1, printed


def gave_up_after_the_second_failure(ended: Ended, went_on: float) -> None:
    """--elastic, --max-restarts 1: the others go on after the first failure (within the
    bound), the rank started again fails the same way, and the job ends with one line."""
    printed = ended.printed
    # horovodrun's elastic driver exits with the first lost rank's code: 1 for an exception,
    # 137 for a stuck rank, killed
    assert ended.returncode in (1, 137), printed
    assert went_on < BOUND, printed
    ours = [line for line in printed.splitlines() if "hvd-cpu:" in line]
    assert any("2 -> 1 ranks; going on" in line for line in ours), printed
    assert any("1 -> 2 ranks" in line for line in ours), printed
    assert "error: gave up after losing ranks 2 time(s) (--max-restarts 1)" in ours[-1], printed
    assert "checkpoint.pt holds epoch" in ours[-1], printed


def resumes(launch: Launch) -> None:
    """The same command, its code fixed, with --resume: from the checkpoint to the end."""
    saved = load(launch.output / CHECKPOINT, "checkpoint")["loop"]["epoch"]
    assert saved >= 1
    launch.step = failing_code.NEVER
    ended = launch("--resume")
    if launch.case.launcher == "fit":
        assert ended.raised == "raised: nothing", ended.printed
    else:
        assert ended.returncode == 0, ended.printed
    epochs = [m["epoch"] for m in metrics(launch.output)]
    assert epochs == list(range(1, epochs[-1] + 1)) and epochs[-1] > saved


def test_a_rank_is_stuck_only_behind_the_others_outside_any_collective() -> None:
    """The heartbeats' view of progress: behind and inside no collective, a peer is stuck
    from when it was first seen so, until it moves on; inside one (MPI lets ranks leave a
    collective at different times) or level with the furthest, it is not."""
    progress = Progress()
    progress.heard(1, entered=5, inside=False)
    progress.heard(2, entered=6, inside=True)
    assert progress.stuck(10.0, mine=6) == {1: 0.0}
    assert progress.stuck(12.5, mine=6) == {1: 2.5}
    progress.heard(1, entered=5, inside=True)  # waits inside the collective it is behind in
    assert progress.stuck(13.0, mine=6) == {}
    progress.heard(1, entered=5, inside=False)
    assert progress.stuck(14.0, mine=6) == {1: 0.0}  # counted again from now
    progress.heard(1, entered=6, inside=False)  # moved on, level with the others
    assert progress.stuck(20.0, mine=6) == {}
    progress.heard(2, entered=6, inside=False)
    assert progress.stuck(21.0, mine=7) == {1: 0.0, 2: 0.0}  # this rank went ahead
    progress.forget(1)
    progress.restart()
    assert progress.stuck(22.0, mine=7) == {2: 0.0}


@SLOW
def test_a_rank_that_fails_in_predict_ends_the_job(frame: Path, tmp_path: Path) -> None:
    """`hvd-cpu predict` under MPI, the model raising on rank 1 only: rank 1's traceback and
    line, exit 1, no hang (Python's teardown would wait in MPI's finalize)."""
    output = tmp_path / "out"
    code = failing_code.write(tmp_path, "validation", 1, 0)
    held_back = tmp_path / failing_code.HELD_BACK
    held_back.touch()
    trained = run([*horovodrun_command(2, "mpi"), "train", "--data", str(frame), "--epochs", "1",
                   "--output", str(output), *code])  # fmt: skip
    assert trained.returncode == 0, trained.stdout + trained.stderr
    held_back.unlink()  # the model's file, unchanged, fails from now on
    predict = ["predict", "--model", str(output), "--data", str(frame),
               "--output", str(tmp_path / "p.csv")]  # fmt: skip
    predicted = run([*horovodrun_command(2, "mpi"), *predict], timeout=60)
    printed = predicted.stdout + predicted.stderr
    assert predicted.returncode == 1, printed
    assert printed.count(TRACEBACK) == 1, printed
    ours = [(rank, text) for rank, text in predicted.rank_lines() if "hvd-cpu:" in text]
    assert len(ours) == 1 and ours[0][0] == 1, printed
    assert ours[0][1].startswith(f"hvd-cpu: rank 1 on {HOST} failed: RuntimeError: validation ")
    assert ours[0][1].endswith("; the job ends; fix it, then run it again"), printed
    assert processes_naming(output, grace=10) == [], printed
