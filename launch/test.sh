#!/usr/bin/env bash
# Quick start, command 2: install what is missing (including test tools), lint, run every test
# but the container build (launch/test-container.sh runs that). Arguments, if any, go to one
# pytest run instead of the two stages below. `--with-container` first: command 3 as well, on
# the CPU time the second stage leaves idle (CI's way: .ci/run), its output after that stage's.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
with_container=0
if [[ ${1:-} == --with-container ]]; then
  with_container=1
  shift
fi
bash "$repo/launch/install.sh" --test
venv=${HVD_CPU_VENV:-$repo/.venv}
export PATH=$venv/bin:$PATH
cd "$repo"
ruff check .
ruff format --check .
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
  if ((with_container)); then
    echo "test: --with-container runs both stages; pytest arguments go without it" >&2
    exit 2
  fi
  tests -m "not container" "$@"
else
  # Two at a time (two workers): the main suite and the slow tests marked `beside` (the
  # whole matrices of bad input, datasets, user models, config files and tracking, the
  # benchmarks, Spark, preemption, SLURM, most rank failures, some elastic jobs, the late
  # ranks), which measure no seconds tightly. Each worker takes whole files (a file's tests
  # one after another: they share its fixtures, a Spark cluster, an MLflow server). Then the
  # rest of the slow ones (faults, namespace hosts, stall bounds, speed) one at a time, as
  # they share the namespace hosts' network or measure seconds. --durations: where time goes.
  tests -m "not container and (not slow or beside)" -n 2 --dist loadfile --no-loadscope-reorder \
    --durations=25
  if ((with_container)); then
    beside_log=$(mktemp "${TMPDIR:-/tmp}/hvd-cpu-container-tier.XXXXXX")
    "$repo/launch/idle.sh" bash "$repo/launch/test-container.sh" >"$beside_log" 2>&1 &
    beside=$!
  fi
  status=0
  tests -m "slow and not beside and not container" --durations=25 || status=$?
  if ((with_container)); then
    container_status=0
    wait "$beside" || container_status=$?
    echo "=== launch/test-container.sh, run beside the second stage (exit $container_status) ==="
    cat "$beside_log"
    rm -f "$beside_log"
    ((status)) || status=$container_status
  fi
  exit "$status"
fi
