"""Data files shared by the tests that launch real jobs."""

from __future__ import annotations

from pathlib import Path

import pytest

from .jobs import demo_file


@pytest.fixture(scope="session")
def demo_parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4096-row demo frame shared by the integration tests."""
    return demo_file(tmp_path_factory.mktemp("data") / "demo.parquet", rows=4096)


@pytest.fixture(scope="session")
def frame_20k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20,000 demo rows: enough batches per epoch for resizes, kills and early stopping."""
    return demo_file(tmp_path_factory.mktemp("data") / "demo20k.parquet", rows=20_000)
