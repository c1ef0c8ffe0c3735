"""A warm start against a full retrain on one small case, and carried against reset optimizer state.

The synthetic generator's default log (``SyntheticConfig(seed=7)``, 83k clicks) cut in time into
a (the first 70 %), b (the next 15 %) and c (the last 15 %):

- parent: from scratch on a, 10 epochs;
- warm-carry / warm-reset: ``train.warm_start`` from the parent on b, ``--warm-epochs`` epochs,
  ``train.warm_start_optimizer`` carry / reset;
- retrain: from scratch on a + b, 10 epochs;

each scored on c (recall@20 over the full catalogue, each user's training clicks excluded: the
parent's count as the warm starts' own), with each job's wall time and training time. One JSON line
a run on stdout. The full period-by-period comparison is the freshness benchmark's; this is the
quick check behind ``train.warm_start_optimizer``'s default.

    python -m benchmarks.bench_warm_start --out /tmp/warm --seeds 42 1 2 --json benchmarks/results/bench_warm_start.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pandas as pd

import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow)
from benchmarks import _harness as harness
from retrieval.config import SyntheticConfig, load_config
from retrieval.data.synthetic import generate_clicks
from retrieval.jobs import RunResult, train_evaluate_export


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the period files and the runs")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42], help="train.seed of each repetition")
    parser.add_argument("--warm-epochs", type=int, default=2, help="epochs of each warm start")
    parser.add_argument("--json", type=Path, help="also write the rows, their means and the machine's load here")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    clicks, _, _ = generate_clicks(SyntheticConfig(seed=7))
    first, second = clicks.timestamp.quantile([0.7, 0.85])
    parts = {"a": clicks[clicks.timestamp <= first],
             "b": clicks[(clicks.timestamp > first) & (clicks.timestamp <= second)],
             "c": clicks[clicks.timestamp > second]}
    parts["ab"] = pd.concat([parts["a"], parts["b"]])
    for name, frame in parts.items():
        frame.to_csv(args.out / f"{name}.csv", index=False)
    print(json.dumps({f"{name} clicks": len(frame) for name, frame in parts.items()}))
    rows: list[dict] = []
    for seed in args.seeds:
        rows += _repetition(args.out, seed, args.warm_epochs)
    if args.json is not None:
        means = {run: round(sum(r["recall@20"] for r in rows if r["run"] == run) / len(args.seeds), 4)
                 for run in ("parent", "warm-carry", "warm-reset", "retrain")}
        training = {run: round(sum(r["training_s"] for r in rows if r["run"] == run) / len(args.seeds), 2)
                    for run in ("warm-carry", "warm-reset", "retrain")}
        harness.write_json(args.json, {
            "command": harness.command("bench_warm_start", sys.argv[1:]),
            "machine": harness.machine("tensorflow", "faiss"),
            "clicks": {name: len(frame) for name, frame in parts.items()}, "warm_epochs": args.warm_epochs,
            "mean_recall@20": means, "mean_training_s": training,
            "warm_carry_over_retrain_recall": round(means["warm-carry"] / means["retrain"], 3),
            "warm_carry_over_retrain_training_s": round(training["warm-carry"] / training["retrain"], 3),
            "runs": rows,
        })


def _repetition(out: Path, seed: int, warm_epochs: int) -> list[dict]:
    common = [f"train.seed={seed}", "split.kind=none", "train.validation_fraction=0", "train.verbose=0",
              "evaluation.plots=false", "evaluation.baselines.rankers=[popularity]",
              f"run.output_dir={out / 'runs'}", "run.overwrite=true"]
    rows = []

    def run(name: str, train: str, test: str, *extra: str) -> RunResult:
        started = time.perf_counter()
        config = load_config(None, [f"data.clicks.path={out / f'{train}.csv'}",
                                    f"data.test_clicks.path={out / f'{test}.csv'}", *common,
                                    f"run.name={name}", *extra])
        result = train_evaluate_export(config)
        rows.append({
            "seed": seed, "run": name, "wall_s": round(time.perf_counter() - started, 1),
            "training_s": result.metrics["timing"]["seconds"]["training"],
            "recall@20": round(result.metrics["model"]["recall@20"], 4),
            "popularity_recall@20": round(result.metrics["popularity"]["recall@20"], 4),
            "load_average": harness.load_average()[0],
        })
        print(json.dumps(rows[-1]), flush=True)
        return result

    parent = run("parent", "a", "b", "train.epochs=10")
    for optimizer in ("carry", "reset"):
        run(f"warm-{optimizer}", "b", "c", f"train.epochs={warm_epochs}",
            f"train.warm_start={parent.directory}", f"train.warm_start_optimizer={optimizer}")
    run("retrain", "ab", "c", "train.epochs=10")
    return rows

if __name__ == "__main__":
    main()
