"""Training on a Ray cluster's CPUs, from a Ray Dataset, a pandas DataFrame or parquet
(pip install 'hvd-cpu[ray]'). Ray Core's public API only: a placement group, one actor per rank.

    fit(ds, target="y", model=Network, num_proc=8)   ray/train_job.py: one rank per actor
    predict(run, ds)                                 ray/predict_job.py: Ray Data's map_batches

The driver's checks (Ray, the address, CPUs, the workers' Python, columns) are ray/cluster.py's;
what an actor runs ray/actor.py's; what Spark's and Ray's jobs share hvd_cpu/clusters/'s. Ray
is imported only when one of them is called; fit and predict themselves on first use, so that
an actor, which imports ray/actor.py alone, checks its node's Python before it needs torch.
"""

from typing import Any

__all__ = ["fit", "predict"]


def __getattr__(name: str) -> Any:
    if name == "fit":
        from hvd_cpu.ray.train_job import fit

        return fit
    if name == "predict":
        from hvd_cpu.ray.predict_job import predict

        return predict
    raise AttributeError(f"module 'hvd_cpu.ray' has no attribute {name!r}")
