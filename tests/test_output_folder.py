"""The folders hvd-cpu writes into are the user's own: one another user owns or may write to
is refused before anything is written, and a link planted in one never leads a record, a
checkpoint or a model into another file (hvd_cpu/atomic.py)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pandas as pd
import pytest

from hvd_cpu.atomic import append
from hvd_cpu.config.options import TrainConfig
from hvd_cpu.errors import InputError
from hvd_cpu.tools.predict import PredictConfig, predict
from hvd_cpu.training.train import train

from .jobs import demo_file, hvd_cpu

# The files a run writes into its folder, each planted as a link to a victim of its own.
WRITTEN = (
    "metrics.jsonl", "checkpoint.pt", "model.pt", "config.toml", "features.json", "ranks.json",
    ".hvd-cpu-job.json",
)  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_file(tmp_path_factory.mktemp("data") / "frame.parquet", rows=300, features=4)


def test_a_folder_others_can_write_is_refused_in_one_line(data: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    job = hvd_cpu("train", "--data", str(data), "--epochs", "1", "--output", str(shared))
    assert job.returncode == 2, job.stderr
    assert job.stderr.splitlines() == [
        f"hvd-cpu: error: the folder {shared} is writable by other users (mode 0777), who could "
        f"plant files in it for hvd-cpu to write through; chmod o-w {shared}, or choose a "
        "folder of your own"
    ]
    assert not list(shared.iterdir())


def test_a_folder_of_another_user_is_refused(data: Path, tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    config = TrainConfig(data=data, output=theirs, epochs=1, quiet=True, progress=False)
    with pytest.raises(InputError, match=r"belongs to another user \(uid 65534\), who could"):
        train(config)
    assert not list(theirs.iterdir())
    mine = tmp_path / "mine"
    train(TrainConfig(data=data, output=mine, epochs=1, quiet=True, progress=False))
    for folder, pattern in ((theirs, "belongs to another user"), (tmp_path, "writable by other")):
        folder.chmod(0o777)
        out = folder / "predictions.csv"
        with pytest.raises(InputError, match=pattern):
            predict(PredictConfig(model_path=mine, data=data, output=out))
        assert not out.exists()
        folder.chmod(0o755)


def test_links_planted_in_the_output_folder_lead_nowhere(data: Path, tmp_path: Path) -> None:
    """A real run into a folder where every file it writes is a link to someone's file: each
    record replaces its link, and no victim changes (a link to nothing makes no file)."""
    output = tmp_path / "run"
    output.mkdir()
    victims = tmp_path / "victims"
    victims.mkdir()
    for name in WRITTEN:
        (victims / name).write_text(f"the victim's own {name}\n")
        (output / name).symlink_to(victims / name)
    (output / "loss.png").symlink_to(victims / "absent.png")
    job = hvd_cpu("train", "--data", str(data), "--epochs", "2", "--output", str(output),
                  "--overwrite")  # fmt: skip
    assert job.returncode == 0, job.stderr
    plot = hvd_cpu("plot", str(output))
    assert plot.returncode == 0, plot.stderr
    for name in WRITTEN:
        assert (victims / name).read_text() == f"the victim's own {name}\n", name
    written = [n for n in WRITTEN if n != ".hvd-cpu-job.json"]  # the holder goes with the job
    assert not [n for n in [*written, "loss.png"] if (output / n).is_symlink()]
    assert len(pd.read_json(output / "metrics.jsonl", lines=True)) == 2
    assert not (victims / "absent.png").exists()


def test_an_append_never_follows_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(OSError) as refused:
        append(tmp_path / "metrics.jsonl", b"{}\n")
    assert refused.value.errno == errno.ELOOP
    assert victim.read_text() == "mine\n"
    append(tmp_path / "new.jsonl", b"{}\n")
    append(tmp_path / "new.jsonl", b"{}\n")
    assert (tmp_path / "new.jsonl").read_text() == "{}\n{}\n"
