"""Run on every rank of a real job (tests/test_collectives.py): each collective of the World's
backend, checked against what it must give, then "collectives ok RANK BACKEND"."""

from __future__ import annotations

import socket
import sys

import numpy as np
import torch

from hvd_cpu.errors import InputError
from hvd_cpu.lines import say
from hvd_cpu.runtime import join


def expect_error(collectives: object, step: object, text: str) -> None:
    try:
        collectives.agreed(step)  # type: ignore[attr-defined]
    except InputError as exc:
        assert str(exc) == text, (str(exc), text)
    else:
        raise AssertionError(f"no InputError, expected {text!r}")


def main() -> None:
    world = join.init(threads=1)
    c, rank, size = world.collectives, world.rank, world.size
    assert size == 2
    values = torch.tensor([rank + 1.0, 10.0 * (rank + 1)], dtype=torch.float64)
    assert c.sum(values, "sum").tolist() == [3.0, 30.0]
    assert values.tolist() == [rank + 1.0, 10.0 * (rank + 1)]  # sum makes a new tensor
    mean = torch.tensor([2.0 * rank, 1.0])
    assert c.average_(mean, "average").tolist() == [1.0, 1.0] and mean.tolist() == [1.0, 1.0]
    state = {
        "weight": torch.full((2, 3), float(rank)),
        "strided": torch.full((3, 2), float(rank)).t(),  # not contiguous: copied back in place
        "steps": torch.tensor(7 + rank),
    }
    strided = state["strided"]
    c.broadcast_(state)
    assert state["weight"].eq(0).all() and strided.eq(0).all() and int(state["steps"]) == 7
    assert c.broadcast_object({"rank": rank}, "object") == {"rank": 0}
    assert c.gather(("rank", rank), "gather") == [("rank", 0), ("rank", 1)]
    summed = c.sum_numbers(np.array([rank, 0.5]))
    assert summed.dtype == np.float64 and summed.tolist() == [1.0, 1.0]

    def fail_on(ranks: set[int]) -> None:
        if rank in ranks:
            raise InputError(f"bad input on {rank}")

    host = socket.gethostname()
    expect_error(c, lambda: fail_on({1}), f"on rank 1 ({host}): bad input on 1")
    expect_error(c, lambda: fail_on({0, 1}), "bad input on 0")  # everywhere: as rank 0 saw it
    assert c.agreed(lambda: rank * 2) == rank * 2
    say(f"collectives ok {rank} {type(c.backend).__name__}")


if __name__ == "__main__":
    sys.exit(main())
