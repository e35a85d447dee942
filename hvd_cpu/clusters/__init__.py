"""What the cluster engines' jobs share (hvd_cpu/spark: Spark's barrier tasks; hvd_cpu/ray:
Ray's actors): each worker starts its rank as a process of its own on the worker's rows
(worker.py starts rank.py), whose lines reach the driver through relay.py; the driver runs the
job once, or again after a lost rank (restarts.py). A new engine says where its workers run,
hands each its rows, and subclasses restarts.Restarts.
"""
