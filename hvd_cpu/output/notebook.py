"""What fit() shows in a notebook while its ranks train: one progress bar over the epochs
(tqdm's notebook display), fed by rank 0's metrics.jsonl. Rank 0's own bar over the batches
needs a terminal, which a rank started from a notebook does not have."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (tqdm's own test, without importing IPython)."""
    ipython = sys.modules.get("IPython")
    shell = ipython and ipython.get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


class EpochBar:
    """The epochs rank 0 has finished, as a bar; call it to bring it up to date."""

    def __init__(self, metrics: Path, epochs: int) -> None:
        try:
            from tqdm.notebook import tqdm

            self.bar: Any = tqdm(total=epochs, desc="epochs", unit="epoch")
        except ImportError:  # no ipywidgets: tqdm's text bar, in the cell's stderr
            from tqdm import tqdm

            self.bar = tqdm(total=epochs, desc="epochs", unit="epoch", file=sys.stderr)
        self.metrics = metrics
        self.since = time.time()  # an earlier run's file in the folder is not progress

    def __call__(self) -> None:
        try:
            if self.metrics.stat().st_mtime < self.since:
                return
            lines = self.metrics.read_text().splitlines()
            last = json.loads(lines[-1]) if lines else None
        except (OSError, ValueError):  # not written yet, or mid-write
            return
        if last and last.get("epoch", 0) != self.bar.n:
            self.bar.n = last["epoch"]
            self.bar.set_postfix_str(f"train loss {last['train_loss']:.4f}", refresh=False)
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
