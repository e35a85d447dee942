#!/usr/bin/env bash
# The container's entrypoint, three ways:
#
#   hvd-cpu-entrypoint COMMAND...            run COMMAND (the image's CMD: the four-rank demo).
#   hvd-cpu-entrypoint worker                a Kubernetes worker pod (deploy/kubernetes):
#       sshd in the foreground, as root or as any user, its port HVD_CPU_SSH_PORT (default
#       2222), the keys of ~/.ssh/authorized_keys (the MPI Operator's Secret). Kubernetes sends
#       SIGTERM to PID 1 alone: this passes it on to the container's ranks, which stop after a
#       step every rank agrees on (rank 0 writes that point's checkpoint and exits 75), waits
#       for them, then ends.
#   hvd-cpu-entrypoint launcher COMMAND...   a launcher pod: waits until every host of
#       HVD_CPU_HOSTFILE (default /etc/mpi/hostfile, the operator's) answers ssh, at most
#       HVD_CPU_WAIT_SECONDS (300), then runs COMMAND. A retried launcher can start while a
#       preempted worker's replacement is still starting.
#
# Multi-host mode, one container per host (HVD_CPU_SSHD=1 with a COMMAND): sshd starts in the
# background first and accepts the public keys in /root/.ssh/authorized_keys, which you mount
# at run time (never bake keys into the image). Host keys are made at start, so every
# container has its own. Give each container the host's network (e.g. docker run --network
# host); then, from one of them, with the private key mounted, name the hosts with -H (or
# --hostfile FILE, whose lines horovodrun reads itself: only "host slots=N" lines, no comments
# and no blank lines, or it fails):
#   horovodrun --gloo -np 4 -H node1:2,node2:2 -p 2222 -i /keys/key hvd-cpu train ...
#   horovodrun --mpi  -np 4 -H node1:2,node2:2 -p 2222 -i /keys/key \
#     --network-interface eth0 hvd-cpu train ...      (mpirun starts its daemons over the same ssh)
set -euo pipefail
port=${HVD_CPU_SSH_PORT:-2222}

# sshd's options: root's host keys are the system's, made at start; any other user's sshd
# runs without the system's configuration (written for root) and with a host key of its own in
# its home (an emptyDir on Kubernetes, kept across a restart of the container).
sshd_options() {
  local mode=$1
  [[ -s $HOME/.ssh/authorized_keys ]] ||
    { echo "hvd-cpu: error: $mode needs $HOME/.ssh/authorized_keys; mount it (-v keys:$HOME/.ssh:ro)" >&2; exit 2; }
  sshd=(/usr/sbin/sshd -p "$port" -o PasswordAuthentication=no -o StrictModes=no -o PidFile=none)
  if ((EUID == 0)); then
    ssh-keygen -A >/dev/null
    sshd+=(-o PermitRootLogin=prohibit-password)
  else
    local key=$HOME/.sshd/host_ed25519_key
    mkdir -p "$HOME/.sshd"
    [[ -f $key ]] || ssh-keygen -q -t ed25519 -N '' -f "$key"
    sshd+=(-f /dev/null -h "$key")
  fi
}

stop_ranks() {
  pkill -TERM -x hvd-cpu || true
  while pgrep -x hvd-cpu >/dev/null; do sleep 0.2; done
  kill "$sshd_pid" 2>/dev/null || true
  exit 0
}

worker() {
  sshd_options worker
  "${sshd[@]}" -D -e &
  sshd_pid=$!
  trap stop_ranks TERM INT
  local status=0
  wait "$sshd_pid" || status=$?
  echo "hvd-cpu: sshd ended (exit $status); so does this worker" >&2
  exit "$status"
}

launcher() {
  local hostfile=${HVD_CPU_HOSTFILE:-/etc/mpi/hostfile} seconds=${HVD_CPU_WAIT_SECONDS:-300}
  [[ -r $hostfile ]] ||
    { echo "hvd-cpu: error: launcher needs the host file $hostfile; set HVD_CPU_HOSTFILE" >&2; exit 2; }
  local deadline=$((SECONDS + seconds)) host said
  for host in $(awk '{print $1}' "$hostfile"); do
    until said=$(ssh -p "$port" -o BatchMode=yes -o ConnectTimeout=5 \
      -o StrictHostKeyChecking=accept-new "$host" true 2>&1); do
      if ((SECONDS >= deadline)); then
        echo "hvd-cpu: launcher: $host did not answer ssh within $seconds s: ${said##*$'\n'}" >&2
        exit 1
      fi
      sleep 2
    done
  done
  exec "$@"
}

case ${1:-} in
  worker) worker ;;
  launcher) shift && launcher "$@" ;;
  *)
    if [[ ${HVD_CPU_SSHD:-0} == 1 ]]; then
      sshd_options HVD_CPU_SSHD=1
      "${sshd[@]}"
    fi
    exec "$@"
    ;;
esac
