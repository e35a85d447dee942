"""What rank 0 writes and says, from a loop's state: the files of Records, the closing table
and the advice when the ranks mostly waited (whole runs check the same files in
tests/test_jobs.py; here each case is cheap, so every branch gets one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hvd_cpu.config.files import RECORD
from hvd_cpu.config.options import TrainConfig
from hvd_cpu.output.records import Records
from hvd_cpu.output.summary import Shape, summary_table, waiting_advice
from hvd_cpu.training.state import EpochMetrics, LoopState


def metrics(epoch: int, wait: float = 0.0, val: float | None = None) -> EpochMetrics:
    return EpochMetrics(epoch, 1.0 / epoch, 1000, 2.0, 0.01, 2, None, val, None, wait)


def state_of(*epochs: EpochMetrics) -> LoopState:
    state = LoopState(epoch=len(epochs), history=[m.record() for m in epochs])
    for m in epochs:
        if m.val_loss is not None:
            state.validated(m.val_loss, m.epoch, None)
    return state


def test_metrics_restart_from_the_resumed_history_then_grow_by_one_line_an_epoch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = TrainConfig(output=tmp_path / "run", progress=False)
    records = Records(config, Shape(2))
    records.start(["dropped 3 rows"], [metrics(1).record()])
    records.epoch(metrics(2, val=0.5))
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2]
    assert json.loads(lines[1])["val_loss"] == 0.5
    assert (tmp_path / "run" / RECORD).is_file()
    out, err = capsys.readouterr()
    assert out == "Epoch 2: Train Loss: 0.5000, Val Loss: 0.5000\n"
    assert err == "hvd-cpu: dropped 3 rows\n"


def test_quiet_writes_the_files_and_prints_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = Records(TrainConfig(output=tmp_path, quiet=True), Shape(1))
    records.start([], [])
    records.epoch(metrics(1))
    records.summary(state_of(metrics(1)), "gradients averaged", "fp32 (--precision fp32)")
    assert capsys.readouterr().out == ""
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


def test_ranks_that_end_with_different_parameters_are_warned_about(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = Records(TrainConfig(output=tmp_path), Shape(2))
    same = [{"rank": 0, "param_sha256": "a"}, {"rank": 1, "param_sha256": "a"}]
    records.ranks(same)
    assert capsys.readouterr().err == ""
    records.ranks([same[0], {"rank": 1, "param_sha256": "b"}])
    assert "ranks ended with different parameters" in capsys.readouterr().err
    assert json.loads((tmp_path / "ranks.json").read_text())[1]["param_sha256"] == "b"


def test_the_table_of_one_process_has_no_rows_about_other_ranks(tmp_path: Path) -> None:
    state = state_of(metrics(1, val=0.9), metrics(2, val=0.7), metrics(3, val=0.8))
    precision = "fp32 (--precision fp32)"
    table = summary_table(TrainConfig(output=tmp_path), state, Shape(1), "unsaid", precision, 7.0)
    names = [line.split("  ")[1] for line in table.splitlines()]
    assert names == [
        "epochs run", "best epoch", "best validation loss", "final train loss",
        "training time", "throughput", "precision", "output",
    ]  # fmt: skip
    assert f"  precision             {precision}\n" in table
    assert "best epoch            2" in table and "6.0 s (wall 7.0 s)" in table
    assert "  500 samples/s over 1 rank(s)" in table


@pytest.mark.parametrize(
    ("controller", "transport", "name"),
    [("gloo", "shared memory", "Gloo over shared memory"), ("mpi", "", "MPI")],
)
def test_the_table_of_several_ranks_says_how_long_they_waited_and_how_they_kept_in_step(
    controller: str, transport: str, name: str
) -> None:
    state = state_of(metrics(1, wait=0.5))
    synchronised = "parameters averaged every 8 steps"
    shape = Shape(2, controller, transport)
    table = summary_table(TrainConfig(), state, shape, synchronised, "fp32", 3.0)
    assert "  waiting for other ranks  25% of training time\n" in table
    assert f"  controller               {name}; parameters averaged every 8 steps\n" in table


@pytest.mark.parametrize(
    ("options", "controller", "transport", "cheaper"),
    [
        ({}, "gloo", "TCP (why)", "(horovodrun --mpi with one rank per core, a larger"),
        ({}, "gloo", "shared memory", "(a larger --batch-size"),
        ({"allreduce": "horovod"}, "gloo", "shared memory", "(--allreduce auto, a larger"),
        ({"allreduce": "horovod"}, "mpi", "", "(--allreduce auto, a larger --batch-size"),
        ({}, "mpi", "", "(a larger --batch-size"),
    ],
)
def test_advice_comes_only_past_half_the_time_waiting_and_names_the_cheaper_path(
    options: dict, controller: str, transport: str, cheaper: str
) -> None:
    config = TrainConfig(**options)

    def advice(wait: float, ranks: int = 2) -> str | None:
        shape = Shape(ranks, controller, transport, ranks_here=ranks, cores_here=2)
        return waiting_advice(config, state_of(metrics(1, wait=wait)), shape)

    assert advice(1.0) is None  # 50 %
    given = advice(1.2)
    assert given is not None and "waited for each other 60% of the time" in given
    assert cheaper in given
    assert advice(1.9, ranks=1) is None


def test_more_ranks_than_cores_is_said_to_be_why_they_waited() -> None:
    shape = Shape(4, "gloo", "shared memory", ranks_here=4, cores_here=2)
    advice = waiting_advice(TrainConfig(), state_of(metrics(1, wait=1.2)), shape)
    assert advice == (
        "hvd-cpu: the ranks waited for each other 60% of the time: 4 ranks share 2 cores on "
        "this host, so each waits while others compute; one rank per core (-np 2 here) or a "
        "larger --batch-size pays more; `hvd-cpu bench` measures which"
    )
