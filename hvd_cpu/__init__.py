"""hvd-cpu: data-parallel PyTorch training on CPU processes and CPU hosts with Horovod over Gloo."""

__version__ = "0.1.0"
