"""The Kubeflow MPI Operator's contract (v0.8.2), emulated with the real image: the pods of the
rendered MPIJobs (deploy/kubernetes), each a podman container in a namespace host of its own
(tests/hosts.py), given exactly what the operator and the kubelet would give them, and running
the commands of the manifests themselves, not retyped.

What each pod gets, as the operator's controller makes it (pkg/controller/mpi_job_controller.go
at v0.8.2, ../shared/k8s/README.md): the job's ssh key Secret (an ECDSA P-521 key as id_rsa,
id_rsa.pub, authorized_keys; mode 0600 under /root/.ssh, the kubelet's 0644 elsewhere) mounted
read-only at sshAuthMountPath in the kubelet's `..data` layout; the launcher's /etc/mpi
(hostfile, one `<job>-worker-<i>.<job>.<namespace>.svc slots=N` line per worker, and
discover_hosts.sh) the same way; the operator's variables (K_MPI_JOB_ROLE, OMPI_MCA_*); the
pods' hostnames, and the workers' names resolving as the job's headless Service makes them.
From the pod specs: args ($(VAR) filled in as Kubernetes does), env (fieldRef included), CPU
and memory limits, the security context, every volume. The launcher starts once every
worker's readiness probe (a TCP connection) succeeds: launcherCreationPolicy
WaitForWorkersReady. A "preemption" is `podman stop` (SIGTERM to the container's PID 1, SIGKILL
after the pod's grace), a "retry" the launcher's pod made again.

Not emulated: the API server, scheduling, the cluster's DNS server (names come from
/etc/hosts), the CNI (one bridge), the kubelet's probes and restarts (the test waits and
restarts as they would). docs/kubernetes.md says what is proven here and what is not.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import torch

from .hosts import Host, Hosts, assert_ranks_numbered_by_host
from .jobs import demo_file, needs_root_and_apt, weights
from .kube import KUBE, container, only, pod_spec, render
from .podman import containers_conf, podman

pytestmark = [pytest.mark.container, pytest.mark.timeout(3600), needs_root_and_apt]

NAMESPACE = "default"  # the Kubernetes namespace the job is applied in
ROWS = 60_000  # the frame on the shared volume: 10 epochs (the manifests' default) in seconds
# The operator's labels on every pod of a job (kubeflow.org v2beta1 constants).
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
ROLE_LABEL = "training.kubeflow.org/job-role"


@pytest.fixture(scope="module")
def namespace_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    """Three nodes: the launcher's and one per worker. A bridge and subnet of their own."""
    folder = tmp_path_factory.mktemp("nodes")
    with Hosts(folder, ["k8sl", "k8sw0", "k8sw1"], sshd=False, bridge="hvdk0",
               subnet="198.18.2") as hosts:  # fmt: skip
        yield hosts


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared volume (the PVC), with the data where the manifests read it."""
    folder = tmp_path_factory.mktemp("shared")
    demo_file(folder / "data" / "frame.parquet", rows=ROWS)
    for writable in (folder, folder / "runs"):  # by the non-root variant's user too
        writable.mkdir(exist_ok=True)
        writable.chmod(0o777)
    return folder


def kubelet_volume(folder: Path, files: dict[str, tuple[str, int]]) -> Path:
    """A Secret's or ConfigMap's volume as the kubelet writes it: the files in a timestamped
    folder, `..data` pointing at it, and each name a link through `..data`."""
    stamp = time.strftime("..%Y_%m_%d_%H_%M_%S.000000000", time.gmtime())
    (folder / stamp).mkdir(parents=True)
    for name, (text, mode) in files.items():
        (folder / stamp / name).write_text(text)
        (folder / stamp / name).chmod(mode)
        (folder / name).symlink_to(f"..data/{name}")
    (folder / "..data").symlink_to(stamp)
    folder.chmod(0o1777)
    return folder


def expand(word: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) in command and args: a variable of the container's env, else kept."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), word)


@dataclass
class Pod:
    name: str  # the pod's hostname, as the operator names it
    role: str  # Launcher or Worker
    node: Host
    container: str  # podman's name for it


class Job:
    """One rendered MPIJob, its pods made as the operator and the kubelet make them."""

    def __init__(self, docs: list[dict], nodes: Hosts, shared: Path, image: str, folder: Path):
        self.docs, self.nodes, self.shared, self.image = docs, nodes, shared, image
        self.folder = folder
        self.mpijob = only(docs, "MPIJob")
        self.name = self.mpijob["metadata"]["name"]
        self.spec = self.mpijob["spec"]
        workers = self.spec["mpiReplicaSpecs"]["Worker"]["replicas"]
        assert workers == len(nodes.hosts) - 1
        self.workers = [
            Pod(f"{self.name}-worker-{i}", "Worker", nodes.hosts[i + 1], f"k8s-{self.name}-w{i}")
            for i in range(workers)
        ]
        self.launcher = Pod(f"{self.name}-launcher", "Launcher", nodes.hosts[0],
                            f"k8s-{self.name}-launcher")  # fmt: skip
        self.key = self._ssh_key()

    def service_name(self, pod: Pod) -> str:
        return f"{pod.name}.{self.name}.{NAMESPACE}.svc"

    def _ssh_key(self) -> tuple[str, str]:
        """The operator's Secret `<job>-ssh`: a P-521 key in SEC1 PEM, its public half."""
        where = self.folder / "key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-b", "521", "-m", "PEM", "-N", "",
                        "-f", str(where)], check=True)  # fmt: skip
        private = where.read_text()
        assert private.startswith("-----BEGIN EC PRIVATE KEY-----")
        public = " ".join((self.folder / "key.pub").read_text().split()[:2]) + "\n"
        return private, public

    def hosts_file(self, pod: Pod) -> Path:
        """/etc/hosts as the pod resolves names: its own (the kubelet's line) and the workers'
        Service names (the cluster's DNS, which serves ready pods only)."""
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost"]
        for other in [self.launcher, *self.workers]:
            fqdn = f"{self.service_name(other)}.cluster.local"
            names = [fqdn, self.service_name(other)] if other.role == "Worker" else [fqdn]
            if other is pod:
                names.append(pod.name)
            if other is pod or other.role == "Worker":
                lines.append(f"{other.node.address} {' '.join(names)}")
        path = self.folder / f"hosts-{pod.name}"
        path.write_text("\n".join(lines) + "\n")
        return path

    def operator_env(self, pod: Pod) -> dict[str, str]:
        env = {"K_MPI_JOB_ROLE": pod.role.lower()}
        if pod.role == "Launcher":
            assert self.spec["mpiImplementation"] == "OpenMPI"
            env |= {
                "OMPI_MCA_orte_keep_fqdn_hostnames": "true",
                "OMPI_MCA_orte_default_hostfile": "/etc/mpi/hostfile",
                "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10",
                "OMPI_MCA_orte_set_default_slots": str(self.spec["slotsPerWorker"]),
                "NVIDIA_VISIBLE_DEVICES": "",
                "NVIDIA_DRIVER_CAPABILITIES": "",
            }
        return env

    def env(self, pod: Pod) -> dict[str, str]:
        """The container's env from its spec (fieldRef to the operator's labels), then the
        operator's, in that order (as the controller appends them)."""
        labels = {JOB_NAME_LABEL: self.name, ROLE_LABEL: pod.role.lower()}
        env: dict[str, str] = {}
        for entry in container(self.mpijob, pod.role).get("env", []):
            if "value" in entry:
                env[entry["name"]] = expand(entry["value"], env)
                continue
            path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
            assert label, f"a fieldRef this emulation does not know: {path}"
            env[entry["name"]] = labels[label[1]]
        return env | self.operator_env(pod)

    def volumes(self, pod: Pod) -> list[str]:
        """podman's -v/--mount for each of the container's volumeMounts, and the operator's."""
        spec, main = pod_spec(self.mpijob, pod.role), container(self.mpijob, pod.role)
        security = spec.get("securityContext", {})
        by_name = {v["name"]: v for v in spec.get("volumes", [])}
        options: list[str] = []
        for mount in main.get("volumeMounts", []):
            volume = by_name[mount["name"]]
            ro = ":ro" if mount.get("readOnly") else ""
            if "persistentVolumeClaim" in volume:
                options += ["-v", f"{self.shared}:{mount['mountPath']}{ro}"]
            elif "configMap" in volume:
                data = self.config_map(volume["configMap"]["name"])
                assert "subPath" in mount, "a whole ConfigMap volume: not used by the manifests"
                path = self.folder / f"{pod.name}-{mount['name']}"
                path.write_text(data[mount["subPath"]])
                options += ["-v", f"{path}:{mount['mountPath']}:ro"]
            elif volume.get("emptyDir", {}).get("medium") == "Memory":
                assert mount["mountPath"] == "/dev/shm", mount
                options += ["--shm-size", volume["emptyDir"]["sizeLimit"].replace("Gi", "g")]
            elif "emptyDir" in volume:  # a new, empty folder for each pod, open to its users
                path = self.folder / f"{pod.name}-{mount['name']}-{time.monotonic_ns()}"
                path.mkdir(mode=0o777)
                path.chmod(0o777)
                options += ["-v", f"{path}:{mount['mountPath']}{ro}"]
            else:
                raise AssertionError(f"a volume this emulation does not know: {volume}")
        # The operator's: its ssh key, and the launcher's /etc/mpi.
        root = self.spec["sshAuthMountPath"] == "/root/.ssh"
        mode = 0o600 if root else 0o644
        private, public = self.key
        secret = kubelet_volume(
            self.folder / f"{pod.name}-ssh-{time.monotonic_ns()}",
            {"id_rsa": (private, mode), "id_rsa.pub": (public, mode),
             "authorized_keys": (public, mode)},
        )  # fmt: skip
        if "fsGroup" in security:  # the kubelet gives the volume's files to the pod's group
            for path in secret.rglob("*"):
                os.lchown(path, -1, security["fsGroup"])
        options += ["-v", f"{secret}:{self.spec['sshAuthMountPath']}:ro"]
        if pod.role == "Launcher":
            slots = self.spec["slotsPerWorker"]
            hostfile = "".join(f"{self.service_name(w)} slots={slots}\n" for w in self.workers)
            discover = "#!/bin/sh\n" + "".join(
                f"echo {self.service_name(w)}\n" for w in self.workers if self.running(w)
            )
            config = kubelet_volume(
                self.folder / f"{pod.name}-config-{time.monotonic_ns()}",
                {"hostfile": (hostfile, 0o444), "discover_hosts.sh": (discover, 0o555)},
            )
            options += ["-v", f"{config}:/etc/mpi:ro"]
        return options

    def config_map(self, name: str) -> dict[str, str]:
        (found,) = [
            d for d in self.docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name
        ]
        return found["data"]

    def security(self, pod: Pod) -> list[str]:
        """The pod's and container's securityContext, as podman says it."""
        spec, main = pod_spec(self.mpijob, pod.role), container(self.mpijob, pod.role)
        pod_context, context = spec.get("securityContext", {}), main.get("securityContext", {})
        options: list[str] = []
        if "runAsUser" in pod_context:
            options += ["--user", f"{pod_context['runAsUser']}:{pod_context.get('runAsGroup', 0)}"]
        if "fsGroup" in pod_context:
            options += ["--group-add", str(pod_context["fsGroup"])]
        if "ALL" in context.get("capabilities", {}).get("drop", []):
            options += ["--cap-drop", "all"]
        if context.get("allowPrivilegeEscalation") is False:
            options += ["--security-opt", "no-new-privileges"]
        return options

    def run_options(self, pod: Pod) -> list[str]:
        main = container(self.mpijob, pod.role)
        assert "command" not in main  # the image's entrypoint stays
        limits = main["resources"]["limits"]
        env = self.env(pod)
        return [
            "--name", pod.container, "--hostname", pod.name,
            "--network", f"ns:/run/netns/{pod.node.name}",
            "--no-hosts", "-v", f"{self.hosts_file(pod)}:/etc/hosts:ro",
            "--cpus", str(limits["cpu"]), "--memory", limits["memory"].replace("Gi", "g"),
            *[f"--env={k}={v}" for k, v in env.items()],
            *self.security(pod), *self.volumes(pod),
            self.image, *[expand(word, env) for word in main["args"]],
        ]  # fmt: skip

    def start_worker(self, pod: Pod) -> None:
        started = podman("run", "-d", *self.run_options(pod))
        assert started.returncode == 0, started.stderr

    def running(self, pod: Pod) -> bool:
        state = podman("inspect", "--format", "{{.State.Running}}", pod.container)
        return state.stdout.strip() == "true"

    def ready(self, pod: Pod) -> bool:
        """The worker's readiness probe: a TCP connection to its port."""
        port = container(self.mpijob, "Worker")["readinessProbe"]["tcpSocket"]["port"]
        try:
            socket.create_connection((pod.node.address, port), timeout=1).close()
        except OSError:
            return False
        return True

    def wait_until_ready(self, pod: Pod, seconds: float = 60) -> None:
        deadline = time.monotonic() + seconds
        while not self.ready(pod):
            assert self.running(pod), self.logs(pod)
            assert time.monotonic() < deadline, f"{pod.name} not ready: {self.logs(pod)}"
            time.sleep(0.5)

    def start_launcher(self) -> subprocess.Popen[str]:
        """The launcher's pod, made (WaitForWorkersReady) and run to its end."""
        return subprocess.Popen(
            ["podman", "run", "--rm", *self.run_options(self.launcher)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **containers_conf()},
        )  # fmt: skip

    def stop(self, pod: Pod) -> int:
        """What the kubelet does to a pod that is deleted: SIGTERM to PID 1, SIGKILL after
        the pod's grace. Its exit code."""
        grace = pod_spec(self.mpijob, pod.role)["terminationGracePeriodSeconds"]
        podman("stop", "-t", str(grace), pod.container, timeout=grace + 30)
        code = podman("inspect", "--format", "{{.State.ExitCode}}", pod.container)
        podman("rm", "--force", pod.container)
        return int(code.stdout.strip())

    def logs(self, pod: Pod) -> str:
        logs = podman("logs", pod.container)
        return logs.stdout + logs.stderr

    def processes(self, pod: Pod, pattern: str) -> str:
        return podman("exec", pod.container, "pgrep", "-af", pattern).stdout.strip()

    def output(self) -> Path:
        return self.shared / "runs" / self.name


