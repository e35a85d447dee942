"""launch/idle.sh, which CI's `launch/test.sh --with-container` runs the container tier under,
beside the serial stage: what it runs gets only the CPU time nothing else wants, although the
tests' jobs run in sessions of their own (where `nice` alone gave the niced side half)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .jobs import REPO

IDLE = str(REPO / "launch" / "idle.sh")
# Busy on core 0 until the time it is given; then the share of the core it had since it began.
BUSY_UNTIL = (
    "import resource, sys, time\n"
    "began = time.time()\n"
    "print('busy', flush=True)\n"
    "while time.time() < float(sys.argv[1]):\n"
    "    pass\n"
    "used = resource.getrusage(resource.RUSAGE_SELF)\n"
    "print((used.ru_utime + used.ru_stime) / (time.time() - began))\n"
)
SECONDS = 3.0


def _busy(until: float, *wrapper: str) -> subprocess.Popen[str]:
    """A busy loop on core 0, in a session of its own (as a test's job is), once it runs."""
    busy = subprocess.Popen(
        [*wrapper, "taskset", "-c", "0", sys.executable, "-c", BUSY_UNTIL, str(until)],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    assert busy.stdout is not None and busy.stdout.readline() == "busy\n"
    return busy


def _share_beside(*wrapper: str) -> tuple[float, int]:
    """The core's share a busy loop has beside one that was busy on it first under `wrapper`,
    and the first's pid."""
    until = time.time() + 1 + SECONDS
    first = _busy(until, *wrapper)
    second = _busy(until)
    shares = [float(busy.communicate(timeout=60)[0]) for busy in (first, second)]
    return shares[1], first.pid


# Slow, so in the serial stage: a second worker's jobs on core 0 would take from the share.
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="a cgroup of its own needs root (else: nice)")
def test_a_command_run_idle_gets_only_the_cpu_time_others_leave() -> None:
    assert _share_beside()[0] < 0.7  # the control: two plain loops share the core
    share, idle = _share_beside(IDLE)
    assert share > 0.85
    assert not list(Path("/sys/fs/cgroup").glob(f"**/hvd-cpu-idle-{idle}")), "its group is gone"


def test_the_command_s_exit_code_is_idle_sh_s() -> None:
    assert subprocess.run([IDLE, "sh", "-c", "exit 7"]).returncode == 7
    assert subprocess.run([IDLE]).returncode == 2
