"""Launching ranks from Python, as horovodrun does for a command (what `hvd_cpu.fit`, bench
and a notebook's own functions run on): Horovod's programmatic launcher, with bad input on the
ranks raised here as the command line would print it."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hvd_cpu.config.options import CONTROLLER_NAMES
from hvd_cpu.errors import InputError, Preempted
from hvd_cpu.runtime import horovod
from hvd_cpu.runtime.join import WITH_MPI


def launch(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    np: int,
    hosts: str | None,
    controller: str = "gloo",
) -> list[Any]:
    """Run `func(*args)` on `np` new ranks over `controller` (Horovod's programmatic launcher,
    what horovodrun does for a command) and return every rank's result, in rank order.

    Bad input on the ranks raises the same InputError here, with the message the command
    line would print; a SIGTERM that stopped the ranks at a step, saved, raises Preempted.
    """
    if controller not in CONTROLLER_NAMES:
        raise InputError(f"unknown controller {controller!r}: choose gloo or mpi")
    if controller == "mpi":
        check_mpi_launcher()
    results = horovod.run(_returning_said_errors, (func, *args), np, hosts, controller)
    errors = [result for result in results if isinstance(result, SAID)]
    if errors:
        raise errors[0]
    return results


# What every rank of a job meets together and says in one line: no worker failure.
SAID = (InputError, Preempted)


def _returning_said_errors(func: Callable[..., Any], *args: Any) -> Any:
    """Run on a launched rank: bad input, or a stop at a saved step, comes back as a value,
    not as a worker failure with its traceback."""
    try:
        return func(*args)
    except SAID as exc:
        return exc


def check_mpi_launcher() -> None:
    """Before launching over MPI: this Horovod must have MPI, and mpirun must be there."""
    if not horovod.mpi_built():
        raise InputError(
            f"this Horovod was built without MPI; {WITH_MPI}, or use the Gloo controller "
            "(controller='gloo')"
        )
    # Open MPI from PyPI is in this Python's bin folder, on the PATH or not (a notebook's
    # kernel); Horovod's launcher takes it from there (the pypi-mpirun patch).
    if shutil.which("mpirun") is None and not (Path(sys.executable).parent / "mpirun").is_file():
        raise InputError(
            "mpirun not found on PATH; install Open MPI (Debian: apt-get install openmpi-bin) "
            "or use the Gloo controller (horovodrun --gloo, controller='gloo')"
        )
