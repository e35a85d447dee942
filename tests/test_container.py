"""The provided container, built for real from the Dockerfile and run for real.

Slow (a Horovod build inside the image): marked `container` and run by
launch/test-container.sh, which .ci/run runs after launch/test.sh. The last tests run one job
over two containers, each in a network namespace of its own (tests/hosts.py): two hosts.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .hosts import Hosts, assert_ranks_numbered_by_host
from .jobs import Run, demo_file, needs_root_and_apt
from .podman import podman as podman_command

pytestmark = [
    pytest.mark.container,
    # The first test pays for the image build, Horovod's compile included: 10 to 20 minutes
    # on 2 cores (MPI + Gloo), past the suite's 600 s per test. Each run inside is bounded.
    pytest.mark.timeout(3600),
    needs_root_and_apt,
]


def podman(*args: str, timeout: float = 600) -> Run:
    """`podman run --rm ARGS`: a container that goes when its command ends."""
    return podman_command("run", "--rm", *args, timeout=timeout)


def test_the_default_command_is_the_four_rank_demo(image: str, tmp_path: Path) -> None:
    """The card's shape, over Gloo (named: plain horovodrun would pick MPI in this image), with
    --auto-resume: the container started again on the same folder finds the job done."""
    job = podman("-v", f"{tmp_path}:/work", image)
    assert job.returncode == 0, job.stdout + job.stderr
    epochs = [line for line in job.stdout.splitlines() if line.startswith("[0]<stdout>:Epoch")]
    assert len(epochs) == 10
    assert "over 4 rank(s)" in job.stdout
    again = podman("-v", f"{tmp_path}:/work", image)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "<stdout>:Epoch" not in again.stdout


def test_training_on_a_mounted_frame(image: str, tmp_path: Path) -> None:
    demo_file(tmp_path / "frame.parquet", rows=5000)
    job = podman(
        "-v", f"{tmp_path}:/data", image,
        "horovodrun", "--gloo", "-np", "4", "hvd-cpu", "train", "--data", "/data/frame.parquet",
        "--epochs", "3", "--output", "/data/out",
    )  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr
    ranks = json.loads((tmp_path / "out" / "ranks.json").read_text())
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert len({r["param_sha256"] for r in ranks}) == 1


def test_threads_follow_the_container_cpu_quota(image: str) -> None:
    probe = "from hvd_cpu.runtime.cores import usable_cores; print(usable_cores())"
    job = podman("--cpus", "1", image, "python3", "-c", probe)
    assert job.returncode == 0, job.stdout + job.stderr
    assert job.stdout.strip() == "1"


def test_multi_host_mode_refuses_to_start_without_mounted_keys(image: str) -> None:
    job = podman("-e", "HVD_CPU_SSHD=1", image, "true")
    assert job.returncode == 2
    assert "needs /root/.ssh/authorized_keys" in job.stderr


def test_multi_host_mode_accepts_the_mounted_key_over_ssh(image: str, tmp_path: Path) -> None:
    key = tmp_path / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    (tmp_path / "authorized_keys").write_text((tmp_path / "key.pub").read_text())
    ssh = "ssh -p 2345 -i /keys/key -o BatchMode=yes -o StrictHostKeyChecking=no"
    job = podman(
        "--network", "host", "-e", "HVD_CPU_SSHD=1", "-e", "HVD_CPU_SSH_PORT=2345",
        "-v", f"{tmp_path}/authorized_keys:/root/.ssh/authorized_keys:ro",
        "-v", f"{key}:/keys/key:ro", image,
        "sh", "-c", f"{ssh} 127.0.0.1 'hvd-cpu --version'",
    )  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr
    assert job.stdout.strip().endswith("hvd-cpu, version 0.1.0")


def test_the_image_has_no_build_tools(image: str) -> None:
    """Open MPI's runtime is in, its compiler wrappers (which need gcc) are not."""
    job = podman(image, "sh", "-c", "command -v g++ gcc cmake make mpicc mpicxx || echo none")
    assert job.stdout.strip() == "none"
    size = podman_command("image", "inspect", "--format", "{{.Size}}", image)
    assert size.returncode == 0, size.stderr
    print(f"image size: {int(size.stdout.strip()) / 2**20:.0f} MiB")


