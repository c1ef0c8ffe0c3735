"""One log trained both ways: in memory and streamed from its shards, the same job, equal metrics.

``tests/jobs/test_out_of_core.py`` proves the contract of the two click sources on
15k clicks; this checks it at a size where both still fit (2M clicks and 100k
users by default, ``bench_scale.py``'s generator and its log when one
exists: its generator draws from 1M items, about 430k of which the 2M clicks reach) and records what
each costs:

1. the shards (``bench_scale.ensure_shards``) and the whole log as one
   Parquet file beside them (the shards in sorted order, the row order the
   streamed split gives its row keys);
2. ``python -m pipelines.train --config configs/scale.yaml`` twice, as
   subprocesses: ``data.out_of_core=false`` on the file, then ``true`` on the
   shards, with a shuffle buffer that holds every click (so the stream yields
   the in-memory batches), every test user evaluated and an exact (Flat) index
   (an IVF index's k-means would see float round-off as different inputs);
3. the two ``metrics.json`` side by side, with their largest relative
   difference, wall time and peak RSS, to
   ``benchmarks/results/bench_scale_both_ways.{json,md}``.

    python -m benchmarks.bench_both_ways                     # ~9 min on 2 cores
    python -m benchmarks.bench_both_ways --clicks 200000 --items 20000 --out /tmp/both
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks._harness import command as command_line
from benchmarks._harness import machine, write_report
from benchmarks.bench_scale import RESULTS, ROOT, ensure_shards, log_name

SOURCES = {"in memory": "false", "streamed": "true"}
COMPARED = ("model", "popularity")


def ensure_log(base: Path, args) -> tuple[Path, Path]:
    """The log's shard folder (generated unless it exists) and its whole-log Parquet file."""
    name = log_name(args)
    shards = base / "logs" / name
    ensure_shards(shards, args)
    whole = base / "logs" / f"{name}-whole.parquet"
    if not whole.exists():
        files = sorted(shards.glob("*.parquet"))
        pq.write_table(pa.concat_tables([pq.read_table(file) for file in files]), whole)
    return shards, whole


def run_job(source: str, data_path: str, train_rows_bound: int, base: Path, args) -> dict:
    """One ``pipelines.train`` subprocess: its metrics, wall time and peak RSS."""
    name = f"both-ways-{source.replace(' ', '-')}"
    overrides = [
        f"data.clicks.path={data_path}", f"data.out_of_core={SOURCES[source]}",
        f"data.stream.shuffle_buffer={train_rows_bound}", "data.stream.max_test_users=null",
        "index.factory=Flat", "train.verbose=2", f"run.output_dir={base / 'runs'}", f"run.name={name}",
        "run.overwrite=true", *args.set,
    ]
    command = [sys.executable, "-m", "pipelines.train", "--config", str(ROOT / "configs" / "scale.yaml")]
    command += [part for setting in overrides for part in ("--set", setting)]
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    if status != 0:
        raise SystemExit(f"{source} job failed (wait status {status}): {' '.join(command)}")
    metrics = json.loads((base / "runs" / name / "metrics.json").read_text())
    return {"seconds": round(seconds, 1), "peak_rss_bytes": usage.ru_maxrss * 1024, "metrics": metrics,
            "command": " ".join(command[1:])}


def relative_difference(a: dict, b: dict) -> float:
    """Largest ``|a - b| / max(|a|, 1e-12)`` over the numbers both dicts hold."""
    return max((abs(a[k] - b[k]) / max(abs(a[k]), 1e-12) for k in a if isinstance(a[k], float) and k in b),
               default=0.0)


def markdown(report: dict) -> str:
    runs = report["runs"]
    memory, streamed = runs["in memory"]["metrics"], runs["streamed"]["metrics"]
    keys = [k for k in memory["model"] if k.startswith(("recall@", "ndcg@"))]
    lines = [
        "# One log trained both ways", "",
        f"`{report['command']}` on {os.cpu_count()} CPUs: `configs/scale.yaml` on {report['log']}, in memory "
        "(one Parquet file) and streamed (its shards; a shuffle buffer holding every click, so the same batches), "
        "every test user, a Flat index.", "",
        "| source | " + " | ".join(keys) + " | final train loss | seconds | peak RSS |",
        "|---|" + "---|" * (len(keys) + 3),
    ]
    for source, run in runs.items():
        m = run["metrics"]
        cells = [f"{m['model'][k]:.4f}" for k in keys]
        cells += [f"{m['final_train_loss']:.6f}", f"{run['seconds']:.0f}", f"{run['peak_rss_bytes'] / 2**30:.2f} GiB"]
        lines.append(f"| {source} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Evaluation counts (" + ", ".join(f"{k} {v}" for k, v in memory["counts"].items()) + "): "
        + ("the same in both runs" if report["same_evaluation_set"] else f"streamed differs, {streamed['counts']}")
        + f"; training clicks {memory['data'].get('train_clicks')} and {streamed['data'].get('train_clicks')}.",
        "Largest relative difference, streamed against in memory: "
        + ", ".join(f"{part} {value:.1e}" for part, value in report["max_relative_difference"].items())
        + ".",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clicks", type=int, default=2_000_000)
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--clicks-per-user", type=float, default=20.0)
    parser.add_argument("--clusters", type=int, default=200)
    parser.add_argument("--shard-clicks", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], help="extra config overrides for both runs")
    parser.add_argument("--dir", default=os.environ.get("RETRIEVAL_SCALE_DIR", "/tmp/retrieval-scale"))
    parser.add_argument("--out", default=str(RESULTS / "bench_scale_both_ways"), help="results path without extension")
    args = parser.parse_args()
    base = Path(args.dir)
    shards, whole = ensure_log(base, args)
    runs = {
        "in memory": run_job("in memory", str(whole), args.clicks, base, args),
        "streamed": run_job("streamed", f"{shards}/*.parquet", args.clicks, base, args),
    }
    memory, streamed = runs["in memory"]["metrics"], runs["streamed"]["metrics"]
    if memory["counts"] != streamed["counts"]:
        print(f"different evaluation sets: {memory['counts']} vs {streamed['counts']}", file=sys.stderr)
    report = {
        "command": command_line("bench_both_ways"),
        "machine": machine("numpy", "tensorflow", "faiss"),
        "log": f"{args.clicks:,} clicks over {args.items:,} items ({shards.name})",
        "runs": runs,
        "same_evaluation_set": memory["counts"] == streamed["counts"],
        "max_relative_difference": {
            **{part: relative_difference(memory[part], streamed[part]) for part in COMPARED},
            "final_train_loss": abs(memory["final_train_loss"] - streamed["final_train_loss"])
            / abs(memory["final_train_loss"]),
        },
    }
    write_report(args.out, report, markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
