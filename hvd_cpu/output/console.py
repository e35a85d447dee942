"""The per-epoch progress bar rank 0 shows on a terminal (its lines: hvd_cpu/lines.py)."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


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
