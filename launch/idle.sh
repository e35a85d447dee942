#!/usr/bin/env bash
# Run a command on CPU time nothing else wants: `launch/idle.sh COMMAND...`. As root it puts
# itself in a cgroup of its own whose tasks the kernel runs only when no other task wants the
# CPU (cgroup v1's or v2's cpu.idle, else the least weight there is); its children stay there
# whatever sessions they start. `nice` alone does not do it where the kernel groups tasks by
# session (autogroup, on by default): a niced build then took half of both cores from the
# tests beside it. Not root, or no cpu controller: nice -n 19. Prints nothing.
set -euo pipefail
(($#)) || { echo "usage: launch/idle.sh COMMAND [ARGS...]" >&2; exit 2; }

group_in() {
  # The cpu controller's folder for a new group in $1, made with the least CPU share it allows.
  local group=$1/hvd-cpu-idle-$$
  mkdir "$group" 2>/dev/null || return 1
  if [[ -f $group/cpu.idle ]]; then
    echo 1 >"$group/cpu.idle"
  elif [[ -f $group/cpu.weight ]]; then
    echo 1 >"$group/cpu.weight"
  else
    echo 2 >"$group/cpu.shares"
  fi && echo "$group"
}

group=""
if [[ $(id -u) -eq 0 ]]; then
  if [[ -f /sys/fs/cgroup/cpu/cpu.shares ]]; then # v1 (or hybrid) with its cpu hierarchy
    group=$(group_in /sys/fs/cgroup/cpu) || group=""
  elif grep -qw cpu /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null; then # v2
    group=$(group_in /sys/fs/cgroup) || group=""
  fi
fi
if [[ -n $group ]]; then
  echo $$ >"$group/cgroup.procs"
  # Emptied when the command ends: the kernel removes nothing by itself.
  trap 'echo $$ >"$(dirname "$group")/cgroup.procs"; rmdir "$group" 2>/dev/null || true' EXIT
  status=0
  nice -n 19 "$@" || status=$?
  exit "$status"
fi
exec nice -n 19 "$@"
