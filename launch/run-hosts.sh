#!/usr/bin/env bash
# Train over the hosts of a host file: one rank per slot, the same command on every host.
#
#   launch/run-hosts.sh HOSTFILE [hvd-cpu train options...]
#
# Environment (all optional):
#   CONTROLLER     gloo or mpi: who carries the collectives (horovodrun --gloo / --mpi;
#                  default below). MPI needs Open MPI's orted on every host's ssh PATH.
#   SSH_PORT       sshd port on the hosts               (horovodrun -p)
#   SSH_KEY        ssh private key                      (horovodrun -i)
#   NIC            network interface the hosts share    (horovodrun --network-interface; with
#                  MPI also Open MPI's control channel: -mca oob_tcp_if_include NIC)
#   START_TIMEOUT  seconds to wait for all ranks        (horovodrun --start-timeout, default 30)
#   HVD_CPU_VENV   the environment to use               (default: <repo>/.venv)
# Check the set-up first with: hvd-cpu doctor --hostfile HOSTFILE [-p PORT] [-i KEY]
set -euo pipefail
DEFAULT_CONTROLLER=gloo # the one line to change to make MPI the default
if (($# < 1)) || [[ ! -f $1 ]]; then
  echo "usage: $0 HOSTFILE [hvd-cpu train options...]  (see launch/hostfile.example)" >&2
  exit 2
fi
hostfile=$1
shift
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PATH=${HVD_CPU_VENV:-$repo/.venv}/bin:$PATH
controller=${CONTROLLER:-$DEFAULT_CONTROLLER}
if [[ $controller != gloo && $controller != mpi ]]; then
  echo "CONTROLLER must be gloo or mpi, not '$controller'" >&2
  exit 2
fi

# One rank per slot. The file is read by hvd_cpu.tools.hostfile, as by doctor (a bad one ends here
# with one line, exit 2), and handed to horovodrun as -H: horovodrun's own --hostfile reader
# fails on comments, blank lines and hosts without slots=.
np=$(python -m hvd_cpu.tools.hostfile total "$hostfile")
hosts=$(python -m hvd_cpu.tools.hostfile hosts "$hostfile")

launcher=("--$controller" -np "$np" -H "$hosts" --start-timeout "${START_TIMEOUT:-30}")
[[ -n ${SSH_PORT:-} ]] && launcher+=(-p "$SSH_PORT")
[[ -n ${SSH_KEY:-} ]] && launcher+=(-i "$SSH_KEY")
[[ -n ${NIC:-} ]] && launcher+=(--network-interface "$NIC")
if [[ $controller == mpi ]]; then
  # mpirun starts orted over its own ssh, which by default asks about a host key it does not
  # know and, without a terminal, fails with "Host key verification failed" (horovodrun's
  # cached ssh check no longer records them). Same options as horovodrun's ssh: a host's key
  # is recorded on first contact and checked from then on.
  export OMPI_MCA_plm_rsh_agent=${OMPI_MCA_plm_rsh_agent:-ssh -o PasswordAuthentication=no -o StrictHostKeyChecking=accept-new -o ServerAliveInterval=5 -o ServerAliveCountMax=3}
  # Without NIC horovodrun finds the common interface and restricts MPI's data (btl) to it;
  # the daemons' control channel (oob) then still tries every address mpirun's host has.
  [[ -n ${NIC:-} ]] && launcher+=(--mpi-args "-mca oob_tcp_if_include $NIC")
fi
exec horovodrun "${launcher[@]}" hvd-cpu train "$@"
