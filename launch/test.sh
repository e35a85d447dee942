#!/usr/bin/env bash
# Quick start, command 2: install what is missing (including test tools), lint, run every test
# but the slow container build (launch/test-container.sh runs that). Extra arguments go to pytest.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$repo/launch/install.sh" --test
venv=${HVD_CPU_VENV:-$repo/.venv}
export PATH=$venv/bin:$PATH
cd "$repo"
ruff check .
ruff format --check .
status=0
pytest -m "not container" "$@" || status=$?
if ((status == 5)); then
  echo "test: pytest collected no tests; that is a failure, not a pass" >&2
  exit 1
fi
exit "$status"
