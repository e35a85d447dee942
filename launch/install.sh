#!/usr/bin/env bash
# Install hvd-cpu, torch and the patched Horovod into one virtual environment (.venv).
#
# Steps: Debian packages, only when run as root with apt-get (a compiler, Open MPI, the test
# tools); the virtual environment (Python 3.11 to 3.13); torch, a CPU-only wheel where one can
# be had; hvd-cpu itself; then `hvd-cpu install-horovod` (hvd_cpu/horovod_build), which builds
# Horovod 0.28.1 with our patches for that torch, once, and caches the wheel. Without root
# nothing is installed system-wide: what is missing then and needs root is named in one line.
# A second run with the cache takes seconds.
#
# Usage: launch/install.sh [--test]     (--test also installs what the test suite needs)
# Environment:
#   HVD_CPU_VENV      virtual environment to create/use   (default: <repo>/.venv)
#   HVD_CPU_CACHE     where built wheels are kept          (default: ~/.cache/hvd-cpu)
#   HVD_CPU_EDITABLE  1: editable install of hvd-cpu (default), 0: a regular install
#   PYTHON            interpreter for a new venv, 3.11 to 3.13 (default: python3)
#   TORCH_SPEC        torch requirement                    (default: torch==2.13.0)
#   TORCH_INDEX_URL   where CPU-only torch wheels come from (default: PyTorch's CPU index;
#                     empty: the default index only, whose Linux torch is the CUDA build)
#   HVD_CPU_WITHOUT_MPI  1: build Horovod with Gloo only (default: with MPI, against the
#                     machine's Open MPI, else Open MPI from PyPI installed into the venv)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${HVD_CPU_VENV:-$repo/.venv}
editable=${HVD_CPU_EDITABLE:-1}
torch_spec=${TORCH_SPEC:-torch==2.13.0}
cpu_index=${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}
with_test=0
[[ ${1:-} == --test ]] && with_test=1

say() { printf 'install: %s\n' "$*" >&2; }
die() { printf 'install: error: %s\n' "$*" >&2; exit 1; }

# Debian packages, as root only: what the build needs (Debian's Open MPI for the MPI controller;
# without root, install-horovod takes Open MPI from PyPI), plus what the multi-host, SLURM
# and Spark tests need.
if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
  need_debs=()
  for tool in g++:g++ make:make mpirun:openmpi-bin mpicxx:libopenmpi-dev; do
    command -v "${tool%%:*}" >/dev/null || need_debs+=("${tool##*:}")
  done
  if ((with_test)); then
    command -v sshd >/dev/null || [[ -x /usr/sbin/sshd ]] || need_debs+=(openssh-server)
    command -v ssh >/dev/null || need_debs+=(openssh-client)
    command -v ip >/dev/null || need_debs+=(iproute2)
    # The compiler cache Horovod's build uses where a machine has it (its test; the fresh
    # machine's rebuilds).
    command -v ccache >/dev/null || need_debs+=(ccache)
    # A debugger that stops a rank at a chosen point inside Horovod (tests/test_elastic.py).
    command -v gdb >/dev/null || need_debs+=(gdb)
    # The SLURM tests' one-machine cluster. srun --mpi=pmix's plugin (in slurm-wlm-basic-plugins,
    # which slurmd pulls in) dlopens pmix2/lib/libpmix.so, which only libpmix-dev ships.
    for tool in munged:munge slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client; do
      command -v "${tool%%:*}" >/dev/null || [[ -x /usr/sbin/${tool%%:*} ]] || need_debs+=("${tool##*:}")
    done
    compgen -G '/usr/lib/*/pmix2/lib/libpmix.so' >/dev/null || need_debs+=(libpmix-dev)
    # The Spark tests' standalone cluster (pyspark 4 runs on Java 17 or 21).
    command -v java >/dev/null || need_debs+=(openjdk-17-jre-headless)
  fi
  if ((${#need_debs[@]})); then
    say "installing Debian packages: ${need_debs[*]}"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_debs[@]}" >/dev/null
  fi
elif ((with_test)); then
  say "not root: no system packages installed; tests that need sshd, network namespaces or SLURM skip"
fi

if [[ ! -x $venv/bin/python ]]; then
  python=${PYTHON:-$(command -v python3 || true)}
  [[ -n $python ]] || die "no python3 found; install Python 3.11 to 3.13 or set PYTHON=/path/to/python3"
  version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])') ||
    die "$python does not run; set PYTHON=/path/to/python3"
  case $version in
    3.11 | 3.12 | 3.13) ;;
    *) die "$python is Python $version; hvd-cpu supports Python 3.11 to 3.13 (what torch and our Horovod patches are tested on): set PYTHON=/path/to/python3.13" ;;
  esac
  say "creating virtual environment $venv (Python $version)"
  "$python" -m venv "$venv" ||
    die "could not create $venv with $python (Debian/Ubuntu: sudo apt-get install python$version-venv; or set PYTHON)"
fi
py=$venv/bin/python
pip=("$py" -m pip --disable-pip-version-check --quiet)

# torch first: Horovod is built against it. PyTorch's CPU-only wheels where they can be had
# (about 0.9 GB installed); else the default index's, which on Linux is the CUDA build.
if ! "$py" -c 'import torch' 2>/dev/null; then
  if [[ -n $cpu_index ]] && say "installing $torch_spec (CPU-only) from $cpu_index" &&
    "${pip[@]}" install --retries 1 --timeout 30 --index-url "$cpu_index" "$torch_spec" numpy 2>/dev/null; then
    :
  else
    [[ -z $cpu_index ]] || say "no CPU-only wheel of $torch_spec could be had from $cpu_index"
    say "installing $torch_spec from the default index (on Linux the CUDA build: a few GB with its nvidia packages; it runs on CPUs as well)"
    "${pip[@]}" install "$torch_spec" numpy || die "could not install $torch_spec"
  fi
  site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # A CPU-only torch has no nvidia or triton folder: du's complaint about them is no failure.
  size=$({ du -smc "$site"/torch "$site"/nvidia "$site"/triton 2>/dev/null || true; } | awk 'END { print $1 }')
  say "installed $("$py" -c 'import torch; print("torch", torch.__version__, "(CUDA build)" if torch.version.cuda else "(CPU-only build)")'), $size MB"
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

"$venv/bin/hvd-cpu" install-horovod
say "ready: $venv"
