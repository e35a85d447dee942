"""checkpoint.pt and model.pt (hvd_cpu/output/model_files.py) and the atomic writer under them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from hvd_cpu.atomic import atomic_write
from hvd_cpu.config.options import TrainConfig
from hvd_cpu.data.features import FeatureTransform, Selection, fit
from hvd_cpu.errors import InputError
from hvd_cpu.model.networks import Network, build_model
from hvd_cpu.model.optim import adam
from hvd_cpu.output.model_files import CHECKPOINT, MODEL, Checkpoint, ModelFile
from hvd_cpu.runtime.alone import Alone


@pytest.fixture
def transform() -> FeatureTransform:
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"x0": rng.normal(size=50), "x1": rng.normal(size=50)})
    frame["target"] = frame["x0"] - frame["x1"]
    return fit(frame, Selection(("target",), None, ()), "regression", 32, False, Alone())


def a_checkpoint(transform: FeatureTransform) -> Checkpoint:
    """A checkpoint as training writes one: Adam with state, after one step."""
    model = Network(transform.n_features)
    optimizer = adam(model.parameters(), 1e-3)
    model(torch.ones(4, transform.n_features)).sum().backward()
    optimizer.step()
    return Checkpoint(
        model=model.state_dict(),
        optimizer=optimizer.state_dict(),
        loop={"epoch": 3, "step": 12, "history": [{"epoch": 1, "train_loss": 0.5}]},
        features=transform.to_dict(),
        config=TrainConfig().to_dict(),
    )


def assert_same(saved: object, loaded: object) -> None:
    """Equal containers, tensors bit for bit."""
    if isinstance(saved, torch.Tensor):
        torch.testing.assert_close(loaded, saved, rtol=0, atol=0)
    elif isinstance(saved, dict):
        assert isinstance(loaded, dict) and loaded.keys() == saved.keys()
        for key, value in saved.items():
            assert_same(value, loaded[key])
    elif isinstance(saved, (list, tuple)):
        assert len(loaded) == len(saved)  # type: ignore[arg-type]
        for value, other in zip(saved, loaded, strict=True):  # type: ignore[call-overload]
            assert_same(value, other)
    else:
        assert loaded == saved


# The files


def test_a_checkpoint_round_trips_as_a_plain_dict(transform: FeatureTransform, tmp_path: Path):
    saved = a_checkpoint(transform)
    saved.save(tmp_path / CHECKPOINT)
    plain = torch.load(tmp_path / CHECKPOINT, weights_only=True)  # what earlier runs hold
    assert list(plain) == ["model", "optimizer", "loop", "features", "config"]
    loaded = Checkpoint.load(tmp_path / CHECKPOINT)
    assert_same(saved.to_dict(), loaded.to_dict())
    assert FeatureTransform.from_dict(loaded.features) == transform


def test_an_exported_model_round_trips_and_rebuilds(transform: FeatureTransform, tmp_path: Path):
    model = Network(transform.n_features, (8,), 1, "relu")
    config = TrainConfig(hidden=(8,), activation="relu")
    ModelFile.export(config, model, transform).save(tmp_path / MODEL)
    plain = torch.load(tmp_path / MODEL, weights_only=True)
    assert list(plain) == ["format", "state_dict", "features", "architecture", "config"]
    assert plain["format"] == "hvd-cpu model 1"
    loaded = ModelFile.load(tmp_path)  # the output folder will do
    rebuilt = build_model(**loaded.architecture)
    rebuilt.load_state_dict(loaded.state_dict)
    x = torch.randn(5, transform.n_features)
    torch.testing.assert_close(rebuilt(x), model(x), rtol=0, atol=0)
    assert loaded.config == config.to_dict()


def test_a_model_file_without_the_training_options_still_loads(
    transform: FeatureTransform, tmp_path: Path
):
    artifact = ModelFile.export(TrainConfig(), Network(transform.n_features), transform).to_dict()
    del artifact["config"]  # read by people only; predict does without it
    torch.save(artifact, tmp_path / MODEL)
    assert ModelFile.load(tmp_path / MODEL).config == {}


# Refusals, in the words the command line prints (tests/test_bad_input.py runs them for real)

NOT_A_CHECKPOINT = "is not a checkpoint written by hvd-cpu train; resume from the output folder"
NOT_A_MODEL = "is not a model exported by hvd-cpu train; pass --model the --output folder"


@pytest.mark.parametrize("kind", ["a tensor", "a dict without all its parts", "a model.pt"])
def test_what_is_not_a_checkpoint_is_refused(
    kind: str, transform: FeatureTransform, tmp_path: Path
):
    model = ModelFile.export(TrainConfig(), Network(transform.n_features), transform)
    contents: object = {
        "a tensor": torch.ones(3),
        "a dict without all its parts": {"model": {}, "optimizer": {}, "loop": {}},
        "a model.pt": model.to_dict(),
    }[kind]
    torch.save(contents, tmp_path / CHECKPOINT)
    with pytest.raises(InputError, match=NOT_A_CHECKPOINT):
        Checkpoint.load(tmp_path / CHECKPOINT)


@pytest.mark.parametrize(
    "change", ["a checkpoint.pt", "another format", "no architecture", "a tensor"]
)
def test_what_is_not_a_model_is_refused(change: str, transform: FeatureTransform, tmp_path: Path):
    artifact = ModelFile.export(TrainConfig(), Network(transform.n_features), transform).to_dict()
    contents: object = {
        "a checkpoint.pt": a_checkpoint(transform).to_dict(),
        "another format": {**artifact, "format": "hvd-cpu model 2"},
        "no architecture": {k: v for k, v in artifact.items() if k != "architecture"},
        "a tensor": torch.ones(3),
    }[change]
    torch.save(contents, tmp_path / MODEL)
    with pytest.raises(InputError, match=NOT_A_MODEL):
        ModelFile.load(tmp_path / MODEL)


def test_missing_and_damaged_files_say_what_to_do(tmp_path: Path):
    with pytest.raises(InputError, match=r"no checkpoint to resume at .*; leave out --resume"):
        Checkpoint.load(tmp_path / CHECKPOINT)
    with pytest.raises(InputError, match=r"no trained model at .*model\.pt; pass --model"):
        ModelFile.load(tmp_path)
    for name, what in [(CHECKPOINT, "checkpoint to resume"), (MODEL, "trained model")]:
        (tmp_path / name).write_bytes(b"PK\x03\x04 not a torch file")
        with pytest.raises(InputError, match=f"cannot load the {what} .*; it is damaged"):
            Checkpoint.load(tmp_path / name) if name == CHECKPOINT else ModelFile.load(tmp_path)


# The atomic writer


def test_new_files_follow_the_umask(tmp_path: Path):
    """As open() would create them: 0666 less the umask, which nothing here changes."""
    script = f"""
        import os
        from pathlib import Path
        from hvd_cpu.atomic import atomic_write

        for umask, name in [(0o027, "a"), (0o002, "b")]:
            os.umask(umask)
            atomic_write(Path({str(tmp_path)!r}) / name, lambda handle: handle.write(b"x"))
            assert os.umask(umask) == umask, "atomic_write changed the umask"
    """
    subprocess.run([sys.executable, "-c", textwrap.dedent(script)], check=True)
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "b").stat().st_mode & 0o777 == 0o664


def test_a_failing_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path):
    path = tmp_path / "records.json"
    atomic_write(path, lambda handle: handle.write(b"old"))

    def fail(handle: object) -> None:
        handle.write(b"half")  # type: ignore[attr-defined]
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(path, fail)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["records.json"]


def test_temporaries_of_earlier_crashes_go_with_the_next_write(tmp_path: Path):
    stale = tmp_path / f".{CHECKPOINT}.0123abcd.tmp"
    stale.write_bytes(b"torn")
    other = tmp_path / f".{MODEL}.0123abcd.tmp"  # another file's write, maybe under way
    other.write_bytes(b"torn")
    atomic_write(tmp_path / CHECKPOINT, lambda handle: handle.write(b"whole"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([CHECKPOINT, other.name])


def test_a_full_disk_under_torch_save_is_the_oserror_it_is(
    monkeypatch: pytest.MonkeyPatch, transform: FeatureTransform, tmp_path: Path
):
    def full(obj: object, handle: object) -> None:
        try:
            raise OSError(28, "No space left on device")
        except OSError as exc:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from exc

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match="No space left on device"):
        a_checkpoint(transform).save(tmp_path / CHECKPOINT)
    assert list(tmp_path.iterdir()) == []
