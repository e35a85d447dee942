"""Where a rank's start goes: the seconds from its process's start to each phase before its
first step (ranks.json's `start_seconds`), so that a slow start names the phase that is slow.

Both ends are read on the kernel's clock since boot: the process's start as /proc records
it, each phase from CLOCK_BOOTTIME (a start time built from the boot's wall-clock second, as
psutil's, is off by up to a second).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# The phases in the order a rank reaches them.
PHASES = ("imported", "joined", "prepared", "first_step")
_reached: dict[str, float] = {}


def reached(phase: str) -> None:
    """This process has reached `phase` now (the first time counts: an elastic job's later
    passes start nothing)."""
    _reached.setdefault(phase, time.clock_gettime(time.CLOCK_BOOTTIME))


def seconds_since_start() -> dict[str, float]:
    """Each phase reached so far, in seconds since this process started."""
    # /proc/PID/stat: after the command's closing bracket, field 22 (starttime) is the 20th.
    starttime = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
    started = starttime / os.sysconf("SC_CLK_TCK")
    return {phase: round(_reached[phase] - started, 3) for phase in PHASES if phase in _reached}
