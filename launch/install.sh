#!/usr/bin/env bash
# Install hvd-cpu and a Horovod that builds against current PyTorch, into one virtual environment.
#
# Horovod 0.28.1 (its last release) forces C++14, which PyTorch >= 2.1 headers refuse. This script
# downloads the 0.28.1 sdist, applies the project's patches (launch/horovod-0.28.1-*.patch, each
# named for what it fixes), builds a wheel with both controllers, MPI (Debian's Open MPI) and
# Gloo, for PyTorch once, caches it (keyed by Horovod version, torch version, Python ABI, the Open
# MPI version and the patches), and installs it. A second run with the cache takes seconds.
#
# Usage: launch/install.sh [--test]     (--test also installs what the test suite needs)
# Environment:
#   HVD_CPU_VENV      virtual environment to create/use   (default: <repo>/.venv)
#   HVD_CPU_CACHE     where built wheels are kept          (default: ~/.cache/hvd-cpu)
#   HVD_CPU_EDITABLE  1: editable install of hvd-cpu (default), 0: a regular install
#   PYTHON            interpreter for a new venv; must be 3.11 (default: python3.11, then python3)
#   TORCH_SPEC        torch requirement                    (default: torch==2.13.0)
#   TORCH_INDEX_URL   an index with CPU-only torch wheels (optional)
set -euo pipefail

HOROVOD_VERSION=0.28.1
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${HVD_CPU_VENV:-$repo/.venv}
cache=${HVD_CPU_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd-cpu}
patches=("$repo"/launch/horovod-$HOROVOD_VERSION-*.patch)
editable=${HVD_CPU_EDITABLE:-1}
torch_spec=${TORCH_SPEC:-torch==2.13.0}
with_test=0
[[ ${1:-} == --test ]] && with_test=1

say() { printf 'install: %s\n' "$*" >&2; }
die() { printf 'install: error: %s\n' "$*" >&2; exit 1; }

# Debian packages: what the Horovod build needs (Open MPI's compiler wrappers and headers
# included), plus what the multi-host tests need.
need_debs=()
for tool in g++:g++ make:make cmake:cmake patch:patch mpirun:openmpi-bin mpicxx:libopenmpi-dev; do
  command -v "${tool%%:*}" >/dev/null || need_debs+=("${tool##*:}")
done
if ((with_test)); then
  command -v sshd >/dev/null || [[ -x /usr/sbin/sshd ]] || need_debs+=(openssh-server)
  command -v ssh >/dev/null || need_debs+=(openssh-client)
  command -v ip >/dev/null || need_debs+=(iproute2)
  # The SLURM tests' one-machine cluster. srun --mpi=pmix's plugin (in slurm-wlm-basic-plugins,
  # which slurmd pulls in) dlopens pmix2/lib/libpmix.so, which only libpmix-dev ships.
  for tool in munged:munge slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client; do
    command -v "${tool%%:*}" >/dev/null || [[ -x /usr/sbin/${tool%%:*} ]] || need_debs+=("${tool##*:}")
  done
  compgen -G '/usr/lib/*/pmix2/lib/libpmix.so' >/dev/null || need_debs+=(libpmix-dev)
