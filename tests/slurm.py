"""A real one-machine SLURM cluster for the SLURM tests: munged, slurmctld and slurmd as root.

Everything lives under a temporary folder: the munge key and socket, slurm.conf, state, spool,
logs and pid files. No system-wide file is read or written: every SLURM command gets
SLURM_CONF pointing at this cluster's slurm.conf (pass `cluster.env` to subprocesses), and the
ports are free ones picked at start, so a second cluster (another test run) can run beside it.
On exit the jobs are cancelled and the daemons stopped; nothing of the cluster keeps running.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

# What the cluster needs, by Debian package: munge, slurmctld, slurmd, slurm-client.
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sinfo", "squeue", "sbatch", "srun", "scancel", "scontrol")


def tool(name: str) -> str | None:
    """Where a SLURM or munge program is (daemons live in /usr/sbin, not always on PATH)."""
    found = shutil.which(name) or Path("/usr/sbin", name)
    return str(found) if Path(found).is_file() else None


def missing_tools() -> list[str]:
    """The SLURM and munge programs not installed here (empty when a cluster can start)."""
    return [name for name in (*DAEMONS, *CLIENTS) if tool(name) is None]


def free_port() -> int:
    """A TCP port nobody listens on now (the kernel's pick), for slurmctld or slurmd."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")


def processes_with(variable: str, value: str) -> list[int]:
    """Live processes whose environment has `variable=value`: the ones a job or a cluster
    started, told apart from other people's on a shared machine."""
    wanted = f"{variable}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if wanted in (entry / "environ").read_bytes().split(b"\0") and pid_alive(
                int(entry.name)
            ):
                found.append(int(entry.name))
    return found


def _in_environ(pid: int, variable: str) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(entry.startswith(f"{variable}=".encode()) for entry in environ)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class SlurmCluster:
    """`with SlurmCluster(folder) as cluster:` a cluster of this machine, `cpus` CPUs, one
    partition, the node idle; `cluster.run("sbatch", ...)` runs a client against it."""

    def __init__(self, folder: Path, cpus: int = 2) -> None:
        self.folder = folder
        self.cpus = cpus
        self.node = socket.gethostname()
        self.conf = folder / "slurm.conf"
        self.munge_socket = folder / "munge" / "munge.socket"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for name in ("SLURM_JOB_ID", "SLURM_JOBID"):  # never mistake us for a job's step
            self.env.pop(name, None)

    def __enter__(self) -> SlurmCluster:
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        """Cancel every job, then stop slurmd, slurmctld and munged (in that order: the
        daemons need munge to talk while they shut down) and anything they left behind."""
        if (self.folder / "run" / "slurmctld.pid").exists():
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                jobs = self.run("squeue", "-h", "-o", "%A", timeout=30).stdout.split()
                if jobs:
                    self.run("scancel", *jobs, timeout=30)
                    self._wait(lambda: not self.run("squeue", "-h").stdout.strip(), 30)
        for name in ("slurmd", "slurmctld"):
            self._stop(self.folder / "run" / f"{name}.pid")
        self._stop(self.folder / "munge" / "munged.pid")
        # What is left of this cluster: a job's task or a SLURM process carrying its
        # SLURM_CONF (not any process that merely has it, like a shell that exported it).
        for pid in processes_with("SLURM_CONF", str(self.conf)):
            if _cmdline(pid).startswith("slurm") or _in_environ(pid, "SLURM_JOB_ID"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def run(self, *command: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """A SLURM client command against this cluster (never the system's slurm.conf)."""
        return subprocess.run(
            command, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )

    def job_processes(self, job_id: str) -> list[int]:
        """Live processes of job `job_id`: its tasks (they carry SLURM_JOB_ID) and the
        slurmstepd processes that run its batch script and steps."""
        steps = [
            pid
            for pid in processes_with("SLURM_CONF", str(self.conf))
            if _cmdline(pid).startswith(f"slurmstepd: [{job_id}.")
        ]
        return sorted({*processes_with("SLURM_JOB_ID", job_id), *steps})

    def log(self) -> str:
        """The daemons' logs, for a failing test's message."""
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}"
            for path in sorted((self.folder / "log").glob("*.log"))
        )

    def _start(self) -> None:
        for sub in ("munge", "state", "spool", "log", "run"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        # munged checks its paths: no group/other write on the socket's folder, x for all.
        os.chmod(self.folder, 0o755)
        os.chmod(self.folder / "munge", 0o755)
        key = self.folder / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        # munged runs as root here (--force allows it) and wants its key owned by its own
        # user, mode 400; as the munge user it would be the munge user's.
        os.chmod(key, 0o400)
        subprocess.run(
            [
                str(tool("munged")),
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={self.folder / 'munge' / 'munged.pid'}",
                f"--log-file={self.folder / 'log' / 'munged.log'}",
                f"--seed-file={self.folder / 'munge' / 'munged.seed'}",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        self._write_conf()
        for daemon in ("slurmctld", "slurmd"):
            started = subprocess.run(
                [str(tool(daemon))],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            if started.returncode != 0:
                raise RuntimeError(f"{daemon} did not start: {started.stderr}\n{self.log()}")
        if not self._wait(self._node_idle, 90):
            raise RuntimeError(f"node {self.node} never became idle\n{self.log()}")

    def _write_conf(self) -> None:
        f = self.folder
        (f / "plugstack.conf").write_text("")  # not /etc/slurm/plugstack.conf
        user = pwd.getpwuid(os.getuid()).pw_name
        self.conf.write_text(
            f"""\
ClusterName=hvdcpu
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
PlugStackConfig={f / "plugstack.conf"}
StateSaveLocation={f / "state"}
SlurmdSpoolDir={f / "spool"}
SlurmctldPidFile={f / "run" / "slurmctld.pid"}
SlurmdPidFile={f / "run" / "slurmd.pid"}
SlurmctldLogFile={f / "log" / "slurmctld.log"}
SlurmdLogFile={f / "log" / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
InactiveLimit=0
KillWait=5
MinJobAge=5
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=main Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _node_idle(self) -> bool:
        shown = self.run("sinfo", "-h", "-n", self.node, "-o", "%T", timeout=30)
        return shown.returncode == 0 and shown.stdout.strip() == "idle"

    def _stop(self, pid_file: Path, wait: float = 20) -> None:
        pid = self._pid(pid_file)
        if pid is None or not pid_alive(pid):
            return
        os.kill(pid, signal.SIGTERM)
        if not self._wait(lambda: not pid_alive(pid), wait):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self._wait(lambda: not pid_alive(pid), 5)

    @staticmethod
    def _pid(pid_file: Path) -> int | None:
        try:
            return int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    @staticmethod
    def _wait(condition: Callable[[], bool], seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while True:
            if condition():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.25)