@contextmanager
def pods(job: Job) -> Iterator[Job]:
    """The job's workers, started and ready; every container of the job gone at the end."""
    try:
        for worker in job.workers:
            job.start_worker(worker)
        for worker in job.workers:
            job.wait_until_ready(worker)
        yield job
    finally:
        names = [p.container for p in (job.launcher, *job.workers)]
        podman("rm", "--force", "--ignore", "--time", "0", *names)
        left = podman("ps", "--all", "--format", "{{.Names}}").stdout.split()
        assert not set(names) & set(left), left


def finish(launcher: subprocess.Popen[str], seconds: float = 600) -> tuple[int, str]:
    out, _ = launcher.communicate(timeout=seconds)
    return launcher.returncode, out


def trained(job: Job, controller: str) -> dict[str, torch.Tensor]:
    """The job's ranks: slotsPerWorker on each worker pod, in order, on `controller`, one
    model; its parameters."""
    ranks = json.loads((job.output() / "ranks.json").read_text())
    slots = job.spec["slotsPerWorker"]
    assert [r["host"] for r in ranks] == [w.name for w in job.workers for _ in range(slots)]
    assert_ranks_numbered_by_host(ranks, [w.name for w in job.workers], slots)
    assert {r["controller"] for r in ranks} == {controller}
    assert len({r["param_sha256"] for r in ranks}) == 1
    return weights(job.output())


