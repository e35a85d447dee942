"""hvd-cpu inside an MPI program of your own: split COMM_WORLD in two halves and let each half
train its own model, here the same network at two learning rates, side by side.

    mpirun -np 4 python launch/mpi4py_two_trainings.py DATA.parquet OUTPUT_FOLDER

Every process of a half calls `hvd_cpu.fit(..., comm=half)`: nothing is launched, the half's
processes are the job's ranks (Horovod runs its MPI controller on that communicator). World
rank 0 then prints both halves' best validation loss.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mpi4py import MPI

import hvd_cpu

LEARNING_RATES = (1e-3, 1e-2)


def main(data: Path, output: Path) -> None:
    world = MPI.COMM_WORLD
    if world.size < 2 or world.size % 2:
        if world.rank == 0:
            print("run it on an even number of processes: mpirun -np 4 ...", file=sys.stderr)
        sys.exit(2)
    color = world.rank * 2 // world.size  # 0 for the first half, 1 for the second
    half = world.Split(color, key=world.rank)
    lr = LEARNING_RATES[color]
    result = hvd_cpu.fit(
        data, comm=half, lr=lr, epochs=3, output=output / f"lr-{lr:g}", quiet=half.rank != 0
    )
    best = result.history["val_loss"].min()
    losses = world.gather((lr, best) if half.rank == 0 else None, root=0)
    if world.rank == 0:
        for lr, loss in sorted(filter(None, losses)):
            print(f"lr {lr:g}: best validation loss {loss:.4f}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: mpirun -np 4 python launch/mpi4py_two_trainings.py DATA OUTPUT_FOLDER")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
