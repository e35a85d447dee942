"""Horovod's MPI controller next to Gloo: every way in (horovodrun --mpi, mpirun, fit(), a
user's own mpi4py program) trains the same parameters as the Gloo run, and so does the direct
gradient allreduce; bad input stays one line."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from hvd_cpu.runtime import startup

from .jobs import BIN, REPO, Run, horovodrun, mpirun, ranks, run, skip_without_mpi, slow_except

ARGS = ["--epochs", "2", "--no-shuffle", "--val-fraction", "0.1"]


@pytest.fixture(autouse=True)
def mpi_controller() -> None:
    """Every test here needs Horovod's MPI controller (not in a Gloo-only build)."""
    skip_without_mpi()


def state(output: Path) -> dict[str, torch.Tensor]:
    return torch.load(output / "model.pt", weights_only=True)["state_dict"]


def assert_same_parameters(a: Path, b: Path, atol: float = 1e-6) -> None:
    ours, theirs = state(a), state(b)
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=atol, msg=name)


def ok(job: Run) -> Run:
    assert job.returncode == 0, job.stdout + job.stderr
    return job


@pytest.fixture(scope="module")
def gloo_run(demo_parquet: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The card's shape, `horovodrun --gloo -np 2`: the reference the MPI runs must match."""
    output = tmp_path_factory.mktemp("gloo") / "run"
    job = ok(horovodrun(2, "train", "--data", str(demo_parquet), *ARGS, "--output", str(output)))
    summary = (
        "Gloo over shared memory; gradients averaged by one allreduce per step (auto: the "
        "fastest over Gloo's shared memory)"
    )
    assert f"controller               {summary}" in job.stdout
    assert {r["controller"] for r in ranks(output)} == {"gloo"}
    return output


# The default (--allreduce auto) averages directly under MPI.
DIRECT_BY_DEFAULT = "gradients averaged by one allreduce per step (auto: the fastest under MPI)"
LAUNCHES = [
    ("horovodrun --mpi", f"MPI; {DIRECT_BY_DEFAULT}"),
    ("mpirun", f"MPI; {DIRECT_BY_DEFAULT}"),
    (
        "horovodrun --mpi --allreduce horovod",
        "MPI; gradients averaged by hvd.DistributedOptimizer (--allreduce horovod)",
    ),
]


@pytest.mark.parametrize(("how", "summary"), slow_except(LAUNCHES, [LAUNCHES[0], LAUNCHES[2]]))
def test_mpi_trains_the_same_parameters_as_gloo(
    how: str, summary: str, gloo_run: Path, demo_parquet: Path, tmp_path: Path
) -> None:
    args = ["train", "--data", str(demo_parquet), *ARGS, "--output", str(tmp_path)]
    if how == "mpirun":
        job = mpirun(2, *args)
    else:
        job = horovodrun(2, *args, *how.split()[2:], controller="mpi")
    ok(job)
    assert f"controller               {summary}" in job.stdout
    epoch_lines = [(r, t) for r, t in job.rank_lines() if t.startswith("Epoch ")]
    assert [r for r, _ in epoch_lines] == [0, 0], "only rank 0 prints"
    reports = ranks(tmp_path)
    assert [r["controller"] for r in reports] == ["mpi", "mpi"]
    assert {f"MPI; {r['sync']}" for r in reports} == {summary}
    for report in reports:  # where each rank's start went, phase by phase, in order
        phases = report["start_seconds"]
        assert tuple(phases) == startup.PHASES, phases
        assert 0 < phases["imported"] <= phases["joined"] <= phases["prepared"], phases
        assert phases["prepared"] <= phases["first_step"], phases
    assert len({r["param_sha256"] for r in reports}) == 1
    assert_same_parameters(tmp_path, gloo_run)


@pytest.mark.slow
def test_four_ranks_over_mpi_with_the_direct_allreduce_match_gloo(
    demo_parquet: Path, tmp_path: Path
) -> None:
    """With 4 ranks the sums may be added in another order: equal to float32 rounding."""
    args = ["train", "--data", str(demo_parquet), *ARGS]
    ok(horovodrun(4, *args, "--output", str(tmp_path / "gloo")))
    direct = horovodrun(
        4, *args, "--allreduce", "direct", "--output", str(tmp_path / "mpi"), controller="mpi"
    )
    ok(direct)
    assert len({r["param_sha256"] for r in ranks(tmp_path / "mpi")}) == 1
    assert_same_parameters(tmp_path / "mpi", tmp_path / "gloo", atol=1e-5)


@pytest.mark.slow
def test_local_sgd_over_mpi_equals_local_sgd_over_gloo(demo_parquet: Path, tmp_path: Path):
    args = ["train", "--data", str(demo_parquet), *ARGS, "--sync-every", "5"]
    for controller in ("mpi", "gloo"):
        out = tmp_path / controller
        ok(horovodrun(2, *args, "--output", str(out), controller=controller))
        assert {r["controller"] for r in ranks(out)} == {controller}
    assert_same_parameters(tmp_path / "mpi", tmp_path / "gloo")


@pytest.mark.slow
def test_fit_over_mpi_equals_fit_over_gloo(demo_parquet: Path, tmp_path: Path) -> None:
    code = (
        "import sys, hvd_cpu, torch\n"
        "result = hvd_cpu.fit(sys.argv[1], np=2, controller=sys.argv[2], epochs=2,\n"
        "                     output=sys.argv[3], quiet=True)\n"
        "torch.save(result.model.state_dict(), sys.argv[3] + '/fit.pt')\n"
    )
    for controller in ("mpi", "gloo"):
        out = tmp_path / controller
        ok(run([sys.executable, "-c", code, str(demo_parquet), controller, str(out)]))
        assert {r["controller"] for r in ranks(out)} == {controller}
    assert_same_parameters(tmp_path / "mpi", tmp_path / "gloo")
    returned = torch.load(tmp_path / "mpi" / "fit.pt", weights_only=True)
    for name, value in state(tmp_path / "mpi").items():
        assert torch.equal(returned[name], value), "fit returns the model it exported"


@pytest.mark.slow
def test_a_users_mpi4py_program_trains_on_two_halves_of_comm_world(
    demo_parquet: Path, tmp_path: Path
) -> None:
    """launch/mpi4py_two_trainings.py: 4 processes, two independent 2-rank trainings."""
    program = [sys.executable, str(REPO / "launch" / "mpi4py_two_trainings.py")]
    command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "4", *program]
    job = ok(run([*command, str(demo_parquet), str(tmp_path)]))
    printed = re.findall(r"lr ([\d.e-]+): best validation loss ([\d.]+)", job.stdout)
    assert [lr for lr, _ in printed] == ["0.001", "0.01"]
    for lr in ("0.001", "0.01"):
        reports = ranks(tmp_path / f"lr-{lr}")
        assert [(r["rank"], r["controller"]) for r in reports] == [(0, "mpi"), (1, "mpi")]
        assert len({r["param_sha256"] for r in reports}) == 1
        assert len({r["pid"] for r in reports}) == 2
    pids = {r["pid"] for lr in ("0.001", "0.01") for r in ranks(tmp_path / f"lr-{lr}")}
    assert len(pids) == 4, "each half has its own two processes"
    # each half is exactly a 2-rank job at its learning rate
    reference = tmp_path / "reference"
    ok(
        horovodrun(
            2, "train", "--data", str(demo_parquet), "--epochs", "3", "--lr", "0.01",
            "--output", str(reference),
        )
    )  # fmt: skip
    assert_same_parameters(tmp_path / "lr-0.01", reference)


