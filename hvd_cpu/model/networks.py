"""The models hvd-cpu trains: the seed's MLP (and wider/deeper kin), or the user's own Module."""

from __future__ import annotations

import hashlib
import inspect
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from hvd_cpu.config.options import CHOICES
from hvd_cpu.errors import InputError
from hvd_cpu.model.user_code import import_object

# The names --activation takes, each with its layer (strict: a name without one fails here).
ACTIVATIONS = dict(zip(CHOICES["activation"], (None, nn.ReLU, nn.GELU), strict=True))
# Rows per forward pass when evaluating or predicting: no gradients, so bigger is cheaper.
EVAL_ROWS = 8192


class Network(nn.Module):
    """Linear layers with an optional activation between them.

    With the defaults it is exactly the seed user's model, `Linear(n, 32) -> Linear(32, 1)`
    with no activation, and its state_dict keys (`linear_1`, `linear_2`) match theirs.
    """

    def __init__(
        self,
        input_size: int,
        hidden: tuple[int, ...] = (32,),
        outputs: int = 1,
        activation: str = "none",
    ) -> None:
        super().__init__()
        self.input_size = input_size
        sizes = [input_size, *hidden, outputs]
        self.layers = []
        for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes), start=1):
            self.add_module(f"linear_{i}", nn.Linear(n_in, n_out))
            self.layers.append(getattr(self, f"linear_{i}"))
        self.activation = ACTIVATIONS[activation]() if ACTIVATIONS[activation] else None

    def forward(self, data: torch.Tensor) -> torch.Tensor:
        *hidden, last = self.layers
        for layer in hidden:
            data = layer(data)
            if self.activation is not None:
                data = self.activation(data)
        return last(data)


# Constructor parameters hvd-cpu fills, named as people name them (torch's own Linear says
# in_features/out_features, the seed's Network says input_size).
FEATURE_PARAMETERS = (
    "n_features", "input_size", "in_features", "n_inputs", "input_dim", "in_dim",
    "num_features", "num_inputs",
)  # fmt: skip
OUTPUT_PARAMETERS = (
    "n_outputs", "output_size", "out_features", "output_dim", "out_dim", "num_outputs",
    "n_classes", "num_classes",
)  # fmt: skip
ANY_ARGUMENTS = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def load_model_factory(spec: str, found: Any = None) -> Callable[..., nn.Module]:
    """`MODULE:NAME` or `FILE.py:NAME` -> a torch.nn.Module subclass, or a function making one;
    `found`: the object the spec names, already imported (by predict, after its checks)."""
    factory = import_object(spec, "--model") if found is None else found
    if isinstance(factory, type) and not issubclass(factory, nn.Module):
        raise InputError(f"--model {spec!r}: {factory.__name__} is not a torch.nn.Module subclass")
    if not callable(factory):
        raise InputError(
            f"--model {spec!r} names a {type(factory).__name__}, not a torch.nn.Module class "
            "or a function returning a model"
        )
    return factory


def model_arguments(
    factory: Callable[..., nn.Module], n_features: int, n_outputs: int, model_args: dict[str, Any]
) -> dict[str, Any]:
    """What to build the user's model with, read from its signature: the feature count for a
    parameter named like input_size (or for the only required one), the output count for one
    named like n_outputs, --model-args for the rest. Refuses, naming them, arguments it
    cannot fill and --model-args the model does not take."""
    name = getattr(factory, "__name__", "the model")
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # e.g. a C function: nothing to read
        return dict(model_args)
    parameters = {n: p for n, p in signature.parameters.items() if p.kind not in ANY_ARGUMENTS}
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        unknown = [key for key in model_args if key not in parameters]
        if unknown:
            raise InputError(
                f"--model-args {unknown[0]!r} is not a parameter of {name}{signature}; "
                "pass only the parameters it takes"
            )
    arguments = dict(model_args)
    counts = dict.fromkeys(FEATURE_PARAMETERS, n_features) | dict.fromkeys(
        OUTPUT_PARAMETERS, n_outputs
    )
    for parameter in parameters:
        if parameter not in arguments and parameter in counts:
            arguments[parameter] = counts[parameter]
    unfilled = [n for n, p in parameters.items() if n not in arguments and p.default is p.empty]
    if (
        unfilled
        and unfilled == list(parameters)[:1]
        and not set(parameters) & set(FEATURE_PARAMETERS)
    ):
        arguments[unfilled.pop()] = n_features  # Network(input_size)'s one size, however named
    if unfilled:
        raise InputError(
            f"--model: cannot build {name}{signature}: nothing to give "
            f"{', '.join(map(repr, unfilled))}; hvd-cpu gives the feature count ({n_features}) "
            "to a parameter named like input_size, in_features or n_features (or to the only "
            f"one), the output count ({n_outputs}) to one named like n_outputs or out_features, "
            f"and the rest come from --model-args '{{\"{unfilled[0]}\": ...}}'"
        )
    return arguments


