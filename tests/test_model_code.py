"""What a model file may run (output/model_code.py): the MLP is rebuilt from its numbers; the
user's code runs only when this user's own training sealed the file, or with --trust-code, and
even then only a class or def of the very file training recorded, unchanged. Crafted model
files name os:system and its kin: the marker their command would make never appears."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

import hvd_cpu
from hvd_cpu.config.options import TrainConfig
from hvd_cpu.errors import InputError
from hvd_cpu.model.code_source import Source, module_file
from hvd_cpu.model.networks import Network
from hvd_cpu.output import seal
from hvd_cpu.output.model_files import MODEL, ModelFile
from hvd_cpu.tools.predict import load_model
from hvd_cpu.training.train import train

from .jobs import BIN, demo_file, run

NETWORK = """
from torch import nn


class Network(nn.Module):
    def __init__(self, input_size):
        super().__init__()
        self.linear_1 = nn.Linear(input_size, 4)
        self.linear_2 = nn.Linear(4, 1)

    def forward(self, data):
        return self.linear_2(self.linear_1(data))
"""
FEATURES = 4
TRUST = r"would run {spec} to rebuild its model, and no training of yours sealed it .*; if you "
TRUST += r"trust that code, pass --trust-code \(trust_code=True from Python\)$"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_file(tmp_path_factory.mktemp("data") / "frame.parquet", rows=300, features=4)


@pytest.fixture(scope="module")
def sealed(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of this user's, trained here on their own class from a file: model.pt sealed."""
    folder = tmp_path_factory.mktemp("sealed")
    (folder / "net.py").write_text(NETWORK)
    output = folder / "run"
    train(TrainConfig(data=data, output=output, model=f"{folder}/net.py:Network", epochs=1,
                      quiet=True, progress=False))  # fmt: skip
    return output


