"""Where a rank stands in its job: a plain value, free of Horovod, that every room below the
commands can hold (runtime/join.py's `init` makes it, once per rank, or again under
--elastic when the ranks change)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from hvd_cpu.runtime.alone import Alone
from hvd_cpu.runtime.collectives import Collectives

# Horovod's own setting, 0 from a user who wants Gloo's TCP between the ranks of a host too.
SHARED_MEMORY_SWITCH = "HOROVOD_GLOO_SHARED_MEMORY"
# Gloo's transport between the ranks of a host, where our Horovod build gives it.
SHARED_MEMORY = "shared memory"


@dataclass(frozen=True)
class World:
    """Where this process stands in the job."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    threads: int
    collectives: Collectives
    controller: str = "gloo"  # "mpi" or "gloo": who carries Horovod's collectives
    # How Gloo moves bytes between the ranks of a host: "shared memory", or "TCP (why)"; "" MPI.
    transport: str = ""

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def averages_directly(self) -> bool:
        """Whether the collectives run from the calling thread, which --allreduce direct
        needs: MPI's communicator, or Gloo through shared memory."""
        return self.collectives.in_calling_thread

    @property
    def notes(self) -> list[str]:
        """What the user should know about how this job runs: Gloo fell back to TCP between
        ranks of one host (unless the user turned shared memory off)."""
        fell_back = self.transport.startswith("TCP") and self.local_size > 1
        if fell_back and os.environ.get(SHARED_MEMORY_SWITCH) != "0":
            return [f"note: Gloo runs over {self.transport} between ranks of a host, slower"]
        return []

    def alone(self) -> World:
        """This process as a job of one (a rank under --elastic preparing on its own)."""
        return replace(self, rank=0, size=1, collectives=Alone())
