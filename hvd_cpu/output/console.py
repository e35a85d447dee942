"""What rank 0 prints while a job runs: whole lines (one write each, so launchers that tag
lines never split one) and the per-epoch progress bar on a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm


def say(text: str, stream: TextIO | None = None) -> None:
    """Print `text` as one write of whole lines: with PYTHONUNBUFFERED, print() writes the
    newline separately, and Open MPI's --tag-output then tags it as a line of its own."""
    stream = stream or sys.stdout
    stream.write(text + "\n")
    stream.flush()


class Progress:
    """A per-epoch progress bar (rows/s, running loss) on a terminal."""

    def __init__(self, epoch: int, batches: int) -> None:
        self.bar = tqdm(
            total=batches,
            desc=f"Epoch {epoch}",
            unit="batch",
            leave=False,
            file=sys.stdout,
            dynamic_ncols=True,
        )
        self.rows = 0
        self.start = time.perf_counter()

    def update(self, rows: int, loss: float) -> None:
        self.rows += rows
        rate = self.rows / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{rate:,.0f} rows/s, loss {loss:.4f}", refresh=False)
        self.bar.update()

    def close(self) -> None:
        self.bar.close()