# Sized for this machine's 2 CPUs, as docs/kubernetes.md tells a user to size the job for
# their nodes: one CPU and one rank per worker. MPI's ranks wait by polling: 4 of them on 2
# CPUs (the base's size) spend 85% of the job waiting (210 s of training, against seconds).
ONE_CPU_WORKERS = """
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - {overlay}
patches:
  - target:
      kind: MPIJob
    patch: |
      - op: replace
        path: /spec/slotsPerWorker
        value: 1
      - op: replace
        path: /spec/mpiReplicaSpecs/Worker/template/spec/containers/0/resources/limits/cpu
        value: "1"
      - op: replace
        path: /spec/mpiReplicaSpecs/Worker/template/spec/containers/0/resources/requests/cpu
        value: "1"
      - op: test
        path: /spec/mpiReplicaSpecs/Launcher/template/spec/containers/0/args/3
        value: -np
      - op: replace
        path: /spec/mpiReplicaSpecs/Launcher/template/spec/containers/0/args/4
        value: "2"
"""


def make_job(overlay: str, kubectl: str, nodes: Hosts, shared: Path, image: str,
             folder: Path, name: str | None = None, one_cpu: bool = False) -> Job:  # fmt: skip
    """The overlay's MPIJob, as applied (renamed to `name`, if given: its own output folder;
    with `one_cpu`, through ONE_CPU_WORKERS)."""
    source = KUBE / overlay
    if one_cpu:
        source = folder / "sized"
        source.mkdir()
        overlay_path = os.path.relpath(KUBE / overlay, source)  # kustomize takes no absolute one
        (source / "kustomization.yaml").write_text(ONE_CPU_WORKERS.format(overlay=overlay_path))
    docs = render(kubectl, source)
    if name:
        only(docs, "MPIJob")["metadata"]["name"] = name
    return Job(docs, nodes, shared, image, folder)


