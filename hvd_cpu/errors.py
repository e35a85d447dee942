"""The exception types that end a job with one line from rank 0 instead of a traceback."""


class InputError(Exception):
    """Bad input: reported as one line (problem and fix) by rank 0, exit code 2, no traceback."""

    exit_code = 2


class RunFailed(Exception):
    """A fault of the machine, not of the input (a full disk): one line from rank 0, exit 1."""

    exit_code = 1


class Preempted(Exception):
    """Stopped by SIGTERM (preemption: Kubernetes, SLURM, a spot machine) with the point it
    stopped at saved: one line from rank 0, exit 75 (EX_TEMPFAIL: the same command run again
    with --auto-resume goes on from there)."""

    exit_code = 75
