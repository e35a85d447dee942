"""What a model file may run to rebuild its model, decided before anything of it runs.

The built-in MLP is rebuilt from the file's numbers alone. The user's own code runs only when
this user's own runs sealed the file (seal.py), or when the user says they trust it
(`--trust-code`, `trust_code=True`: Hugging Face's trust_remote_code); and even then only a
class or def of the very file training recorded, unchanged since (model/code_source.py). A
class or function the caller hands over (`predict(..., model=Network)`) is theirs already.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from hvd_cpu.errors import InputError
from hvd_cpu.model.code_source import OPTION, Source
from hvd_cpu.model.networks import build_user_model, mlp_from_record
from hvd_cpu.model.user_code import given, split_spec
from hvd_cpu.output.model_files import ModelFile


def trusted_source(artifact: ModelFile, path: Path, trust_code: bool) -> Source | None:
    """The code `artifact` (loaded from `path`) names, checked without running it; None when
    there is none to import (the MLP, or the caller's own object). Each refusal is one line
    naming the code and what to do."""
    spec = artifact.architecture.get("model")
    if not spec or (isinstance(spec, str) and given(spec)):
        return None
    if not isinstance(spec, str):
        raise InputError(
            f"{path} names its model's code with a {type(spec).__name__}; it is damaged or was "
            "not written by hvd-cpu train: train it again"
        )
    split_spec(spec, OPTION)  # a notebook's class cannot be imported: the caller passes it
    recorded = artifact.architecture.get("code_sha256")
    recorded = recorded if isinstance(recorded, str) else None
    if not trust_code and not (recorded and artifact.sealed()):
        raise InputError(
            f"{path} would run {spec} to rebuild its model, and no training of yours sealed it "
            "(it comes from another user or host, or an older hvd-cpu); if you trust that "
            "code, pass --trust-code (trust_code=True from Python)"
        )
    source = Source.find(spec)
    source.check(recorded, path)
    return source


def rebuild(artifact: ModelFile, source: Source | None) -> nn.Module:
    """`artifact`'s model with its weights: the MLP from its numbers, else the user's code
    (`source`, checked by trusted_source, or the caller's own object) built with the
    arguments recorded. A record that does not add up raises ValueError or torch's error."""
    record = artifact.architecture
    if not record.get("model"):
        return mlp_from_record(record, artifact.state_dict)
    counts = (record.get("n_features"), record.get("n_outputs"))
    model_args = record.get("model_args")
    if not all(type(n) is int and n > 0 for n in counts) or not isinstance(
        model_args, (dict, type(None))
    ):
        raise ValueError(f"the feature and output counts {counts} or model_args do not add up")
    found = source.load() if source else None
    model = build_user_model(record["model"], *counts, model_args, found)
    model.load_state_dict(artifact.state_dict)
    return model
