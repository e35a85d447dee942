"""The shared-memory engine at its edges (our Horovod build's shared-memory-agreement,
-liveness and -no-leftovers patches): ranks that call different collectives fail at once
with a line naming both, never a wrong sum; a live rank however slow is waited for, a dead
one fails the others within milliseconds; no segment outlives a job, however it ends. Real
Gloo jobs of 2 and 4 ranks, real SIGKILLs."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from .hosts import SSH_PORT, Hosts, assert_ranks_numbered_by_host, needs_namespaces
from .jobs import REPO, LiveJob, horovodrun, horovodrun_command, processes_naming, run

STRESS = str(REPO / "tests" / "shared_memory_stress.py")


def segments() -> set[str]:
    """This machine's shared-memory segments of hvd-cpu's build."""
    return {p.name for p in Path("/dev/shm").glob("hvd-cpu-*")}


def gloo(np: int, script: str, *args: str, timeout: float = 300, env: dict | None = None):
    return run([*horovodrun_command(np, program=(sys.executable,)), script, *args],
               timeout=timeout, env=env)  # fmt: skip


def rank_lines(output: str, rank: int) -> list[str]:
    return [line.split(":", 1)[1] for line in output.splitlines() if line.startswith(f"[{rank}]")]


@pytest.mark.slow
@pytest.mark.parametrize("np", [2, 4])  # 4: more ranks than this machine's 2 cores
def test_a_random_loop_of_collectives_gives_the_rank_order_results_bit_for_bit(
    np: int,
) -> None:
    before = segments()
    job = gloo(np, STRESS, str(1000 + np), "15")
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    done = [line for line in job.stdout.splitlines() if "stress ok" in line]
    assert len(done) == np and all(int(line.split()[-1]) > 50 for line in done), done
    assert segments() <= before


# The engine's 20 ms check, with room for 3 ranks sharing 2 busy cores.
WAITING_LEARNS = 0.25


@pytest.mark.slow
def test_a_rank_killed_mid_loop_fails_every_other_at_once_and_leaves_no_segment() -> None:
    """Each survivor learns of the loss within WAITING_LEARNS of waiting for the dead rank
    (from the kill, or from entering the collective if it was busy with its own work until
    then: it cannot know sooner); the engine checks every 20 ms, Gloo's timeout is 30 s."""
    before = segments()
    job = LiveJob([*horovodrun_command(4, program=(sys.executable,)), STRESS, "7", "600"])
    ranks = wait_for_ranks(STRESS, 4)
    deadline = time.monotonic() + 120
    while job.output.count("<stdout>:looping") < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1)  # well into the loop
    victim = random.choice([p for p in ranks if _rank_of(p) != 0])
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    job.finish(120)
    lost = [line.split() for line in job.output.splitlines() if "<stdout>:lost " in line]
    assert len(lost) == 3, job.summary()
    late = [float(learnt) - max(killed_at, float(entered)) for *_, learnt, entered in lost]
    assert max(late) < WAITING_LEARNS, late
    assert segments() <= before


def wait_for_ranks(marker: str, count: int) -> list[int]:
    """The pids of the `count` rank processes whose command names `marker`, once all run."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ranks = [p for p in processes_naming(marker) if _is_rank(p)]
        if len(ranks) == count:
            return ranks
        time.sleep(0.005)
    pytest.fail(f"{count} ranks of {marker} did not start")


def _rank_of(pid: int) -> int:
    return int(psutil.Process(pid).environ().get("HOROVOD_RANK", -1))


def _is_rank(pid: int) -> bool:
    try:
        return "python" in psutil.Process(pid).name() and _rank_of(pid) >= 0
    except psutil.Error:
        return False


MISMATCHED = """
import sys, torch, horovod.torch as hvd
counts = [int(n) for n in sys.argv[1].split(",")]
dtypes = [getattr(torch, d) for d in sys.argv[2].split(",")]
hvd.init()
rank = hvd.rank()
try:
    hvd.direct_allreduce_(torch.ones(counts[rank], dtype=dtypes[rank]))
    print("no error", flush=True)
except hvd.HorovodInternalError as error:
    print("refused:", error, flush=True)
"""


@pytest.mark.parametrize(
    ("counts", "dtypes", "said"),
    [
        ("4095,4096", "float32,float32", "an allreduce of 4095 float32 (sum)"),
        ("262144,262145", "float32,float32", "an allreduce of 262144 float32 (sum)"),
        ("705,705", "float32,float64", "an allreduce of 705 float64 (sum)"),
    ],
    ids=["4095 against 4096", "262144 against 262145", "float32 against float64"],
)
def test_ranks_calling_different_collectives_fail_with_a_line_naming_both(
    counts: str, dtypes: str, said: str, tmp_path: Path
) -> None:
    """Unpatched, 4095 floats against 4096 summed to 3.0 on both ranks, and 262144 against
    262145 to 1.0 and 2.0 in one tensor: no error anywhere, and every later collective paired
    with the wrong one."""
    script = tmp_path / "mismatched.py"
    script.write_text(MISMATCHED)
    job = gloo(2, str(script), counts, dtypes, timeout=120)
    for rank in (0, 1):
        lines = [line for line in rank_lines(job.stdout, rank) if "refused" in line]
        assert len(lines) == 1, job.stdout + job.stderr
        assert "local ranks " in lines[0] and "called different collectives" in lines[0]
        assert said in lines[0], lines[0]
    assert "no error" not in job.stdout


SLOW_PEER = """
import sys, time, torch, horovod.torch as hvd
hvd.init()
for call in range(2):
    if hvd.rank() == 1 and call == 1:
        time.sleep(float(sys.argv[1]))  # a long evaluation, a checkpoint on a slow disk
    total = hvd.direct_allreduce_(torch.ones(3))
