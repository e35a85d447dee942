#!/usr/bin/env bash
# Quick start, command 1: install what is missing, then train the seed's model on a generated
# demo DataFrame with four CPU processes. Extra arguments go to `hvd-cpu train`.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$repo/launch/install.sh"
venv=${HVD_CPU_VENV:-$repo/.venv}
export PATH=$venv/bin:$PATH
cd "$repo"
# The demo is disposable: each run replaces the last one's output.
# Gloo, named: plain horovodrun picks MPI when it is built in, and MPI with more ranks than
# cores (4 on a 2-core machine) busy-waits itself slower (docs/usage.md#controllers-gloo-or-mpi).
exec horovodrun --gloo -np 4 hvd-cpu train --output runs/demo --overwrite "$@"