def test_horovodrun_in_the_image_answers_its_build_check_from_the_cache(image: str) -> None:
    """The build stage's `horovodrun --check-build` filled the cache; it must still hold after
    the copy into the runtime stage, or every launch in the container pays 2 torch imports.
    A hit leaves the cache file as it was; a miss would rewrite it with a new fingerprint."""
    cache = "/opt/venv/lib/python3*/site-packages/horovod/.build-checks.json"
    job = podman(
        image, "sh", "-c", f"cat {cache}; echo; horovodrun -np 1 true >/dev/null; cat {cache}"
    )
    assert job.returncode == 0, job.stderr
    before, after = job.stdout.strip().splitlines()
    assert before == after
    assert json.loads(after)["torch|built with Gloo"][1] is True
    assert json.loads(after)["torch|built with MPI"][1] is True


def trained_ranks(output: Path, controller: str, hosts: list[str] | None = None) -> list[dict]:
    """ranks.json of a finished job: ranks in order, on `controller`, ending with one model."""
    ranks = json.loads((output / "ranks.json").read_text())
    assert [r["rank"] for r in ranks] == list(range(len(ranks)))
    assert {r["controller"] for r in ranks} == {controller}
    assert len({r["param_sha256"] for r in ranks}) == 1
    if hosts is not None:
        assert [r["host"] for r in ranks] == hosts
        assert_ranks_numbered_by_host(ranks, hosts, 1)
    return ranks


def test_mpirun_inside_the_image_trains_over_mpi(image: str, tmp_path: Path) -> None:
    """Plain `mpirun`: the image lets root run it (no --allow-run-as-root needed)."""
    job = podman(
        "-v", f"{tmp_path}:/data", image,
        "mpirun", "-np", "2", "hvd-cpu", "train", "--epochs", "2", "--output", "/data/out",
    )  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr
    assert len(trained_ranks(tmp_path / "out", "mpi")) == 2


def test_horovodrun_mpi_inside_the_image_trains_over_mpi(image: str, tmp_path: Path) -> None:
    job = podman(
        "-v", f"{tmp_path}:/data", image,
        "horovodrun", "--mpi", "-np", "2", "hvd-cpu", "train", "--epochs", "2",
        "--output", "/data/out",
    )  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr
    assert len(trained_ranks(tmp_path / "out", "mpi")) == 2


def test_a_large_mpi_message_crosses_shared_memory_in_the_image(image: str) -> None:
    """16 MB between two ranks over Open MPI's shared-memory transport (single-copy, by
    cross-memory attach, far above its eager limit): the path a real model's gradients take,
    which the small demo model's never reach."""
    program = (
        "import numpy as np; from mpi4py import MPI; "
        "x = np.full(4 << 20, MPI.COMM_WORLD.rank + 1.0, np.float32); "
        "MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, x); print(x[0], x[-1])"
    )
    job = podman(image, "mpirun", "-np", "2", "python3", "-c", program)
    assert job.returncode == 0, job.stdout + job.stderr
    assert job.stdout.split() == ["3.0"] * 4


# One job over two containers, each the only container of its "host" (a network namespace
# with its own address and name); both in multi-host mode (the entrypoint's sshd).
SSH_PORT = "2222"  # the entrypoint's default
CONTAINER_HOSTS = ["hvdctra", "hvdctrb"]


@dataclass(frozen=True)
class TwoHosts:
    containers: list[str]  # podman names; the job starts in the first
    hostnames: list[str]
    data: Path  # mounted at /data in both

    def launch(self, *args: str, timeout: float = 600) -> Run:
        """`podman exec` in the first container: the command a user types on the first host."""
        return podman_command("exec", self.containers[0], *args, timeout=timeout)


