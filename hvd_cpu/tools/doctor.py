"""`hvd-cpu doctor`: check, before a long job, what a multi-host launch needs.

Each host is probed over the same passwordless ssh that horovodrun uses, by running this
module with the same Python (`python -m hvd_cpu.tools.doctor probe`): the same environment and paths
on every host is a requirement anyway. The probes' answers are then compared here.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import psutil

from hvd_cpu.runtime.cores import usable_cores
from hvd_cpu.tools.hostfile import HostSlots, read_hostfile

SSH_TIMEOUT = 20  # seconds for one host's probe, connection included
# What the first check wants built into Horovod, keyed as in runtime.horovod.build_info().
BUILT = {"pytorch": "PyTorch", "mpi": "MPI", "gloo": "Gloo"}


@dataclass(frozen=True)
class Check:
    """One line of the checklist."""

    name: str
    host: str
    ok: bool
    detail: str
    fix: str = ""


def probe(data: str | None) -> dict[str, Any]:
    """What this host says about itself (runs on every host)."""
    return {
        "hostname": socket.gethostname(),
        "interfaces": {
            nic: [a.address for a in addresses if a.family == socket.AF_INET]
            for nic, addresses in psutil.net_if_addrs().items()
        },
        "versions": {p: _version_of(p) for p in ("hvd-cpu", "torch", "horovod")},
        "horovod": _horovod_build(),
        "cores": usable_cores(),
        "data_readable": None if data is None else os.access(data, os.R_OK),
        "open_mpi": open_mpi(),
    }


def _version_of(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _horovod_build() -> dict[str, bool]:
    """What the Horovod here can do; all False when it does not import (missing, or broken)."""
    try:
        from hvd_cpu.runtime import horovod
    except (ImportError, OSError):
        return dict.fromkeys(BUILT, False)
    return horovod.build_info()


def open_mpi() -> dict[str, str | None]:
    """Where this host's `mpirun` and `orted` are, and Open MPI's version.

    Those beside this Python first: Open MPI from PyPI, which horovodrun launches with (the
    pypi-mpirun patch) and which starts `prted` on the other hosts from its own folder. Else
    the PATH's: run over ssh this sees the PATH of a non-interactive ssh session, the one in
    which mpirun starts `orted` on every other host of an MPI job.
    """

    def where(program: str) -> str | None:
        beside = Path(sys.executable).parent / program
        return str(beside) if beside.is_file() else shutil.which(program)

    found: dict[str, str | None] = {
        "mpirun": where("mpirun"),
        "orted": where("orted") or where("prted"),  # Open MPI 5's name for it
    }
    found["version"] = None
    if found["mpirun"]:
        try:
            said = subprocess.run(
                [found["mpirun"], "--version"], capture_output=True, text=True, timeout=10
            ).stdout.splitlines()
        except (OSError, subprocess.TimeoutExpired):
            said = []
        # "mpirun (Open MPI) 4.1.4" -> "Open MPI 4.1.4"
        found["version"] = said[0].replace("mpirun (", "").replace(")", "") if said else None
    return found


def ssh_probe(
    host: str, port: int | None, identity: Path | None, data: str | None
) -> dict[str, Any] | str:
    """Run `probe` on `host` over ssh; the answer, or why ssh failed."""
    command = [
        "ssh", "-o", "BatchMode=yes", "-o", "PasswordAuthentication=no",
        "-o", "StrictHostKeyChecking=accept-new", "-o", "ConnectTimeout=5", "-o", "LogLevel=ERROR",
    ]  # fmt: skip
    if port:
        command += ["-p", str(port)]
    if identity:
        command += ["-i", str(identity)]
    remote = [sys.executable, "-m", "hvd_cpu.tools.doctor", "probe", *([data] if data else [])]
    try:
        done = subprocess.run(
            [*command, host, " ".join(map(_quote, remote))],
            capture_output=True, text=True, timeout=SSH_TIMEOUT, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"no answer within {SSH_TIMEOUT} s"
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return lines[-1] if lines else f"ssh exited with {done.returncode}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _quote(word: str) -> str:
    return "'" + word.replace("'", "'\\''") + "'"


def diagnose(
    hostfile: Path | None, port: int | None, identity: Path | None, data: Path | None
) -> list[Check]:
    """The whole checklist, local build first, then each host, then what they must share."""
    listed = None if hostfile is None else read_hostfile(hostfile)  # bad: before slow probes
    here = probe(str(data) if data else None)
    checks = [horovod_build_check(here["versions"]), controllers_check(here)]
    if listed is None:
        hosts = [HostSlots("localhost", here["cores"])]
        answers: dict[str, dict[str, Any] | str] = {"localhost": here}
    else:
        hosts = listed
        with ThreadPoolExecutor(max_workers=len(hosts)) as pool:
            futures = {
                h.host: pool.submit(ssh_probe, h.host, port, identity, str(data) if data else None)
                for h in hosts
            }
            answers = {host: future.result() for host, future in futures.items()}
    several = len(hosts) > 1

    reached = {}
    for h in hosts:
        answer = answers[h.host]
        if isinstance(answer, str):
            checks.append(Check("passwordless ssh", h.host, False, answer, ssh_fix(h.host, port)))
            continue
        reached[h.host] = answer
        if hostfile is not None:
            checks.append(Check("passwordless ssh", h.host, True, f"reached {answer['hostname']}"))
        checks += host_checks(h, answer, here, several, data)
    if several and len(reached) == len(hosts):
        checks.append(common_interface(reached))
    return checks


def horovod_build_check(versions: dict[str, str | None]) -> Check:
    """Whether the Horovod here is hvd-cpu's patched build for this torch, Python and MPI
    (what `hvd-cpu install-horovod` would install now)."""
    from hvd_cpu.horovod_build import InstallError, installed_record, plan

    fix = "run hvd-cpu install-horovod (or launch/install.sh)"
    if versions["horovod"] is None:
        return Check("Horovod build", "this host", False, "Horovod is not installed", fix)
    record = installed_record()
    if record is None:
        detail = f"horovod {versions['horovod']} is not hvd-cpu's patched build"
        return Check("Horovod build", "this host", False, detail, fix)
    try:
        wanted, _ = plan()
    except InstallError as exc:
        return Check("Horovod build", "this host", False, str(exc), "see the detail")
    differences = build_differences(record, wanted.record())
    detail = "; ".join(differences) or f"patched, for torch {record['torch']}, {record['python']}"
    return Check("Horovod build", "this host", not differences, detail, fix)


def build_differences(built: dict[str, object], wanted: dict[str, object]) -> list[str]:
    """How the installed build's record differs from the build this environment needs."""
    differences = [
        f"built for {what} {built.get(key)}, here is {wanted[key]}"
        for key, what in (("torch", "torch"), ("python", "Python"), ("mpi", "MPI"))
        if built.get(key) != wanted[key]
    ]
    if built.get("key") != wanted["key"] and not differences:
        differences = ["built with other patches than this hvd-cpu's"]
    return differences


