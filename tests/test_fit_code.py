"""fit() with the user's own code as written: a class and a loss defined in the script itself
(`__main__`) reach the ranks by value, a class from a file comes back to the caller, and both
train exactly as the command line does. tests/test_notebooks.py does the same in Jupyter."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import torch

from .jobs import demo_file, horovodrun, processes_naming, run, weights

NETWORK = """
    import torch
    from torch import nn

    class Network(nn.Module):  # the seed's class
        def __init__(self, input_size):
            super().__init__()
            self.linear_1 = nn.Linear(input_size, 32)
            self.linear_2 = nn.Linear(32, 1)

        def forward(self, data):
            return self.linear_2(self.linear_1(data))

    def mse(output, target):
        return ((output - target) ** 2).mean()
"""


def test_fit_takes_the_scripts_own_class_and_loss_and_a_files_and_hands_both_back(
    tmp_path: Path,
) -> None:
    data = demo_file(tmp_path / "frame.parquet", rows=4000, features=6)
    (tmp_path / "net.py").write_text(textwrap.dedent(NETWORK))
    script = textwrap.dedent(NETWORK) + textwrap.dedent(f"""
        import pickle, threading, hvd_cpu, pandas as pd
        from hvd_cpu.errors import InputError

        frame = pd.read_parquet({str(data)!r})
        new = frame.drop(columns="target").head(50)
        options = dict(np=2, epochs=2, quiet=True)
        here = hvd_cpu.fit(frame, model=Network, loss=mse, output="here", **options)
        there = hvd_cpu.fit(frame, model="net.py:Network", loss="net.py:mse", output="there",
                            **options)
        said = {{}}
        for name, call in {{
            "unshippable": lambda: hvd_cpu.fit(
                frame, model=type("Locked", (Network,), {{"lock": threading.Lock()}}), **options),
            "unnamed": lambda: hvd_cpu.predict("here", new),  # before model=Network is given
            "not_callable": lambda: hvd_cpu.fit(frame, model=3, **options),
            "two_lambdas": lambda: hvd_cpu.fit(
                frame, model=lambda n: Network(n), loss=lambda o, t: mse(o, t), **options),
        }}.items():
            try:
                call()
            except InputError as exc:
                said[name] = str(exc)
        said |= {{
            "here_is_network": isinstance(here.model, Network),
            "there_class": f"{{type(there.model).__module__}}.{{type(there.model).__name__}}",
            "saved": [len(pickle.dumps(r.model)) > 0 for r in (here, there)],
            "epochs": here.history["epoch"].tolist(),
            "same_predictions": here.predict(new).equals(
                hvd_cpu.predict("here", new, model=Network)),
        }}
        print(json.dumps(said))
    """)
    job = run([sys.executable, "-c", "import json\n" + script], cwd=tmp_path)
    assert job.returncode == 0, job.stdout + job.stderr
    said = json.loads(job.stdout.splitlines()[-1])
    assert said["here_is_network"] and said["there_class"] == "hvd_cpu_user.net.Network"
    assert said["saved"] == [True, True], "both models pickle again in the caller (torch.save)"
    assert said["epochs"] == [1, 2] and said["same_predictions"]
    assert said["unshippable"].startswith("model=Locked cannot be sent to the ranks: TypeError")
    assert said["unnamed"].endswith(
        "--model '__main__:Network' was defined in a notebook or script, which cannot be "
        "imported here: from Python pass the object itself (model=Network), or move it into "
        "a file and name it FILE.py:Network"
    )
    assert said["not_callable"].startswith("model= takes a class, a function or a 'MODULE:NAME'")
    assert said["two_lambdas"].startswith("model= and loss= are both named <lambda>")
    assert "Traceback" not in job.stderr
    for marker in ("hvd_cpu.runtime.driver", "horovod.runner.run_task"):
        assert not processes_naming(marker, grace=10), f"left running: {marker}"

    # Both train what the command line trains with the same class and loss from a file.
    cli = horovodrun(2, "train", "--data", str(data), "--epochs", "2", "--quiet",
                     "--model", str(tmp_path / "net.py:Network"), "--loss",
                     str(tmp_path / "net.py:mse"), "--output", str(tmp_path / "cli"))  # fmt: skip
    assert cli.returncode == 0, cli.stdout + cli.stderr
    for folder in ("here", "there"):
        for name, value in weights(tmp_path / "cli").items():
            assert torch.equal(weights(tmp_path / folder)[name], value), (folder, name)
    recorded = torch.load(tmp_path / "here" / "model.pt", weights_only=True)["architecture"]
    assert recorded["model"] == "__main__:Network"
