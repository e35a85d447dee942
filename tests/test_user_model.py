"""The user's own model and loss as they already wrote them: the constructor's signature is
read (the seed's `Network(input_size)` unchanged), factories and --model-args, and --loss by
name or as the user's function."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

from hvd_cpu.errors import InputError
from hvd_cpu.model.losses import build_loss, check_loss
from hvd_cpu.model.networks import build_user_model, model_arguments
from hvd_cpu.tools.predict import load_model

from .jobs import SLOW, horovodrun, hvd_cpu, metrics, weights

# Slow tests here may run beside another test (launch/test.sh's first stage, two workers).
pytestmark = pytest.mark.beside

# The seed user's class, exactly as in their question (super(Network, self) included).
SEED_NETWORK = """
import torch
from torch import nn


class Network(nn.Module):
    def __init__(
        self,
        input_size
    ):
        super(Network, self).__init__()

        self.input_size = input_size

        self.linear_1 = nn.Linear(self.input_size, 32)
        self.linear_2 = nn.Linear(32, 1)


    def forward(self, data):
        output = self.linear_1(data)
        output = self.linear_2(output)

        return output
"""

FACTORY = """
from torch import nn


def make_model(in_features, width, out_features=1):
    return nn.Sequential(nn.Linear(in_features, width), nn.ReLU(), nn.Linear(width, out_features))
"""

USER_LOSSES = """
def l1(output, target):
    return (output - target).abs().mean()
"""


def written(folder: Path, name: str, text: str) -> Path:
    (folder / name).write_text(text)
    return folder / name


class Only:
    def __init__(self, d): ...


class Named:
    def __init__(self, depth, in_features, out_features, width=3): ...


class Keywords:
    def __init__(self, input_dim, **rest): ...


class NoArguments:
    def __init__(self): ...


@pytest.mark.parametrize(
    ("factory", "model_args", "expected"),
    [
        (Only, {}, {"d": 8}),  # the only parameter: the feature count, whatever its name
        (Named, {"depth": 2}, {"depth": 2, "in_features": 8, "out_features": 1}),
        (Keywords, {"dropout": 0.1}, {"dropout": 0.1, "input_dim": 8}),
        (NoArguments, {}, {}),
        (Only, {"d": 5}, {"d": 5}),  # --model-args wins over what hvd-cpu would fill
    ],
)
def test_arguments_follow_the_constructor(factory, model_args, expected):
    assert model_arguments(factory, 8, 1, model_args) == expected


def test_parameters_nobody_can_fill_are_named():
    with pytest.raises(InputError, match=r"nothing to give 'depth'; .*--model-args '\{\"depth\""):
        model_arguments(Named, 8, 1, {})


def test_the_seed_network_is_built_from_its_one_parameter(tmp_path: Path):
    spec = f"{written(tmp_path, 'user_net.py', SEED_NETWORK)}:Network"
    model = build_user_model(spec, 8, 1)
    assert model.linear_1.in_features == 8
    assert model.input_size == 8


def test_a_factory_gets_counts_and_model_args(tmp_path: Path):
    spec = f"{written(tmp_path, 'factory.py', FACTORY)}:make_model"
    model = build_user_model(spec, 8, 2, {"width": 5})
    assert [tuple(p.shape) for p in model.parameters()] == [(5, 8), (5,), (2, 5), (2,)]


@pytest.mark.parametrize(
    ("name", "task", "kind"),
    [
        (None, "regression", nn.MSELoss),
        (None, "classification", nn.CrossEntropyLoss),
        ("mse", "regression", nn.MSELoss),
        ("l1", "regression", nn.L1Loss),
        ("huber", "regression", nn.HuberLoss),
        ("torch.nn:SmoothL1Loss", "regression", nn.SmoothL1Loss),
    ],
)
def test_losses_by_name_and_class(name, task, kind):
    assert type(build_loss(name, task)) is kind


def test_a_user_loss_is_checked_on_the_models_output(tmp_path: Path):
    spec = f"{written(tmp_path, 'losses.py', USER_LOSSES)}:l1"
    loss = build_loss(spec, "regression")
    output = torch.ones(2, 1, requires_grad=True)
    check_loss(loss, spec, output, torch.zeros(2, 1))
    with pytest.raises(InputError, match=r"returned a tensor of shape \(2, 1\)"):
        check_loss(lambda o, t: o - t, "m:f", output, torch.zeros(2, 1))
    with pytest.raises(InputError, match=r"no gradient flows back"):
        check_loss(lambda o, t: (o - t).abs().mean().detach(), "m:f", output, torch.zeros(2, 1))


def train_args(data: Path, output: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(data), "--epochs", "2", "--output", str(output), *extra]


def predicts(run: Path, data: Path) -> None:
    """predict rebuilds the run's model (from the user's file and arguments) and uses it."""
    output = run.parent / f"{run.name}-predictions.csv"
    args = ["--model", str(run), "--data", str(data), "--output", str(output)]
    predicted = hvd_cpu("predict", *args)
    assert predicted.returncode == 0, predicted.stderr
    assert len(pd.read_csv(output)) == len(pd.read_parquet(data))


def test_the_seed_network_trains_unchanged_as_the_built_in_mlp(demo_parquet: Path, tmp_path):
    """The seed's class, passed as written, trains under horovodrun and ends bit-identical
    to hvd-cpu's own MLP (the same layers built from the same seed), and predict rebuilds it."""
    spec = f"{written(tmp_path, 'user_net.py', SEED_NETWORK)}:Network"
    theirs = horovodrun(2, *train_args(demo_parquet, tmp_path / "theirs", "--model", spec))
    assert theirs.returncode == 0, theirs.stderr
    ours = horovodrun(2, *train_args(demo_parquet, tmp_path / "ours"))
    assert ours.returncode == 0, ours.stderr
    mine, built_in = weights(tmp_path / "theirs"), weights(tmp_path / "ours")
    assert list(mine) == ["linear_1.weight", "linear_1.bias", "linear_2.weight", "linear_2.bias"]
    assert all(torch.equal(mine[key], built_in[key]) for key in mine)
    predicts(tmp_path / "theirs", demo_parquet)


