"""`hvd_cpu.benchmark` is `hvd-cpu bench`: the checks, the demo frame and the configuration
are the API's, and the command line only hands it its options; and bench's rule for what it
recommends, on measurements made up here. Nothing is launched here (bench.run is replaced);
tests/test_speed.py runs real benches."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from hvd_cpu import api
from hvd_cpu.cli import cli
from hvd_cpu.config.options import TrainConfig
from hvd_cpu.errors import InputError
from hvd_cpu.runtime.cores import usable_cores
from hvd_cpu.runtime.lifecycle import RANK_VARIABLES
from hvd_cpu.tools import bench

REPORT = {"measurements": [], "recommendation": {}}


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bench.BenchConfig, int]]:
    """What bench.run was given; it and bench.write do nothing."""
    calls: list[tuple[bench.BenchConfig, int]] = []
    monkeypatch.setattr(
        bench, "run", lambda config, epochs: calls.append((config, epochs)) or REPORT
    )
    monkeypatch.setattr(bench, "write", lambda report, output: None)
    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return calls


def test_without_data_it_measures_a_demo_frame_as_the_command_did(
    launched: list[tuple[bench.BenchConfig, int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert api.benchmark(target="y", rows=100, output="out", hidden=(8,)) is REPORT
    [(config, epochs)] = launched
    out = tmp_path / "out"
    assert epochs == 2
    assert (out / "demo.parquet").is_file()
    train = config.train
    assert (train.data, train.output, train.targets, train.hidden) == (
        out / "demo.parquet", out, ("y",), (8,)
    )  # fmt: skip
    assert (train.batch_size, train.val_fraction, train.quiet) == (64, 0.0, True)
    assert config.process_counts == bench.default_process_counts(usable_cores())
    assert (config.batch_sizes, config.sync_intervals, config.controllers) == (
        (64, 1024), (1, 8), ("mpi", "gloo")
    )  # fmt: skip
    assert config.precisions == bench.default_precisions()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_sizes": ()}, "--batch-size names no size; give at least one (e.g. 64,1024)"),
        ({"epochs": 1}, "epochs must be at least 2 (the first is not timed), got 1"),
    ],
)
def test_bad_settings_are_refused_before_any_work(
    launched: list, tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(InputError) as raised:
        api.benchmark(output=tmp_path / "out", **kwargs)
    assert str(raised.value) == message
    assert not launched and not (tmp_path / "out").exists()


def test_an_earlier_bench_is_kept_unless_overwritten(launched: list, tmp_path: Path) -> None:
    (tmp_path / "bench.json").write_text("{}")
    data = tmp_path / "frame.parquet"
    with pytest.raises(InputError, match="holds an earlier bench; pass --overwrite"):
        api.benchmark(data, output=tmp_path)
    api.benchmark(data, output=tmp_path, overwrite=True)
    assert launched[0][0].train.data == data


def test_under_a_launcher_it_refuses(launched: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RANK_VARIABLES[0], "0")
    with pytest.raises(InputError, match="launches its own jobs: run it without horovodrun"):
        api.benchmark()


def test_the_command_hands_its_options_to_the_api(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    given: dict[str, Any] = {}
    monkeypatch.setattr(api, "benchmark", lambda **kwargs: given.update(kwargs) or REPORT)
    monkeypatch.setattr(bench, "table", lambda report: "the table")
    args = ["bench", "--target", "y", "--processes", "1,2", "--output", str(tmp_path)]
    cli.main(args, standalone_mode=False)
    assert given["target"] == ("y",) and given["processes"] == (1, 2)
    assert given["output"] == tmp_path and given["data"] is None
    assert (given["batch_sizes"], given["epochs"], given["overwrite"]) == ((64, 1024), 2, False)


@pytest.mark.parametrize(("slurm", "spelled"), [(None, False), ("3", True)])
def test_the_recommended_command_leaves_out_only_the_threads_train_would_pick(
    monkeypatch: pytest.MonkeyPatch, slurm: str | None, spelled: bool
) -> None:
    """Measured with 2 threads per rank on 4 cores: train picks 2 by itself, unless SLURM's
    --cpus-per-task says otherwise, and then the command must say --threads 2."""
    if slurm is None:
        monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    else:
        monkeypatch.setenv("SLURM_CPUS_PER_TASK", slurm)
    setting = bench.Setting(processes=2, threads=2, batch_size=64, sync_every=1)
    line = bench.command_line(setting, TrainConfig(data=Path("f.parquet")), cores=4)
    assert ("--threads 2" in line) == spelled, line


def measured(setting: bench.Setting, samples_per_s: float) -> bench.Measurement:
    """A measurement of `setting` at `samples_per_s` (its step's split does not matter here)."""
    return bench.Measurement(setting, samples_per_s, step_ms=1.0, compute_ms=0.6, wait_ms=0.4)


@pytest.mark.parametrize("faster", ["horovod", "direct"])
@pytest.mark.parametrize("win", [0.99, 1.0])
def test_the_recommendation_follows_the_measurements_by_bench_s_rule(faster: str, win: float):
    """The fastest setting that trains as asked (batch 64, every step) unless another is
    CLEAR_WIN times as fast; under MPI the averaging measured faster, whichever it is (auto
    would take direct), and a command that trains with it."""
    slower = {"horovod": "direct", "direct": "horovod"}[faster]
    best = measured(bench.Setting(2, 1, 64, 1, "mpi", faster), 1000.0)
    others = [
        measured(bench.Setting(2, 1, 64, 1, "mpi", slower), 900.0),
        measured(bench.Setting(1, 2, 64, 1), 800.0),
        measured(bench.Setting(2, 1, 64, 1, "gloo", "direct"), 950.0),
    ]
    changed = measured(bench.Setting(2, 1, 1024, 8, "mpi"), bench.CLEAR_WIN * 1000.0 * win)
    train = TrainConfig(data=Path("f.parquet"))
    recommended = bench.recommend([*others, changed, best], 64, train, cores=2)
    chosen = best if win < 1 else changed
    assert recommended["setting"] == asdict(chosen.setting)
    assert recommended["command"] == bench.command_line(chosen.setting, train, cores=2)
    assert ("--allreduce horovod" in recommended["command"]) == (
        chosen.setting == best.setting and faster == "horovod"
    )


@pytest.mark.parametrize(
    ("losses", "target", "epochs"),
    [
        ((0.5, 0.3, 0.2), 0.2, 3.0),
        ((0.5, 0.3, 0.2), 0.25, 2.5),  # half of the third epoch's gain was needed
        ((0.5, 0.3, 0.2), 0.6, 1.0),
        ((0.5, 0.3, 0.2), 0.1, None),
        ((0.5, float("nan")), 0.4, None),
    ],
)
def test_the_epochs_to_a_loss_are_interpolated_within_the_epoch_that_reached_it(
    losses: tuple[float, ...], target: float, epochs: float | None
) -> None:
    assert bench.epochs_to(losses, target) == epochs


def test_the_soonest_to_the_same_loss_may_be_neither_the_fastest_nor_exact() -> None:
    """The loss every setting as asked reached is the target; a larger batch that is faster a
    sample but slower to learn loses to bf16 at the asked batch, and the command says bf16."""

    def timed(
        setting: bench.Setting, per_s: float, epoch_s: float, losses: tuple
    ) -> bench.Measurement:
        return bench.Measurement(setting, per_s, 1.0, 0.6, 0.4, epoch_s, losses)

    fp32 = timed(bench.Setting(1, 2, 64, 1), 1000.0, 2.0, (0.5, 0.3, 0.2))
    bf16 = timed(bench.Setting(1, 2, 64, 1, precision="bf16"), 1900.0, 1.0, (0.5, 0.31, 0.21))
    larger = timed(bench.Setting(1, 2, 1024, 1), 4000.0, 0.5, (0.9, 0.7, 0.6))
    measurements = [fp32, bf16, larger]
    assert bench.to_same_loss(measurements, 64) == 0.21
    assert (fp32.seconds_to_loss, bf16.seconds_to_loss, larger.seconds_to_loss) == (
        pytest.approx(2 * 2.9), 3.0, None
    )  # fmt: skip
    train = TrainConfig(data=Path("f.parquet"))
    soonest = bench.soonest(measurements, 0.21, train, cores=2)
    assert soonest["setting"] == asdict(bf16.setting)
    assert soonest["reason"] == (
        "train loss 0.21 in 3.00 s, 1.93x sooner than fp32's soonest "
        f"({fp32.setting.label()}, 5.80 s)"
    )
    assert "--precision bf16" in soonest["command"]
    assert "--precision" not in bench.command_line(fp32.setting, train, cores=2)


def test_every_setting_is_tried_in_every_precision_asked() -> None:
    train = TrainConfig(data=Path("f.parquet"))
    config = bench.BenchConfig(train, (1,), (64,), (1,), cores=2, precisions=("fp32", "bf16"))
    assert [[s.precision for s in job] for job in bench.jobs(config)] == [["fp32", "bf16"]] * 2
    with pytest.raises(InputError, match="precisions are fp32 and bf16, got fp16"):
        bench.BenchConfig(train, (1,), (64,), (1,), cores=2, precisions=("fp16",))