def controllers_check(here: dict[str, Any]) -> Check:
    """PyTorch and Gloo are needed; MPI is optional (it comes with Open MPI)."""
    build = here["horovod"]
    shown = ", ".join(f"{n} {'yes' if build[k] else 'no'}" for k, n in BUILT.items())
    return Check(
        "Horovod controllers", "this host", build["pytorch"] and build["gloo"],
        f"horovod {here['versions']['horovod']}: {shown}",
        "run hvd-cpu install-horovod: it builds Gloo, and MPI with the machine's Open MPI or "
        "one from PyPI",
    )  # fmt: skip


def host_checks(
    h: HostSlots, answer: dict[str, Any], here: dict[str, Any], several: bool, data: Path | None
) -> list[Check]:
    """What must hold on each host on its own."""
    checks = []
    if several:
        same = answer["versions"] == here["versions"]
        shown = ", ".join(f"{k} {v}" for k, v in answer["versions"].items())
        checks.append(
            Check("same versions as here", h.host, same, shown,
                  "install the same hvd-cpu, torch and Horovod everywhere (launch/install.sh)")
        )  # fmt: skip
    if data is not None:
        checks.append(
            Check("data readable", h.host, bool(answer["data_readable"]), str(data),
                  f"copy the data to {data} on {h.host}, or mount shared storage there")
        )  # fmt: skip
    if here["horovod"]["mpi"]:
        checks.append(open_mpi_check(h.host, answer["open_mpi"], here["open_mpi"], several))
    cores = answer["cores"]
    checks.append(
        Check(
            "thread budget", h.host, h.slots <= cores,
            f"{h.slots} rank(s) on {cores} core(s): {max(1, cores // h.slots)} thread(s) each",
            f"at most {cores} slots on {h.host}: more ranks than cores only wait on each other",
        )
    )  # fmt: skip
    return checks