def train_across_pods(job: Job) -> None:
    with pods(job):
        started = time.monotonic()
        code, out = finish(job.start_launcher())
        assert code == 0, out
        print(f"{job.name}: {time.monotonic() - started:.0f} s\n{out[-1500:]}")
        for worker in job.workers:
            assert job.processes(worker, "hvd-cpu train") == ""


@pytest.fixture(scope="module")
def one_host(image: str, shared: Path) -> Callable[[Job], dict[str, torch.Tensor]]:
    """What a job across the worker pods must end with: the launcher's `hvd-cpu train`, as
    the manifest has it, run by as many ranks in one container, over Gloo."""

    @cache
    def trained_with(words: tuple[str, ...]) -> dict[str, torch.Tensor]:
        output = f"one-host-{len(list(shared.glob('runs/one-host-*')))}"
        train = [expand(w, {"HVD_CPU_JOB": output}) for w in words[words.index("hvd-cpu") :]]
        np = words[words.index("-np") + 1]
        done = podman("run", "--rm", "-v", f"{shared}:/shared", "--shm-size", "1g", image,
                      "horovodrun", "--gloo", "-np", np, *train)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        return weights(shared / "runs" / output)

    return lambda job: trained_with(tuple(container(job.mpijob, "Launcher")["args"]))


