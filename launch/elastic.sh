#!/usr/bin/env bash
# Train with Horovod's elastic mode: when a rank or a host dies the others go on, and ranks
# that come (back) are taken in (docs/elastic.md).
#
#   launch/elastic.sh [hvd-cpu train options...]
#
# After more than --max-restarts lost ranks (default 3) the job ends with one line.
#
# Environment (all optional):
#   HVD_CPU_HOSTFILE  hosts as for launch/run-hosts.sh, re-read every second (edit it to take
#                     a host out or in; a bad one stops this script with one line and exit 2,
#                     and broken while the job runs, the job keeps the hosts it had); unset:
#                     this machine (see launch/discover-hosts.sh)
#   HVD_CPU_SLOTS     without a host file: ranks on this machine (default: its cores)
#   NP, MIN_NP        ranks to start with (default: every slot) and the fewest to go on with
#                     (default 1); at most NP run at once
#   COOLDOWN          seconds a host whose rank failed stays out, "LOW HIGH" (default "5 15";
#                     it doubles with each failure of that host, up to HIGH)
#   GLOO_TIMEOUT      seconds the ranks wait for a lost one before going on (default 15)
#   SSH_PORT, SSH_KEY, NIC, START_TIMEOUT, HVD_CPU_VENV   as for launch/run-hosts.sh
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PATH=${HVD_CPU_VENV:-$repo/.venv}/bin:$PATH
discover=$repo/launch/discover-hosts.sh
if [[ -n ${HVD_CPU_HOSTFILE:-} ]]; then
  [[ -f $HVD_CPU_HOSTFILE ]] || { echo "HVD_CPU_HOSTFILE: no such file: $HVD_CPU_HOSTFILE" >&2; exit 2; }
  export HVD_CPU_HOSTFILE=$(realpath "$HVD_CPU_HOSTFILE")
fi
[[ -z ${HVD_CPU_HOSTFILE:-} && -n ${NP:-} ]] && export HVD_CPU_SLOTS=${HVD_CPU_SLOTS:-$NP}
slots=$("$discover" | awk -F: '{ total += $2 } END { print total + 0 }')
np=${NP:-$slots}
if ((np < 1 || np > slots)); then
  echo "elastic.sh: NP=$np ranks, but the hosts offer $slots slots: check NP, HVD_CPU_HOSTFILE or HVD_CPU_SLOTS" >&2
  exit 2
fi
read -r cool_low cool_high <<<"${COOLDOWN:-5 15}"
launcher=(--gloo -np "$np" --min-np "${MIN_NP:-1}" --max-np "$np"
  --host-discovery-script "$discover"
  --blacklist-cooldown-range "$cool_low" "$cool_high" --gloo-timeout-seconds "${GLOO_TIMEOUT:-15}"
  --start-timeout "${START_TIMEOUT:-30}")
[[ -n ${SSH_PORT:-} ]] && launcher+=(-p "$SSH_PORT")
[[ -n ${SSH_KEY:-} ]] && launcher+=(-i "$SSH_KEY")
[[ -n ${NIC:-} ]] && launcher+=(--network-interface "$NIC")
exec horovodrun "${launcher[@]}" hvd-cpu train --elastic "$@"