@pytest.fixture(scope="module")
def mlp(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of the built-in MLP."""
    output = tmp_path_factory.mktemp("mlp") / "run"
    train(TrainConfig(data=data, output=output, epochs=1, quiet=True, progress=False))
    return output


def crafted(run: Path, folder: Path, sealed: bool = False, **changes: Any) -> Path:
    """A copy of `run`'s model.pt with its architecture changed, sealed with the key this
    process finds now, or not at all."""
    saved = torch.load(run / MODEL, weights_only=True)
    saved["architecture"].update(changes)
    saved.pop("seal", None)
    if sealed:
        saved["seal"] = seal.seal(saved["architecture"])
    path = folder / f"crafted-{secrets.token_hex(4)}.pt"
    torch.save(saved, path)
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_training_records_its_code_and_seals_it(sealed: Path) -> None:
    saved = torch.load(sealed / MODEL, weights_only=True)
    record = saved["architecture"]
    assert record["code_sha256"] == sha256(sealed.parent / "net.py")
    assert hmac.compare_digest(saved["seal"], seal.seal(record))
    assert ModelFile.load(sealed).sealed()
    assert oct(seal.key_path().stat().st_mode & 0o777) == "0o600"


def test_a_crafted_model_naming_os_system_runs_nothing(
    sealed: Path, data: Path, tmp_path: Path
) -> None:
    """From the command line, with and without --trust-code: one line, exit 2, no command."""
    marker = tmp_path / "marker"
    os_py = module_file("os")
    assert os_py is not None
    command = {"command": f"touch {marker}"}
    evil = crafted(sealed, tmp_path, model="os:system", model_args=command,
                   code_sha256=sha256(os_py))  # fmt: skip
    refusals = {
        (): TRUST.format(spec="os:system"),
        ("--trust-code",): r"names os:system, but system is not a class or def written at the "
        r"top of .*os\.py; a model file may only name model code defined in the file it names",
    }
    for extra, pattern in refusals.items():
        job = run([str(BIN / "hvd-cpu"), "predict", "--model", str(evil), "--data", str(data),
                   "--output", str(tmp_path / "p.csv"), *extra])  # fmt: skip
        assert job.returncode == 2, job.stderr
        lines = job.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("hvd-cpu: error: "), lines
        assert re.search(pattern, lines[0]), lines[0]
    assert not marker.exists() and not (tmp_path / "p.csv").exists()


# A spec of the standard library, the arguments that would leave MARKER, and what refuses it
# once --trust-code is given (without it, every one is refused as unsealed).
GADGETS: dict[str, tuple[Callable[[Path], dict[str, Any]], str]] = {
    "subprocess:call": (lambda m: {"args": ["touch", str(m)]}, "which is Python's own library"),
    "builtins:exec": (lambda m: {"source": f"open({str(m)!r}, 'w')"}, "no Python source file"),
    "webbrowser:open": (lambda m: {"url": f"file://{m}"}, "which is Python's own library"),
    "antigravity:geohash": (lambda m: {}, "which is Python's own library"),  # its import: a browser
}


@pytest.mark.parametrize("spec", GADGETS)
def test_standard_library_gadgets_are_refused_unimported(
    spec: str, sealed: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "marker"
    args, refusal = GADGETS[spec]
    where = spec.partition(":")[0]
    source = module_file(where)
    hashed = sha256(source) if source else None  # the file's true hash: only the code decides
    evil = crafted(sealed, tmp_path, model=spec, model_args=args(marker), code_sha256=hashed)
    with pytest.raises(InputError, match=TRUST.format(spec=spec)):
        load_model(evil)
    with pytest.raises(InputError, match=refusal):
        load_model(evil, trust_code=True)
    assert not marker.exists()
    assert "antigravity" not in sys.modules


def test_a_name_the_file_only_imports_is_refused_before_the_file_runs(
    sealed: Path, tmp_path: Path
) -> None:
    """Sealed or not, NAME must be a class or def of the file itself: checked on its source,
    so a re-exported `system` is refused without running the file."""
    marker = tmp_path / "imported"
    user = tmp_path / "user.py"
    user.write_text(
        f"import pathlib\nfrom os import system\npathlib.Path({str(marker)!r}).touch()\n"
    )
    command = {"command": f"touch {tmp_path / 'ran'}"}
    evil = crafted(sealed, tmp_path, True, model=f"{user}:system", model_args=command,
                   code_sha256=sha256(user))  # fmt: skip
    with pytest.raises(InputError, match=r"but system is not a class or def written at the top"):
        load_model(evil, trust_code=True)
    assert not marker.exists() and not (tmp_path / "ran").exists()


def test_a_def_rebound_to_another_object_is_refused_before_it_is_called(
    sealed: Path, tmp_path: Path
) -> None:
    user = tmp_path / "rebound.py"
    user.write_text("import os\n\n\ndef make(input_size):\n    pass\n\n\nmake = os.system\n")
    command = {"command": f"touch {tmp_path / 'ran'}"}
    evil = crafted(sealed, tmp_path, True, model=f"{user}:make", model_args=command,
                   code_sha256=sha256(user))  # fmt: skip
    with pytest.raises(InputError, match=r"make is not the class or function written in"):
        load_model(evil)
    assert not (tmp_path / "ran").exists()


def test_a_dotted_module_is_found_without_running_its_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "package-ran"
    (tmp_path / "userpkg").mkdir()
    (tmp_path / "userpkg" / "__init__.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
    )
    (tmp_path / "userpkg" / "net.py").write_text(NETWORK)
    monkeypatch.syspath_prepend(str(tmp_path))
    source = Source.find("userpkg.net:Network")
    assert source.path == (tmp_path / "userpkg" / "net.py").resolve()
    source.check(sha256(source.path), tmp_path / MODEL)
    assert module_file("userpkg.absent") is None and module_file("os.path") is None
    assert not marker.exists() and "userpkg" not in sys.modules


def test_a_changed_file_is_refused_even_when_trusted(sealed: Path, tmp_path: Path) -> None:
    user = tmp_path / "net.py"
    user.write_text(NETWORK)
    mine = crafted(sealed, tmp_path, True, model=f"{user}:Network", code_sha256=sha256(user))
    assert isinstance(load_model(mine)[0], torch.nn.Module)  # sealed, unchanged: it predicts
    with user.open("a") as file:
        file.write("import os\nos.system('touch changed')\n")
    for trust in (False, True):
        with pytest.raises(InputError, match=rf"^{user} changed since {mine} was trained with it"):
            load_model(mine, trust_code=trust)


def test_an_unsealed_model_asks_for_trust_code_and_takes_it(
    sealed: Path, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    frame = pd.read_parquet(data).head(20)
    expected = hvd_cpu.predict(sealed, frame)
    spec = torch.load(sealed / MODEL, weights_only=True)["architecture"]["model"]
    older = crafted(sealed, tmp_path)  # no seal: an older hvd-cpu's
    with monkeypatch.context() as another_user:
        another_user.setenv("XDG_CONFIG_HOME", str(tmp_path / "theirs"))
        seal.ready_key()
        theirs = crafted(sealed, tmp_path, True)  # sealed with another key
    for other in (older, theirs):
        with pytest.raises(InputError, match=TRUST.format(spec=spec)):
            hvd_cpu.predict(other, frame)
        pd.testing.assert_frame_equal(hvd_cpu.predict(other, frame, trust_code=True), expected)


def test_another_users_key_does_not_open_a_sealed_model(
    sealed: Path, data: Path, tmp_path: Path
) -> None:
    """The command line, as another user (another XDG_CONFIG_HOME, so another key)."""
    args = ["predict", "--model", str(sealed), "--data", str(data), "--output"]
    env = {"XDG_CONFIG_HOME": str(tmp_path / "elsewhere")}
    refused = run([str(BIN / "hvd-cpu"), *args, str(tmp_path / "a.csv")], env=env)
    assert refused.returncode == 2
    assert len(refused.stderr.splitlines()) == 1 and "pass --trust-code" in refused.stderr
    trusted = run([str(BIN / "hvd-cpu"), *args, str(tmp_path / "b.csv"), "--trust-code"], env=env)
    assert trusted.returncode == 0, trusted.stderr
    assert len(pd.read_csv(tmp_path / "b.csv")) == len(pd.read_parquet(data))
    assert not (tmp_path / "elsewhere" / "hvd-cpu").exists(), "predict makes no key"


@pytest.mark.parametrize(
    "changes",
    [
        {"activation": "os:system"},
        {"hidden": [10**12]},
        {"hidden": "32"},
        {"n_features": True},
        {"n_outputs": -1},
    ],
    ids=["activation", "huge", "text", "bool", "negative"],
)
def test_the_mlp_is_rebuilt_from_checked_numbers_alone(
    changes: dict[str, Any], mlp: Path, tmp_path: Path
) -> None:
    network, _ = load_model(mlp)
    assert type(network) is Network
    bad = crafted(mlp, tmp_path, **changes)
    with pytest.raises(InputError, match=r"(?s)cannot rebuild the model in .*; it is damaged"):
        load_model(bad)


def test_the_seal_key_is_the_users_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    path = tmp_path / "hvd-cpu" / "model-seal.key"
    assert seal.key_path() == path and seal.read_key() is None
    assert not seal.verify({"model": "x.py:N"}, "00")
    seal.ready_key()
    key = path.read_bytes()
    assert len(key) == 32 and path.stat().st_mode & 0o777 == 0o600
    assert (path.parent.stat().st_mode & 0o777) == 0o700
    seal.ready_key()  # made once
    assert path.read_bytes() == key and seal.read_key() == key
    path.chmod(0o640)
    with pytest.raises(InputError, match=r"is open to other users \(mode 0640\); chmod 600"):
        seal.read_key()
    path.chmod(0o600)
    os.chown(path, 65534, 65534)
    with pytest.raises(InputError, match=r"belongs to another user \(uid 65534\); remove it"):
        seal.read_key()
    path.unlink()
    (tmp_path / "other").write_bytes(key)
    (tmp_path / "other").chmod(0o600)
    path.symlink_to(tmp_path / "other")
    with pytest.raises(InputError, match=r"cannot read the model seal key .*: Too many levels"):
        seal.read_key()
