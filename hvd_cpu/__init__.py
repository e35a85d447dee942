"""hvd-cpu: data-parallel PyTorch training on CPU processes and hosts with Horovod (MPI or Gloo)."""

import os
from typing import Any

# Arrow picks its allocator when pyarrow is first imported. Its default, mimalloc, keeps the
# memory of freed buffers for reuse, so a parquet table converted to pandas stays counted
# twice; jemalloc, told in data/parquet.py to give freed pages back at once, does not (the
# peak it saves: docs/usage.md#big-tables). Your own setting wins.
os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "jemalloc")

__version__ = "0.1.0"
__all__ = ["__version__", "benchmark", "fit", "predict"]


def __getattr__(name: str) -> Any:
    # `hvd_cpu.fit`, `predict` and `benchmark` are hvd_cpu.api's, imported on first use so
    # that `import hvd_cpu` (and `hvd-cpu --help`) does not pay for loading torch and Horovod.
    if name in ("benchmark", "fit", "predict"):
        from hvd_cpu import api

        return getattr(api, name)
    raise AttributeError(f"module 'hvd_cpu' has no attribute {name!r}")
