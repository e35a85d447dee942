"""Gloo through shared memory between the ranks of a host (our gloo-shared-memory patch), in
real jobs: Horovod's collectives and the direct allreduce give the exact rank-order sums,
with as many ranks as cores and with more; a /dev/shm without room is one note and TCP,
with the same parameters; killed ranks and concurrent jobs leave nothing behind and share
nothing. Across hosts (hierarchical) in tests/test_hosts.py; what it costs and saves in
benchmarks/."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from .jobs import BIN, REPO, horovodrun_command, needs_root, run, slow_except

SEGMENTS = Path("/dev/shm")
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}


def segments() -> list[str]:
    """hvd-cpu's shared-memory segments that still have a name (none should, once made)."""
    return sorted(p.name for p in SEGMENTS.glob("hvd-cpu-*"))


def ranks_of(output: Path) -> list[dict]:
    return json.loads((output / "ranks.json").read_text())


@pytest.mark.parametrize("np", [2, 3])  # 3: more ranks than this machine's 2 cores
def test_horovods_collectives_through_shared_memory_give_the_rank_order_sums(np: int) -> None:
    script = REPO / "tests" / "shared_memory_check.py"
    command = horovodrun_command(np, program=(str(BIN / "python"), str(script)))
    job = run(command, timeout=180, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    said = sorted(text for _, text in job.rank_lines() if text.startswith("shared memory ok"))
    assert said == [f"shared memory ok {rank} {np}" for rank in range(np)]


PEER_GONE = """
import os, time
import horovod.torch as hvd
import torch
hvd.init()
hvd.direct_allreduce_(torch.zeros(3))
if hvd.rank() == 1:
    os._exit(0)  # gone without a word (nor a failure for the launcher to end the job on)
time.sleep(2)  # Horovod's background loop meets the loss in its own cycle and shuts down
try:
    hvd.direct_allreduce_(torch.zeros(3))
except hvd.HorovodInternalError as lost:
    print("lost peer:", str(lost).split(".")[0], flush=True)
"""


def test_a_peer_gone_before_a_direct_allreduce_is_horovods_lost_peer_error() -> None:
    """Once Horovod's background loop has shut down over a lost peer, the direct allreduce
    raises HorovodInternalError (PeerLost to hvd-cpu), as Horovod's own collectives do, and not
    a ValueError that would end the rank with a traceback (seen with --elastic and across
    hosts in CI)."""
    command = horovodrun_command(2, program=(str(BIN / "python"), "-c", PEER_GONE))
    job = run(command, timeout=120)
    said = [text for rank, text in job.rank_lines() if rank == 0 and "lost peer" in text]
    assert said == ["lost peer: Horovod has been shut down"], job.stdout + job.stderr


def training(data: Path, output: Path, epochs: int = 2) -> list[str]:
    """The command line of a 2-rank Gloo job."""
    train = ["train", "--data", str(data), "--epochs", str(epochs), "--output", str(output)]
    return [*horovodrun_command(2), *train]


def train(demo_parquet: Path, output: Path, **env: str) -> list[str]:
    """A 2-rank Gloo job's lines, checked to have worked."""
    job = run(training(demo_parquet, output), env=env)
    assert job.returncode == 0, job.stdout + job.stderr
    return job.stdout.splitlines() + job.stderr.splitlines()


@needs_root
def test_a_dev_shm_without_room_is_one_note_and_tcp_with_the_same_parameters(
    demo_parquet: Path, tmp_path: Path
) -> None:
    """As in a container started without --shm-size, only smaller: a 1 MB /dev/shm of its own
    (a mount namespace). Two ranks sum a + b in either order alike: the same parameters."""
    lines = train(demo_parquet, tmp_path / "shm")
    assert not any("note: Gloo runs over TCP" in line for line in lines)
    assert {r["transport"] for r in ranks_of(tmp_path / "shm")} == {"shared memory"}

    small = tmp_path / "small"
    command = shlex.join(training(demo_parquet, small))
    mounted = f"mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {command}"
    job = run(["unshare", "--mount", "sh", "-c", mounted])
    assert job.returncode == 0, job.stdout + job.stderr
    why = "TCP (/dev/shm has no room for 4 MB (a container's is 64 MB unless run with --shm-size))"
    notes = [(rank, text) for rank, text in job.rank_lines() if "note: Gloo" in text]
    assert notes == [(0, f"hvd-cpu: note: Gloo runs over {why} between ranks of a host, slower")]
    assert f"controller               Gloo over {why}; gradients averaged by" in job.stdout
    assert {r["transport"] for r in ranks_of(small)} == {why}
    digests = {r["param_sha256"] for r in ranks_of(small) + ranks_of(tmp_path / "shm")}
    assert len(digests) == 1


def test_turned_off_it_is_tcp_without_a_note(demo_parquet: Path, tmp_path: Path) -> None:
    lines = train(demo_parquet, tmp_path / "tcp", HOROVOD_GLOO_SHARED_MEMORY="0")
    assert not any("note:" in line for line in lines)
    why = "TCP (turned off by HOROVOD_GLOO_SHARED_MEMORY=0)"
    assert {r["transport"] for r in ranks_of(tmp_path / "tcp")} == {why}
    assert any(f"Gloo over {why}; gradients averaged by hvd.Distri" in line for line in lines)


@pytest.mark.parametrize("who", slow_except(["every rank", "one rank"], ["every rank"]))
def test_killed_ranks_leave_no_segment_behind(who: str, frame_20k: Path, tmp_path: Path) -> None:
    """kill -9, which no clean-up code sees: the segment's name is gone as soon as every rank
    has mapped it, and its memory with the last process that maps it."""
    before = segments()
    launcher = subprocess.Popen(
        training(frame_20k, tmp_path, epochs=1000),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = [
            p for p in psutil.Process(launcher.pid).children(recursive=True)
            if "train" in p.cmdline() and "horovodrun" not in " ".join(p.cmdline())
        ]  # fmt: skip
        assert len(ranks) >= 2, [p.cmdline() for p in ranks]
        for rank in ranks if who == "every rank" else ranks[-1:]:
            rank.send_signal(signal.SIGKILL)
        launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    assert segments() == before


@pytest.mark.slow
def test_two_jobs_at_once_train_as_each_alone(demo_parquet: Path, tmp_path: Path) -> None:
    """Each job's ranks make their own segment: two jobs on one host never share one."""
    names = ("alone", "first", "second")
    train(demo_parquet, tmp_path / names[0])
    jobs = [
        subprocess.Popen(
            training(demo_parquet, tmp_path / name),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV,
        )
        for name in names[1:]
    ]  # fmt: skip
    for job in jobs:
        assert job.wait(timeout=300) == 0, job.stderr.read() if job.stderr else ""
    digests = {r["param_sha256"] for name in names for r in ranks_of(tmp_path / name)}
    assert len(digests) == 1


def test_this_build_has_the_direct_allreduce_and_says_why_it_is_off() -> None:
    """A plain process is a job of one: nothing to share, and the direct allreduce says so."""
    code = (
        "import torch, horovod.torch as hvd\n"
        "hvd.init()\n"
        "print(hvd.gloo_shared_memory())\n"
        "try:\n"
        "    hvd.direct_allreduce_(torch.ones(3))\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )
    gloo = {"HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo"}
    job = run([str(BIN / "python"), "-c", code], env=gloo)
    assert job.returncode == 0, job.stderr
    assert job.stdout.splitlines() == ["one rank", "direct_allreduce_: one rank"]


def test_distributed_optimizer_averages_in_one_allreduce_as_its_hooks_did() -> None:
    """The optimizer-one-allreduce patch: hvd.DistributedOptimizer on CPU, where Gloo's ranks
    share memory, averages every gradient in one allreduce at synchronize(); over TCP its
    hooks hand each gradient to Horovod's cycle as before. Both end with the same parameters
    (two ranks sum a + b alike), an unused parameter's gradient counted as zeros in both."""
    code = (
        "import hashlib, torch, horovod.torch as hvd\n"
        "hvd.init(); torch.manual_seed(0)\n"
        "layers = {'used': torch.nn.Linear(5, 3), 'unused': torch.nn.Linear(2, 2)}\n"
        "net = torch.nn.ModuleDict(layers)\n"
        "inner = torch.optim.Adam(net.parameters(), lr=0.01)\n"
        "opt = hvd.DistributedOptimizer(inner, named_parameters=net.named_parameters())\n"
        "hvd.broadcast_parameters(net.state_dict(), root_rank=0)\n"
        "g = torch.Generator().manual_seed(hvd.rank())\n"
        "for _ in range(20):\n"
        "    opt.zero_grad()\n"
        "    net['used'](torch.randn(8, 5, generator=g)).square().mean().backward()\n"
        "    opt.step()\n"
        "flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])\n"
        "way = 'one' if opt._one_allreduce else 'hooks'\n"
        "print(way, hashlib.sha256(flat.numpy().tobytes()).hexdigest())\n"
    )
    said = {}
    for shared_memory in ("1", "0"):
        command = horovodrun_command(2, program=(str(BIN / "python"), "-c", code))
        job = run(command, env={"HOROVOD_GLOO_SHARED_MEMORY": shared_memory})
        assert job.returncode == 0, job.stdout + job.stderr
        said[shared_memory] = {text for _, text in job.rank_lines() if text.strip()}
    (one,), (hooks,) = said["1"], said["0"]
    assert one.split()[0] == "one" and hooks.split()[0] == "hooks"
    assert one.split()[1] == hooks.split()[1]