fi
if ((${#need_debs[@]})); then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    say "installing Debian packages: ${need_debs[*]}"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_debs[@]}" >/dev/null
  else
    die "missing tools: ${need_debs[*]}; install them (Debian/Ubuntu: apt-get install ${need_debs[*]}) and rerun"
  fi
fi

# The virtual environment, on Python 3.11 (Horovod's CMake glue still imports distutils).
if [[ ! -x $venv/bin/python ]]; then
  python=${PYTHON:-$(command -v python3.11 || command -v python3 || true)}
  [[ -n $python ]] || die "no python3.11 found; install Python 3.11 or set PYTHON=/path/to/python3.11"
  "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' ||
    die "$python is not Python 3.11 (Horovod $HOROVOD_VERSION's build needs distutils); set PYTHON=/path/to/python3.11"
  say "creating virtual environment $venv"
  "$python" -m venv "$venv" || die "could not create $venv (Debian: apt-get install python3-venv)"
fi
py=$venv/bin/python
pip=("$py" -m pip --disable-pip-version-check --quiet)

# torch first: Horovod's build compiles against the installed torch.
if ! "$py" -c 'import torch' 2>/dev/null; then
  say "installing $torch_spec"
  "${pip[@]}" install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$torch_spec" numpy
fi
torch_version=$("$py" -c 'import torch; print(torch.__version__)')
abi=$("$py" -c 'import sys; print(f"cp{sys.version_info.major}{sys.version_info.minor}")')
patch_id=$(cat "${patches[@]}" | sha256sum | cut -c1-12)
ompi_version=$(mpirun --version 2>/dev/null | sed -n 's/^mpirun (Open MPI) //p')
[[ -n $ompi_version ]] || die "mpirun is not Open MPI's; install Debian's openmpi-bin and libopenmpi-dev"
wheel_dir=$cache/wheels/horovod-$HOROVOD_VERSION-torch$torch_version-$abi-ompi$ompi_version-$patch_id

# Quick check on every run; the full `horovodrun --check-build` (7 s) runs after an install.
horovod_ok() {
  "$py" -c "import horovod, horovod.torch as hvd
assert horovod.__version__ == '$HOROVOD_VERSION' and hvd.gloo_built() and hvd.mpi_built()" 2>/dev/null
}

build_horovod_wheel() {
  local work log
  work=$(mktemp -d "${TMPDIR:-/tmp}/hvd-cpu-horovod-build.XXXXXX")
  log=$cache/horovod-build.log
  mkdir -p "$cache"
  say "building Horovod $HOROVOD_VERSION against torch $torch_version (about 5 to 9 minutes on 2 cores); log: $log"
  "${pip[@]}" install setuptools wheel cloudpickle psutil pyyaml packaging
  "${pip[@]}" download --no-deps --no-binary :all: --no-build-isolation "horovod==$HOROVOD_VERSION" -d "$work" >"$log" 2>&1 ||
    die "could not download the horovod $HOROVOD_VERSION sdist from the package index; log: $log"
  tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
  for patch_file in "${patches[@]}"; do
    patch -d "$work/horovod-$HOROVOD_VERSION" -p1 <"$patch_file" >>"$log" 2>&1 ||
      die "could not apply $patch_file to the horovod sdist; log: $log"
  done
  # Both controllers; no HOROVOD_CPU_OPERATIONS, so each runs its own tensor operations (Gloo's
  # under the MPI controller crash).
  if ! HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    "$py" -m pip wheel --no-deps --no-build-isolation -w "$work/dist" "$work/horovod-$HOROVOD_VERSION" >>"$log" 2>&1; then
    tail -n 20 "$log" >&2
    die "the Horovod build failed (last lines above); full log: $log"
  fi
  mkdir -p "$wheel_dir"
  mv "$work"/dist/horovod-*.whl "$wheel_dir/"
  rm -rf "$work"
}

horovod_stamp=$venv/.hvd-cpu-horovod
if [[ $(cat "$horovod_stamp" 2>/dev/null) != "$wheel_dir" ]] || ! horovod_ok; then
  compgen -G "$wheel_dir/horovod-*.whl" >/dev/null || build_horovod_wheel
  say "installing Horovod from $wheel_dir"
  "${pip[@]}" uninstall -y horovod 2>/dev/null
  "${pip[@]}" install "$wheel_dir"/horovod-*.whl
  horovod_ok || die "Horovod installed from $wheel_dir but 'import horovod.torch' fails; delete that folder and rerun"
  check=$("$venv/bin/horovodrun" --check-build 2>&1) || true
  if ! grep -q '\[X\] PyTorch' <<<"$check" || ! grep -q '\[X\] Gloo' <<<"$check" ||
    ! grep -q '\[X\] MPI' <<<"$check"; then
    "${pip[@]}" uninstall -y horovod
    die "Horovod from $wheel_dir lacks PyTorch, Gloo or MPI (horovodrun --check-build below); delete that folder and rerun"$'\n'"$check"
  fi
  echo "$wheel_dir" >"$horovod_stamp"
fi

# hvd-cpu itself; skipped when nothing it declares has changed since the last install
# (an install with the test extras also serves a later run without them).
extras=$([[ $with_test == 1 ]] && echo '[test]' || true)
stamp=$venv/.hvd-cpu-installed
installed="$(sha256sum "$repo/pyproject.toml" | cut -c1-16) $editable $repo"
up_to_date() {
  [[ -f $stamp && $(head -n1 "$stamp") == "$installed" ]] && { ((!with_test)) || grep -qx test "$stamp"; }
}
if ! up_to_date; then
  say "installing hvd-cpu$extras"
  if [[ $editable == 1 ]]; then
    "${pip[@]}" install -e "$repo$extras"
  else
    "${pip[@]}" install "$repo$extras"
  fi
  printf '%s\n%s\n' "$installed" "$([[ $with_test == 1 ]] && echo test)" >"$stamp"
fi

say "ready: $venv (torch $torch_version, Horovod $HOROVOD_VERSION with PyTorch, MPI (Open MPI $ompi_version) and Gloo)"
