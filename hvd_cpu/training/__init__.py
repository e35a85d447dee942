"""What every rank runs, in the order the data flows: train.py (the entry) -> prepare.py (read,
fit, encode, split, build, each step agreed by all ranks) -> trainer.py (one rank's model,
optimizer and epoch) -> job.py (the epochs and rank 0's writing).

How the job's ranks come together is its membership (membership.py: `Fixed`, the same ranks
throughout; elastic.py: `Elastic`, the same job inside Horovod's elastic loop): a new way
(Spark's tasks) is one new subclass there, chosen in train.py, and nothing else branches on it.
What a run holds while it runs (its watchdog, its output folder) is scope.py's RunScope, owned
by the run and let go when it ends.

How the ranks stay in step is sync.py: one GradientSync subclass per strategy (a new strategy
is one new subclass there, chosen in sync.choose). state.py holds the loop's state and epoch
metrics (a leaf, read by the output room), schedule.py the lr, validation.py the held-out rows,
stopping.py when the ranks stop together after a SIGTERM (preemption), precision.py what
the steps' forward pass and loss run in (--precision: fp32, bf16 autocast, or auto's timed
choice).
"""
