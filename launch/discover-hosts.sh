#!/usr/bin/env bash
# Host discovery for `hvd-cpu train --elastic` (horovodrun --host-discovery-script): prints
# the hosts that may run ranks now, one "host:slots" per line. Horovod runs it every second,
# so editing the host file while the job runs takes a host out or lets it (back) in.
#
#   HVD_CPU_HOSTFILE  a host file as launch/run-hosts.sh takes ("host slots=N" lines, # for
#                     comments), read by hvd_cpu.tools.hostfile: a bad one is one line and exit 2
#                     (while a job runs, Horovod then keeps the hosts it had). Unset: this
#                     machine, HVD_CPU_SLOTS ranks (default: its cores).
#   HVD_CPU_VENV      the environment whose Python reads the file (default: <repo>/.venv)
#
# This machine is listed under two names, localhost and 127.0.0.1, each with half the slots:
# Horovod's elastic mode wants two hosts to find a network interface they share, and it
# takes a host whose rank failed out for a cool-down: under one name that would be every
# rank, and the job would end instead of going on.
set -euo pipefail
if [[ -n ${HVD_CPU_HOSTFILE:-} ]]; then
  repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  exec "${HVD_CPU_VENV:-$repo/.venv}/bin/python" -m hvd_cpu.tools.hostfile discovery "$HVD_CPU_HOSTFILE"
else
  slots=${HVD_CPU_SLOTS:-$(nproc)}
  echo "localhost:$(((slots + 1) / 2))"
  ((slots > 1)) && echo "127.0.0.1:$((slots / 2))"
fi
