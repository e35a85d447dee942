# hvd-cpu in a container: Horovod (patched for current PyTorch; MPI + Gloo) + Debian's Open MPI
# + CPU-only torch + hvd-cpu.
#
#   docker build -t hvd-cpu .
#   docker run --rm hvd-cpu              # the demo: horovodrun --gloo -np 4 hvd-cpu train --auto-resume
#   docker run --rm -v "$PWD/data:/data" hvd-cpu horovodrun --gloo -np 4 hvd-cpu train --data /data/frame.parquet
#   docker run --rm hvd-cpu horovodrun --mpi -np 2 hvd-cpu train                     # MPI
#   docker run --rm hvd-cpu mpirun -np 2 hvd-cpu train                               # MPI
#
# Name the controller: plain `horovodrun` picks MPI when it is built in, as here, and MPI pays
# only with at most one rank per core (docs/usage.md#controllers-gloo-or-mpi). Several
# containers make one job in multi-host mode (HVD_CPU_SSHD=1), and on Kubernetes the pods start
# the entrypoint's `worker` and `launcher` modes (launch/container-entrypoint.sh).
#
# Build arguments: BASE_IMAGE (Debian 13 trixie, Python 3.13; docker.io/library/debian:bookworm-slim
# gives Debian 12 with Python 3.11), TORCH_SPEC, TORCH_INDEX_URL (where CPU-only torch wheels
# come from; empty: the default index, which serves CUDA builds of several GB), PIP_FIND_LINKS
# (a folder of wheels mounted at build time) and PIP_CERT (a CA bundle mounted at build time,
# behind a TLS-inspecting proxy: added to the build stage's trust store, which is all that
# trixie's pip reads), both optional.
ARG BASE_IMAGE=docker.io/library/debian:trixie-slim

FROM ${BASE_IMAGE} AS build
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS=
ARG PIP_CERT=
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv python3-dev g++ make cmake ca-certificates \
      openmpi-bin libopenmpi-dev \
 && rm -rf /var/lib/apt/lists/* \
 && if [ -n "$PIP_CERT" ]; then cat "$PIP_CERT" >>/etc/ssl/certs/ca-certificates.crt; fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY hvd_cpu hvd_cpu
COPY launch launch
# The same install script as a local set-up; a regular (not editable) install into /opt/venv.
# HVD_CPU_CACHE may name a cache folder mounted at build time that holds a Horovod wheel
# built for this image's Debian, Python, torch and Open MPI (its cache key); the default is
# empty and thrown away.
ARG HVD_CPU_CACHE=/tmp/hvd-cpu-cache
RUN env HVD_CPU_VENV=/opt/venv HVD_CPU_EDITABLE=0 HVD_CPU_CACHE="$HVD_CPU_CACHE" \
    TORCH_SPEC="$TORCH_SPEC" TORCH_INDEX_URL="$TORCH_INDEX_URL" PIP_NO_CACHE_DIR=1 \
    ${PIP_FIND_LINKS:+PIP_FIND_LINKS=$PIP_FIND_LINKS} ${PIP_CERT:+PIP_CERT=$PIP_CERT} \
    bash launch/install.sh \
 && find /opt/venv -name __pycache__ -prune -exec rm -rf {} + \
 && rm -rf /tmp/hvd-cpu-cache

# The image that runs: Python, Open MPI's runtime (mpirun, orted, libmpi: the library Horovod's
# MPI controller and mpi4py load), ssh for multi-host jobs, the environment built above. No
# compilers, no build caches. openmpi-bin also ships the compiler wrappers (mpicc, mpicxx, ...),
# which only fail without a compiler: their links are removed so that no one mistakes them for
# a tool chain (mpirun, mpiexec and orted stay).
FROM ${BASE_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 libstdc++6 openssh-client openssh-server procps openmpi-bin \
 && update-alternatives --remove-all mpi \
 && rm -rf /var/lib/apt/lists/* /etc/ssh/ssh_host_* \
 && mkdir -p /run/sshd
COPY --from=build /opt/venv /opt/venv
# Also on the PATH of ssh sessions (multi-host mode), which do not see the ENV below.
# --check-build fills horovodrun's cache of build checks again: it is keyed on the extension's
# mtime, which the copy between stages does not keep exactly.
RUN ln -s /opt/venv/bin/hvd-cpu /opt/venv/bin/horovodrun /usr/local/bin/ \
 && horovodrun --check-build >/dev/null
COPY launch/container-entrypoint.sh /usr/local/bin/hvd-cpu-entrypoint
# Root is the container's user: Open MPI's mpirun may run as root without --allow-run-as-root.
ENV PATH=/opt/venv/bin:$PATH OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
WORKDIR /work
ENTRYPOINT ["hvd-cpu-entrypoint"]
# --auto-resume: the same command run again (a restarted container with its output folder
# mounted) goes on from the checkpoint of this job instead of refusing the folder.
CMD ["horovodrun", "--gloo", "-np", "4", "hvd-cpu", "train", "--auto-resume"]