@pytest.mark.slow
def test_an_mpi_without_thread_support_is_one_clear_error(
    demo_parquet: Path, tmp_path: Path
) -> None:
    code = (
        "import sys, mpi4py\n"
        "mpi4py.rc.thread_level = 'single'\n"
        "from mpi4py import MPI\n"
        "import hvd_cpu\n"
        "from hvd_cpu.errors import InputError\n"
        "try:\n"
        "    hvd_cpu.fit(sys.argv[1], comm=MPI.COMM_WORLD, output=sys.argv[2])\n"
        "except InputError as exc:\n"
        "    if MPI.COMM_WORLD.rank == 0: print(exc)\n"
        "    sys.exit(2)\n"
    )
    command = ["mpirun", "--allow-run-as-root", "-q", "-np", "2", sys.executable, "-c", code]
    job = run([*command, str(demo_parquet), str(tmp_path / "out")])
    assert job.returncode == 2
    assert job.stdout.splitlines() == [
        "MPI gives thread level single, Horovod needs MPI_THREAD_MULTIPLE; initialise MPI with "
        "it (mpi4py.rc.thread_level = 'multiple') and use Open MPI's ob1 transport (mpirun "
        "--mca pml ob1), or launch with horovodrun --gloo"
    ]
    assert not (tmp_path / "out").exists()


def test_the_direct_allreduce_under_gloo_over_tcp_is_one_line(
    demo_parquet: Path, tmp_path: Path
) -> None:
    job = horovodrun(
        2, "train", "--data", str(demo_parquet), "--allreduce", "direct",
        "--output", str(tmp_path / "out"), env={"HOROVOD_GLOO_SHARED_MEMORY": "0"},
    )  # fmt: skip
    assert job.returncode == 2
    errors = [(rank, text) for rank, text in job.rank_lines() if text.strip()]
    assert errors == [
        (
            0,
            "hvd-cpu: error: --allreduce direct needs MPI or Gloo through shared memory, and "
            "this job runs Gloo over TCP (turned off by HOROVOD_GLOO_SHARED_MEMORY=0): launch "
            "with horovodrun --mpi, or leave out --allreduce direct",
        )
    ]
    assert "Traceback" not in job.stdout + job.stderr


def test_fit_over_mpi_without_mpirun_is_one_clear_error(tmp_path: Path) -> None:
    code = (
        "import hvd_cpu\n"
        "from hvd_cpu.errors import InputError\n"
        "try:\n"
        "    hvd_cpu.fit('unused.parquet', np=2, controller='mpi')\n"
        "except InputError as exc:\n"
        "    print(exc)\n"
    )
    job = run([sys.executable, "-c", code], env={"PATH": str(BIN)})  # no /usr/bin: no mpirun
    assert job.returncode == 0, job.stderr
    assert job.stdout.strip() == (
        "mpirun not found on PATH; install Open MPI (Debian: apt-get install openmpi-bin) or "
        "use the Gloo controller (horovodrun --gloo, controller='gloo')"
    )
