"""Gloo across two hosts: hierarchical (shared memory within each host, TCP between them, the
default since the gloo-shared-memory patch) against flat TCP (HOROVOD_GLOO_SHARED_MEMORY=0,
as before), 2 ranks on each of two network-namespace hosts of this machine (tests/hosts.py,
as the multi-host tests make them: root, iproute2 and openssh-server), the seed's MLP at
batch 64 per rank, alternated in rounds; medians, and whether both end with the same
parameters (within float rounding: another summing order).

Usage (from the repository, as root, after launch/install.sh --test):
    .venv/bin/python benchmarks/two_hosts.py [--rounds 3] [--output runs/two-hosts]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from common import frame_file, training_throughput

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.hosts import SSH_PORT, Hosts  # noqa: E402

BIN = Path(sys.executable).parent
NAMES = ["hvdhosta", "hvdhostb"]
PATH = {"PATH": f"{BIN}:/usr/local/bin:/usr/bin:/bin"}  # the ranks' ssh finds hvd-cpu there
SETTINGS = {
    "hierarchical (default)": PATH,
    "flat TCP": {**PATH, "HOROVOD_GLOO_SHARED_MEMORY": "0"},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--output", type=Path, default=Path("runs/two-hosts"))
    args = parser.parse_args()
    frame = frame_file(args.output, args.rows)
    runs: dict[str, list[float]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as folder, Hosts(Path(folder), NAMES) as hosts:
        launcher = [str(BIN / "horovodrun"), "--gloo", "-np", "4", "--disable-cache",
                    "--hostfile", str(hosts.hostfile(2)),
                    "-p", str(SSH_PORT), "-i", str(hosts.key)]  # fmt: skip
        for round_ in range(args.rounds):
            for name, env in SETTINGS.items():
                out = args.output / name.split()[0]
                runs[name].append(training_throughput(launcher, frame, out, env=env))
                print(f"round {round_ + 1}: {name}: {runs[name][-1]:,.0f}", file=sys.stderr)
    models = [
        torch.load(args.output / name.split()[0] / "model.pt", weights_only=True)["state_dict"]
        for name in SETTINGS
    ]
    largest = max((models[0][k] - models[1][k]).abs().max().item() for k in models[0])
    print(f"| 4 ranks on 2 hosts, seed MLP, batch 64 per rank, {args.rows:,} rows "
          "| samples/s (median) | runs |")  # fmt: skip
    print("|---|---:|---|")
    for name, measured in runs.items():
        listed = ", ".join(f"{r:,.0f}" for r in measured)
        print(f"| {name} | {statistics.median(measured):,.0f} | {listed} |")
    print(f"\nlargest parameter difference between the two: {largest:.2e}")
    (args.output / "results.json").write_text(
        json.dumps({"runs": runs, "largest_difference": largest}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
