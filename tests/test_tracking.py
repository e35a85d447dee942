"""--tensorboard and --mlflow: rank 0 alone logs, so a job is one event file or one MLflow run
whatever its ranks; read back with TensorBoard's own reader and MLflow's client, from a real
`mlflow server`. Neither package is imported unless asked for."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hvd_cpu.config.options import TrainConfig
from hvd_cpu.errors import InputError
from hvd_cpu.output import tracking

from .jobs import BIN, SLOW, horovodrun, horovodrun_command, hvd_cpu, metrics, run
from .slurm import free_port

# Slow tests here may run beside another test (launch/test.sh's first stage, two workers).
pytestmark = pytest.mark.beside

SERVER_START_SECONDS = 240  # migrations and imports: tens of seconds on a busy 2-core machine
PER_EPOCH = ("train_loss", "val_loss", "lr")  # logged exactly as metrics.jsonl has them


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in `folder`, as (step, value), by TensorBoard's reader."""
    events = EventAccumulator(str(folder))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def expected(records: list[dict], name: str) -> list[tuple[int, float]]:
    return [(r["epoch"], pytest.approx(r[name], rel=1e-6)) for r in records]


def test_tensorboard_one_event_file_from_rank_0(tmp_path: Path, demo_parquet: Path) -> None:
    out, board = tmp_path / "out", tmp_path / "board"
    job = horovodrun(
        2, "train", "--data", str(demo_parquet), "--epochs", "2", "--output", str(out),
        "--tensorboard", str(board), "--quiet",
    )  # fmt: skip
    assert job.returncode == 0, job.stderr
    assert len(list(board.glob("events.out.tfevents.*"))) == 1
    logged, records = scalars(board), metrics(out)
    for name in PER_EPOCH:
        assert logged[name] == expected(records, name)
    assert [step for step, _ in logged["samples_per_s"]] == [1, 2]
    for (_, rate), record in zip(logged["samples_per_s"], records, strict=True):
        assert rate == pytest.approx(record["samples_per_s"], abs=0.1, rel=1e-4)
    for (_, share), record in zip(logged["wait_share"], records, strict=True):
        # metrics.jsonl keeps 4 decimals of each, and an epoch here may last 13 ms
        rounding = 1e-4 / record["seconds"]
        assert share == pytest.approx(record["wait_seconds"] / record["seconds"], abs=rounding)