def _leftovers(names: list[str]) -> list[str]:
    """Containers, namespaces and processes (conmon, sshd, ranks) the test set-up left."""
    found = podman_command("ps", "-a", "--format", "{{.Names}}").stdout.split()
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    processes = subprocess.run(
        ["pgrep", "-af", "hvd-cpu-test-hvdctr"], capture_output=True, text=True
    ).stdout.splitlines()
    return (
        [f"container {n}" for n in found if n in names]
        + [f"namespace {h}" for h in CONTAINER_HOSTS if h in namespaces.split()]
        + [f"process {p}" for p in processes]
    )


@pytest.fixture(scope="module")
def two_hosts(image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoHosts]:
    folder = tmp_path_factory.mktemp("two-hosts")
    data = folder / "data"
    data.mkdir()
    (data / "hostfile").write_text("".join(f"{h} slots=1\n" for h in CONTAINER_HOSTS))
    names = [f"hvd-cpu-test-{h}" for h in CONTAINER_HOSTS]
    # A bridge and subnet of their own: test_hosts.py may be using hvd0 and 198.18.0.0/24.
    with Hosts(folder, CONTAINER_HOSTS, sshd=False, bridge="hvdc0", subnet="198.18.1") as hosts:
        try:
            for host, name in zip(hosts.hosts, names, strict=True):
                started = podman_command(
                    "run", "-d", "--name", name,
                    "--network", f"ns:/run/netns/{host.name}", "--hostname", host.name,
                    "--no-hosts", "-v", f"/etc/netns/{host.name}/hosts:/etc/hosts:ro",
                    "-e", "HVD_CPU_SSHD=1",
                    "-v", f"{folder}/authorized_keys:/root/.ssh/authorized_keys:ro",
                    "-v", f"{hosts.key}:/keys/key:ro", "-v", f"{data}:/data",
                    image, "sleep", "infinity",
                )  # fmt: skip
                assert started.returncode == 0, started.stderr
            made = TwoHosts(names, CONTAINER_HOSTS, data)
            for hostname in CONTAINER_HOSTS:  # sshd up; and known, as a user's first ssh does
                _wait_for_ssh(made, hostname)
            yield made
        finally:
            podman_command("rm", "-f", "-t", "0", *names)
    deadline = time.monotonic() + 10
    while _leftovers(names) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _leftovers(names) == []


def _wait_for_ssh(hosts: TwoHosts, hostname: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        probe = hosts.launch(
            "ssh", "-p", SSH_PORT, "-i", "/keys/key", "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=accept-new", "-o", "ConnectTimeout=5",
            hostname, "hostname",
        )  # fmt: skip
        if probe.returncode == 0 and probe.stdout.strip() == hostname:
            return
        assert time.monotonic() < deadline, f"no ssh to {hostname}: {probe.stderr}"
        time.sleep(0.5)


def _no_rank_left(hosts: TwoHosts) -> None:
    for container in hosts.containers:
        ranks = podman_command("exec", container, "pgrep", "-af", "hvd-cpu train")
        assert ranks.stdout.strip() == "", f"{container} still runs: {ranks.stdout}"


def test_one_gloo_job_over_two_containers_as_two_hosts(two_hosts: TwoHosts) -> None:
    job = two_hosts.launch(
        "horovodrun", "--gloo", "-np", "2", "--hostfile", "/data/hostfile",
        "-p", SSH_PORT, "-i", "/keys/key", "--disable-cache",
        "hvd-cpu", "train", "--epochs", "2", "--output", "/data/gloo",
    )  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr
    trained_ranks(two_hosts.data / "gloo", "gloo", hosts=two_hosts.hostnames)
    _no_rank_left(two_hosts)


def test_one_mpi_job_over_two_containers_as_two_hosts(two_hosts: TwoHosts) -> None:
    """mpirun starts its daemon in the other container over the same ssh, then MPI's TCP
    transport carries the job over the namespaces' common NIC."""
    job = two_hosts.launch(
        "horovodrun", "--mpi", "-np", "2", "--hostfile", "/data/hostfile",
        "-p", SSH_PORT, "-i", "/keys/key", "--disable-cache", "--network-interface", "hvd0",
        "hvd-cpu", "train", "--epochs", "2", "--output", "/data/mpi",
    )  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr
    trained_ranks(two_hosts.data / "mpi", "mpi", hosts=two_hosts.hostnames)
    _no_rank_left(two_hosts)
