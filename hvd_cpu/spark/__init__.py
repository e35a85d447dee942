"""Training where the data already lives: on a Spark cluster's executors, from a Spark
DataFrame (pip install 'hvd-cpu[spark]', and Java).

    fit(sdf, target="y", model=Network, num_proc=8)   spark/train_job.py: one rank per barrier task
    predict(run, sdf)                                  spark/predict_job.py: on the executors

The driver's checks (pyspark, Java, master, slots, columns) are spark/cluster.py's; what a
task runs spark/task.py's. What Spark's and Ray's jobs share (the rank's process, the relay of
its lines, the restarts) is hvd_cpu/clusters/'s. pyspark is imported only when one of them is
called.
"""

from hvd_cpu.spark.predict_job import predict
from hvd_cpu.spark.train_job import fit

__all__ = ["fit", "predict"]
