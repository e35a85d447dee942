"""The closing summary of a run and the advice that goes with it: text from the loop's
history, computed apart from printing so that both can be checked."""

from __future__ import annotations

from dataclasses import dataclass

from hvd_cpu.config.options import CONTROLLER_NAMES, TrainConfig
from hvd_cpu.training.state import LoopState

# Above this share of training time spent waiting, more processes are not paying for themselves.
WAITING_HINT = 0.5


@dataclass(frozen=True)
class Shape:
    """How a job runs, as its summary words it: ranks, controller, how Gloo moves bytes within
    a host (`transport`, "" under MPI), and rank 0's host's ranks and cores."""

    size: int
    controller: str = "gloo"
    transport: str = ""
    ranks_here: int = 1
    cores_here: int = 1


def waiting_share(state: LoopState) -> float:
    """Of the training time, the share the ranks spent waiting for each other (rank mean)."""
    seconds = sum(h["seconds"] for h in state.history)
    return sum(h.get("wait_seconds", 0.0) for h in state.history) / seconds


def summary_table(
    config: TrainConfig,
    state: LoopState,
    shape: Shape,
    synchronised: str,
    precision: str,
    wall: float,
) -> str:
    """The closing table: epochs, best validation, time, throughput, the arithmetic
    (`precision`, and why); with several ranks, how long they waited, over what and how they
    stayed in step (`synchronised`, the strategy's words)."""
    samples = sum(h["samples"] for h in state.history)
    seconds = sum(h["seconds"] for h in state.history)
    rows = [("epochs run", f"{state.epoch}")]
    if state.best_epoch:
        rows += [
            ("best epoch", f"{state.best_epoch}"),
            ("best validation loss", f"{state.best_val_loss:.4f}"),
        ]
    rows += [
        ("final train loss", f"{state.history[-1]['train_loss']:.4f}"),
        ("training time", f"{seconds:.1f} s (wall {wall:.1f} s)"),
        ("throughput", f"{samples / seconds:,.0f} samples/s over {shape.size} rank(s)"),
        ("precision", precision),
    ]
    if shape.size > 1:
        rows.append(("waiting for other ranks", f"{waiting_share(state):.0%} of training time"))
        over = f" over {shape.transport}" if shape.transport else ""
        controller = CONTROLLER_NAMES[shape.controller]
        rows.append(("controller", f"{controller}{over}; {synchronised}"))
    rows.append(("output", f"{config.output}"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def waiting_advice(config: TrainConfig, state: LoopState, shape: Shape) -> str | None:
    """When the ranks waited more than they trained: why, and what makes it cheaper here."""
    waiting = waiting_share(state)
    if shape.size == 1 or waiting <= WAITING_HINT:
        return None
    said = f"hvd-cpu: the ranks waited for each other {waiting:.0%} of the time: "
    if shape.ranks_here > shape.cores_here:
        return (
            f"{said}{shape.ranks_here} ranks share {shape.cores_here} cores on this host, so "
            f"each waits while others compute; one rank per core (-np {shape.cores_here} "
            "here) or a larger --batch-size pays more; `hvd-cpu bench` measures which"
        )
    cheaper = ""
    if config.allreduce == "horovod":
        cheaper = "--allreduce auto, "
    elif shape.transport.startswith("TCP"):
        cheaper = "horovodrun --mpi with one rank per core, "
    return (
        f"{said}cheaper or fewer synchronisations pay here ({cheaper}a larger --batch-size, "
        "--sync-every 8, or fewer processes); `hvd-cpu bench` measures which"
    )
