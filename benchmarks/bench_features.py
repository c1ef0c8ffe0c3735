"""Feature towers on MovieLens 100K: ID-only vs features vs features + click history.

    python -m benchmarks.bench_features                 # or: make bench-features
    python -m benchmarks.bench_features --seeds 0       # one seed (about a third of the time)

For each config (``configs/ml100k.yaml``, ``ml100k_features.yaml``,
``ml100k_features_history.yaml`` with mean and attention pooling,
``ml100k_features_history_dropout.yaml``) and seed, the main job
(``retrieval.jobs.train_evaluate_export``) runs twice on the temporal split:

1. **As configured.** ``recall@20`` / ``NDCG@20`` over warm test users (users
   with training ratings; the job's own metrics, popularity beside them). Then,
   from the exported bundle, what is *served* (``Bundle.recommend_batch``,
   raw features in, training items excluded) to the test users **unseen in
   training**: an ID tower can only fall back to popularity for them, a
   feature tower embeds them from their features.
2. **Cold items** (``split.hold_out_items=0.1``): a random 10% of the rated
   items lose every training rating but keep their test ratings and stay in
   the catalogue. ``recall@20`` of the served top-20 (full corpus, warm users)
   counting only test ratings of those items: how well items nobody clicked
   in training are retrieved on their features alone.

``train.seed`` and ``split.seed`` (which items are held out) take each seed;
every row trains for 5 epochs without early stopping (``PINNED``).
Writes ``bench_features.json`` and ``bench_features.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

import retrieval  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)
from benchmarks._harness import RESULTS, Stopwatch, machine, write_report
from retrieval.config import Config, EvaluationConfig, load_config
from retrieval.data import ITEM, USER, load_dataset
from retrieval.evaluation import build_eval_set, ranking_metrics
from retrieval.features import TowerTables
from retrieval.jobs import train_evaluate_export
from retrieval.serving import Bundle

ROOT = Path(__file__).resolve().parents[1]
# name -> (config, overrides)
CONFIGS = {
    "ID only": ("configs/ml100k.yaml", []),
    "features": ("configs/ml100k_features.yaml", []),
    "features + history (mean)": ("configs/ml100k_features_history.yaml", ["towers.query.history.pooling=mean"]),
    "features + history (attention)": ("configs/ml100k_features_history.yaml", []),
    "features + history (attention) + ID dropout": ("configs/ml100k_features_history_dropout.yaml", []),
}
K = 20
HOLD_OUT = 0.1
# Every row trains alike: 5 epochs, no early stopping (the feature configs' own setting; the ID-only
# configs/ml100k.yaml has since moved to early stopping, which these runs predate).
PINNED = ["train.epochs=5", "train.validation_fraction=0"]
# Off for speed: plots, the ALS baseline and the extra top-k SavedModel have nothing to do with towers.
QUIET = ["train.verbose=0", "evaluation.plots=false", "evaluation.baselines.rankers=[popularity]",
         "export.topk_model=false"]


def served_metrics(bundle: Bundle, config: Config, users: str, items: tuple[str, ...] | None) -> dict:
    """recall/NDCG@K of what ``bundle`` serves to the test users of ``config``'s split.

    Args:
      users: "warm" (users with training clicks) or "unseen" (none).
      items: count only test clicks on these items (None: all).
    """
    dataset = load_dataset(config.data, config.split)
    test = dataset.test
    train_users = set(dataset.train[USER])
    test = test[test[USER].isin(train_users) == (users == "warm")]
    if items is not None:
        test = test[test[ITEM].isin(set(items))]
    catalogue = list(bundle.index.item_ids)
    eval_set = build_eval_set(dataset.train, test, catalogue, EvaluationConfig(unseen_users="keep"))
    queries = TowerTables.from_dataset(dataset, config.towers).queries(eval_set.user_ids).to_dict("records")
    exclude = [[catalogue[row] for row in rows] for rows in eval_set.exclude]
    served = bundle.recommend_batch(queries, K, exclude)
    row_of = {item: row for row, item in enumerate(catalogue)}
    ranked = np.full((len(served), K), -1, dtype=np.int64)
    for i, result in enumerate(served):
        ranked[i, : len(result.item_ids)] = [row_of[item] for item in result.item_ids]
    metrics = ranking_metrics(ranked, eval_set.relevant, [K])
    fallback = sum(result.fallback is not None for result in served)
    return {
        f"recall@{K}": metrics[f"recall@{K}"],
        f"ndcg@{K}": metrics[f"ndcg@{K}"],
        "users": metrics["users"],
        "relevant_pairs": eval_set.counts["relevant_pairs"],
        "popularity_fallbacks": fallback,
    }


def run(name: str, seed: int, out: Path) -> dict:
    path, extra = CONFIGS[name]
    overrides = QUIET + PINNED + extra + [f"train.seed={seed}", f"split.seed={seed}", f"run.output_dir={out}"]
    clock = Stopwatch()
    config = load_config(ROOT / path, overrides + [f"run.name={_slug(name)}-{seed}"])
    result = train_evaluate_export(config)
    bundle = Bundle.load(result.directory)
    row = {
        "config": name,
        "command": _command(path, extra),
        "seed": seed,
        "warm": {
            key: result.metrics[ranker][key] for ranker in ("model",) for key in (f"recall@{K}", f"ndcg@{K}", "users")
        },
        "popularity": {key: result.metrics["popularity"][key] for key in (f"recall@{K}", f"ndcg@{K}")},
        "unseen_users": served_metrics(bundle, config, "unseen", None),
    }
    cold_config = load_config(
        ROOT / path, overrides + [f"run.name={_slug(name)}-cold-{seed}", f"split.hold_out_items={HOLD_OUT}"]
    )
    cold = train_evaluate_export(cold_config)
    held = load_dataset(cold_config.data, cold_config.split).held_out_items
    row["cold_items"] = served_metrics(Bundle.load(cold.directory), cold_config, "warm", held) | {
        "held_out_items": len(held)
    }
    row["seconds"] = round(clock.seconds, 1)
    return row


def _command(path: str, extra: list[str]) -> str:
    return f'make train CONFIG={path} SET="{" ".join(PINNED + extra)}"'


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower())


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def markdown(rows: list[dict], seeds: list[int]) -> str:
    lines = [
        f"# Feature towers on MovieLens 100K (temporal split, {len(seeds)} seed(s): {seeds})",
        "",
        f"Mean ± standard deviation over seeds. Warm users: test users with training ratings (the job's "
        f"metrics). Unseen users: test users without any, served from the exported bundle. Cold items: "
        f"{HOLD_OUT:.0%} of items held out of training entirely, recall@{K} over their test ratings only.",
        "",
        f"| towers | recall@{K} (warm) | NDCG@{K} (warm) | recall@{K} (unseen users) | NDCG@{K} (unseen users) "
        f"| recall@{K} (cold items) | command |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in [n for n in CONFIGS if any(r["config"] == n for r in rows)]:
        mine = [r for r in rows if r["config"] == name]
        cells = [
            _mean_std([r["warm"][f"recall@{K}"] for r in mine]),
            _mean_std([r["warm"][f"ndcg@{K}"] for r in mine]),
            _mean_std([r["unseen_users"][f"recall@{K}"] for r in mine]),
            _mean_std([r["unseen_users"][f"ndcg@{K}"] for r in mine]),
            _mean_std([r["cold_items"][f"recall@{K}"] for r in mine]),
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | `{mine[0]['command']}` |")
    first = rows[0]
    lines.append(
        f"| popularity | {_mean_std([r['popularity'][f'recall@{K}'] for r in rows[:1]])} | "
        f"{_mean_std([r['popularity'][f'ndcg@{K}'] for r in rows[:1]])} | (ID-only row: served by popularity) | | | |"
    )
    lines += [
        "",
        f"Users: {first['warm']['users']} warm, {first['unseen_users']['users']} unseen "
        f"({first['unseen_users']['relevant_pairs']} test pairs); cold items: "
        f"{first['cold_items']['held_out_items']} held out, {first['cold_items']['relevant_pairs']} test pairs over "
        f"{first['cold_items']['users']} users (seed {first['seed']}).",
        "",
        "Reproduce: `make bench-features` (or `python -m benchmarks.bench_features --seeds 0 1 2`). A command "
        "above is one run of its row; the benchmark adds `train.seed=S split.seed=S` per seed, and "
        f"`split.hold_out_items={HOLD_OUT}` for the cold-item run.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-features-") as scratch:
        for seed in args.seeds:
            for name in args.configs:
                row = run(name, seed, Path(scratch))
                print(json.dumps(row), flush=True)
                rows.append(row)
    report = {"k": K, "hold_out_items": HOLD_OUT, "seeds": args.seeds, "machine": machine("tensorflow"), "runs": rows}
    write_report(Path(args.out) / "bench_features", report, markdown(rows, args.seeds))
    print(markdown(rows, args.seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
