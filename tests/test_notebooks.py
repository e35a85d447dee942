"""fit() from real notebooks through a real Jupyter kernel (nbclient, ipykernel): the example,
a class and a loss defined in cells, an interrupted training, code that cannot be shipped.
Each checks what the cells show, the parameters against the same run from the command line,
and that no process is left."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import nbformat
import pandas as pd
import pytest
import torch
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook

from hvd_cpu.data.demo import make_demo_frame
from hvd_cpu.output.model_files import CHECKPOINT, Checkpoint
from hvd_cpu.output.records import METRICS

from .jobs import REPO, horovodrun, metrics, processes_naming, run, weights

pytestmark = pytest.mark.slow

# What a launched job runs: fit()'s driver and Horovod's ranks.
JOB_MARKERS = ("hvd_cpu.runtime.driver", "horovod.runner.run_task")
WIDGET = "application/vnd.jupyter.widget-view+json"


def execute(notebook: nbformat.NotebookNode, folder: Path, client_hook=None) -> list[list]:
    """Run every cell in a new kernel with `folder` as its working directory (errors kept as
    outputs); each code cell's outputs, and no job process left behind."""
    client = NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(folder)}},
    )
    if client_hook:
        threading.Thread(target=client_hook, args=(client,), daemon=True).start()
    client.execute()
    for marker in JOB_MARKERS:
        assert not processes_naming(marker, grace=10), f"left running: {marker}"
    return [cell.outputs for cell in notebook.cells if cell.cell_type == "code"]


def interrupt(client: NotebookClient) -> None:
    """What Jupyter's interrupt button does (interrupt_mode "signal"): SIGINT to the kernel's
    process group. (The client's own interrupt_kernel is a coroutine of its event loop.)"""
    os.killpg(os.getpgid(client.km.provisioner.process.pid), signal.SIGINT)


def notebook_of(*cells: str) -> nbformat.NotebookNode:
    return new_notebook(cells=[new_code_cell(textwrap.dedent(c).strip()) for c in cells])


def text(outputs: list) -> str:
    """What a cell printed and returned, as text."""
    said = []
    for output in outputs:
        said.append(output.get("text", ""))
        said.append(output.get("data", {}).get("text/plain", ""))
    return "".join(said)


def errors(outputs: list) -> list[tuple[str, str]]:
    return [(o.ename, o.evalue) for o in outputs if o.output_type == "error"]


def same_parameters(a: Path, b: Path, atol: float = 0.0) -> None:
    """Equal parameters: bit for bit, or within `atol` where the sums' order may differ."""
    ours, theirs = weights(a), weights(b)
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=atol, msg=name)


def test_the_example_notebook_and_script_train_as_the_command_line_does(tmp_path: Path) -> None:
    notebook = nbformat.read(REPO / "examples" / "seed.ipynb", as_version=4)
    (tmp_path / "nb").mkdir()
    cells = execute(notebook, tmp_path / "nb")
    assert not [e for c in cells for e in errors(c)]
    fit_cell = cells[2]
    assert "Epoch 10: Train Loss" in text(fit_cell), "rank 0's epoch lines show in the cell"
    assert any(WIDGET in o.get("data", {}) for o in fit_cell), "a notebook progress bar"
    assert "Network True" in text(cells[4])

    (tmp_path / "py").mkdir()
    script = run([sys.executable, str(REPO / "examples" / "seed.py")], cwd=tmp_path / "py")
    assert script.returncode == 0, script.stdout + script.stderr

    frame = tmp_path / "frame.pkl"
    make_demo_frame(rows=20_000, features=8, seed=0).to_pickle(frame)
    cli = horovodrun(4, "train", "--data", str(frame), "--epochs", "10", "--quiet",
                     "--output", str(tmp_path / "cli"))  # fmt: skip
    assert cli.returncode == 0, cli.stdout + cli.stderr
    # Four ranks: Horovod fuses gradients as they come, so a sum's order, and the last bits of
    # the parameters, can differ between any two runs (two ranks' sums cannot: a + b = b + a).
    same_parameters(tmp_path / "nb" / "runs" / "seed", tmp_path / "cli", atol=1e-6)
    same_parameters(tmp_path / "py" / "runs" / "seed", tmp_path / "cli", atol=1e-6)


CODE = """
    import torch
    from torch import nn

    class Wide(nn.Module):
        def __init__(self, n_features, width):
            super().__init__()
            self.hidden = nn.Linear(n_features, width)
            self.out = nn.Linear(width, 1)

        def forward(self, x):
            return self.out(torch.relu(self.hidden(x)))

    def half_mse(output, target):
        return 0.5 * ((output - target) ** 2).mean()
"""


