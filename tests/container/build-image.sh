#!/usr/bin/env bash
# Build the project's Dockerfile, unchanged, on a machine without a Docker engine: Debian's
# buildah and podman, run as root. Everything specific to this kind of machine lives here,
# not in the Dockerfile:
#   - the base image is made locally with debootstrap from the machine's own apt mirror and
#     tagged with the name the Dockerfile's FROM uses (cached as a tarball between runs);
#   - the host's CA bundle is mounted (and named by PIP_CERT) so that pip inside RUN steps
#     trusts this network's proxy;
#   - the local folder of torch wheels, if any, is mounted and offered to pip (find-links);
#   - the wheel cache is mounted (HVD_CPU_CACHE), so a Horovod wheel built earlier is reused;
#   - containers.conf: runc, cgroupfs and fixed ulimits (crun and raising limits fail here).
# Usage: tests/container/build-image.sh TAG [SUITE]   SUITE: trixie (the Dockerfile's default
# base) or bookworm (built through BASE_IMAGE). Prints what it does; exits non-zero on failure.
set -euo pipefail
tag=${1:?usage: build-image.sh TAG [trixie|bookworm]}
suite=${2:-trixie}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cache=${HVD_CPU_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd-cpu}
base_name=docker.io/library/debian:$suite-slim
say() { printf 'container: %s\n' "$*" >&2; }

need=()
for tool in buildah podman debootstrap runc; do command -v "$tool" >/dev/null || need+=("$tool"); done
if ((${#need[@]})); then
  say "installing ${need[*]}"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

conf_dir=$cache/containers
mkdir -p "$conf_dir"
cat >"$conf_dir/containers.conf" <<CONF
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
export CONTAINERS_CONF=$conf_dir/containers.conf

if ! buildah inspect --type image "$base_name" >/dev/null 2>&1; then
  base_tar=$("$repo/tests/container/debian-root.sh" "$suite")
  say "importing the base image as $base_name"
  root=$(mktemp -d)
  tar -C "$root" -xf "$base_tar"
  container=$(buildah from scratch)
  buildah copy --quiet "$container" "$root" / >/dev/null
  rm -rf "$root"
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$container"
  buildah commit --quiet "$container" "$base_name" >/dev/null
  buildah rm "$container" >/dev/null
fi

# Beside, not over, the image's own bundle: the ca-certificates package rewrites that one.
volumes=(-v /etc/ssl/certs/ca-certificates.crt:/run/host-ca.crt:ro)
build_args=(--build-arg PIP_CERT=/run/host-ca.crt)
# This machine's wheel cache: a Horovod wheel built for the image's Debian, Python, torch and
# Open MPI (an earlier image build leaves one there) saves the build its compile.
volumes+=(-v "$cache:/run/hvd-cpu-cache")
build_args+=(--build-arg HVD_CPU_CACHE=/run/hvd-cpu-cache)
if compgen -G "/opt/wheels/torch-*.whl" >/dev/null; then
  volumes+=(-v /opt/wheels:/opt/wheels:ro)
  build_args+=(--build-arg TORCH_INDEX_URL= --build-arg PIP_FIND_LINKS=/opt/wheels)
fi
[[ $suite == trixie ]] || build_args+=(--build-arg "BASE_IMAGE=$base_name")

# Disk: the build holds the venv twice (build stage and image) and a layer's tarball while it
# commits; with the CUDA build of torch (what the default index serves) that peaks near 16 GB.
# A rebuild would leave the old image behind untagged, so it goes first.
podman rmi --force --ignore "$tag" >/dev/null
store=$(podman info --format '{{.Store.GraphRoot}}')
free_gb=$(df --output=avail -BG "$store" | tail -1 | tr -dc 0-9)
if ((free_gb < 20)); then
  say "only ${free_gb} GB free under $store; building the image needs about 20 GB: free some (podman system prune -a, old folders in /tmp) and run again"
  exit 1
fi
say "building $tag from $repo/Dockerfile on $base_name"
buildah bud --pull=never --isolation chroot --layers=false "${volumes[@]}" "${build_args[@]}" \
  -t "$tag" "$repo"