@SLOW
def test_a_factory_with_model_args_trains_and_predicts(demo_parquet: Path, tmp_path: Path):
    spec = f"{written(tmp_path, 'factory.py', FACTORY)}:make_model"
    args = train_args(
        demo_parquet, tmp_path / "run", "--model", spec, "--model-args", '{"width": 5}'
    )
    job = horovodrun(2, *args)
    assert job.returncode == 0, job.stderr
    assert tuple(weights(tmp_path / "run")["0.weight"].shape) == (5, 8)
    predicts(tmp_path / "run", demo_parquet)


@SLOW
@pytest.mark.parametrize(
    ("named", "own"),
    [("huber", "torch.nn:HuberLoss"), ("l1", "{losses}:l1")],
)
def test_a_named_loss_trains_as_the_same_loss_written_out(
    named: str, own: str, demo_parquet: Path, tmp_path: Path
):
    """--loss NAME picks the loss it names: training with it ends where training with the
    same loss passed as the user's own class or function ends."""
    own = own.format(losses=written(tmp_path, "losses.py", USER_LOSSES))
    runs = {}
    for label, loss in (("named", named), ("own", own)):
        job = hvd_cpu(*train_args(demo_parquet, tmp_path / label, "--loss", loss))
        assert job.returncode == 0, job.stderr
        runs[label] = weights(tmp_path / label)
    for key, value in runs["named"].items():
        torch.testing.assert_close(runs["own"][key], value, rtol=0, atol=1e-5)
    mse = hvd_cpu(*train_args(demo_parquet, tmp_path / "mse"))
    assert mse.returncode == 0, mse.stderr
    assert not torch.equal(
        weights(tmp_path / "mse")["linear_1.weight"], runs["named"]["linear_1.weight"]
    )


@SLOW
def test_gelu_goes_between_the_layers_of_the_mlp_and_it_trains(demo_parquet: Path, tmp_path):
    """--hidden 16,16 --activation gelu: model.pt rebuilds (as predict does) into three
    Linear layers with GELU between each two, computing exactly that, and the loss falls."""
    args = train_args(demo_parquet, tmp_path / "run", "--hidden", "16,16", "--activation", "gelu")
    job = hvd_cpu(*args)
    assert job.returncode == 0, job.stderr
    model, _ = load_model(tmp_path / "run")
    kinds = {name: type(module) for name, module in model.named_children()}
    assert kinds == {f"linear_{i}": nn.Linear for i in (1, 2, 3)} | {"activation": nn.GELU}
    first, second, last = model.linear_1, model.linear_2, model.linear_3
    x = torch.randn(64, 8)
    with torch.no_grad():
        gelu = nn.functional.gelu
        torch.testing.assert_close(model(x), last(gelu(second(gelu(first(x))))))
        assert not torch.allclose(model(x), last(second(first(x))), atol=1e-3)
    history = [m["train_loss"] for m in metrics(tmp_path / "run")]
    assert history[-1] < history[0]