def test_a_class_and_a_loss_defined_in_cells_train_resume_and_predict(tmp_path: Path) -> None:
    frame = tmp_path / "frame.pkl"
    make_demo_frame(rows=3000, features=5, seed=2).to_pickle(frame)
    notebook = notebook_of(
        CODE,
        f"""
        import pandas as pd, hvd_cpu
        df = pd.read_pickle({str(frame)!r})
        options = dict(model=Wide, loss=half_mse, model_args={{"width": 16}}, np=2, output="run")
        first = hvd_cpu.fit(df, epochs=2, **options)
        """,
        """
        result = hvd_cpu.fit(df, epochs=3, resume=True, **options)
        print("epochs", result.history["epoch"].tolist(), type(result.model).__name__)
        """,
        """
        new = df.drop(columns="target").head(20)
        print("same", result.predict(new).equals(hvd_cpu.predict("run", new, model=Wide)))
        """,
    )
    cells = execute(notebook, tmp_path)
    assert not [e for c in cells for e in errors(c)]
    assert "epochs [1, 2, 3] Wide" in text(cells[2])
    assert "same True" in text(cells[3])
    recorded = torch.load(tmp_path / "run" / "model.pt", weights_only=True)["architecture"]
    assert (recorded["model"], recorded["model_args"]) == ("__main__:Wide", {"width": 16})

    # The same code from a file, three epochs straight: the resumed run ends where it does.
    (tmp_path / "code.py").write_text(textwrap.dedent(CODE))
    cli = horovodrun(2, "train", "--data", str(frame), "--epochs", "3", "--quiet",
                     "--model", str(tmp_path / "code.py:Wide"), "--model-args", '{"width": 16}',
                     "--loss", str(tmp_path / "code.py:half_mse"),
                     "--output", str(tmp_path / "cli"))  # fmt: skip
    assert cli.returncode == 0, cli.stdout + cli.stderr
    same_parameters(tmp_path / "run", tmp_path / "cli")


def test_interrupting_the_kernel_stops_every_rank_and_keeps_the_checkpoint(
    tmp_path: Path,
) -> None:
    frame = tmp_path / "frame.pkl"
    make_demo_frame(rows=20_000, features=8, seed=3).to_pickle(frame)
    stopping: list[float] = []
    asleep = tmp_path / "asleep"  # the second cell's start time

    def wait_for(ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 120
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.1)

    def interrupt_after_two_epochs_then_again(client: NotebookClient) -> None:
        out = tmp_path / "run"
        wait_for(lambda: (out / METRICS).exists() and len(metrics(out)) >= 2)
        interrupted = time.time()
        interrupt(client)
        wait_for(lambda: asleep.exists() and asleep.read_text() != "")
        stopping.append(float(asleep.read_text()) - interrupted)
        interrupt(client)  # and the kernel's own interrupt still works

    notebook = notebook_of(
        f"""
        import time, pandas as pd, hvd_cpu
        df = pd.read_pickle({str(frame)!r})
        hvd_cpu.fit(df, np=2, epochs=1000, output="run")
        """,
        f"""
        open({str(asleep)!r}, "w").write(str(time.time()))
        time.sleep(120)
        """,
        f'print("asleep for", round(time.time() - float(open({str(asleep)!r}).read())))',
    )
    cells = execute(notebook, tmp_path, client_hook=interrupt_after_two_epochs_then_again)
    assert errors(cells[0])[0][0] == "KeyboardInterrupt", cells[0]
    assert stopping and stopping[0] < 20, f"every rank stopped within seconds: {stopping}"
    print(f"the cell ended {stopping[0]:.1f} s after the interrupt")
    assert errors(cells[1])[0][0] == "KeyboardInterrupt", "the kernel's Ctrl-C is its own again"
    assert int(text(cells[2]).split()[-1]) < 15, "interrupting a plain cell took effect at once"
    checkpoint = Checkpoint.load(tmp_path / "run" / CHECKPOINT)
    assert checkpoint.loop["epoch"] >= 2
    assert "Traceback" not in text(cells[0])


def test_code_that_cannot_reach_the_ranks_is_one_error_in_the_cell(tmp_path: Path) -> None:
    frame = tmp_path / "frame.pkl"
    make_demo_frame(rows=500, features=4, seed=4).to_pickle(frame)
    notebook = notebook_of(
        f"""
        import threading, pandas as pd, hvd_cpu
        from torch import nn
        df = pd.read_pickle({str(frame)!r})
        lock = threading.Lock()

        class Locked(nn.Module):
            def __init__(self, input_size):
                super().__init__()
                self.lock = lock
                self.linear = nn.Linear(input_size, 1)

            def forward(self, x):
                return self.linear(x)

        class Broken(nn.Module):
            def __init__(self, input_size):
                raise ValueError("no such layer")
        """,
        'hvd_cpu.fit(df, model=Locked, np=2, output="a")',
        'hvd_cpu.fit(df, model=Broken, np=2, output="b")',
        'hvd_cpu.fit(df, np=2, epochs=0, output="c")',
    )
    cells = execute(notebook, tmp_path)
    found = [errors(cell) for cell in cells[1:]]
    assert found[0] == [("InputError", "model=Locked cannot be sent to the ranks: TypeError: "
                         "cannot pickle '_thread.lock' object; create what it holds (files, "
                         "locks, connections) inside it, not around it")]  # fmt: skip
    assert found[1] == [("InputError", "--model '__main__:Broken': Broken(input_size=4) "
                         "failed: ValueError: no such layer")]  # fmt: skip
    assert found[2] == [("InputError", "epochs must be at least 1, got 0")]
    for cell in cells[1:]:
        assert "Traceback" not in text(cell), "no rank's traceback in the cell"
    assert not any((tmp_path / name).exists() for name in "ac")
    assert pd.read_pickle(frame).shape == (500, 5)
