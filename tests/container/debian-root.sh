#!/usr/bin/env bash
# A minimal Debian root file system (debootstrap --variant=minbase) from the machine's own apt
# mirror, kept as a tarball in the cache; prints the tarball's path. The container tests'
# base image and the fresh-machine install test (tests/test_fresh_install.py) both start
# from it. Usage: tests/container/debian-root.sh SUITE (trixie, bookworm)
set -euo pipefail
suite=${1:?usage: debian-root.sh SUITE}
cache=${HVD_CPU_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd-cpu}
tarball=$cache/base/debian-$suite-minbase.tar
if [[ ! -s $tarball ]]; then
  command -v debootstrap >/dev/null || {
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
  }
  mirror=$(awk '/^URIs:/ { print $2; exit }' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  [[ -n $mirror ]] || mirror=$(awk '$1 == "deb" { print $2; exit }' /etc/apt/sources.list)
  root=$(mktemp -d)
  mkdir -p "$(dirname "$tarball")"
  printf 'container: debootstrap %s (minbase) from %s (about 70 s)\n' "$suite" "$mirror" >&2
  debootstrap --variant=minbase "$suite" "$root" "$mirror" >"$cache/debootstrap-$suite.log" 2>&1 ||
    { tail -n 20 "$cache/debootstrap-$suite.log" >&2; rm -rf "$root"; exit 1; }
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  chmod 755 "$root"  # mktemp made it 0700; it is "/"
  tar -C "$root" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
  rm -rf "$root"
fi
echo "$tarball"
