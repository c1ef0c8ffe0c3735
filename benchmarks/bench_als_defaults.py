"""The ALS baseline's defaults (``evaluation.baselines.als``): one grid point for every log.

Each point of ``bench_public.ALS_GRID`` is scored on four logs, never on a test part: ML-100K and
the synthetic log of ``make train`` on the validation cut of their training part
(``split.evaluate_on: validation``, as hyper-parameter tuning scores), and Gowalla and MovieLens-1M
on ``valid.txt`` from ``benchmarks/results/bench_public.json`` (its ALS grid rows, measured by
``make bench-public``). A point's score is the mean over the logs of its recall@20 over that log's
best point (1.0 = the best on every log); the default is the point with the highest score.

    python -m benchmarks.bench_als_defaults [--out benchmarks/results/bench_als_defaults]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from benchmarks._harness import RESULTS, command, machine, markdown_table, write_report
from benchmarks.bench_public import ALS_GRID, RECALL, als_grid, read_report
from retrieval.config import ALSConfig, load_config
from retrieval.evaluation.compare import compare_rankers
from retrieval.jobs.train import _als_ranking, evaluation_clicks, read_and_split

ROOT = Path(__file__).resolve().parents[1]
LOGS = {"ml-100k": ROOT / "configs/ml100k.yaml", "synthetic": ROOT / "configs/default.yaml"}
PUBLIC = ("gowalla", "ml-1m")


def point_name(point: dict) -> str:
    return " ".join(f"{key}={value:g}" for key, value in point.items())


def score_log(config_path: Path, points: list[dict]) -> dict[str, float]:
    """recall@20 of each ALS point on the validation cut of a log's training part."""
    config = load_config(config_path, ["split.evaluate_on=validation", "evaluation.baselines.rankers=[als]"])
    data = read_and_split(config)
    evaluated = evaluation_clicks(config, data)
    catalogue = pd.Index(data.catalogue_ids, dtype=object)
    activity = np.zeros(len(evaluated.eval_set.user_ids), np.int64)
    counts = np.zeros(len(catalogue), np.int64)
    depth = max(config.evaluation.ks)
    scores = {}
    for point in points:
        evaluation = config.evaluation.model_copy(
            update={"baselines": config.evaluation.baselines.model_copy(update={"als": ALSConfig(**point)})})
        started = time.perf_counter()
        ranked = {"als": lambda evaluation=evaluation: _als_ranking(data, catalogue, evaluated.eval_set, depth,
                                                                    evaluation)}
        result = compare_rankers(ranked, evaluated.eval_set, counts, activity, evaluation)
        scores[point_name(point)] = float(result["als"][RECALL])
        print(f"{config_path.name} {point_name(point)}: {scores[point_name(point)]:.4f} "
              f"({time.perf_counter() - started:.1f} s)", flush=True)
    return scores


def public_scores(dataset: str) -> dict[str, float]:
    """recall@20 on valid.txt of every ALS grid point bench_public measured on ``dataset`` (seed 0)."""
    rows = read_report(RESULTS / "bench_public.json")["rows"]
    scores = {}
    for row in rows:
        if row["dataset"] == dataset and row["row"] == "als" and row["seed"] == 0:
            point = {key: type(ALS_GRID[key][0])(value) for key, value in (o.split("=") for o in row["overrides"])}
            scores[point_name(point)] = float(row[RECALL])
    return scores


def choose(table: dict[str, dict[str, float]]) -> list[dict]:
    """Every point with its recall per log and its mean share of each log's best, best first."""
    best = {log: max(scores.values()) for log, scores in table.items()}
    points = set.intersection(*(set(scores) for scores in table.values()))
    ranked = [{"point": p, **{log: table[log][p] for log in table},
               "share_of_best": float(np.mean([table[log][p] / best[log] for log in table]))} for p in points]
    return sorted(ranked, key=lambda r: -r["share_of_best"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS / "bench_als_defaults"))
    args = parser.parse_args(argv)
    points = als_grid()
    table = {log: score_log(path, points) for log, path in LOGS.items()}
    table.update({dataset: public_scores(dataset) for dataset in PUBLIC})
    ranked = choose(table)
    current = point_name({key: getattr(ALSConfig(), key) for key in ALS_GRID})
    report = {"command": command("bench_als_defaults", argv), "machine": machine("implicit"), "logs": list(table),
              "current_default": current, "chosen": ranked[0]["point"], "rows": ranked}
    write_report(args.out, report, markdown(report))
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    logs = report["logs"]
    rows = report["rows"]
    shown = rows[:10] + [r for r in rows[10:] if r["point"] == report["current_default"]]
    table = markdown_table(["point", *logs, "mean share of best"],
                           [[r["point"], *(f"{r[log]:.4f}" for log in logs), f"{r['share_of_best']:.3f}"]
                            for r in shown], align="l" + "r" * (len(logs) + 1))
    return "\n".join([
        "# ALS defaults: one grid point for every log",
        "",
        f"`{report['command']}`. recall@20 of each ALS point: ML-100K and the synthetic log on the validation cut "
        "of their training part, Gowalla and MovieLens-1M on valid.txt (bench_public.json's grid). The default is "
        "the point with the highest mean share of each log's best; the ten best and the previous default:",
        "",
        *table,
        "",
        f"Chosen: `{report['chosen']}` (previous default `{report['current_default']}`).",
    ])


if __name__ == "__main__":
    sys.exit(main())
