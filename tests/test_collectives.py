"""The collectives backends, each in a real two-rank job: Gloo's through shared memory
(horovodrun --gloo: Horovod's, with sums and averages by the direct allreduce), Horovod's
alone (Gloo over TCP) and our mpi4py communicator's (horovodrun --mpi); all must give the
same answers to the same calls, as the training code relies on whichever the launch picked.
The job of one (`Alone`) is checked here in-process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hvd_cpu.errors import InputError
from hvd_cpu.runtime.alone import Alone

from .jobs import BIN, REPO, horovodrun_command, run


@pytest.mark.parametrize(
    ("controller", "shared_memory", "backend"),
    [
        ("gloo", "1", "SharedMemoryCollectives"),
        ("gloo", "0", "HorovodCollectives"),
        ("mpi", "1", "MpiCollectives"),
    ],
)
def test_each_backend_gives_the_same_answers_on_two_ranks(
    controller: str, shared_memory: str, backend: str
) -> None:
    script = REPO / "tests" / "collectives_check.py"
    command = horovodrun_command(2, controller, program=(str(BIN / "python"), str(script)))
    job = run(command, timeout=120, env={"HOROVOD_GLOO_SHARED_MEMORY": shared_memory})
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    said = sorted(text for _, text in job.rank_lines() if text.startswith("collectives ok"))
    assert said == [f"collectives ok 0 {backend}", f"collectives ok 1 {backend}"]


def test_a_job_of_one_gives_back_its_own_values_and_its_own_errors() -> None:
    alone = Alone()
    values = torch.tensor([1.0, 2.0])
    total = alone.sum(values, "sum")
    total.add_(1)
    assert values.tolist() == [1.0, 2.0]  # a new tensor, as on every backend
    assert alone.gather("x", "gather") == ["x"]
    assert alone.sum_numbers(np.array([1, 2])).tolist() == [1.0, 2.0]

    def bad() -> None:
        raise InputError("bad input")

    with pytest.raises(InputError, match=r"^bad input$"):
        alone.agreed(bad)
