#!/usr/bin/env bash
# Quick start, command 2: install what is missing (including test tools), lint, run every test
# but the container build (launch/test-container.sh runs that). Arguments, if any, go to one
# pytest run instead of the two stages below.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$repo/launch/install.sh" --test
venv=${HVD_CPU_VENV:-$repo/.venv}
export PATH=$venv/bin:$PATH
cd "$repo"
ruff check .
ruff format --check .
# Slow files whose tests may run two at a time: none measures seconds or shares a network.
BESIDE_EACH_OTHER=(tests/test_bad_input.py tests/test_datasets.py tests/test_user_model.py
  tests/test_messy.py tests/test_config_file.py tests/test_tracking.py)
# pytest's "no tests collected" (exit 5) is a failure here, never a pass.
tests() {
  local status=0
  pytest "$@" || status=$?
  if ((status == 5)); then
    echo "test: pytest collected no tests; that is a failure, not a pass" >&2
    return 1
  fi
  return "$status"
}
if (($#)); then
  tests -m "not container" "$@"
else
  # The main suite (under 5 minutes, two workers), then the slow one: minutes of real jobs.
  # Its whole matrices of bad input, datasets, user models, config files and tracking run
  # two at a time like the main suite; the rest (elastic, faults, namespace hosts, SLURM,
  # speed) one at a time, as they share the namespace hosts' network and measure seconds.
  # --durations: the slowest tests of each stage, where CI's time can be found.
  tests -m "not slow and not container" -n 2 --durations=15
  tests -m "slow and not container" -n 2 --durations=10 "${BESIDE_EACH_OTHER[@]}"
  tests -m "slow and not container" --durations=25 "${BESIDE_EACH_OTHER[@]/#/--ignore=}"
fi
