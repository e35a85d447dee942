"""Text of a user's model file whose code fails on one rank at one training step, in the way
a test asks (tests/test_rank_failures.py): `write(folder, where, rank, step)`. The failing
rank notes the time it fails in FOLDER/failed_at (the first time), for the test's bound.
While FOLDER/held_back exists it fails nowhere: a model trained with the file can then fail
in predict with the file unchanged (predict refuses a model file changed since training)."""

from __future__ import annotations

from pathlib import Path

# What can fail, and where: the model's forward pass, the loss, backward, validation, rank 0's
# checkpoint (the model's state_dict as it is saved), a bad row of one rank's shard (the
# model's own check of its input), sys.exit, a MemoryError, or a main thread that waits for
# ever (a deadlock: the stall).
KINDS = (
    "forward", "loss", "backward", "validation", "checkpoint", "data", "exit", "memory", "stuck",
)  # fmt: skip

CODE = '''
import os
import sys
import threading
import time

import torch

from hvd_cpu.runtime.lifecycle import launch_rank

WHERE, RANK, STEP, PACE, MARK, HELD = {where!r}, {rank}, {step}, {pace}, {mark!r}, {held!r}
steps = 0


def trouble(where):
    """Fail here, if this is the chosen place, rank and step."""
    if where != WHERE or launch_rank() != RANK or steps < STEP or os.path.exists(HELD):
        return
    if not os.path.exists(MARK):
        with open(MARK, "w") as note:
            note.write(repr(time.time()))
    if WHERE == "exit":
        sys.exit(3)
    if WHERE == "memory":
        raise MemoryError("cannot allocate the activations")
    if WHERE == "stuck":
        threading.Event().wait()
    if WHERE == "data":
        raise ValueError(f"row out of range in this rank's shard (step {{steps}})")
    raise RuntimeError(f"{{where}} failed on rank {{RANK}} at step {{steps}}")


class Fails(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        trouble("backward")
        return grad


class Model(torch.nn.Module):
    def __init__(self, n_features, n_outputs):
        super().__init__()
        self.layer = torch.nn.Linear(n_features, n_outputs)

    def forward(self, x):
        global steps
        if not self.training:
            trouble("validation")
            return self.layer(x)
        steps += 1
        time.sleep(PACE)
        for where in ("forward", "data", "exit", "memory", "stuck"):
            trouble(where)
        return Fails.apply(self.layer(x))

    def state_dict(self, *args, **kwargs):
        trouble("checkpoint")
        return super().state_dict(*args, **kwargs)


def loss(output, target):
    if torch.is_grad_enabled():
        trouble("loss")
    return torch.nn.functional.mse_loss(output, target)
'''


HELD_BACK = "held_back"
# A step that never comes: the same file, disarmed (for --resume).
NEVER = 10**9


def write(folder: Path, where: str, rank: int, step: int, pace: float = 0.0) -> tuple[str, ...]:
    """The --model and --loss options of code that fails `where`, on `rank`, once it has
    trained `step` steps (each `pace` seconds longer, asleep), noting when in FOLDER/failed_at;
    written again with step NEVER, the same options train without failing."""
    assert where in KINDS, where
    path = folder / f"fails_{where}_on_{rank}.py"
    mark, held = str(folder / "failed_at"), str(folder / HELD_BACK)
    path.write_text(CODE.format(where=where, rank=rank, step=step, pace=pace, mark=mark, held=held))
    return ("--model", f"{path}:Model", "--loss", f"{path}:loss")
