"""`make train` (configs/demo.yaml on the embedded synthetic log) at several training seeds.

    python -m benchmarks.bench_demo                  # or: make bench-demo; seeds 0 1 2, ~3 min on 2 cores
    python -m benchmarks.bench_demo --seeds 0 1 2 3 4

Each seed is one run of the job itself (``python -m pipelines.train --config configs/demo.yaml
--set train.seed=N``, what ``make train SET="train.seed=N"`` runs), in a subprocess, one at a time;
its ``metrics.json`` gives the model's, popularity's and ALS's metrics. The ALS baseline keeps its
own defaults (``evaluation.baselines.als``, seed 0), so it scores the same at every training seed.
The spread of the model is max - min of its recall@20 over the seeds; the margin is the model's
lowest recall@20 less ALS's highest. Writes ``bench_demo.json`` and ``bench_demo.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._harness import RESULTS, ROOT, command, machine, markdown_table, timed, write_report

CONFIG = "configs/demo.yaml"
RANKERS = ("model", "popularity", "als")
METRICS = ("recall@20", "ndcg@20")


def run_seed(seed: int, output_dir: Path) -> dict:
    """One run of the job at ``train.seed=seed``: the rankers' metrics and what training chose."""
    name = f"demo-seed-{seed}"
    argv = [sys.executable, "-m", "pipelines.train", "--config", CONFIG, "--set", f"train.seed={seed}",
            "--set", f"run.output_dir={output_dir}", "--set", f"run.name={name}"]
    with timed() as clock:
        subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    seconds = clock.seconds
    metrics = json.loads((output_dir / name / "metrics.json").read_text())
    return {
        "seed": seed,
        **{ranker: {metric: metrics[ranker][metric] for metric in METRICS} for ranker in RANKERS},
        "epochs": metrics["training"]["epochs"],
        "temperature": metrics["derived"].get("model.temperature"),
        "seconds": round(seconds, 1),
    }


def summarise(rows: list[dict]) -> dict:
    """Mean of each ranker's recall@20, the model's spread (max - min) and its margin over ALS."""
    recall = {ranker: [row[ranker]["recall@20"] for row in rows] for ranker in RANKERS}
    return {
        **{f"{ranker}_mean_recall@20": sum(values) / len(values) for ranker, values in recall.items()},
        "model_spread_recall@20": max(recall["model"]) - min(recall["model"]),
        "model_min_less_als_max_recall@20": min(recall["model"]) - max(recall["als"]),
    }


def _markdown(results: dict) -> str:
    env, summary = results["environment"], results["summary"]
    rows = [[row["seed"], *(f"{row[r][m]:.4f}" for m in METRICS for r in RANKERS), row["epochs"], row["seconds"]]
            for row in results["rows"]]
    header = ["train.seed", *(f"{r} {m}" for m in METRICS for r in RANKERS), "epochs", "seconds"]
    return "\n".join([
        "# The demo: `make train` at several seeds",
        "",
        f"`{results['command']}` on {env['cpus']} CPU cores ({env['cpu']}), {results['date']}; each row is "
        f"`make train SET=\"train.seed=N\"` (`{CONFIG}`, the embedded synthetic log). Load average at start: "
        f"{env['load_average']}.",
        "",
        *markdown_table(header, rows, "r" * len(header)),
        "",
        f"Model recall@20: mean {summary['model_mean_recall@20']:.4f}, spread (max - min) "
        f"{summary['model_spread_recall@20']:.4f}; ALS mean {summary['als_mean_recall@20']:.4f}; the model's "
        f"lowest less ALS's highest: {summary['model_min_less_als_max_recall@20']:+.4f}.",
    ])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="train.seed of each run")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of bench_demo.json and .md")
    args = parser.parse_args(argv)
    environment = machine("tensorflow", "implicit")
    with tempfile.TemporaryDirectory() as runs:
        rows = [run_seed(seed, Path(runs)) for seed in args.seeds]
    results = {
        "command": command("bench_demo", argv),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "environment": environment,
        "config": CONFIG,
        "rows": rows,
        "summary": summarise(rows),
    }
    write_report(args.out / "bench_demo", results, _markdown(results))
    print(_markdown(results))


if __name__ == "__main__":
    main()
