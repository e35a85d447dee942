"""deploy/kubernetes/: every overlay rendered by the real `kubectl kustomize`, then checked as the
Kubeflow MPI Operator v0.8.2 would check it (its CRD's schema, strictly, and its controller's rules)
and for what hvd-cpu needs of it: one rank per CPU, one ssh port, --auto-resume, retries, the
`restricted` Pod Security profile for the non-root variant, SIGTERM passed on to the ranks.

No cluster runs here: what a cluster alone can show (pods scheduled, ssh between them, a job
trained and resumed) is not proven by these tests (docs/kubernetes.md).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml

from .jobs import REPO
from .kube import KUBE, container, only, pod_spec, render

CRD = KUBE / "crd" / "kubeflow.org_mpijobs-v0.8.2.yaml"
OVERLAYS = ("gloo", "mpi", "nonroot", "elastic")
CONTROLLER = {"gloo": "--gloo", "mpi": "--mpi", "nonroot": "--gloo", "elastic": "--gloo"}
ROLES = ("Launcher", "Worker")
JOB_NAME_LABEL = "training.kubeflow.org/job-name"  # set by the operator on every pod of a job


# --- rendering ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def renders(kubectl: str) -> dict[str, list[dict]]:
    return {name: render(kubectl, KUBE / name) for name in (*OVERLAYS, "storage")}


def horovodrun(job: dict) -> tuple[list[str], list[str]]:
    """The launcher's horovodrun options and `hvd-cpu train` options: its args are the image
    entrypoint's `launcher` mode, then horovodrun's command line."""
    mode, program, *words = container(job, "Launcher")["args"]
    assert (mode, program) == ("launcher", "horovodrun"), container(job, "Launcher")["args"]
    at = words.index("hvd-cpu")
    assert words[at + 1] == "train", words
    return words[:at], words[at + 2 :]


def value_of(words: list[str], option: str) -> str:
    assert words.count(option) == 1, f"{option} in {words}"
    return words[words.index(option) + 1]


def config_map(docs: list[dict], job: dict, role: str, volume: str) -> dict:
    """The rendered ConfigMap a pod's volume names (its name carries kustomize's hash)."""
    (source,) = [v["configMap"] for v in pod_spec(job, role)["volumes"] if v["name"] == volume]
    found = [
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == source["name"]
    ]
    assert len(found) == 1, f"ConfigMap {source['name']} named by {role} volume {volume}"
    return found[0]


def quantity(q: str | int | float) -> float:
    """A Kubernetes resource quantity as a number ("500m" = 0.5, "4Gi" = 4 * 2**30)."""
    units = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20}
    units |= {"Gi": 2**30, "Ti": 2**40}
    number, unit = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(q)).groups()
    return float(number) * units.get(unit, 1)


# --- the CRD's schema, strictly -----------------------------------------------------------


@cache
def job_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v2beta1"]
    return version["schema"]["openAPIV3Schema"]


@cache
def pod_spec_schema() -> dict:
    """The PodSpec schema the CRD holds for a replica's template (a Pod's spec)."""
    replica = job_schema()["properties"]["spec"]["properties"]["mpiReplicaSpecs"]
    return replica["additionalProperties"]["properties"]["template"]["properties"]["spec"]


# The API server checks an object's metadata as ObjectMeta (the CRD gives it as a bare object);
# these are the fields a manifest may set.
OBJECT_META = {"name", "namespace", "generateName", "labels", "annotations", "finalizers"}


def schema_errors(value: dict, schema: dict) -> list[str]:
    validator = jsonschema.Draft4Validator(schema)
    return [f"{e.json_path}: {e.message}" for e in validator.iter_errors(value)]


def structural_errors(value: object, schema: dict, path: str = "$") -> list[str]:
    """What the schema's types cannot say: a field it does not declare (the API server drops it
    without a word, or kubectl's strict field validation refuses it), unless the schema keeps
    unknown fields there; and two items of a list-map (containers, env, ports...) with one key."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    errors = []
    if isinstance(value, dict):
        declared, extra = schema.get("properties", {}), schema.get("additionalProperties")
        for key, item in value.items():
            if key in declared:
                errors += structural_errors(item, declared[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                errors += structural_errors(item, extra, f"{path}.{key}")
            elif extra is not True:
                errors.append(f"{path}.{key}: not in the schema")
    elif isinstance(value, list):
        if schema.get("x-kubernetes-list-type") == "map":
            keys = schema["x-kubernetes-list-map-keys"]
            seen = Counter(tuple(item.get(k) for k in keys) for item in value)
            errors += [f"{path}: {keys} {k} twice" for k, n in seen.items() if n > 1]
        elif schema.get("x-kubernetes-list-type") == "set":
            seen = Counter(json.dumps(item, sort_keys=True) for item in value)
            errors += [f"{path}: {k} twice" for k, n in seen.items() if n > 1]
        for i, item in enumerate(value):
            errors += structural_errors(item, schema.get("items", {}), f"{path}[{i}]")
    return errors


def strict_errors(job: dict) -> list[str]:
    meta = sorted(set(job.get("metadata", {})) - OBJECT_META)
    without_meta = {k: v for k, v in job.items() if k != "metadata"}
    return (
        [f"$.metadata.{key}: not in ObjectMeta" for key in meta]
        + schema_errors(job, job_schema())
        + structural_errors(without_meta, job_schema())
    )


# --- the operator's controller ------------------------------------------------------------


def with_operator_defaults(job: dict) -> dict:
    """The MPIJob as the controller validates it: after v2beta1's SetDefaults_MPIJob, which
    fills pointers left nil and strings left empty (Go's zero value: "" counts as unset)."""
    job = copy.deepcopy(job)
    spec = job["spec"]
    policy = spec.setdefault("runPolicy", {})
    if policy.get("cleanPodPolicy") is None:
        policy["cleanPodPolicy"] = "None"
    if spec.get("slotsPerWorker") is None:
        spec["slotsPerWorker"] = 1
    for field, default in (
        ("sshAuthMountPath", "/root/.ssh"),
        ("mpiImplementation", "OpenMPI"),
        ("launcherCreationPolicy", "AtStartup"),
    ):
        spec[field] = spec.get(field) or default
    replicas = spec.get("mpiReplicaSpecs") or {}
    for role, restart, count in (("Launcher", "OnFailure", 1), ("Worker", "Never", 0)):
        if replicas.get(role) is not None:
            replicas[role]["restartPolicy"] = replicas[role].get("restartPolicy") or restart
            if replicas[role].get("replicas") is None:
                replicas[role]["replicas"] = count
    return job


DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def replica_errors(role: str, replica: dict) -> list[str]:
    errors = []
    if replica.get("replicas") is None:
        errors.append(f"{role}.replicas: required")
    if replica.get("restartPolicy") not in ("Never", "OnFailure"):
        errors.append(f"{role}.restartPolicy: {replica.get('restartPolicy')} not Never/OnFailure")
    if not replica.get("template", {}).get("spec", {}).get("containers"):
        errors.append(f"{role}.template.spec.containers: at least one")
    return errors


def run_policy_errors(policy: dict) -> list[str]:
    errors = []
    if policy.get("cleanPodPolicy") not in ("None", "Running", "All"):
        errors.append(f"cleanPodPolicy: {policy.get('cleanPodPolicy')}")
    for field in ("ttlSecondsAfterFinished", "activeDeadlineSeconds", "backoffLimit"):
        if policy.get(field) is not None and policy[field] < 0:
            errors.append(f"runPolicy.{field}: negative")
    if policy.get("managedBy") not in (
        None,
        "kubeflow.org/mpi-operator",
        "kueue.x-k8s.io/multikueue",
    ):
        errors.append(f"runPolicy.managedBy: {policy['managedBy']}")
    return errors


def controller_errors(job: dict) -> list[str]:
    """The operator's own rules beyond the schema (pkg/apis/kubeflow/validation/validation.go at
    v0.8.2). A job that breaks one is accepted by the API server and then never started: the
    controller only records a ValidationError event."""
    job = with_operator_defaults(job)
    spec, errors = job["spec"], []
    replicas = spec.get("mpiReplicaSpecs")
    if not replicas:
        return ["mpiReplicaSpecs: required"]
    workers = (replicas.get("Worker") or {}).get("replicas") or 1
    last_pod = f"{job['metadata']['name']}-worker-{max(workers, 1) - 1}"
    if len(last_pod) > 63 or not DNS_1035_LABEL.fullmatch(last_pod):
        errors.append(f"metadata.name: {last_pod} is no DNS-1035 label")
    if replicas.get("Launcher") is None:
        errors.append("mpiReplicaSpecs.Launcher: required")
    else:
        errors += replica_errors("Launcher", replicas["Launcher"])
        if replicas["Launcher"].get("replicas") not in (None, 1):
            errors.append("Launcher.replicas: must be 1")
    if replicas.get("Worker") is not None:
        errors += replica_errors("Worker", replicas["Worker"])
        if (replicas["Worker"].get("replicas") or 0) < 1:
            errors.append("Worker.replicas: must be at least 1")
    if spec.get("slotsPerWorker") is None or spec["slotsPerWorker"] < 0:
        errors.append("slotsPerWorker: required, not negative")
    errors += run_policy_errors(spec["runPolicy"])
    if not spec.get("sshAuthMountPath"):
        errors.append("sshAuthMountPath: required")
    if spec.get("mpiImplementation") not in ("OpenMPI", "Intel", "MPICH"):
        errors.append(f"mpiImplementation: {spec.get('mpiImplementation')}")
    # An enum in types.go that the generated schema lacks (its marker is misspelt): any other
    # value makes the controller wait for the workers, as WaitForWorkersReady does.
    if spec.get("launcherCreationPolicy") not in ("AtStartup", "WaitForWorkersReady"):
        errors.append(f"launcherCreationPolicy: {spec.get('launcherCreationPolicy')}")
    return errors


def pod_as_operator_makes_it(job: dict, role: str) -> dict:
    """A replica's pod spec with what the controller adds (mpi_job_controller.go at v0.8.2):
    the ssh Secret at sshAuthMountPath on both, the hostfile ConfigMap at /etc/mpi on the
    launcher, its environment, and the replica's restartPolicy."""
    job = with_operator_defaults(job)
    spec = copy.deepcopy(pod_spec(job, role))
    main = spec["containers"][0]
    if role == "Worker" and not main.get("command") and not main.get("args"):
        main["command"] = ["/usr/sbin/sshd", "-De"]
    spec["restartPolicy"] = job["spec"]["mpiReplicaSpecs"][role]["restartPolicy"]
    name = job["metadata"]["name"]
    spec.setdefault("volumes", []).append(
        {"name": "ssh-auth", "secret": {"secretName": f"{name}-ssh"}}
    )
    main.setdefault("volumeMounts", []).append(
        {"name": "ssh-auth", "mountPath": job["spec"]["sshAuthMountPath"]}
    )
    main.setdefault("env", []).append({"name": "K_MPI_JOB_ROLE", "value": role.lower()})
    if role == "Launcher":
        spec["volumes"].append({"name": "mpi-job-config", "configMap": {"name": f"{name}-config"}})
        main["volumeMounts"].append({"name": "mpi-job-config", "mountPath": "/etc/mpi"})
    return spec


# --- Pod Security Standards: `restricted` -------------------------------------------------
# As the Kubernetes docs (concepts/security/pod-security-standards) and Pod Security
# admission's checks state them; `restricted` includes `baseline`. A pod in a user namespace
# (hostUsers: false) is allowed more; these manifests do not use one, so that is left out.

RESTRICTED_VOLUMES = {"configMap", "downwardAPI", "emptyDir", "projected", "secret", "csi"}
RESTRICTED_VOLUMES |= {"persistentVolumeClaim", "ephemeral", "image"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.tcp_syncookies"}
SAFE_SYSCTLS |= {"net.ipv4.ping_group_range", "net.ipv4.ip_unprivileged_port_start"}
SAFE_SYSCTLS |= {"net.ipv4.ip_local_reserved_ports", "net.ipv4.tcp_keepalive_time"}
SAFE_SYSCTLS |= {"net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl"}
SAFE_SYSCTLS |= {"net.ipv4.tcp_keepalive_probes", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"}
SAFE_SYSCTLS |= {"net.ipv4.tcp_slow_start_after_idle", "net.ipv4.tcp_notsent_lowat"}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t"}
PROFILE_TYPES = {"RuntimeDefault", "Localhost"}


def context_violations(where: str, context: dict) -> list[str]:
    """Rules on a pod's or a container's securityContext alike."""
    found = []
    if context.get("runAsUser") == 0:
        found.append(f"{where}.runAsUser: 0")
    selinux = context.get("seLinuxOptions", {})
    if selinux.get("type") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
        found.append(f"{where}.seLinuxOptions: {selinux}")
    if context.get("appArmorProfile", {}).get("type", "RuntimeDefault") not in PROFILE_TYPES:
        found.append(f"{where}.appArmorProfile: not RuntimeDefault/Localhost")
    return found


def container_violations(c: dict, pod_context: dict) -> list[str]:
    where, context = f"container {c['name']}", c.get("securityContext", {})
    found = context_violations(where, context)
    if context.get("privileged"):
        found.append(f"{where}: privileged")
    if context.get("allowPrivilegeEscalation") is not False:
        found.append(f"{where}: allowPrivilegeEscalation is not false")
    capabilities = context.get("capabilities", {})
    if "ALL" not in capabilities.get("drop", []):
        found.append(f"{where}: capabilities do not drop ALL")
    if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
        found.append(f"{where}: capabilities add {capabilities['add']}")
    if context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is not True:
        found.append(f"{where}: runAsNonRoot is not true (here or in the pod)")
    seccomp = context.get("seccompProfile") or pod_context.get("seccompProfile") or {}
    if seccomp.get("type") not in PROFILE_TYPES:
        found.append(f"{where}: seccompProfile is not RuntimeDefault/Localhost")
    if context.get("procMount", "Default") != "Default":
        found.append(f"{where}: procMount {context['procMount']}")
    found += [f"{where}: hostPort {p['hostPort']}" for p in c.get("ports", []) if p.get("hostPort")]
    handlers = [c.get(p, {}) for p in ("livenessProbe", "readinessProbe", "startupProbe")]
    handlers += list(c.get("lifecycle", {}).values())
    for handler in handlers:
        for kind in ("httpGet", "tcpSocket"):
            if handler.get(kind, {}).get("host"):
                found.append(f"{where}: a probe or lifecycle {kind} names a host")
    return found


def restricted_violations(pod: dict, annotations: dict | None = None) -> list[str]:
    context = pod.get("securityContext", {})
    found = [f"spec.{f}" for f in ("hostNetwork", "hostPID", "hostIPC") if pod.get(f)]
    found += context_violations("spec.securityContext", context)
    found += [
        f"sysctl {s['name']}" for s in context.get("sysctls", []) if s["name"] not in SAFE_SYSCTLS
    ]
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if kinds - RESTRICTED_VOLUMES:
            found.append(f"volume {volume['name']}: {sorted(kinds)}")
    containers = [c for key in ("initContainers", "containers", "ephemeralContainers")
                  for c in pod.get(key, [])]  # fmt: skip
    for c in containers:
        found += container_violations(c, context)
    for key, value in (annotations or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            found.append(f"annotation {key}: {value}")
    return found


# --- the schema and the controller --------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_fits_the_crd_schema_strictly(renders, overlay):
    assert strict_errors(only(renders[overlay], "MPIJob")) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_passes_the_operators_controller_rules(renders, overlay):
    assert controller_errors(only(renders[overlay], "MPIJob")) == []


def test_a_misspelt_field_is_refused_though_the_schema_alone_takes_it(kubectl, tmp_path):
    """An overlay of the real base with two misspelt fields, rendered by kustomize: the CRD's
    schema has no additionalProperties: false, so jsonschema alone accepts them, and the API
    server would drop them silently; the strict walk names both."""
    base = os.path.relpath(KUBE / "base", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [{base}]\n"
        "patches:\n"
        "  - target: {kind: MPIJob}\n"
        "    patch: |\n"
        "      - {op: add, path: /spec/slotPerWorker, value: 2}\n"
        "      - op: add\n"
        "        path: /spec/mpiReplicaSpecs/Worker/template/spec/containers/0/readynessProbe\n"
        "        value: {tcpSocket: {port: 2222}}\n"
    )
    job = only(render(kubectl, tmp_path), "MPIJob")
    assert schema_errors(job, job_schema()) == []
    worker = "$.spec.mpiReplicaSpecs.Worker.template.spec.containers[0]"
    assert strict_errors(job) == [
        f"{worker}.readynessProbe: not in the schema",
        "$.spec.slotPerWorker: not in the schema",
    ]


def test_a_duplicate_env_variable_is_refused(renders):
    job = copy.deepcopy(only(renders["gloo"], "MPIJob"))
    env = container(job, "Worker")["env"]
    env.append(dict(env[0]))
    assert strict_errors(job) == [
        "$.spec.mpiReplicaSpecs.Worker.template.spec.containers[0].env: ['name'] "
        "('HVD_CPU_SSH_PORT',) twice"
    ]


def test_a_wrong_type_is_refused(renders):
    job = copy.deepcopy(only(renders["gloo"], "MPIJob"))
    job["spec"]["slotsPerWorker"] = "2"
    assert strict_errors(job) == ["$.spec.slotsPerWorker: '2' is not of type 'integer'"]


BROKEN_FOR_THE_CONTROLLER = {
    "two launchers": (lambda s: s["mpiReplicaSpecs"]["Launcher"].update(replicas=2), "Launcher"),
    "no workers": (lambda s: s["mpiReplicaSpecs"]["Worker"].update(replicas=0), "Worker.repl"),
    "restart Always": (
        lambda s: s["mpiReplicaSpecs"]["Worker"].update(restartPolicy="Always"),
        "restartPolicy",
    ),
    "negative slots": (lambda s: s.update(slotsPerWorker=-1), "slotsPerWorker"),
    "negative TTL": (lambda s: s["runPolicy"].update(ttlSecondsAfterFinished=-1), "ttlSeconds"),
    "managed elsewhere": (lambda s: s["runPolicy"].update(managedBy="example.com/x"), "managedBy"),
    "no such clean-up": (lambda s: s["runPolicy"].update(cleanPodPolicy="Sometimes"), "cleanPod"),
    "negative backoff": (lambda s: s["runPolicy"].update(backoffLimit=-1), "backoffLimit"),
    "creation policy": (lambda s: s.update(launcherCreationPolicy="WhenReady"), "launcherCreat"),
}


@pytest.mark.parametrize("case", BROKEN_FOR_THE_CONTROLLER)
def test_what_only_the_controller_refuses_is_refused(renders, case):
    """Each of these passes the API server's schema and is then never started by the operator."""
    break_it, named = BROKEN_FOR_THE_CONTROLLER[case]
    job = copy.deepcopy(only(renders["gloo"], "MPIJob"))
    break_it(job["spec"])
    assert strict_errors(job) == []
    errors = controller_errors(job)
    assert len(errors) == 1 and named in errors[0], errors


def test_empty_strings_take_the_controllers_defaults(renders):
    """As in Go, where "" is a string's zero value: an empty sshAuthMountPath is /root/.ssh."""
    job = copy.deepcopy(only(renders["gloo"], "MPIJob"))
    job["spec"]["sshAuthMountPath"] = ""
    assert controller_errors(job) == []
    assert with_operator_defaults(job)["spec"]["sshAuthMountPath"] == "/root/.ssh"


@pytest.mark.parametrize("name", ["Hvd-cpu", "hvd.cpu", "9hvd", "h" * 55])
def test_a_name_no_pod_can_take_is_refused(renders, name):
    job = copy.deepcopy(only(renders["gloo"], "MPIJob"))
    job["metadata"]["name"] = name
    assert strict_errors(job) == []
    assert [e for e in controller_errors(job) if e.startswith("metadata.name")], name


# --- what hvd-cpu needs -------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_rank_per_cpu(renders, overlay):
    """Requests equal to limits (the Guaranteed class, whole CPUs of their own under the
    static CPU manager), slots = the worker's CPUs, and -np = slots x workers."""
    job = only(renders[overlay], "MPIJob")
    for role in ROLES:
        resources = container(job, role)["resources"]
        for kind in ("cpu", "memory"):
            assert quantity(resources["requests"][kind]) == quantity(resources["limits"][kind])
    slots, workers = job["spec"]["slotsPerWorker"], job["spec"]["mpiReplicaSpecs"]["Worker"]
    assert slots >= 1
    assert quantity(container(job, "Worker")["resources"]["limits"]["cpu"]) == slots
    options, _ = horovodrun(job)
    assert int(value_of(options, "-np")) == slots * workers["replicas"]
    if overlay == "elastic":
        assert int(value_of(options, "--slots-per-host")) == slots
        assert int(value_of(options, "--max-np")) == slots * workers["replicas"]
        assert 1 <= int(value_of(options, "--min-np")) <= slots * workers["replicas"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_launcher_trains_with_auto_resume_on_the_shared_volume(renders, overlay):
    job = only(renders[overlay], "MPIJob")
    options, train = horovodrun(job)
    assert CONTROLLER[overlay] in options
    if overlay == "elastic":
        assert value_of(options, "--host-discovery-script") == "/etc/mpi/discover_hosts.sh"
        assert "--elastic" in train
    else:
        assert value_of(options, "--hostfile") == "/etc/mpi/hostfile"
    assert "--auto-resume" in train
    (mount,) = [
        m["mountPath"] for m in container(job, "Worker")["volumeMounts"] if m["name"] == "shared"
    ]
    assert value_of(train, "--data").startswith(f"{mount}/")
    # $(NAME) in args: Kubernetes puts in the container's variable NAME.
    assert value_of(train, "--output") == f"{mount}/runs/$(HVD_CPU_JOB)"
    (job_env,) = [e for e in container(job, "Launcher")["env"] if e["name"] == "HVD_CPU_JOB"]
    field = job_env["valueFrom"]["fieldRef"]["fieldPath"]
    assert field == f"metadata.labels['{JOB_NAME_LABEL}']"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_launch_parses_with_horovodrun_and_hvd_cpu(renders, overlay):
    """The launcher's command, read by horovodrun's own parser and `hvd-cpu train`'s: an option
    misspelt or gone would fail every attempt at its start, in the cluster."""
    launch = pytest.importorskip("horovod.runner.launch", reason="needs Horovod (install.sh)")
    from hvd_cpu.cli import cli

    job = only(renders[overlay], "MPIJob")
    options, train = horovodrun(job)
    argv, sys.argv = sys.argv, ["horovodrun", *options, "hvd-cpu", "train", *train]
    try:
        parsed = launch.parse_args()
    finally:
        sys.argv = argv
    slots, workers = job["spec"]["slotsPerWorker"], job["spec"]["mpiReplicaSpecs"]["Worker"]
    assert parsed.num_proc == slots * workers["replicas"]
    assert parsed.ssh_port == sshd_port(job)
    assert (parsed.use_gloo, parsed.use_mpi) == (overlay != "mpi", overlay == "mpi")
    assert list(parsed.command) == ["hvd-cpu", "train", *train]
    context = cli.commands["train"].make_context("hvd-cpu train", list(train))
    assert context.params["auto_resume"] is True
    assert context.params["elastic"] is (overlay == "elastic")


def sshd_port(job: dict) -> int:
    """The port the worker's sshd listens on: hvd-cpu-entrypoint's `worker` mode reads it from
    HVD_CPU_SSH_PORT (default 2222)."""
    worker = container(job, "Worker")
    assert worker["args"] == ["worker"]
    env = {e["name"]: e.get("value") for e in worker.get("env", [])}
    return int(env.get("HVD_CPU_SSH_PORT", 2222))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_ssh_port_everywhere(renders, overlay):
    """sshd, the readiness probe the launcher waits for, the container's port, horovodrun's
    -p, and the ssh client's configuration (mpirun's ssh, the launcher's wait) agree."""
    docs = renders[overlay]
    job = only(docs, "MPIJob")
    worker = container(job, "Worker")
    port = sshd_port(job)
    assert worker["readinessProbe"]["tcpSocket"]["port"] == port
    assert [p["containerPort"] for p in worker["ports"]] == [port]
    assert int(value_of(horovodrun(job)[0], "-p")) == port
    for role in ROLES:
        (mount,) = [
            m for m in container(job, role)["volumeMounts"] if m["name"] == "ssh-client-config"
        ]
        # Debian's /etc/ssh/ssh_config includes /etc/ssh/ssh_config.d/*.conf.
        assert re.fullmatch(r"/etc/ssh/ssh_config\.d/[^/]+\.conf", mount["mountPath"])
        text = config_map(docs, job, role, "ssh-client-config")["data"][mount["subPath"]]
        assert re.findall(r"^\s*Port\s+(\d+)\s*$", text, re.M) == [str(port)]
        assert re.search(r"^\s*UserKnownHostsFile\s+/dev/null\s*$", text, re.M)


def test_the_image_runs_the_entrypoint_the_manifests_start():
    """Every pod's args are a mode of hvd-cpu-entrypoint (launch/container-entrypoint.sh), the
    image's ENTRYPOINT; what the modes do is proven by running them (below, and
    tests/test_kubernetes_contract.py)."""
    dockerfile = (REPO / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["hvd-cpu-entrypoint"]' in dockerfile
    assert "COPY launch/container-entrypoint.sh /usr/local/bin/hvd-cpu-entrypoint" in dockerfile


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pods_keep_the_images_entrypoint(renders, overlay):
    """A container's command would replace hvd-cpu-entrypoint; a worker with neither command
    nor args would get the operator's `/usr/sbin/sshd -De` instead of hvd-cpu's sshd."""
    job = only(renders[overlay], "MPIJob")
    for role in ROLES:
        assert "command" not in container(job, role)
        assert container(job, role)["args"]


@pytest.mark.parametrize("overlay", ["gloo", "mpi", "elastic"])
def test_root_variants_take_the_key_where_the_entrypoints_sshd_reads_it(renders, overlay):
    """`worker` reads $HOME/.ssh/authorized_keys: root's home, which no variable moves."""
    job = only(renders[overlay], "MPIJob")
    assert job["spec"]["sshAuthMountPath"] == "/root/.ssh"
    assert "HOME" not in {e["name"] for e in container(job, "Worker").get("env", [])}


def test_the_nonroot_user_has_a_name_a_home_and_the_key_in_it(renders):
    """ssh and sshd need the user in /etc/passwd; sshd reads ~/.ssh/authorized_keys (where the
    operator mounts it), ssh ~/.ssh/id_rsa, both from the passwd home; the home is writable."""
    docs = renders["nonroot"]
    job = only(docs, "MPIJob")
    for role in ROLES:
        spec, main = pod_spec(job, role), container(job, role)
        (mount,) = [m for m in main["volumeMounts"] if m["name"] == "passwd"]
        assert mount["mountPath"] == "/etc/passwd"
        passwd = config_map(docs, job, role, "passwd")["data"][mount["subPath"]]
        users = {int(f[2]): f for f in (line.split(":") for line in passwd.splitlines())}
        home = users[spec["securityContext"]["runAsUser"]][5]
        assert job["spec"]["sshAuthMountPath"] == f"{home}/.ssh"
        assert {"name": "HOME", "value": home} in main["env"]
        (home_mount,) = [m for m in main["volumeMounts"] if m["mountPath"] == home]
        (volume,) = [v for v in spec["volumes"] if v["name"] == home_mount["name"]]
        assert "emptyDir" in volume


def test_the_nonroot_variant_meets_the_restricted_profile(renders):
    job = only(renders["nonroot"], "MPIJob")
    for role in ROLES:
        assert restricted_violations(pod_as_operator_makes_it(job, role)) == []


@pytest.mark.parametrize("overlay", ["gloo", "mpi", "elastic"])
def test_the_root_variants_do_not(renders, overlay):
    job = only(renders[overlay], "MPIJob")
    violations = restricted_violations(pod_as_operator_makes_it(job, "Worker"))
    assert "container worker: runAsNonRoot is not true (here or in the pod)" in violations
    assert "container worker: allowPrivilegeEscalation is not false" in violations


@pytest.mark.parametrize(
    "change, named",
    [
        ({"capabilities": {"drop": ["ALL"], "add": ["SYS_PTRACE"]}}, "capabilities add"),
        ({"allowPrivilegeEscalation": True}, "allowPrivilegeEscalation"),
        ({"runAsUser": 0}, "runAsUser: 0"),
        ({"seccompProfile": {"type": "Unconfined"}}, "seccompProfile"),
        ({"privileged": True}, "privileged"),
    ],
)
def test_the_restricted_rules_can_fail(renders, change, named):
    job = copy.deepcopy(only(renders["nonroot"], "MPIJob"))
    container(job, "Worker")["securityContext"].update(change)
    violations = restricted_violations(pod_as_operator_makes_it(job, "Worker"))
    assert [v for v in violations if named in v], violations


def test_a_host_path_volume_breaks_the_restricted_profile(renders):
    job = copy.deepcopy(only(renders["nonroot"], "MPIJob"))
    pod_spec(job, "Worker")["volumes"].append({"name": "host", "hostPath": {"path": "/data"}})
    assert restricted_violations(pod_spec(job, "Worker")) == ["volume host: ['hostPath']"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_retry_contract(renders, overlay):
    """Preempted, the ranks stop with a checkpoint and exit 75; the launcher fails and the
    operator's launcher Job runs a new one (backoffLimit), which goes on (--auto-resume) once
    the workers answer; the pods' grace outlasts a rank's own wait for a stop."""
    from hvd_cpu.runtime.lifecycle import STOP_GRACE_SECONDS

    job = only(renders[overlay], "MPIJob")
    spec = job["spec"]
    assert spec["runPolicy"]["backoffLimit"] >= 1
    assert spec["runPolicy"]["cleanPodPolicy"] == "Running"
    assert spec["launcherCreationPolicy"] == "WaitForWorkersReady"
    assert spec["mpiReplicaSpecs"]["Launcher"]["restartPolicy"] == "Never"
    assert spec["mpiReplicaSpecs"]["Worker"]["restartPolicy"] == "OnFailure"
    for role in ROLES:
        assert pod_spec(job, role)["terminationGracePeriodSeconds"] >= STOP_GRACE_SECONDS + 15


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_generated_config_maps_are_named_as_rendered(renders, overlay):
    """Kustomize adds a hash to a generated ConfigMap's name; kustomizeconfig.yaml makes it
    follow in the MPIJob's volumes (a custom resource's fields are unknown to it)."""
    docs = renders[overlay]
    job = only(docs, "MPIJob")
    for role in ROLES:
        for volume in pod_spec(job, role)["volumes"]:
            if "configMap" in volume:
                assert config_map(docs, job, role, volume["name"])


def base_image() -> str:
    (image,) = yaml.safe_load((KUBE / "base" / "kustomization.yaml").read_text())["images"]
    return f"{image['newName']}:{image['newTag']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_the_image_named_in_the_base(renders, overlay):
    job = only(renders[overlay], "MPIJob")
    assert [container(job, role)["image"] for role in ROLES] == [base_image()] * 2


def test_the_shared_volume_is_the_storage_folders_claim(renders):
    claim = only(renders["storage"], "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for overlay in OVERLAYS:
        volumes = pod_spec(only(renders[overlay], "MPIJob"), "Worker")["volumes"]
        (shared,) = [v for v in volumes if v["name"] == "shared"]
        assert shared["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]


def test_the_data_loader_pod(renders):
    """Its spec is a PodSpec (checked against the CRD's own PodSpec schema), restricted, on
    the storage folder's claim, with the base's image."""
    pod = yaml.safe_load((KUBE / "storage" / "data-loader.yaml").read_text())
    assert schema_errors(pod["spec"], pod_spec_schema()) == []
    assert structural_errors(pod["spec"], pod_spec_schema()) == []
    assert restricted_violations(pod["spec"]) == []
    claim = only(renders["storage"], "PersistentVolumeClaim")["metadata"]["name"]
    assert pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim
    assert pod["spec"]["containers"][0]["image"] == base_image()


def test_the_crd_is_the_one_its_readme_names():
    noted = re.search(r"sha256: ([0-9a-f]{64})", (KUBE / "crd" / "README.md").read_text())
    assert hashlib.sha256(CRD.read_bytes()).hexdigest() == noted.group(1)


# --- the worker's PID 1 and SIGTERM -------------------------------------------------------
# Kubernetes sends SIGTERM to a container's PID 1 only, and PID 1 ignores every signal it has
# no handler for. The entrypoint runs here as PID 1 of a new PID namespace (as in a
# container: pgrep and pkill see that namespace's processes only), with a stand-in rank named
# hvd-cpu that takes 0.5 s to stop (its checkpoint), and gets SIGTERM from outside.

RANK = """#!/bin/bash
trap 'echo TERM >>"$0.log"; sleep 0.5; echo stopped >>"$0.log"; exit 75' TERM
echo started >>"$0.log"
sleep 30 &
wait
"""


ENTRYPOINT = REPO / "launch" / "container-entrypoint.sh"


def as_pid1(
    command: str, tmp_path: Path, settle: float, child: str | None = None
) -> tuple[int | None, list[str]]:
    """SIGTERM to PID 1 once the rank runs (and PID 1's `child` process, if named): PID 1's
    exit code (None: still running after `settle` seconds, then SIGKILLed) and the rank's
    log. A network namespace of its own too: a worker's sshd listens there only."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("a PID namespace needs root and unshare (util-linux)")
    rank = tmp_path / "hvd-cpu"
    rank.write_text(RANK)
    rank.chmod(0o755)
    # The rank is started by a subshell (not a child of PID 1, as under sshd); `$$ = 1` makes
    # sure that this is a namespace of its own before any pkill runs.
    prelude = f'[ "$$" = 1 ] || exit 99; ( {shlex.quote(str(rank))} & )\n'
    shell = subprocess.Popen(
        ["unshare", "--pid", "--net", "--fork", "--mount-proc", "bash", "-c", prelude + command]
    )
    try:
        log = tmp_path / "hvd-cpu.log"
        deadline = time.monotonic() + 10
        while not (log.exists() and "started" in log.read_text() and pid1_runs(shell, child)):
            assert time.monotonic() < deadline and shell.poll() is None, "PID 1 did not start"
            time.sleep(0.05)
        pid1 = children_of(shell.pid)[0]
        os.kill(pid1, signal.SIGTERM)
        try:
            code = shell.wait(timeout=settle)
        except subprocess.TimeoutExpired:
            os.kill(pid1, signal.SIGKILL)
            shell.wait(timeout=10)
            code = None
        return code, log.read_text().split()
    finally:
        if shell.poll() is None:
            shell.kill()
            shell.wait(timeout=10)


def children_of(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def pid1_runs(unshare: subprocess.Popen, child: str | None) -> bool:
    """PID 1 is up, and so is its child named `child` (sshd: in the foreground, its own)."""
    started = children_of(unshare.pid)
    if not started or child is None:
        return bool(started)
    names = [Path(f"/proc/{c}/comm").read_text().strip() for c in children_of(started[0])]
    return child in names


def test_a_workers_pid1_runs_sshd_passes_sigterm_on_and_waits_for_the_ranks(renders, tmp_path):
    """The pods' `worker`, run for real: the entrypoint as PID 1, sshd its child in the
    foreground; SIGTERM reaches the rank, which PID 1 waits for, then it ends with 0."""
    (worker,) = {tuple(container(only(renders[o], "MPIJob"), "Worker")["args"]) for o in OVERLAYS}
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "authorized_keys").write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5 x\n")
    command = f"exec env HOME={home} {ENTRYPOINT} {shlex.join(worker)}"
    code, log = as_pid1(command, tmp_path, 10, child="sshd")
    assert (code, log) == (0, ["started", "TERM", "stopped"])


def test_a_worker_without_the_operators_key_says_so(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    done = subprocess.run(
        [str(ENTRYPOINT), "worker"], env={**os.environ, "HOME": str(home)},
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == (
        f"hvd-cpu: error: worker needs {home}/.ssh/authorized_keys; "
        f"mount it (-v keys:{home}/.ssh:ro)\n"
    )


def test_sleep_as_pid1_would_ignore_sigterm(tmp_path):
    """Why the workers' PID 1 is the entrypoint with a trap: `sleep infinity` as PID 1 takes
    no notice, and the ranks are SIGKILLed at the grace's end."""
    code, log = as_pid1("exec sleep infinity", tmp_path, 2)
    assert (code, log) == (None, ["started"])
