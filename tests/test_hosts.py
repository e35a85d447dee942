"""Two real hosts (network namespaces, each with its own sshd, hostname, address, /dev/shm and
disk): the same job over a host file, `doctor`, and what happens when a host or a rank goes
away. Data goes on each host's disk (`Hosts.local`), and a run's files are read from rank 0's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from .hosts import SSH_PORT, Host, Hosts, assert_ranks_numbered_by_host, needs_namespaces
from .jobs import BIN, REPO, Run, demo_file, horovodrun, hvd_cpu, metrics, run

pytestmark = [needs_namespaces, pytest.mark.slow]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    with Hosts(tmp_path_factory.mktemp("hosts"), ["hvdhosta", "hvdhostb"]) as made:
        yield made


@pytest.fixture
def local(hosts: Hosts, tmp_path: Path) -> Path:
    """A folder of this test's own on the hosts' disks, for its data and outputs."""
    return hosts.local / tmp_path.name


def rank_0s(hosts: Hosts) -> Host:
    """Where a job's files are: the first host of the host file runs rank 0."""
    return hosts.hosts[0]


@pytest.fixture
def sshd_back(hosts: Hosts) -> Iterator[None]:
    """Whatever a test did to the hosts, the next one finds them whole."""
    yield
    for host in hosts.hosts:
        hosts.resolve(host, host.address)
        if not host.pid_file.exists():
            hosts.start_sshd(host)
            hosts.wait_for_ssh(host)


def over_hosts(hosts: Hosts, *args: str, timeout: float = 300):
    launcher = ("--hostfile", str(hosts.hostfile(2)), "-p", str(SSH_PORT), "-i", str(hosts.key))
    return horovodrun(4, *args, launcher=launcher, timeout=timeout)


def doctor(hosts: Hosts, *extra: str):
    return hvd_cpu(
        "doctor", "--hostfile", str(hosts.hostfile(2)), "-p", str(SSH_PORT), "-i", str(hosts.key),
        *extra,
    )  # fmt: skip


EPOCHS = ("--epochs", "3")


