"""hvd-cpu: data-parallel PyTorch training on CPU processes and hosts with Horovod (MPI or Gloo)."""

from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "benchmark", "fit"]


def __getattr__(name: str) -> Any:
    # `hvd_cpu.fit` and `hvd_cpu.benchmark` are hvd_cpu.api's, imported on first use so that
    # `import hvd_cpu` (and `hvd-cpu --help`) does not pay for loading torch and Horovod.
    if name in ("benchmark", "fit"):
        from hvd_cpu import api

        return getattr(api, name)
    raise AttributeError(f"module 'hvd_cpu' has no attribute {name!r}")
