#!/usr/bin/env bash
# The container's entrypoint: optionally start sshd (multi-host mode), then run the command.
#
# Multi-host mode (HVD_CPU_SSHD=1): sshd listens on HVD_CPU_SSH_PORT (default 2222) and accepts
# the public keys in /root/.ssh/authorized_keys, which you mount at run time (never bake keys
# into the image). Host keys are made at first start, so every container has its own. One
# container per host, each with the host's network (e.g. docker run --network host); then,
# from one of them, with the private key mounted, name the hosts with -H (or --hostfile FILE,
# whose lines horovodrun reads itself: only "host slots=N" lines, no comments and no blank
# lines, or it fails):
#   horovodrun --gloo -np 4 -H node1:2,node2:2 -p 2222 -i /keys/key hvd-cpu train ...
#   horovodrun --mpi  -np 4 -H node1:2,node2:2 -p 2222 -i /keys/key \
#     --network-interface eth0 hvd-cpu train ...      (mpirun starts its daemons over the same ssh)
set -euo pipefail
if [[ ${HVD_CPU_SSHD:-0} == 1 ]]; then
  if [[ ! -s /root/.ssh/authorized_keys ]]; then
    echo "hvd-cpu: error: HVD_CPU_SSHD=1 needs /root/.ssh/authorized_keys; mount it (-v keys:/root/.ssh:ro)" >&2
    exit 2
  fi
  ssh-keygen -A >/dev/null
  /usr/sbin/sshd -p "${HVD_CPU_SSH_PORT:-2222}" -o PasswordAuthentication=no \
    -o PermitRootLogin=prohibit-password -o StrictModes=no
fi
exec "$@"
