"""Two real hosts (network namespaces, each with its own sshd, hostname and address): the same
job over a host file, `doctor`, and what happens when a host or a rank goes away."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import BIN, REPO, demo_file, horovodrun, hvd_cpu, run
from .hosts import SSH_PORT, Hosts

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not Path("/usr/sbin/sshd").exists(),
    reason="multi-host tests need root (network namespaces), iproute2 and openssh-server",
)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    with Hosts(tmp_path_factory.mktemp("hosts"), ["hvdhosta", "hvdhostb"]) as made:
        yield made


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


def test_four_ranks_on_two_hosts_train_like_four_on_one(hosts: Hosts, tmp_path: Path) -> None:
    """Through launch/run-hosts.sh, as the README tells users to."""
    script = str(REPO / "launch" / "run-hosts.sh")
    keys = {"SSH_PORT": str(SSH_PORT), "SSH_KEY": str(hosts.key), "HVD_CPU_VENV": str(BIN.parent)}
    args = ["--epochs", "3"]
    spread = run(
        [script, str(hosts.hostfile(2)), *args, "--output", str(tmp_path / "spread")], env=keys
    )
    assert spread.returncode == 0, spread.stdout + spread.stderr
    local = horovodrun(4, "train", *args, "--output", str(tmp_path / "local"))
    assert local.returncode == 0, local.stdout + local.stderr

    ranks = json.loads((tmp_path / "spread" / "ranks.json").read_text())
    assert [r["host"] for r in ranks] == ["hvdhosta", "hvdhosta", "hvdhostb", "hvdhostb"]
    assert len({r["param_sha256"] for r in ranks}) == 1

    def losses(name: str) -> list[float]:
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["train_loss"] for line in lines]

    assert losses("spread") == pytest.approx(losses("local"), rel=1e-6)


def test_doctor_passes_on_a_good_set_up(hosts: Hosts, tmp_path: Path) -> None:
    data = demo_file(tmp_path / "frame.parquet", rows=100)
    checked = doctor(hosts, "--data", str(data))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.splitlines()[-1] == "12 of 12 checks OK"
    assert "common network interface     all hosts   hvd0" in checked.stdout


def test_doctor_names_the_host_whose_sshd_is_down(hosts: Hosts, sshd_back: None) -> None:
    hosts.stop_sshd(hosts.hosts[1])
    checked = doctor(hosts)
    assert checked.returncode == 1
    failures = [line for line in checked.stdout.splitlines() if line.startswith("FAIL")]
    assert len(failures) == 1
    assert "passwordless ssh" in failures[0] and "198.18.0.3" in failures[0]
    assert "Connection refused" in failures[0]


def test_doctor_names_the_host_whose_name_resolves_to_loopback(
    hosts: Hosts, sshd_back: None
) -> None:
    hosts.resolve(hosts.hosts[1], "127.0.0.1")
    checked = doctor(hosts)
    assert checked.returncode == 1
    failures = [line for line in checked.stdout.splitlines() if line.startswith("FAIL")]
    assert failures == [
        "FAIL  own hostname resolves        198.18.0.3  hvdhostb -> 127.0.0.1",
    ]


def test_a_launch_with_a_host_down_fails_fast_naming_it(hosts: Hosts, sshd_back: None) -> None:
    hosts.stop_sshd(hosts.hosts[1])
    job = over_hosts(hosts, "train", timeout=60)
    assert job.returncode != 0
    assert job.seconds < 15
    assert "198.18.0.3" in job.stdout + job.stderr
    assert "Traceback" not in job.stdout + job.stderr


def test_a_rank_killed_on_the_remote_host_ends_the_job_everywhere(
    hosts: Hosts, tmp_path: Path
) -> None:
    output = tmp_path / "killed"
    command = [
        str(BIN / "horovodrun"), "-np", "4", "--disable-cache", "--hostfile",
        str(hosts.hostfile(2)), "-p", str(SSH_PORT), "-i", str(hosts.key),
        str(BIN / "hvd-cpu"), "train", "--epochs", "1000", "--output", str(output),
    ]  # fmt: skip
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    metrics = output / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not metrics.exists() or not metrics.read_text():
        assert job.poll() is None and time.monotonic() < deadline, "the job did not start"
        time.sleep(0.1)

    ours = os.readlink("/proc/self/ns/net")
    remote = [
        pid for pid in hosts.processes(f"hvd-cpu train --epochs 1000 --output {output}")
        if os.readlink(f"/proc/{pid}/ns/net") != ours and _is_python(pid)
    ]  # fmt: skip
    assert remote, "no rank found on the remote host"
    killed_at = time.monotonic()
    os.kill(remote[0], signal.SIGKILL)
    try:
        job.wait(timeout=30)
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail("horovodrun did not end within 30 s of losing a rank")
    assert job.returncode != 0
    assert time.monotonic() - killed_at < 30
    deadline = time.monotonic() + 10
    while hosts.processes(f"--output {output}") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert hosts.processes(f"--output {output}") == [], "a process of the job outlived it"
    printed = job.stdout.read().decode()
    assert "Traceback" not in printed
    assert "lost another rank of the job" in printed


def _is_python(pid: int) -> bool:
    try:
        return "python" in Path(f"/proc/{pid}/exe").resolve().name
    except OSError:
        return False


def test_hosts_are_reachable_only_through_the_test_bridge(hosts: Hosts) -> None:
    """The set-up itself: no default route, so nothing a test sends leaves the machine."""
    routes = run(hosts.hosts[0].exec("ip", "route"))
    assert routes.returncode == 0
    assert "default" not in routes.stdout and "198.18.0.0/24 dev hvd0" in routes.stdout
