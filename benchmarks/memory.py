"""Peak memory per rank of `--shard-read` on a big parquet table, against the bound
1.3 x (table in memory / ranks) + the memory of a rank before it reads anything.

Usage (from the repository, after launch/install.sh):
    .venv/bin/python benchmarks/memory.py [--rows 15000000] [--np 1,2,4]
        [--cache /tmp/hvd-cpu-memory] [--results benchmarks/results/DATE-memory.md]

The table (demo-like: float32 features x0..., a float32 target; 15 M rows x 25 columns is
2.3 GB on disk) is written once into --cache and reused. Each `-np N` is one
`horovodrun --gloo -np N hvd-cpu train --shard-read --epochs 1` job; its ranks.json gives every
rank's peak resident memory. The baseline is a process that has imported what a rank imports
(torch, Horovod, pandas, pyarrow and hvd-cpu's training modules) and read nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
MB = 2**20
BASELINE = (
    "import resource, hvd_cpu, torch, horovod.torch, pandas, pyarrow, pyarrow.dataset\n"
    "import hvd_cpu.cli, hvd_cpu.training.train, hvd_cpu.training.prepare\n"
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
)


def write_table(path: Path, rows: int, features: int, row_group: int) -> None:
    """Features ~ N(0, 1), target linear in them plus noise (as make_demo_frame), written one
    row group at a time so that writing a table bigger than memory works too."""
    rng = np.random.default_rng(0)
    weights = rng.uniform(-1.0, 1.0, features).astype(np.float32)
    names = [f"x{i}" for i in range(features)]
    partial = path.with_name(path.name + ".partial")
    writer = None
    for start in range(0, rows, row_group):
        n = min(row_group, rows - start)
        x = rng.standard_normal((n, features), dtype=np.float32)
        target = x @ weights + rng.normal(0.0, 0.1, n).astype(np.float32)
        table = pa.table({**{name: x[:, i] for i, name in enumerate(names)}, "target": target})
        writer = writer or pq.ParquetWriter(partial, table.schema)
        writer.write_table(table, row_group_size=row_group)
    writer.close()
    partial.rename(path)


def table_file(cache: Path, rows: int, features: int, row_group: int) -> Path:
    """The cached table of this shape, written first if it is not there."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"demo-{rows}x{features}-rg{row_group}.parquet"
    if not path.exists():
        write_table(path, rows, features, row_group)
    return path


def in_memory_mb(path: Path) -> float:
    """The table's size as a DataFrame: fixed-width columns, so rows x bytes per row."""
    metadata = pq.read_metadata(path)
    row_bytes = sum(field.type.bit_width // 8 for field in metadata.schema.to_arrow_schema())
    return metadata.num_rows * row_bytes / MB


def run(command: list[str]) -> str:
    """The command's output; stops the benchmark if it fails."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(f"failed: {' '.join(command)}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def measure(path: Path, np_: int, batch_size: int, output: Path) -> list[dict]:
    """ranks.json of one `--shard-read` epoch on `np_` ranks."""
    run(
        [str(BIN / "horovodrun"), "--gloo", "-np", str(np_), "--disable-cache",
         str(BIN / "hvd-cpu"), "train", "--data", str(path), "--shard-read", "--epochs", "1",
         "--batch-size", str(batch_size), "--output", str(output), "--overwrite"]
    )  # fmt: skip
    return json.loads((output / "ranks.json").read_text())


def report(path: Path, baseline: float, runs: dict[int, list[dict]]) -> str:
    """The Markdown table: each N's peak RSS per rank against its bound."""
    table_mb = in_memory_mb(path)
    lines = [
        f"# Peak memory per rank with --shard-read, {datetime.date.today()}",
        "",
        f"`{' '.join(['.venv/bin/python', 'benchmarks/memory.py', *sys.argv[1:]])}`",
        "",
        f"- table: {pq.read_metadata(path).num_rows:,} rows x "
        f"{pq.read_metadata(path).num_columns} float32 columns in "
        f"{pq.ParquetFile(path).num_row_groups} row groups; "
        f"{path.stat().st_size / MB:,.0f} MB on disk, {table_mb:,.0f} MB as a DataFrame",
        f"- import baseline (a process that has imported what a rank imports): {baseline:.0f} MB",
        "- bound: 1.3 x table / N + baseline",
        "",
        "| ranks | rows per rank | table / N (MB) | bound (MB) | peak RSS per rank (MB) | "
        "peak - bound (MB) |",
        "|---:|---|---:|---:|---|---:|",
    ]
    for np_, ranks in runs.items():
        bound = 1.3 * table_mb / np_ + baseline
        peaks = [r["peak_rss_mb"] for r in ranks]
        rows = [r["rows_read"] for r in ranks]
        lines.append(
            f"| {np_} | {', '.join(f'{n:,}' for n in rows)} | {table_mb / np_:,.0f} | "
            f"{bound:,.0f} | {', '.join(f'{p:,.0f}' for p in peaks)} | {max(peaks) - bound:+,.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=15_000_000)
    parser.add_argument("--features", type=int, default=24)
    parser.add_argument("--row-group-size", type=int, default=250_000)
    parser.add_argument("--np", default="1,2,4", help="rank counts, comma-separated")
    parser.add_argument("--batch-size", type=int, default=65_536)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/hvd-cpu-memory"))
    parser.add_argument("--output", type=Path, help="the runs' folder (default: in --cache)")
    parser.add_argument(
        "--results",
        type=Path,
        default=HERE / "results" / f"{datetime.date.today()}-memory.md",
    )
    args = parser.parse_args()
    path = table_file(args.cache, args.rows, args.features, args.row_group_size)
    output = args.output or args.cache / "runs"
    baseline = float(run([sys.executable, "-c", BASELINE]))
    runs = {
        n: measure(path, n, args.batch_size, output / f"np{n}")
        for n in map(int, args.np.split(","))
    }
    text = report(path, baseline, runs)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
