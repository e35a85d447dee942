"""--checkpoint-every, --plateau-patience and --patience through a whole training, in this
process (a job of one) on the demo frame: seconds, where a horovodrun job takes a minute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hvd_cpu.config.options import TrainConfig
from hvd_cpu.output.model_files import CHECKPOINT, Checkpoint
from hvd_cpu.training.train import train


def trained(output: Path, **options: object) -> list[dict]:
    """metrics.jsonl of a quiet run on the demo frame."""
    train(TrainConfig(output=output, batch_size=256, threads=1, quiet=True, **options))
    lines = (output / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_checkpoints_are_written_every_n_epochs_and_after_the_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = []
    save = Checkpoint.save

    def counted(checkpoint: Checkpoint, path: Path) -> None:
        saved.append(checkpoint.loop["epoch"])
        save(checkpoint, path)

    monkeypatch.setattr(Checkpoint, "save", counted)
    history = trained(tmp_path, epochs=5, checkpoint_every=2)
    assert saved == [2, 4, 5]
    last = Checkpoint.load(tmp_path / CHECKPOINT)
    assert last.loop["epoch"] == 5
    assert last.loop["history"] == history


def test_a_plateau_halves_the_lr_and_patience_ends_the_run(tmp_path: Path) -> None:
    """An lr far too small to move any float32 weight keeps the validation loss exactly the
    same every epoch: a plateau by construction, not by luck."""
    history = trained(tmp_path, epochs=60, lr=1e-30, plateau_patience=2, patience=5)
    assert len({epoch["val_loss"] for epoch in history}) == 1
    assert [epoch["lr"] for epoch in history] == [1e-30] * 3 + [5e-31] * 2 + [2.5e-31]