@SLOW
def test_tensorboard_steps_go_on_under_resume(tmp_path: Path, demo_parquet: Path) -> None:
    out, board = tmp_path / "out", tmp_path / "board"
    common = ["train", "--data", str(demo_parquet), "--output", str(out)]
    common += ["--tensorboard", str(board), "--quiet"]
    assert hvd_cpu(*common, "--epochs", "2").returncode == 0
    resumed = hvd_cpu(*common, "--epochs", "3", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert len(list(board.glob("events.out.tfevents.*"))) == 2  # one per job
    assert scalars(board)["train_loss"] == expected(metrics(out), "train_loss")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `mlflow server` on a sqlite store, its artifacts served through it; its URI."""
    folder = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    command = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}"]
    command += ["--artifacts-destination", str(folder / "artifacts"), "--workers", "1"]
    log = (folder / "server.log").open("w")
    # Without job execution (the tests submit no jobs), whose store MLflow makes in /dev/shm and
    # leaves there when it is stopped.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while not answers(uri):
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not start: {(folder / 'server.log').read_text()}")
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # its own session: the server and its workers
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def answers(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@SLOW
@pytest.mark.parametrize("np", [2, 3])
def test_mlflow_one_run_per_job(
    np: int, mlflow_server: str, tmp_path: Path, demo_parquet: Path
) -> None:
    out, experiment = tmp_path / "out", f"ranks-{np}"
    command = horovodrun_command(np)
    command += ["train", "--data", str(demo_parquet), "--epochs", "3", "--output", str(out)]
    command += ["--mlflow", "--mlflow-experiment", experiment, "--mlflow-run-name", "first"]
    job = run(command, env={"MLFLOW_TRACKING_URI": mlflow_server})
    assert job.returncode == 0, job.stderr
    client = MlflowClient(mlflow_server)
    [found] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    run_id = found.info.run_id
    assert (found.info.run_name, found.info.status) == ("first", "FINISHED")
    params = found.data.params
    assert params["world_size"] == str(np)
    assert params["output"] == str(out) and params["epochs"] == "3"
    assert params["data"] == str(demo_parquet) and params["mlflow"] == "True"
    records = metrics(out)
    for name in PER_EPOCH:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))
        assert history == expected(records, name)
    steps = [m.step for m in client.get_metric_history(run_id, "wait_share")]
    assert sorted(steps) == [1, 2, 3]
    assert {a.path for a in client.list_artifacts(run_id)} == {"model.pt", "features.json"}
    model = Path(client.download_artifacts(run_id, "model.pt", str(tmp_path)))
    assert model.read_bytes() == (out / "model.pt").read_bytes()


@SLOW
@pytest.mark.parametrize(
    ("option", "variable", "experiment"),
    [(None, "from-env", "from-env"), ("from-option", "from-env", "from-option"),
     (None, None, tracking.DEFAULT_EXPERIMENT)],
    ids=["MLFLOW_EXPERIMENT_NAME", "--mlflow-experiment over it", "neither"],
)  # fmt: skip
def test_the_run_lands_in_the_experiment_named(
    option: str | None,
    variable: str | None,
    experiment: str,
    mlflow_server: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--mlflow-experiment NAME, else MLFLOW_EXPERIMENT_NAME, else hvd-cpu (README)."""
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    env = {"MLFLOW_TRACKING_URI": mlflow_server}
    if variable:
        env["MLFLOW_EXPERIMENT_NAME"] = variable
    name = f"run-{tmp_path.name}"
    command = [str(BIN / "hvd-cpu"), "train", "--epochs", "1", "--output", str(tmp_path / "out")]
    command += ["--mlflow", "--mlflow-run-name", name]
    command += ["--mlflow-experiment", option] if option else []
    job = run(command, env=env)
    assert job.returncode == 0, job.stderr
    client = MlflowClient(mlflow_server)
    landed = [
        e.name
        for e in client.search_experiments()
        for r in client.search_runs([e.experiment_id])
        if r.info.run_name == name
    ]
    assert landed == [experiment]


@SLOW
def test_a_failed_job_ends_its_mlflow_run_failed(mlflow_server: str, tmp_path: Path) -> None:
    """A diverging run stops after its first epoch; its run says so, and holds no model."""
    command = [str(BIN / "hvd-cpu"), "train", "--lr", "1e30", "--output", str(tmp_path)]
    command += ["--mlflow", "--mlflow-experiment", "diverged"]
    job = run(command, env={"MLFLOW_TRACKING_URI": mlflow_server})
    assert job.returncode == 2 and "training diverged" in job.stderr
    client = MlflowClient(mlflow_server)
    [found] = client.search_runs([client.get_experiment_by_name("diverged").experiment_id])
    assert found.info.status == "FAILED"
    assert client.list_artifacts(found.info.run_id) == []


@SLOW
def test_unreachable_mlflow_ends_the_job_before_training(tmp_path: Path) -> None:
    """One line from rank 0, exit 1 (the machine's fault, not the input's), in seconds: the
    client's retries are bounded (tracking.MLFLOW_HTTP_LIMITS)."""
    out, uri = tmp_path / "out", f"http://127.0.0.1:{free_port()}"  # nobody listens there
    command = [*horovodrun_command(2), "train", "--epochs", "2", "--output", str(out), "--mlflow"]
    job = run(command, env={"MLFLOW_TRACKING_URI": uri})
    assert job.returncode == 1
    errors = [text for _, text in job.rank_lines() if "error" in text]
    assert errors == [
        f"hvd-cpu: error: on rank 0 ({socket.gethostname()}): --mlflow: cannot log to {uri} "
        "([Errno 111] Connection refused); start the tracking server or correct "
        "MLFLOW_TRACKING_URI, or leave out --mlflow"
    ]
    assert "Epoch 1" not in job.stdout and not (out / "metrics.jsonl").exists()
    assert job.seconds < 90  # MLflow's own retries would take minutes


IMPORTED = """
import sys
from pathlib import Path
from hvd_cpu.config.options import TrainConfig
from hvd_cpu.training.train import train
train(TrainConfig(epochs=1, output=Path(sys.argv[1]), quiet=True))
print(sorted({name.split(".")[0] for name in sys.modules} & {"tensorboard", "mlflow"}))
"""


def test_nothing_of_tracking_is_imported_unless_asked(tmp_path: Path) -> None:
    done = run([sys.executable, "-c", IMPORTED, str(tmp_path / "out")])
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    "options, message",
    [
        ({"tensorboard": Path("board")}, "--tensorboard needs the tracking extra: "),
        ({"mlflow": True}, "--mlflow needs the tracking extra: "),
    ],
)
def test_a_missing_extra_is_named_before_anything_is_read(
    options: dict, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on a host without the extra: its import is blocked the way Python documents (None
    in sys.modules), so find_spec finds nothing."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    for package in ("tensorboard", "mlflow"):
        monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(InputError, match="^" + message + r"pip install 'hvd-cpu\[tracking\]'$"):
        tracking.check(TrainConfig(**options))


def test_mlflow_needs_a_tracking_uri(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(InputError, match="MLFLOW_TRACKING_URI"):
        tracking.check(TrainConfig(mlflow=True))


@pytest.mark.parametrize("option", ["mlflow_experiment", "mlflow_run_name"])
def test_mlflow_names_need_mlflow(option: str) -> None:
    with pytest.raises(InputError, match=r"add --mlflow$"):
        TrainConfig(**{option: "x"})