def build_user_model(
    spec: str,
    n_features: int,
    n_outputs: int,
    model_args: dict[str, Any] | None = None,
    found: Any = None,
) -> nn.Module:
    """Build the user's model from what its constructor asks for and check, before any rank
    trains, what training needs of it: one row of n_outputs per input row whatever the batch
    size, and an output that gradients flow back from into parameters. A class is checked to
    be a Module before it is called, a function's result after."""
    factory = load_model_factory(spec, found)
    arguments = model_arguments(factory, n_features, n_outputs, model_args or {})
    name = getattr(factory, "__name__", spec)
    built = f"{name}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})"
    try:
        model = factory(**arguments)
    except Exception as exc:
        raise InputError(f"--model {spec!r}: {built} failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise InputError(
            f"--model {spec!r}: {built} returned a {type(model).__name__}, not a torch.nn.Module"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise InputError(f"--model {spec!r}: {built} has no trainable parameters")
    with torch.enable_grad():
        for rows in (2, 3):  # two sizes: a forward written for one batch size fails on another
            try:
                out = model(torch.zeros(rows, n_features))
            except Exception as exc:
                raise InputError(
                    f"--model {spec!r}: {built} failed on a batch of shape ({rows}, "
                    f"{n_features}): {type(exc).__name__}: {exc}"
                ) from exc
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != (rows, n_outputs):
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise InputError(
                    f"--model {spec!r}: forward returned {got} for a batch of {rows} rows; "
                    f"expected shape (batch, n_outputs) = ({rows}, {n_outputs})"
                )
    if not (out.is_floating_point() and out.requires_grad):
        raise InputError(
            f"--model {spec!r}: forward returned {out.dtype} values that no gradient flows "
            "back from; return floating-point values computed by the model's parameters "
            "(no .detach(), integer casts or torch.no_grad() in forward)"
        )
    return model


def build_model(
    model: str | None,
    hidden: tuple[int, ...],
    activation: str,
    n_features: int,
    n_outputs: int,
    model_args: dict[str, Any] | None = None,
) -> nn.Module:
    """The user's model if `model` names one, else the MLP."""
    if model:
        return build_user_model(model, n_features, n_outputs, model_args)
    return Network(n_features, tuple(hidden), n_outputs, activation)


def mlp_from_record(record: dict[str, Any], state_dict: dict[str, Any]) -> Network:
    """The built-in MLP of a model file, from its numbers alone (each checked; nothing named
    in the file is imported or called), holding the file's weights. Built on the meta device
    and given the weights in place: a record whose sizes do not fit its weights fails in
    load_state_dict before any memory is spent on the sizes it claims."""
    hidden, activation = record.get("hidden"), record.get("activation")
    if not isinstance(hidden, (list, tuple)) or activation not in ACTIVATIONS:
        raise ValueError(f"hidden {hidden!r} or activation {activation!r} is not the MLP's")
    sizes = [record.get("n_features"), *hidden, record.get("n_outputs")]
    if not all(type(size) is int and size > 0 for size in sizes):
        raise ValueError(f"the MLP's layer sizes {sizes!r} are not all positive integers")
    with torch.device("meta"):
        network = Network(sizes[0], tuple(sizes[1:-1]), sizes[-1], activation)
    network.load_state_dict(state_dict, assign=True)
    return network


def parameter_digest(model: nn.Module) -> str:
    """A hash of every parameter and buffer's bytes: equal digests mean bit-identical models."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


@torch.no_grad()
def outputs(model: nn.Module, inputs: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The model's output for each of `inputs` (chunks of at most EVAL_ROWS rows), in eval
    mode and without autograd (torch's decorator keeps the caller's mode between chunks)."""
    model.eval()
    for x in inputs:
        yield model(x)
