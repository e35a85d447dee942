#!/usr/bin/env bash
# Build the project's Dockerfile, unchanged, on a machine without a Docker engine: Debian's
# buildah and podman, run as root. Everything specific to this kind of machine lives here,
# not in the Dockerfile:
#   - the base image is made locally with debootstrap from the machine's own apt mirror and
#     tagged with the name the Dockerfile's FROM uses (cached as a tarball between runs);
#   - the host's CA bundle is mounted (and named by PIP_CERT) so that pip inside RUN steps
#     trusts this network's proxy;
#   - the local folder of torch wheels, if any, is mounted and offered to pip (find-links);
#   - containers.conf: runc, cgroupfs and fixed ulimits (crun and raising limits fail here).
# Usage: tests/container/build-image.sh TAG      Prints what it does; exits non-zero on failure.
set -euo pipefail
tag=${1:?usage: build-image.sh TAG}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cache=${HVD_CPU_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd-cpu}
base_name=docker.io/library/debian:bookworm-slim
base_tar=$cache/base/debian-bookworm-minbase.tar
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
  if [[ ! -s $base_tar ]]; then
    mirror=$(awk '/^URIs:/ { print $2; exit }' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
    [[ -n $mirror ]] || mirror=$(awk '$1 == "deb" { print $2; exit }' /etc/apt/sources.list)
    root=$(mktemp -d)
    say "debootstrap bookworm (minbase) from $mirror (about 70 s)"
    debootstrap --variant=minbase bookworm "$root" "$mirror" >"$cache/debootstrap.log" 2>&1 ||
      { tail -n 20 "$cache/debootstrap.log" >&2; exit 1; }
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    mkdir -p "$(dirname "$base_tar")"
    tar -C "$root" -cf "$base_tar.tmp" . && mv "$base_tar.tmp" "$base_tar"
    rm -rf "$root"
  fi
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
if compgen -G "/opt/wheels/torch-*.whl" >/dev/null; then
  volumes+=(-v /opt/wheels:/opt/wheels:ro)
  build_args+=(--build-arg TORCH_INDEX_URL= --build-arg PIP_FIND_LINKS=/opt/wheels)
fi
say "building $tag from $repo/Dockerfile"
buildah bud --pull=never --isolation chroot --layers=false "${volumes[@]}" "${build_args[@]}" \
  -t "$tag" "$repo"