@pytest.fixture(scope="module")
def local_four(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference run: `horovodrun --gloo -np 4` on this host, once for every comparison."""
    output = tmp_path_factory.mktemp("local") / "out"
    local = horovodrun(4, "train", *EPOCHS, "--output", str(output))
    assert local.returncode == 0, local.stdout + local.stderr
    return output


def run_hosts(hosts: Hosts, output: Path, *args: str, **env: str) -> Run:
    """launch/run-hosts.sh over both hosts (2 slots each), as docs/hosts.md tells users to."""
    script = str(REPO / "launch" / "run-hosts.sh")
    keys = {"SSH_PORT": str(SSH_PORT), "SSH_KEY": str(hosts.key), "HVD_CPU_VENV": str(BIN.parent)}
    return run(
        [script, str(hosts.hostfile(2)), *EPOCHS, *args, "--output", str(output)],
        env={**keys, **env},
    )


def ranks_of(output: Path) -> list[dict]:
    return json.loads((output / "ranks.json").read_text())


def spread_over_both_hosts(hosts: Hosts, output: Path, controller: str) -> Path:
    """Ranks 0, 1 on the first host and 2, 3 on the second, numbered 0, 1 on each, all on
    `controller`, all ending with the same parameters; where this machine reads the run (on
    rank 0's host: the other has none of it)."""
    written = rank_0s(hosts).path(output)
    ranks = ranks_of(written)
    assert [r["host"] for r in ranks] == ["hvdhosta", "hvdhosta", "hvdhostb", "hvdhostb"]
    assert_ranks_numbered_by_host(ranks, ["hvdhosta", "hvdhostb"], 2)
    assert {r["controller"] for r in ranks} == {controller}
    assert len({r["param_sha256"] for r in ranks}) == 1
    assert not hosts.hosts[1].path(output).exists()
    return written


def parameters(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "model.pt", weights_only=True)["state_dict"]


def assert_close_parameters(got: Path, want: Path) -> None:
    """Within float rounding: 4 ranks may sum in another order."""
    ours, theirs = parameters(got), parameters(want)
    assert ours.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-5, msg=name)


def test_four_ranks_on_two_hosts_train_like_four_on_one(
    hosts: Hosts, local_four: Path, local: Path
) -> None:
    """Gloo, run-hosts.sh's default controller: through shared memory within each host and
    TCP between them (hierarchical), as flat TCP gives (HOROVOD_GLOO_SHARED_MEMORY=0). Each
    host's ranks share a segment in that host's /dev/shm: ranks of both grouped as one host
    would find no segment on the other and take TCP."""
    spread = run_hosts(hosts, local / "spread", HOROVOD_LOG_LEVEL="debug")
    assert spread.returncode == 0, spread.stdout + spread.stderr
    written = spread_over_both_hosts(hosts, local / "spread", "gloo")
    assert {r["transport"] for r in ranks_of(written)} == {"shared memory"}
    path = "Gloo through shared memory between 2 local ranks, hierarchical across hosts"
    assert sorted({rank for rank, text in spread.rank_lines() if path in text}) == [0, 1, 2, 3]

    def losses(folder: Path) -> list[float]:
        return [record["train_loss"] for record in metrics(folder)]

    assert losses(written) == pytest.approx(losses(local_four), rel=1e-6)
    flat = run_hosts(hosts, local / "flat", HOROVOD_GLOO_SHARED_MEMORY="0")
    assert flat.returncode == 0, flat.stdout + flat.stderr
    transports = {r["transport"] for r in ranks_of(rank_0s(hosts).path(local / "flat"))}
    assert transports == {"TCP (turned off by HOROVOD_GLOO_SHARED_MEMORY=0)"}
    assert_close_parameters(written, rank_0s(hosts).path(local / "flat"))


@pytest.mark.parametrize(
    ("allreduce", "nic"),
    [("horovod", ""), ("direct", "hvd0")],
    ids=["horovod-allreduce-nic-found-by-horovodrun", "direct-allreduce-nic-named"],
)
def test_four_mpi_ranks_on_two_hosts_train_like_four_gloo_ranks_on_one(
    hosts: Hosts, local_four: Path, local: Path, allreduce: str, nic: str
) -> None:
    """CONTROLLER=mpi: mpirun starts orted on each host over ssh. The hosts' keys are not in
    known_hosts, and horovodrun's cache of its own ssh check (which records them) is warm after
    the Gloo test: mpirun's ssh must still get through. 4 ranks may sum in another order than
    Gloo's, hence a tolerance instead of equality."""
    hosts.forget_host_keys()
    spread = run_hosts(hosts, local / "spread", "--allreduce", allreduce, CONTROLLER="mpi", NIC=nic)
    assert spread.returncode == 0, spread.stdout + spread.stderr
    assert_close_parameters(spread_over_both_hosts(hosts, local / "spread", "mpi"), local_four)


def test_doctor_passes_on_a_good_set_up(hosts: Hosts, tmp_path: Path) -> None:
    data = hosts.place(demo_file(tmp_path / "doctor.parquet", rows=100))
    checked = doctor(hosts, "--data", str(data))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.splitlines()[-1] == "13 of 13 checks OK"
    lines = checked.stdout.splitlines()
    assert lines[0].split()[:5] == ["OK", "Horovod", "build", "this", "host"]
    assert lines[1].split() == [
        "OK", "Horovod", "controllers", "this", "host",
        "horovod", "0.28.1:", "PyTorch", "yes,", "MPI", "yes,", "Gloo", "yes",
    ]  # fmt: skip
    open_mpi = [line for line in lines if "Open MPI on PATH" in line]
    assert [line.split()[5] for line in open_mpi] == ["198.18.0.2", "198.18.0.3"]
    assert all("/orted" in line for line in open_mpi)
    assert "common network interface  all hosts   hvd0" in checked.stdout


def test_data_on_one_host_only_is_named_by_doctor_and_ends_the_job_in_one_line(
    hosts: Hosts, tmp_path: Path, local: Path
) -> None:
    """Each host reads its own disk: data copied to the first host only is not on the second."""
    data = hosts.place(demo_file(tmp_path / "first-only.parquet", rows=200), on=[rank_0s(hosts)])
    checked = doctor(hosts, "--data", str(data))
    assert checked.returncode == 1
    failures = [" ".join(line.split()) for line in checked.stdout.splitlines() if "FAIL" in line]
    assert failures == [f"FAIL data readable 198.18.0.3 {data}"]
    fix = f"fix: copy the data to {data} on 198.18.0.3, or mount shared storage there"
    assert fix in checked.stdout
    job = over_hosts(hosts, "train", "--data", str(data), "--output", str(local / "out"))
    assert job.returncode == 2, job.stdout + job.stderr
    ours = [text for _, text in job.rank_lines() if "hvd-cpu" in text]
    assert ours == [
        f"hvd-cpu: error: on rank 2 (hvdhostb): data file not found: {data}; check the path "
        "(it must exist on every host)"
    ], job.stdout + job.stderr


def test_doctor_names_the_host_without_orted_on_its_ssh_path(hosts: Hosts, sshd_back: None) -> None:
    """mpirun runs `orted` through a non-interactive ssh session: its PATH is what counts."""
    second = hosts.hosts[1]
    hosts.stop_sshd(second)
    hosts.start_sshd(second, extra="SetEnv PATH=/nonexistent\n")
    try:
        hosts.wait_for_ssh(second)
        checked = doctor(hosts)
    finally:
        hosts.stop_sshd(second)  # sshd_back starts it again with the usual config
    assert checked.returncode == 1
    failures = [" ".join(line.split()) for line in checked.stdout.splitlines() if "FAIL" in line]
    assert failures == [
        "FAIL Open MPI on PATH 198.18.0.3 mpirun and orted not on the PATH of an ssh session"
    ]
    assert "apt-get install openmpi-bin" in checked.stdout


def test_doctor_names_the_host_whose_sshd_is_down(hosts: Hosts, sshd_back: None) -> None:
    hosts.stop_sshd(hosts.hosts[1])
    checked = doctor(hosts)
    assert checked.returncode == 1
    failures = [line for line in checked.stdout.splitlines() if line.startswith("FAIL")]
    assert len(failures) == 1
    assert "passwordless ssh" in failures[0] and "198.18.0.3" in failures[0]
    assert "Connection refused" in failures[0]


def test_hosts_whose_names_resolve_to_loopback_train_together(
    hosts: Hosts, local_four: Path, local: Path, sshd_back: None
) -> None:
    """Debian's /etc/hosts maps a machine's own name to 127.0.1.1. Horovod's Gloo bound the
    connections of each process set (the global one included) to the address the hostname
    resolves to, not to the interface horovodrun names, so the ranks on the other host were
    refused at 127.0.1.1 (patch process-set-gloo-iface). Now the job trains as with names that
    resolve to the hosts' addresses, and doctor asks nothing of the names."""
    for host in hosts.hosts:
        hosts.resolve(host, "127.0.1.1")
    checked = doctor(hosts)
    assert checked.returncode == 0, checked.stdout
    spread = run_hosts(hosts, local / "spread")
    assert spread.returncode == 0, spread.stdout + spread.stderr
    assert_close_parameters(spread_over_both_hosts(hosts, local / "spread", "gloo"), local_four)


def test_a_launch_with_a_host_down_fails_fast_naming_it(hosts: Hosts, sshd_back: None) -> None:
    hosts.stop_sshd(hosts.hosts[1])
    job = over_hosts(hosts, "train", timeout=60)
    assert job.returncode != 0
    assert job.seconds < 15
    assert "198.18.0.3" in job.stdout + job.stderr
    assert "Traceback" not in job.stdout + job.stderr


def test_a_rank_killed_on_the_remote_host_ends_the_job_everywhere(
    hosts: Hosts, local: Path
) -> None:
    output = local / "killed"
    job = start_over_hosts(hosts, output, "gloo")
    wait_for_epochs(job, rank_0s(hosts).path(output), 1)
    remote = a_remote_rank(hosts, output)
    killed_at = time.monotonic()
    os.kill(remote, signal.SIGKILL)
    try:
        job.wait(timeout=30)
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail("horovodrun did not end within 30 s of losing a rank")
    assert job.returncode != 0
    assert_nothing_left(hosts, output)  # it waits for them up to 10 s more
    assert time.monotonic() - killed_at < 30, "the job's last process ended 30 s or more after"
    printed = job.stdout.read().decode()
    assert "Traceback" not in printed
    assert "lost another rank of the job" in printed


def start_over_hosts(hosts: Hosts, output: Path, controller: str, *extra: str) -> subprocess.Popen:
    """horovodrun -np 4 over both hosts, 2 ranks each, training until stopped."""
    command = [
        str(BIN / "horovodrun"), f"--{controller}", "-np", "4", "--disable-cache", "--hostfile",
        str(hosts.hostfile(2)), "-p", str(SSH_PORT), "-i", str(hosts.key),
        str(BIN / "hvd-cpu"), "train", "--epochs", "1000", "--output", str(output), *extra,
    ]  # fmt: skip
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait_for_epochs(job: subprocess.Popen, written: Path, count: int) -> None:
    """Until the job has written `count` epochs (to `written`, its output on rank 0's host);
    fails with what it printed if it ends first."""
    metrics = written / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not metrics.exists() or len(metrics.read_text().splitlines()) < count:
        if job.poll() is not None or time.monotonic() > deadline:
            job.kill()
            pytest.fail(f"the job did not start: {job.communicate()[0].decode()}")
        time.sleep(0.1)


def a_remote_rank(hosts: Hosts, output: Path) -> int:
    """The pid of a rank running in a host's namespace, not in this test's."""
    ours = os.readlink("/proc/self/ns/net")
    remote = [
        pid for pid in hosts.processes(f"hvd-cpu train --epochs 1000 --output {output}")
        if os.readlink(f"/proc/{pid}/ns/net") != ours and _is_python(pid)
    ]  # fmt: skip
    assert remote, "no rank found on the remote host"
    return remote[0]


def _is_python(pid: int) -> bool:
    try:
        return "python" in Path(f"/proc/{pid}/exe").resolve().name
    except OSError:
        return False


def assert_nothing_left(hosts: Hosts, output: Path) -> None:
    deadline = time.monotonic() + 10
    while hosts.processes(f"--output {output}") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert hosts.processes(f"--output {output}") == [], "a process of the job outlived it"


def test_hosts_are_reachable_only_through_the_test_bridge(hosts: Hosts) -> None:
    """The set-up itself: no default route, so nothing a test sends leaves the machine."""
    routes = run(hosts.hosts[0].exec("ip", "route"))
    assert routes.returncode == 0
    assert "default" not in routes.stdout and "198.18.0.0/24 dev hvd0" in routes.stdout


def test_each_host_has_a_dev_shm_and_a_disk_of_its_own(hosts: Hosts, local: Path) -> None:
    """The set-up itself: what one host writes to /dev/shm and its disk is not on the other
    host nor on this machine, while the environment installed here is on both."""
    first, second = hosts.hosts
    made = hosts.ssh(first, f"mkdir -p {local} && touch /dev/shm/hvd-cpu-test {local}/mine")
    assert made.returncode == 0, made.stderr
    try:
        assert first.path(local / "mine").exists() and not (local / "mine").exists()
        assert not Path("/dev/shm/hvd-cpu-test").exists()
        seen = hosts.ssh(second, f"ls /dev/shm/hvd-cpu-test {local}/mine; test -x {BIN}/hvd-cpu")
        assert seen.returncode == 0 and seen.stdout == "", seen
        assert seen.stderr.count("No such file or directory") == 2, seen
    finally:
        hosts.ssh(first, "rm /dev/shm/hvd-cpu-test")


# Longer than elsewhere: 4 ranks of 2 hosts on this 2-core VM, where all ranks of one host were
# seen to stand still for 6.6 s at a job's start (under MPI, 1 run in about 15).
STALL_SECONDS = 15


# Gloo only: under MPI, Open MPI's TCP connect between the namespace hosts failed at a job's
# start in about 1 run of 15 ("connect() to 198.18.0.2:1028 failed"), the ranks stood still,
# and the watchdog rightly ended that job before the stop. A stopped rank under MPI is tested
# on one host (test_faults.py) and under srun (test_slurm.py).
@pytest.mark.parametrize("controller", ["gloo"])
def test_a_rank_stopped_on_the_remote_host_is_named_and_the_job_ends_everywhere(
    hosts: Hosts, local: Path, controller: str
) -> None:
    """SIGSTOP of a rank on the other host: a live rank names it and its host after
    --stall-seconds, the job exits 1, and the launcher takes the stopped process too (hvd-cpu
    kills a stalled rank only under --elastic; these hosts share a kernel, real ones do not)."""
    output = local / "stopped"
    job = start_over_hosts(hosts, output, controller, "--stall-seconds", str(STALL_SECONDS))
    wait_for_epochs(job, rank_0s(hosts).path(output), 2)
    remote = a_remote_rank(hosts, output)
    host = run(["ip", "netns", "identify", str(remote)]).stdout.strip()
    os.kill(remote, signal.SIGSTOP)
    try:
        job.wait(timeout=STALL_SECONDS + 30)
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail(f"horovodrun did not end within {STALL_SECONDS + 30} s of a rank's stop")
    printed = job.stdout.read().decode()
    assert job.returncode == 1, printed
    assert "Traceback" not in printed, printed
    assert f"on {host} (pid {remote}) has not answered for {STALL_SECONDS} s" in printed, printed
    assert_nothing_left(hosts, output)
