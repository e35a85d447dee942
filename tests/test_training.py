"""Training people can trust: validation, early stopping, checkpoints, resume, predict, API."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from hvd_cpu.atomic import atomic_write
from hvd_cpu.output.model_files import CHECKPOINT, load

from .jobs import (
    BIN,
    assert_same_history,
    demo_file,
    history,
    horovodrun,
    hvd_cpu,
    processes_naming,
    ranks,
    run,
    weights,
)


# Its ranks, their horovodrun killed, get SIGTERM (end_with_parent) and may stop inside an
# epoch with a checkpoint of that step, as under preemption (a slower machine, another test
# beside it): the resumed epoch's record is then still the whole epoch's.
@pytest.mark.slow
@pytest.mark.beside
def test_a_killed_run_resumed_ends_where_an_uninterrupted_one_does(
    frame_20k: Path, tmp_path: Path
) -> None:
    args = ["train", "--data", str(frame_20k), "--epochs", "6", "--warmup-epochs", "2"]
    whole = horovodrun(2, *args, "--output", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stdout + whole.stderr

    # The same job, killed (SIGKILL to horovodrun) once it has checkpointed epoch 2.
    killed = tmp_path / "killed"
    command = [
        str(BIN / "horovodrun"),
        "--gloo",
        "-np",
        "2",
        "--disable-cache",
        str(BIN / "hvd-cpu"),
    ]
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    job = subprocess.Popen(
        [*command, *args, "--output", str(killed)], env=env, stdout=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    while not (killed / "metrics.jsonl").exists() or len(history(killed)) < 2:
        assert job.poll() is None and time.monotonic() < deadline, "the job ended too early"
        time.sleep(0.05)
    job.send_signal(signal.SIGKILL)
    job.wait()
    assert processes_naming(killed, grace=10) == [], "ranks outlived the killed horovodrun"
    stopped_at = load(killed / CHECKPOINT, "checkpoint")["loop"]["epoch"]
    assert 2 <= stopped_at < 6

    resumed = horovodrun(2, *args, "--output", str(killed), "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    epochs = [t for r, t in resumed.rank_lines(0) if t.startswith("Epoch")]
    assert epochs[0].startswith(f"Epoch {stopped_at + 1}:")
    assert_same_history(killed, tmp_path / "whole")
    for name, value in weights(tmp_path / "whole").items():
        torch.testing.assert_close(weights(killed)[name], value, rtol=0, atol=0)
    lrs = [h["lr"] for h in history(killed)]
    assert lrs[0] == pytest.approx(1e-3) and lrs[2:] == pytest.approx([2e-3] * 4)  # warm-up


def test_a_save_killed_halfway_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT
    atomic_write(path, lambda handle: torch.save({"epoch": 1}, handle))
    script = f"""
        import sys, time
        from pathlib import Path
        from hvd_cpu.atomic import atomic_write

        def write(handle):
            handle.write(b"half a checkpoint" * 1000)
            handle.flush()
            print("writing", flush=True)
            time.sleep(60)

        atomic_write(Path({str(path)!r}), write)
    """
    writer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout.readline().strip() == "writing"
    writer.kill()
    writer.wait()
    assert load(path, "checkpoint") == {"epoch": 1}
    assert len(list(tmp_path.glob(f".{CHECKPOINT}.*.tmp"))) == 1  # the torn write, aside
    atomic_write(path, lambda handle: torch.save({"epoch": 2}, handle))
    assert load(path, "checkpoint") == {"epoch": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT]


def test_an_earlier_run_is_never_overwritten_by_accident(tmp_path: Path) -> None:
    first = hvd_cpu("train", "--epochs", "2", "--output", str(tmp_path))
    assert first.returncode == 0, first.stderr
    before = (tmp_path / CHECKPOINT).read_bytes()

    again = hvd_cpu("train", "--epochs", "2", "--output", str(tmp_path))
    assert again.returncode == 2
    assert "holds a checkpoint from an earlier run; pass --resume" in again.stderr
    assert "--overwrite" in again.stderr
    assert (tmp_path / CHECKPOINT).read_bytes() == before

    other = hvd_cpu("train", "--hidden", "8", "--resume", "--output", str(tmp_path))
    assert other.returncode == 2
    assert "was trained with hidden=[32]; resume with the same options" in other.stderr

    fresh = hvd_cpu("train", "--epochs", "1", "--overwrite", "--output", str(tmp_path))
    assert fresh.returncode == 0, fresh.stderr
    assert len(history(tmp_path)) == 1

    nothing = hvd_cpu("train", "--resume", "--output", str(tmp_path / "empty"))
    assert nothing.returncode == 2
    assert "no checkpoint to resume at" in nothing.stderr


def test_early_stopping_ends_every_rank_at_the_same_epoch(
    demo_parquet: Path, tmp_path: Path
) -> None:
    """An lr too small to move a float32 weight: the validation loss never improves on epoch 1's,
    so --patience 2 ends every rank after epoch 3 (the arithmetic is unit-tested in
    test_schedule.py; this is about the ranks agreeing and the summary saying so)."""
    job = horovodrun(
        2, "train", "--data", str(demo_parquet), "--epochs", "60", "--patience", "2",
        "--lr", "1e-30", "--output", str(tmp_path),
    )  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr
    assert [r["epochs_run"] for r in ranks(tmp_path)] == [3, 3]
    losses = [h["val_loss"] for h in history(tmp_path)]
    assert len(losses) == 3 and len(set(losses)) == 1
    best = 1
    summary = "\n".join(t for _, t in job.rank_lines(0))
    assert re.search(rf"best epoch +{best}\n", summary)


@pytest.mark.slow
@pytest.mark.beside
def test_predictions_are_the_same_from_one_rank_or_two(frame_20k: Path, tmp_path: Path) -> None:
    trained = hvd_cpu("train", "--data", str(frame_20k), "--epochs", "2", "--output",
                      str(tmp_path / "model"))  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    new = pd.read_parquet(frame_20k).drop(columns="target").iloc[:5001]
    new.insert(0, "row_id", [f"r{i}" for i in range(len(new))])
    new.to_parquet(tmp_path / "new.parquet")

    args = ["predict", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "new.parquet")]
    one = hvd_cpu(*args, "--id", "row_id", "--output", str(tmp_path / "one.csv"))
    two = horovodrun(2, *args, "--id", "row_id", "--output", str(tmp_path / "two.csv"))
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stdout + two.stderr
    first, second = pd.read_csv(tmp_path / "one.csv"), pd.read_csv(tmp_path / "two.csv")
    assert list(first.columns) == ["row_id", "prediction"]
    assert first["row_id"].tolist() == new["row_id"].tolist()
    pd.testing.assert_frame_equal(first, second, rtol=0, atol=1e-6)

    # the model predicts what it learnt: the demo's noise floor is an MSE of 0.01
    truth = pd.read_parquet(frame_20k)["target"].iloc[:5001].to_numpy()
    assert ((first["prediction"].to_numpy() - truth) ** 2).mean() < 0.05

    new.drop(columns="x3").to_parquet(tmp_path / "missing.parquet")
    missing = hvd_cpu(*args[:-1], str(tmp_path / "missing.parquet"), "--output",
                      str(tmp_path / "m.csv"))  # fmt: skip
    assert missing.returncode == 2 and "lacks the feature column(s) x3" in missing.stderr
    extra = hvd_cpu(*args, "--output", str(tmp_path / "e.csv"))  # row_id not named with --id
    assert extra.returncode == 2 and "has column(s) row_id that the model" in extra.stderr


def test_fit_runs_two_ranks_from_a_plain_python_process(tmp_path: Path) -> None:
    script = f"""
        import hvd_cpu
        from hvd_cpu.data.demo import make_demo_frame
        from hvd_cpu.errors import InputError

        frame = make_demo_frame(4000, 6, seed=1)
        result = hvd_cpu.fit(frame, target="target", np=2, epochs=3, quiet=True,
                             output={str(tmp_path / "api")!r})
        print("worlds", result.history["world_size"].tolist())
        print("losses", result.history["train_loss"].round(4).tolist())
        print("features", result.model.linear_1.in_features)
        try:
            hvd_cpu.fit(frame, target="price", np=2, output={str(tmp_path / "bad")!r})
        except InputError as exc:
            print("error", exc)
    """
    job = run([sys.executable, "-c", textwrap.dedent(script)], timeout=300)
    assert job.returncode == 0, job.stdout + job.stderr
    lines = dict(line.split(" ", 1) for line in job.stdout.splitlines() if " " in line)
    assert lines["worlds"] == "[2, 2, 2]"
    losses = json.loads(lines["losses"])
    assert losses[-1] < losses[0]
    assert lines["features"] == "6"
    assert lines["error"].startswith("target column 'price' not in the data")
    assert history(tmp_path / "api")[-1]["train_loss"] == pytest.approx(losses[-1], abs=1e-4)


@pytest.mark.slow
@pytest.mark.beside
def test_a_terminal_gets_a_progress_bar_and_plot_draws_the_curves(
    frame_20k: Path, tmp_path: Path
) -> None:
    hvd = BIN / "hvd-cpu"
    train = f"{hvd} train --data {frame_20k} --epochs 2 --batch-size 16 --output {tmp_path}"
    # script(1) gives the command a pseudo-terminal; stty gives that terminal a width
    job = run(["script", "-qec", f"stty cols 120 rows 40; {train}", "/dev/null"])
    assert job.returncode == 0, job.stdout + job.stderr
    assert "rows/s, loss" in job.stdout and "Epoch 2: Train Loss" in job.stdout

    plotted = hvd_cpu("plot", str(tmp_path))
    assert plotted.returncode == 0, plotted.stderr
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    quiet = hvd_cpu("train", "--quiet", "--overwrite", "--output", str(tmp_path))
    assert quiet.returncode == 0 and quiet.stdout == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    """A 5 MB disk holds one 3.2 MB checkpoint, but not the second beside it (the save is
    atomic: the new file is written next to the old one)."""
    data = demo_file(tmp_path / "frame.parquet", rows=2000)
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(disk)], check=True)
    try:
        job = horovodrun(
            2, "train", "--data", str(data), "--hidden", "512,512", "--epochs", "3",
            "--output", str(disk / "run"),
        )  # fmt: skip
        assert job.returncode == 1, job.stdout + job.stderr
        errors = [(rank, text) for rank, text in job.rank_lines() if text.strip()]
        assert [rank for rank, _ in errors] == [0, 0, 0], errors  # two epoch lines, the error
        assert re.fullmatch(
            r"hvd-cpu: error: on rank 0 \(\S+\): could not write to "
            + re.escape(
                f"{disk / 'run'}: No space left on device; {disk / 'run/checkpoint.pt'} holds "
            )
            + r"epoch 1; free space \(or choose another --output\) and run again with --resume",
            errors[2][1],
        ), errors[2][1]
        assert "Traceback" not in job.stdout + job.stderr
        saved = torch.load(disk / "run" / "checkpoint.pt", weights_only=True)
        assert saved["loop"]["epoch"] == 1
        assert sorted(p.name for p in (disk / "run").iterdir()) == [
            "checkpoint.pt", "config.toml", "metrics.jsonl"
        ]  # fmt: skip
    finally:
        subprocess.run(["umount", str(disk)], check=False)
