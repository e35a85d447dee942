"""The project's image, built once per test session from the Dockerfile (tests/container/
build-image.sh), and podman as this machine runs it. Used by the container tests
(tests/test_container.py, tests/test_kubernetes_contract.py) through conftest.py's `image`."""

from __future__ import annotations

import os
from pathlib import Path

from .jobs import REPO, Run, run

TAG = "localhost/hvd-cpu:test"


def containers_conf() -> dict[str, str]:
    """build-image.sh's containers.conf (runc, cgroupfs, fixed ulimits), for every podman."""
    cache = Path(os.environ.get("HVD_CPU_CACHE", Path.home() / ".cache" / "hvd-cpu"))
    return {"CONTAINERS_CONF": str(cache / "containers" / "containers.conf")}


def podman(*args: str, timeout: float = 600) -> Run:
    return run(["podman", *args], timeout=timeout, env=containers_conf())


def build_image() -> str:
    """The image under test. HVD_CPU_TEST_IMAGE names one built already from this tree (by
    tests/container/build-image.sh): no build then, and the tests leave it in place."""
    if os.environ.get("HVD_CPU_TEST_IMAGE"):
        return os.environ["HVD_CPU_TEST_IMAGE"]
    built = run([str(REPO / "tests" / "container" / "build-image.sh"), TAG], timeout=3000)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return TAG


def remove_image() -> None:
    """Several GB with the CUDA build of torch: a machine that runs CI again needs the room."""
    if not os.environ.get("HVD_CPU_TEST_IMAGE"):
        podman("rmi", "--force", TAG)