@pytest.fixture(scope="module")
def gloo_job(kubectl, namespace_hosts, shared, image, tmp_path_factory) -> Job:
    """The gloo overlay's job, trained across the two worker pods, never stopped."""
    job = make_job("gloo", kubectl, namespace_hosts, shared, image,
                   tmp_path_factory.mktemp("gloo"))  # fmt: skip
    train_across_pods(job)
    return job


def assert_same_model(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """The same training in another order of summation: equal to float32's rounding."""
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


def digest(job: Job) -> str:
    (found,) = {r["param_sha256"] for r in json.loads((job.output() / "ranks.json").read_text())}
    return found


@pytest.mark.parametrize("overlay", ["gloo", "mpi", "nonroot"])
def test_the_job_trains_across_two_worker_pods_as_on_one_host(
    overlay, kubectl, namespace_hosts, shared, image, one_host, gloo_job, tmp_path
):
    """Each variant as applied: ssh with the operator's key (read-only, its modes), the
    hostfile's names, the workers' sshd (as root; as user 1000 under the restricted profile),
    the launcher's wait, horovodrun's ranks slotsPerWorker to a pod."""
    job = gloo_job
    if overlay != "gloo":
        job = make_job(overlay, kubectl, namespace_hosts, shared, image, tmp_path,
                       one_cpu=overlay == "mpi")  # fmt: skip
        train_across_pods(job)
    assert_same_model(trained(job, "mpi" if overlay == "mpi" else "gloo"), one_host(job))


def test_a_preempted_worker_stops_the_job_with_a_checkpoint_and_the_retry_resumes(
    kubectl, namespace_hosts, shared, image, gloo_job, tmp_path
):
    """Worker 0 deleted (preemption, a drain): SIGTERM to its PID 1, the entrypoint's
    `worker`, which passes it on to its ranks. Every rank stops at one step, rank 0 saves
    that point and exits 75, and so does horovodrun: the launcher's pod fails. The operator
    makes the worker again; the launcher Job's retry, started before that worker answers,
    waits for it, goes on from the checkpoint (--auto-resume) and ends with the parameters of
    the job never stopped, bit for bit."""
    job = make_job("gloo", kubectl, namespace_hosts, shared, image, tmp_path,
                   name=f"{gloo_job.name}-preempted")  # fmt: skip
    first, second = job.workers
    with pods(job):
        launcher = job.start_launcher()
        seen = []
        for line in launcher.stdout:
            seen.append(line)
            if line.startswith("[0]<stdout>:Epoch 2:"):
                break
        assert launcher.poll() is None, "".join(seen)
        asked = time.monotonic()
        assert job.stop(first) == 0  # the ranks stopped, then sshd: the pod ends cleanly
        code, out = finish(launcher, seconds=60)
        stopped = time.monotonic() - asked
        out = "".join(seen) + out
        assert code == 75, out
        assert stopped < 30, f"{stopped:.0f} s"
        print(f"preempted: the launcher ended {stopped:.1f} s after the SIGTERM")
        assert "hvd-cpu: rank 0: stopped by SIGTERM after step" in out
        assert (job.output() / "checkpoint.pt").exists()
        assert job.processes(second, "hvd-cpu train") == ""

        retry = job.start_launcher()
        time.sleep(6)  # the retry waits for worker 0, which is not there yet
        assert retry.poll() is None
        assert job.processes(second, "hvd-cpu train") == ""
        job.start_worker(first)
        code, out = finish(retry)
        assert code == 0, out
        resumed = [line for line in out.splitlines() if line.startswith("[0]<stdout>:Epoch")]
        assert resumed and not resumed[0].startswith("[0]<stdout>:Epoch 1:"), out
    trained(job, "gloo")
    assert digest(job) == digest(gloo_job)
