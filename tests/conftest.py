"""Data files shared by the tests that launch real jobs, and what tests that train inside
pytest's own process must leave as they found it."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from .jobs import demo_file
from .kube import kubectl_path
from .podman import build_image, remove_image


@pytest.fixture(scope="session")
def demo_parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4096-row demo frame shared by the integration tests."""
    return demo_file(tmp_path_factory.mktemp("data") / "demo.parquet", rows=4096)


@pytest.fixture(scope="session")
def frame_20k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20,000 demo rows: enough batches per epoch for resizes, kills and early stopping."""
    return demo_file(tmp_path_factory.mktemp("data") / "demo20k.parquet", rows=20_000)


@pytest.fixture(scope="session")
def kubectl() -> str:
    """kubectl, kustomize built in: the manifests' tests render deploy/kubernetes/ with it."""
    return kubectl_path()


@pytest.fixture(scope="session")
def image() -> Iterator[str]:
    """The project's image, built for real once for every container test of the session: the
    first test that asks pays for the build (10-20 minutes, Horovod's compile included)."""
    yield build_image()
    remove_image()


@pytest.fixture(autouse=True)
def process_state_restored() -> Iterator[None]:
    """A run puts back what it changed (training/scope.py; tests/test_prepare.py checks it),
    but a test that joins without one (join.init itself) sets Horovod's controller in
    os.environ and hvd-cpu's signal handlers; left there, the next test's mpirun would start
    its ranks with HOROVOD_CONTROLLER=gloo and Ctrl-C would end pytest without its report."""
    environment = dict(os.environ)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    wakeup_fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup_fd)
    yield
    signal.set_wakeup_fd(wakeup_fd)
    os.environ.clear()
    os.environ.update(environment)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


# launch/test.sh's first stage deals out whole files to two workers in this order: the longest
# first, so that neither is left alone with one at the end. The seconds each took there, of
# 3005 in all (2026-12-06): the two workers then ended 9 s apart, the stage in 25 min 18 s.
LONGEST_FIRST = [
    "test_bad_input.py",  # 522
    "test_spark.py",  # 482
    "test_rank_failures.py",  # 367
    "test_benchmarks.py",  # 308
    "test_ray.py",  # 193
    "test_elastic.py",  # 150
    "test_shared_memory_edges.py",  # 132
    "test_training.py",  # 115
    "test_tracking.py",  # 89
    "test_datasets.py",  # 78
    "test_slurm.py",  # 61
    "test_preemption.py",  # 59
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files in LONGEST_FIRST's order, then the rest as collected; each file's own tests
    in their order (a stable sort)."""
    place = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(item.path.name, len(place)))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """No test may leave one of hvd-cpu's shared-memory segments in /dev/shm: each is unlinked
    as soon as its ranks have mapped it, however the job ends later (kill -9 included). Checked
    once, by the session that ran them all (not by each xdist worker)."""
    if hasattr(session.config, "workerinput"):
        return
    left = sorted(p.name for p in Path("/dev/shm").glob("hvd-cpu-*"))
    if left:
        session.config.get_terminal_writer().line(
            f"hvd-cpu's shared-memory segments left in /dev/shm: {', '.join(left)}", red=True
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