def open_mpi_check(
    host: str, there: dict[str, str | None], here: dict[str, str | None], several: bool
) -> Check:
    """MPI across hosts: mpirun starts `orted` over ssh on every host, so it must be on the
    PATH there, and the same Open MPI everywhere (daemons of other versions do not talk)."""
    missing = [name for name in ("mpirun", "orted") if not there[name]]
    same = not several or there["version"] == here["version"]
    if missing:
        detail = f"{' and '.join(missing)} not on the PATH of an ssh session"
    else:
        detail = f"{there['version']}: {there['mpirun']}, {there['orted']}"
        if not same:
            detail += f" (here: {here['version']})"
    fix = (
        f"install the same Open MPI as here on {host} (Debian: apt-get install openmpi-bin) "
        "with orted on the PATH a non-interactive ssh session gets, or launch with Gloo "
        "(CONTROLLER=gloo, horovodrun --gloo)"
    )
    return Check("Open MPI on PATH", host, not missing and same, detail, fix)


def common_interface(answers: dict[str, dict[str, Any]]) -> Check:
    """horovodrun needs a network interface of the same name on every host."""
    names = [
        {n for n, addresses in a["interfaces"].items() if n != "lo" and addresses}
        for a in answers.values()
    ]
    common = sorted(set.intersection(*names))
    return Check(
        "common network interface", "all hosts", bool(common),
        ", ".join(common) or "none: " + "; ".join(
            f"{host}: {', '.join(sorted(n))}" for host, n in zip(answers, names, strict=True)
        ),
        "give the NICs of the shared network the same name on every host",
    )  # fmt: skip


def ssh_fix(host: str, port: int | None) -> str:
    port_option = f" -p {port}" if port else ""
    return (
        f"check that sshd runs on {host}{port_option} and that `ssh{port_option} {host} true` "
        "works without a password (ssh-copy-id)"
    )


def report(checks: list[Check]) -> str:
    """The checklist as a table; each failure is followed by its fix."""
    width_name = max(len(c.name) for c in checks)
    width_host = max(len(c.host) for c in checks)
    lines = []
    for c in checks:
        status = "OK  " if c.ok else "FAIL"
        lines.append(f"{status}  {c.name:<{width_name}}  {c.host:<{width_host}}  {c.detail}")
        if not c.ok:
            lines.append(f"      fix: {c.fix}")
    failed = sum(not c.ok for c in checks)
    lines.append(
        f"{len(checks) - failed} of {len(checks)} checks OK"
        + (", fix the rest before launching" if failed else "")
    )
    return "\n".join(lines)


if __name__ == "__main__" and sys.argv[1:2] == ["probe"]:
    print(json.dumps(probe(sys.argv[2] if len(sys.argv) > 2 else None)))
