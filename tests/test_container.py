"""The provided container, built for real from the Dockerfile and run for real.

Slow (a Horovod build inside the image): marked `container` and run by
launch/test-container.sh, which .ci/run runs after the main suite.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import REPO, Run, demo_file, run

TAG = "localhost/hvd-cpu:test"
pytestmark = [
    pytest.mark.container,
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("apt-get"),
        reason="building the image here needs root and apt-get (buildah, podman, debootstrap)",
    ),
]


def containers_conf() -> dict[str, str]:
    cache = Path(os.environ.get("HVD_CPU_CACHE", Path.home() / ".cache" / "hvd-cpu"))
    return {"CONTAINERS_CONF": str(cache / "containers" / "containers.conf")}


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    built = run([str(REPO / "tests" / "container" / "build-image.sh"), TAG], timeout=3000)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    yield TAG


def podman(*args: str, timeout: float = 600) -> Run:
    return run(["podman", "run", "--rm", *args], timeout=timeout, env=containers_conf())


def test_the_default_command_is_the_four_rank_demo(image: str) -> None:
    job = podman(image)
    assert job.returncode == 0, job.stdout + job.stderr
    epochs = [line for line in job.stdout.splitlines() if line.startswith("[0]<stdout>:Epoch")]
    assert len(epochs) == 10
    assert "over 4 rank(s)" in job.stdout


def test_training_on_a_mounted_frame(image: str, tmp_path: Path) -> None:
    demo_file(tmp_path / "frame.parquet", rows=5000)
    job = podman(
        "-v", f"{tmp_path}:/data", image,
        "horovodrun", "-np", "4", "hvd-cpu", "train", "--data", "/data/frame.parquet",
        "--epochs", "3", "--output", "/data/out",
    )  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr
    ranks = json.loads((tmp_path / "out" / "ranks.json").read_text())
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert len({r["param_sha256"] for r in ranks}) == 1


def test_threads_follow_the_container_cpu_quota(image: str) -> None:
    probe = "from hvd_cpu.dist import usable_cores; print(usable_cores())"
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
    job = podman(image, "sh", "-c", "command -v g++ cmake make || echo none")
    assert job.stdout.strip() == "none"
    size = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Size}}", image],
        capture_output=True, text=True, env={**os.environ, **containers_conf()}, check=True,
    ).stdout.strip()  # fmt: skip
    print(f"image size: {int(size) / 2**20:.0f} MiB")


def test_horovodrun_in_the_image_answers_its_build_check_from_the_cache(image: str) -> None:
    """The build stage's `horovodrun --check-build` filled the cache; it must still hold after
    the copy into the runtime stage, or every launch in the container pays 2 torch imports.
    A hit leaves the cache file as it was; a miss would rewrite it with a new fingerprint."""
    cache = "/opt/venv/lib/python3.11/site-packages/horovod/.build-checks.json"
    job = podman(
        image, "sh", "-c", f"cat {cache}; echo; horovodrun -np 1 true >/dev/null; cat {cache}"
    )
    assert job.returncode == 0, job.stderr
    before, after = job.stdout.strip().splitlines()
    assert before == after
    assert json.loads(after)["torch|built with Gloo"][1] is True
