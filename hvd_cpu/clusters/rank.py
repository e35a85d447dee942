"""One rank of a cluster's job, in a process of its own that its Spark task or Ray actor started
(clusters/worker.py): `python -m hvd_cpu.clusters.rank FOLDER`, where FOLDER holds the job and
the worker's rows, and gets the outcome: ("result", rank 0's TrainResult pickled, else None) or
("error", the InputError every rank met). A rank that fails leaves its exception in FOLDER as
under fit() (runtime/failure.py) and exits 1."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import cloudpickle
import pandas as pd

from hvd_cpu.atomic import atomic_write
from hvd_cpu.errors import InputError
from hvd_cpu.model import user_code
from hvd_cpu.runtime import horovod
from hvd_cpu.runtime.lifecycle import end_with_parent, exit_now, launch_rank
from hvd_cpu.training.train import train


def main(folder: Path) -> None:
    end_with_parent()  # a worker killed (by Spark, by Ray) takes its rank with it
    config, shipped = cloudpickle.loads((folder / "job.pkl").read_bytes())
    own = pd.read_pickle(folder / "rows.pkl")
    for read in ("job.pkl", "rows.pkl"):  # the user's code and rows: not left on a disk
        (folder / read).unlink()
    outcome: tuple[str, Any]
    try:
        user_code.receive(shipped)  # every rank meets the same error here, before joining
        result = train(config, own=own)
        outcome = ("result", cloudpickle.dumps(result) if launch_rank() == 0 else None)
    except InputError as exc:
        outcome = ("error", exc)
    except horovod.PeerLost:
        exit_now(1)  # another rank was lost: the driver says so, with the engine's reason
    record = cloudpickle.dumps(outcome)
    atomic_write(folder / "outcome.pkl", lambda file: file.write(record))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
