#!/usr/bin/env bash
# The container tests: build the Dockerfile for real (buildah) and run the image (podman).
# Slow (Horovod is built inside the image), so separate from launch/test.sh; .ci/run runs both.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$repo/launch/install.sh" --test
export PATH=${HVD_CPU_VENV:-$repo/.venv}/bin:$PATH
cd "$repo"
status=0
# The fresh machine first, then the image (which builds its Horovod, or takes an earlier
# image build's wheel from the cache), then the MPI Operator's pods made of that same image.
files=(tests/test_fresh_install.py tests/test_container.py tests/test_kubernetes_contract.py)
(($#)) && files=("$@")
pytest -m container -s "${files[@]}" || status=$?
if ((status == 5)); then
  echo "test-container: pytest collected no tests; that is a failure, not a pass" >&2
  exit 1
fi
exit "$status"
