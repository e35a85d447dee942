"""Everything before the first step, on a rank of its own (the job of one's collectives, no
launcher): what prepare hands the loop, the output checks, --elastic's preparing alone, and a
run that leaves its process as it found it.
How ranks agree on bad input is tests/test_collectives.py's and, in whole jobs,
tests/test_bad_input.py's."""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hvd_cpu.config.options import DEMO_FEATURES, DEMO_ROWS, TrainConfig
from hvd_cpu.errors import InputError
from hvd_cpu.output.lock import HOLDER
from hvd_cpu.output.model_files import CHECKPOINT
from hvd_cpu.runtime.alone import Alone
from hvd_cpu.runtime.world import World
from hvd_cpu.training.elastic import Elastic
from hvd_cpu.training.membership import Fixed
from hvd_cpu.training.prepare import open_output, prepare

ONE = World(0, 1, 0, 1, 1, Alone())


def test_the_demo_is_split_encoded_and_met_by_a_model_of_its_shape(tmp_path: Path) -> None:
    config = TrainConfig(output=tmp_path, val_fraction=0.25, hidden=(8, 4))
    prepared = prepare(config, ONE, Fixed())
    assert prepared.arrays.x.shape == (DEMO_ROWS, DEMO_FEATURES)
    train, val = set(prepared.train_rows.tolist()), set(prepared.val_rows.tolist())
    assert not train & val and train | val == set(range(DEMO_ROWS))
    assert len(val) == DEMO_ROWS // 4 and prepared.train_length == DEMO_ROWS - len(val)
    out = prepared.model(torch.from_numpy(prepared.arrays.x[:3]))
    assert out.shape == (3, 1) and prepared.resumed is None
    again = prepare(replace(config, overwrite=True), ONE, Fixed())  # the seed fixes all of it
    assert torch.equal(again.val_rows, prepared.val_rows)


def test_under_elastic_every_rank_prepares_alone_and_holds_every_held_out_row(
    tmp_path: Path,
) -> None:
    config = TrainConfig(output=tmp_path, elastic=True)
    one = prepare(config, ONE, Elastic())
    third_of_three = prepare(config, replace(ONE, rank=2, size=3), Elastic())
    assert torch.equal(third_of_three.val_rows, one.val_rows)
    assert torch.equal(third_of_three.train_rows, one.train_rows)


def test_an_earlier_checkpoint_is_neither_overwritten_nor_resumed_with_other_options(
    tmp_path: Path,
) -> None:
    from hvd_cpu.training.train import train

    train(TrainConfig(output=tmp_path, epochs=1, quiet=True))
    assert (tmp_path / CHECKPOINT).is_file()
    with pytest.raises(InputError, match="holds a checkpoint from an earlier run; pass --resume"):
        open_output(TrainConfig(output=tmp_path), ONE)
    with pytest.raises(InputError, match=r"trained with hidden=\[32\]; resume with the same"):
        open_output(TrainConfig(output=tmp_path, resume=True, hidden=(16,)), ONE)
    resumed = open_output(TrainConfig(output=tmp_path, resume=True), ONE)
    assert resumed is not None and resumed.loop["epoch"] == 1
    assert open_output(TrainConfig(output=tmp_path), replace(ONE, rank=1)) is None  # rank 0's


def test_auto_resume_starts_an_empty_folder_continues_this_job_and_refuses_another_jobs(
    tmp_path: Path,
) -> None:
    """The one command of a job, for its first run and its retries (docs/usage.md,
    "Preemption and retries"): another job is other data, another seed or another model."""
    from hvd_cpu.training.train import train

    assert open_output(TrainConfig(output=tmp_path, auto_resume=True), ONE) is None
    train(TrainConfig(output=tmp_path, epochs=1, quiet=True, seed=3))
    resumed = open_output(TrainConfig(output=tmp_path, auto_resume=True, seed=3, epochs=5), ONE)
    assert resumed is not None and resumed.loop["epoch"] == 1
    for other in ({"seed": 4}, {"hidden": (16,)}, {"data": tmp_path / "other.csv"}):
        config = TrainConfig(output=tmp_path, auto_resume=True, **{"seed": 3, **other})
        with pytest.raises(InputError, match=r"holds the checkpoint of another job \(trained "):
            open_output(config, ONE)
    for both in ("resume", "overwrite"):
        with pytest.raises(InputError, match=f"^--auto-resume continues .*: leave out --{both}$"):
            TrainConfig(output=tmp_path, auto_resume=True, **{both: True})


def test_an_output_that_cannot_be_made_leaves_no_folder_behind(tmp_path: Path) -> None:
    """Folders made only to try writing go again (a run stopped by bad input leaves none)."""
    (tmp_path / "a-file").write_text("not a folder")
    under_a_file = TrainConfig(output=tmp_path / "a-file" / "run")
    with pytest.raises(InputError, match=r"cannot write to output folder .*; choose another"):
        open_output(under_a_file, ONE)
    too_long = TrainConfig(output=tmp_path / "new" / "deeper" / ("x" * 300))
    with pytest.raises(InputError, match="File name too long; choose another --output"):
        open_output(too_long, ONE)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_run_in_a_process_that_goes_on_puts_back_what_it_changed(tmp_path: Path) -> None:
    """training/scope.py: the signal handlers, the wakeup fd, Horovod's environment, the
    heartbeat and exit-on-signal threads and the output folder's lock are the run's, so a
    second run in the same process (a notebook's) starts as the first did."""
    from hvd_cpu.training.train import train

    def process_state() -> tuple:
        wakeup = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(wakeup)
        handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
        return handlers, wakeup, dict(os.environ), sorted(t.name for t in threading.enumerate())

    before = process_state()
    for name in ("first", "second"):
        train(TrainConfig(output=tmp_path / name, epochs=1, quiet=True))
        assert process_state() == before, name
        assert not (tmp_path / name / HOLDER).exists()  # the folder is free for the next job
