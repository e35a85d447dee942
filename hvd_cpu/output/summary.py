"""The closing summary of a run and the advice that goes with it: text from the loop's
history, computed apart from printing so that both can be checked."""

from __future__ import annotations

from hvd_cpu.config.options import CONTROLLER_NAMES, TrainConfig
from hvd_cpu.training.state import LoopState

# Above this share of training time spent waiting, more processes are not paying for themselves.
WAITING_HINT = 0.5


def waiting_share(state: LoopState) -> float:
    """Of the training time, the share the ranks spent waiting for each other (rank mean)."""
    seconds = sum(h["seconds"] for h in state.history)
    return sum(h.get("wait_seconds", 0.0) for h in state.history) / seconds


def summary_table(
    config: TrainConfig,
    state: LoopState,
    world_size: int,
    controller: str,
    synchronised: str,
    wall: float,
    transport: str = "",
) -> str:
    """The closing table: epochs, best validation, time, throughput; with several ranks, how
    long they waited, over what (`transport`: how Gloo moves bytes within a host) and how
    they stayed in step (`synchronised`, the strategy's words)."""
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
        ("throughput", f"{samples / seconds:,.0f} samples/s over {world_size} rank(s)"),
    ]
    if world_size > 1:
        rows.append(("waiting for other ranks", f"{waiting_share(state):.0%} of training time"))
        over = f" over {transport}" if transport else ""
        rows.append(("controller", f"{CONTROLLER_NAMES[controller]}{over}; {synchronised}"))
    rows.append(("output", f"{config.output}"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def waiting_advice(
    config: TrainConfig, state: LoopState, world_size: int, controller: str, transport: str = ""
) -> str | None:
    """When the ranks waited more than they trained: what makes synchronising cheaper here."""
    waiting = waiting_share(state)
    if world_size == 1 or waiting <= WAITING_HINT:
        return None
    cheaper = ""
    if config.allreduce == "horovod":
        cheaper = "--allreduce auto, "
    elif transport.startswith("TCP"):
        cheaper = "horovodrun --mpi with one rank per core, "
    return (
        f"hvd-cpu: the ranks waited for each other {waiting:.0%} of the time: cheaper or "
        f"fewer synchronisations pay here ({cheaper}a larger --batch-size, --sync-every "
        "8, or fewer processes); `hvd-cpu bench` measures which"
    )