print("sum", total.tolist(), flush=True)
"""


@pytest.mark.slow
@pytest.mark.beside  # asleep, timing nothing; makes segments but counts none
def test_a_live_rank_is_waited_for_however_long_it_takes(tmp_path: Path) -> None:
    """A user's own script (no hvd-cpu watchdog) whose rank 1 spends twice Gloo's timeout
    between two allreduces: the engine failed it at the timeout ("rank 1 of this host did not
    answer for 30 s", past the default 30 s; the timeout is 5 s here, to be quick); a rank
    that is alive is now waited for."""
    script = tmp_path / "slow.py"
    script.write_text(SLOW_PEER)
    job = gloo(2, str(script), "10", timeout=120,
               env={**os.environ, "HOROVOD_GLOO_TIMEOUT_SECONDS": "5"})  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr
    assert job.stdout.count("sum [2.0, 2.0, 2.0]") == 2, job.stdout


# Horovod's start alone, without torch's import (2 s of each of 50 jobs): its C++ library,
# loaded as horovod.torch loads it.
INIT_ONLY = """
import os
import horovod
from horovod.common.basics import HorovodBasics
from horovod.common.process_sets import _setup as setup_process_sets

basics = HorovodBasics(os.path.join(os.path.dirname(horovod.__file__), "torch", "mpi_ops.py"),
                       "mpi_lib_v2")
setup_process_sets(basics)
basics.init()
print("joined", flush=True)
"""


@pytest.mark.slow
def test_ranks_killed_inside_hvd_init_leave_no_segment(tmp_path: Path) -> None:
    """50 jobs, one of whose two ranks is killed at a random moment of Horovod's start (from
    its first listening socket on): a segment its maker made but had not yet unlinked is
    unlinked by the maker when a peer is lost, or, when the maker itself was killed, by the
    next job's maker on this host. So once one job has started whole, none is left."""
    before = segments()
    draw = random.Random(50)
    script = tmp_path / "init_only.py"
    script.write_text(INIT_ONLY)
    for _ in range(50):
        job = LiveJob([*horovodrun_command(2, program=(sys.executable,)), str(script)])
        victim = draw.choice(wait_for_ranks(str(script), 2))
        deadline = time.monotonic() + 30
        while not listening(victim) and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(draw.uniform(0, 0.3))
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
        job.finish(60)
    whole = gloo(2, str(script), timeout=120)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert segments() <= before


def listening(pid: int) -> bool:
    try:
        return any(c.status == psutil.CONN_LISTEN for c in psutil.Process(pid).net_connections())
    except psutil.Error:
        return False


def test_a_segment_whose_maker_ended_is_swept_by_the_next_maker() -> None:
    """Left by a maker killed between making it and unlinking it: one of a pid that has
    ended, one of a pid given since to a process that started after the segment was made
    (this test's own), are removed by the next job's maker; one of a live maker stays."""
    ended = _ended_pid()
    names = {
        "ended": f"hvd-cpu-{ended}-{os.urandom(8).hex()}",
        "reused": f"hvd-cpu-{os.getpid()}-{os.urandom(8).hex()}",
        "live": f"hvd-cpu-{psutil.Process().ppid()}-{os.urandom(8).hex()}",
    }
    for kind, name in names.items():
        path = Path("/dev/shm") / name
        path.write_bytes(b"")
        if kind == "reused":  # made before this process started
            made = psutil.Process().create_time() - 60
            os.utime(path, (made, made))
    try:
        job = gloo(2, "-c", INIT_ONLY, timeout=120)
        assert job.returncode == 0, job.stdout + job.stderr
        left = {kind for kind, name in names.items() if (Path("/dev/shm") / name).exists()}
        assert left == {"live"}
    finally:
        for name in names.values():
            (Path("/dev/shm") / name).unlink(missing_ok=True)


def _ended_pid() -> int:
    ended = subprocess.Popen(["true"])
    ended.wait()
    return ended.pid


LATE_MODEL = """
import os, time
from torch import nn

class Network(nn.Module):
    def __init__(self, input_size):
        super().__init__()
        self.linear = nn.Linear(input_size, 1)
        self.steps = 0

    def forward(self, data):
        self.steps += 1
        rank = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
        if self.training and self.steps == 3 and rank == "1":
            time.sleep({seconds})  # a long evaluation, a checkpoint on a slow disk
        return self.linear(data)
"""


