"""The job a rank belongs to: joining it, what the ranks exchange, the machine's cores, how the
process ends.

world.py is the World, where a rank stands (a plain value, no Horovod in it). join.py joins
the job (init, and elastic_world after a reset) and chooses the backend of the job's
collectives in one place (`_backend`); launch.py starts ranks from Python; elastic_loop.py
runs Horovod's elastic loop. horovod.py holds every direct Horovod call, each as small as it
can be (starting it, its collectives, its DistributedOptimizer, its launcher, its elastic
state). collectives.py is the one interface of what ranks exchange; each backend is a subclass
(Horovod's in horovod.py, MPI's in mpi.py, the job of one in alone.py): a new backend is
one new subclass, chosen in join.py's `_backend`.
cores.py gives each rank its share of cores; lifecycle.py signals, exit codes, parent death;
watchdog.py heartbeats between the ranks, so a rank that stops answering, or stops moving on
while the others wait for it, ends the job (heartbeat.py their signed datagram, reach.py the
one address each rank hears them on); failure.py ends the job when a rank fails on its
own (the user's code, memory, sys.exit): its traceback, one line, the others told at once;
driver.py runs Horovod's launcher for fit() in a child process (the caller keeps its Ctrl-C);
startup.py notes when the rank reaches each phase of its start (ranks.json's start_seconds).
secret.py is the job's secret (HOROVOD_JOB_KEY, made where the job starts, carried in the
environment) and the MACs every channel of the job signs with a key derived from it.
"""
