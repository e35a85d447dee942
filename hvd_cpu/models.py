"""The models hvd-cpu trains: the seed's MLP (and wider/deeper kin), or the user's own Module."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import io
import itertools
import sys
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from hvd_cpu.errors import InputError

ACTIVATIONS = {"none": None, "relu": nn.ReLU, "gelu": nn.GELU}


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


def load_model_class(spec: str) -> type[nn.Module]:
    """`package.module:ClassName` or `path/to/file.py:ClassName` -> the class."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise InputError(f"--model {spec!r} is not MODULE:CLASS or FILE.py:CLASS")
    if where.endswith(".py") and not Path(where).is_file():
        raise InputError(f"--model file not found: {where}; check the path on every host")
    # What the module prints while it imports is held back: when the import fails, each rank
    # would print it, and the error is what the user needs to see.
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            module = _import(where)
    except SystemExit as exc:  # a training script's own argument parsing or exit
        said = [line for line in (out.getvalue() + err.getvalue()).splitlines() if line.strip()]
        raise InputError(
            f"--model {spec!r}: importing {where} ended the program (exit code {exc.code}"
            + (f": {said[-1].strip()}" if said else "")
            + "); put the file's own code under `if __name__ == '__main__':` or keep the "
            "class in a file of its own"
        ) from exc
    except Exception as exc:  # the user's code can fail in any way while importing
        raise InputError(
            f"--model {spec!r}: cannot import {where}: {type(exc).__name__}: {exc}; "
            "check that it imports on its own (python -c 'import ...') on every host"
        ) from exc
    sys.stdout.write(out.getvalue())
    sys.stderr.write(err.getvalue())
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise InputError(f"--model {spec!r}: {where} has no torch.nn.Module subclass {name!r}")
    return cls


def _import(where: str) -> ModuleType:
    """The module `where` names: a dotted module path, or a FILE.py."""
    if not where.endswith(".py"):
        return importlib.import_module(where)
    path = Path(where)
    module_spec = importlib.util.spec_from_file_location(f"hvd_cpu_user.{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
    return module


def portable_spec(spec: str) -> str:
    """A --model spec that still works from another working directory (FILE.py made absolute)."""
    where, _, name = spec.rpartition(":")
    return f"{Path(where).absolute()}:{name}" if where.endswith(".py") else spec


def build_user_model(spec: str, n_features: int, n_outputs: int) -> nn.Module:
    """Build the user's class as `ClassName(n_features=..., n_outputs=...)` and check, before
    any rank trains, what training needs of it: one row of n_outputs per input row whatever
    the batch size, and an output that gradients flow back from into parameters."""
    cls = load_model_class(spec)
    built = f"{cls.__name__}(n_features={n_features}, n_outputs={n_outputs})"
    try:
        model = cls(n_features=n_features, n_outputs=n_outputs)
    except Exception as exc:
        raise InputError(
            f"--model {spec!r}: {built} failed: {type(exc).__name__}: {exc}; its __init__ "
            "must take the keyword arguments n_features and n_outputs"
        ) from exc
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
    model: str | None, hidden: tuple[int, ...], activation: str, n_features: int, n_outputs: int
) -> nn.Module:
    """The user's Module if `model` names one, else the MLP."""
    if model:
        return build_user_model(model, n_features, n_outputs)
    return Network(n_features, tuple(hidden), n_outputs, activation)


def parameter_digest(model: nn.Module) -> str:
    """A hash of every parameter and buffer's bytes: equal digests mean bit-identical models."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()