def late_model(folder: Path, seconds: float) -> str:
    (folder / "late.py").write_text(LATE_MODEL.format(seconds=seconds))
    return f"{folder / 'late.py'}:Network"


@pytest.mark.slow
@pytest.mark.beside  # asleep for most of it, timing nothing
@pytest.mark.parametrize(
    ("controller", "env", "stall"),
    [("mpi", {}, "60"), ("gloo", {"HOROVOD_GLOO_SHARED_MEMORY": "0"}, "0")],
    ids=["mpi", "gloo over tcp, --stall-seconds 0"],
)
def test_a_rank_late_by_35_s_is_waited_for_within_the_stall_bound(
    controller: str, env: dict[str, str], stall: str, tmp_path: Path
) -> None:
    """Past Gloo's 30 s default: the job is the job's to end (--stall-seconds, 60 by
    default; 0 waits for ever, which over TCP ended after Gloo's own 30 s), not the
    transport's. (Through shared memory: test_a_live_rank_is_waited_for_however_long_it_takes,
    without even hvd-cpu's watchdog.)"""
    job = horovodrun(2, "train", "--epochs", "1", "--model", late_model(tmp_path, 35),
                     "--stall-seconds", stall, "--output", str(tmp_path / "out"),
                     controller=controller, env=env, timeout=240)  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr


@needs_namespaces
@pytest.mark.slow
def test_across_two_hosts_a_rank_late_by_35_s_is_waited_for(tmp_path: Path) -> None:
    """The hierarchical path: the late rank's host-mates wait in shared memory, the other
    host's over Gloo's TCP, whose timeout hvd-cpu puts beyond --stall-seconds."""
    (tmp_path / "hosts").mkdir()
    with Hosts(tmp_path / "hosts", ["hvdlatea", "hvdlateb"]) as hosts:
        launcher = ("--hostfile", str(hosts.hostfile(2)), "-p", str(SSH_PORT), "-i",
                    str(hosts.key))  # fmt: skip
        output = hosts.local / "out"
        job = horovodrun(4, "train", "--epochs", "1", "--model", late_model(tmp_path, 35),
                         "--output", str(output), launcher=launcher, timeout=240)  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr
    written = hosts.hosts[0].path(output)  # on rank 0's host's disk, kept after the hosts
    report = json.loads((written / "ranks.json").read_text())
    assert_ranks_numbered_by_host(report, ["hvdlatea", "hvdlateb"], 2)
    assert {r["transport"] for r in report} == {"shared memory"}


@pytest.mark.slow
def test_with_a_stall_bound_of_4_s_the_late_rank_ends_the_job_named(tmp_path: Path) -> None:
    job = horovodrun(2, "train", "--epochs", "1", "--model", late_model(tmp_path, 35),
                     "--stall-seconds", "4", "--output", str(tmp_path / "out"),
                     timeout=240)  # fmt: skip
    assert job.returncode == 1, job.stdout + job.stderr
    named = [
        line for line in (job.stdout + job.stderr).splitlines() if "--stall-seconds 4)" in line
    ]
    assert len(named) == 1 and "rank 1 on" in named[0], job.stdout + job.stderr


ORDERED = """
import sys, torch, horovod.torch as hvd
hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
if sys.argv[1] == "other-model" and hvd.rank() == 1:
    model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Linear(2, 1))
params = list(model.parameters())
if sys.argv[1] == "reversed" and hvd.rank() == 1:
    params = params[::-1]  # the same parameters, listed in another order
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1),
                                     named_parameters=model.named_parameters())
torch.manual_seed(hvd.rank())
model(torch.randn(8, 4)).pow(2).mean().backward()
try:
    optimizer.step()
except ValueError as error:
    print("refused:", error, flush=True)
    sys.exit(0)
print("params", [round(x, 6) for p in model.parameters() for x in p.flatten().tolist()], flush=True)
"""


@pytest.mark.parametrize("case", ["reversed", "other-model"])
def test_the_one_allreduce_optimizer_lays_gradients_out_by_name_and_checks_the_layout(
    case: str, tmp_path: Path
) -> None:
    """hvd.DistributedOptimizer's one buffer was laid out in each rank's param_groups order:
    ranks that listed the same parameters in another order summed unrelated gradients."""
    script = tmp_path / "ordered.py"
    script.write_text(ORDERED)
    job = gloo(2, str(script), case, timeout=120)
    assert job.returncode == 0, job.stdout + job.stderr
    if case == "other-model":
        refused = [line for line in job.stdout.splitlines() if "refused:" in line]
        assert len(refused) == 2 and "the ranks' models differ" in refused[0], job.stdout
        return
    same = gloo(2, str(script), "same", timeout=120)
    params = [sorted(rank_lines(run.stdout, r)) for run in (job, same) for r in (0, 1)]
    assert params[0] == params[1] == params[2] == params[3], params
