"""Losses and samplers: step time against corpus size, and retrieval quality.

    python -m benchmarks.bench_losses                 # or: make bench-losses
    python -m benchmarks.bench_losses --part quality --datasets synthetic --seeds 1   # quick

Two parts, both written to ``--out`` as ``bench_losses.json`` / ``.md`` (and
``bench_losses.png`` for the step times):

- ``steptime``: median seconds of one training step (forward, backward, SGD
  update) of ID towers on synthetic batches, for each loss at corpus sizes
  10k, 100k and 1M. Full softmax embeds the whole corpus every step; sampled
  and in-batch losses touch a fixed number of items. The optimiser is
  ``tf.keras.optimizers.legacy.SGD``, whose update is a scatter over the rows
  in the batch, so the step time is the loss's own cost (the Keras 2.11+
  optimizers, Adam included, update dense slots over the whole table every
  step: O(corpus) whatever the loss).
- ``quality``: recall@20, NDCG@20 and tail recall@20 (relevant items outside
  the 20% most clicked in training) on the held-out split of each dataset
  (MovieLens 100K, temporal split; the default synthetic log), for each loss
  trained with the shipped configuration's model and training settings (only
  the loss changes), beside popularity, implicit ALS and the TFRS tutorial
  recipe. Every ranker is scored exactly over the whole catalogue with the
  users' training items masked, as ``make train`` evaluates; each number is
  the mean (± standard deviation) over ``--seeds`` training seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import tensorflow as tf

import retrieval  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)
from benchmarks._harness import RESULTS, command, machine, markdown_table, pyplot, save_figure, timed, write_report
from benchmarks._quality import VARIANTS, K, Prepared, metrics_of, prepare_config, rank_scores
from retrieval.config import ALSConfig, load_config
from retrieval.data import ITEM, USER, locate_movielens_100k
from retrieval.evaluation.baselines import fit_als
from retrieval.features import FeatureStatistics
from retrieval.model import build_model
from retrieval.training import fit, seed_everything

ROOT = Path(__file__).resolve().parents[1]
DATASETS = {"ml100k": ROOT / "configs/ml100k.yaml", "synthetic": ROOT / "configs/default.yaml"}
def prepare(name: str, overrides: list[str] | None = None) -> Prepared:
    return prepare_config(name, load_config(DATASETS[name], ["train.verbose=0", *(overrides or [])]))


def model_scores(model, data: Prepared) -> np.ndarray:
    """The model's scores of every catalogue row for the evaluated users.

    Items without training clicks have the zero OOV embedding (score 0, as in
    the FAISS index); for the hierarchical softmax they have no leaf (-inf).
    """
    queries = model.query_tower({USER: tf.constant(np.asarray(data.eval_set.user_ids, dtype=object))})
    scores = model.item_scores(queries).numpy()  # [users, num_items + 1], tower-index columns
    if model.servable_by_dot_product:
        scores[:, 0] = 0.0
    return scores[:, data.catalogue_index]


def train_and_score(data: Prepared, overrides: list[str], seed: int) -> dict:
    config = load_config(
        DATASETS[data.name],
        ["train.verbose=0", f"train.seed={42 + seed}", f"model.loss.seed={seed}", *overrides],
    )
    with timed() as clock:
        seed_everything(config.train.seed)
        model = build_model(config.model, data.stats, train_clicks=data.train)
        history = fit(model, data.train, config.train, split=config.split)
        result = metrics_of(rank_scores(model_scores(model, data), data), data)
        result["epochs"] = len(history["loss"])
    result["seconds"] = clock.seconds
    return result


def baseline_rows(data: Prepared, seeds: int) -> dict[str, list[dict]]:
    users = np.asarray(data.eval_set.user_ids, dtype=object)
    counts = data.train[ITEM].astype(str).value_counts().reindex(data.catalogue_ids, fill_value=0).to_numpy()
    popularity = np.broadcast_to(
        counts.astype(np.float64) - np.arange(len(counts)) * 1e-9, (len(users), len(counts))
    )
    rows = {"popularity": [metrics_of(rank_scores(popularity, data), data)]}
    rows["implicit ALS"] = []
    for seed in range(seeds):
        with timed() as clock:
            factors = fit_als(data.train, data.catalogue_ids, ALSConfig(seed=seed))
            result = metrics_of(rank_scores(factors.users(users) @ factors.item_factors.T, data), data)
        result["seconds"] = clock.seconds
        rows["implicit ALS"].append(result)
    return rows


def summarise(runs: list[dict]) -> dict:
    summary = {}
    for key in (f"recall@{K}", f"ndcg@{K}", f"tail_recall@{K}", "epochs", "seconds"):
        values = [run[key] for run in runs if key in run]
        if values:
            summary[key] = statistics.fmean(values)
            summary[f"{key}_std"] = statistics.pstdev(values) if len(values) > 1 else 0.0
    summary["runs"] = len(runs)
    summary["users"] = runs[0]["users"]
    return summary


def quality(datasets: list[str], variants: list[str], seeds: dict[str, int], log=print) -> dict:
    results = {}
    for name in datasets:
        if name == "ml100k":
            try:
                locate_movielens_100k()
            except FileNotFoundError as error:
                log(f"skipping ml100k: {error}")
                continue
        data = prepare(name)
        table = {ranker: summarise(runs) for ranker, runs in baseline_rows(data, seeds[name]).items()}
        log(f"{name}: {table}")
        for variant in variants:
            runs = []
            for seed in range(seeds[name]):
                runs.append(train_and_score(data, VARIANTS[variant], seed))
                log(f"{name} | {variant} | seed {seed}: {json.dumps(runs[-1])}")
            table[variant] = summarise(runs)
        results[name] = {
            "config": str(DATASETS[name].relative_to(ROOT)),
            "evaluated_users": len(data.eval_set.user_ids),
            "rankers": table,
        }
    return results


# -- step time ---------------------------------------------------------------------------

STEP_LOSSES: dict[str, list[str]] = {
    "in-batch softmax": ["model.loss.kind=softmax", "model.loss.negatives=in_batch"],
    "sampled softmax (unigram, 1024)": ["model.loss.kind=softmax", "model.loss.negatives=unigram"],
    "mixed (in-batch + 1024 uniform)": ["model.loss.kind=softmax", "model.loss.negatives=mixed"],
    "SGNS (20 negatives)": [
        "model.loss.kind=sgns",
        "model.loss.negatives=unigram",
        "model.loss.num_negatives=20",
    ],
    "hierarchical softmax": ["model.loss.kind=hierarchical_softmax"],
    "full softmax": ["model.loss.kind=full_softmax"],
}


def step_time(num_items: int, loss: list[str], batch_size: int, steps: int, dim: int = 64) -> float:
    """Median seconds of a compiled training step on a Zipfian synthetic batch stream."""
    rng = np.random.default_rng(0)
    num_users = 10_000
    clicks = max(4 * num_items, 50_000)
    items = np.minimum(rng.zipf(1.2, clicks), num_items) - 1
    items[:num_items] = np.arange(num_items)  # every item is in the vocabulary
    train = pd.DataFrame(
        {USER: [f"u{u}" for u in rng.integers(0, num_users, clicks)], ITEM: [f"i{i}" for i in items]}
    )
    stats = FeatureStatistics.from_training_clicks(train)
    config = load_config(None, [f"model.embedding_dim={dim}", *loss])
    seed_everything(0)
    model = build_model(config.model, stats)
    # The legacy SGD applies IndexedSlices gradients with a scatter (O(batch)); the Keras 2.11+
    # optimizers keep dense slots (SGD's momentum, Adam's moments) updated over the whole table
    # every step, an O(corpus) cost that has nothing to do with the loss.
    model.compile(optimizer=tf.keras.optimizers.legacy.SGD(0.05))
    batches = [
        {
            USER: tf.constant(train[USER].to_numpy(dtype=object)[start : start + batch_size]),
            ITEM: tf.constant(train[ITEM].to_numpy(dtype=object)[start : start + batch_size]),
        }
        for start in range(0, steps * batch_size, batch_size)
    ]
    step = tf.function(model.train_step)
    step(batches[0])  # trace and warm up
    times = []
    for batch in batches[1:]:
        with timed() as clock:
            step(batch)["loss"].numpy()
        times.append(clock.seconds)
    return statistics.median(times)


def steptime(sizes: list[int], batch_size: int, steps: int, log=print) -> dict:
    results = {}
    for loss, overrides in STEP_LOSSES.items():
        results[loss] = {}
        for size in sizes:
            results[loss][str(size)] = step_time(size, overrides, batch_size, steps)
            log(f"step time | {loss} | {size} items: {results[loss][str(size)] * 1000:.1f} ms")
    return {"batch_size": batch_size, "steps": steps, "sizes": sizes, "seconds": results}


# -- reports -----------------------------------------------------------------------------


def _number(summary: dict, key: str) -> str:
    if key not in summary:
        return ""
    std = summary.get(f"{key}_std", 0.0)
    return f"{summary[key]:.4f}" + (f" ± {std:.4f}" if summary["runs"] > 1 else "")


def markdown(report: dict) -> str:
    lines = ["# Loss benchmark\n"]
    if "steptime" in report:
        part = report["steptime"]
        sizes = part["sizes"]
        lines += [
            (
                f"## Step time (ms per training step, batch {part['batch_size']}, median of "
                f"{part['steps'] - 1} steps, legacy SGD, dim 64)\n"
            ),
            f"`{part['command']}`\n",
            *markdown_table(["loss", *(f"{s:,} items" for s in sizes)],
                            [[loss, *(f"{by_size[str(s)] * 1000:.1f}" for s in sizes)]
                             for loss, by_size in part["seconds"].items()]),
            "",
        ]
    for name, part in report.get("quality", {}).items():
        lines += [
            f"## {name}: {part['evaluated_users']} evaluated users ({part['config']}; mean ± std over seeds)\n",
            *(f"`{command}`" for command in part.get("commands", [part.get("command", "")])),
            "",
            *markdown_table(
                ["ranker", f"recall@{K}", f"NDCG@{K}", f"tail recall@{K}", "epochs", "seconds"],
                [[ranker, _number(summary, f"recall@{K}"), _number(summary, f"ndcg@{K}"),
                  _number(summary, f"tail_recall@{K}"), f"{summary['epochs']:.1f}" if "epochs" in summary else "",
                  f"{summary['seconds']:.0f}" if "seconds" in summary else ""]
                 for ranker, summary in part["rankers"].items()],
            ),
        ]
        lines.append("")
    return "\n".join(lines)


def plot(part: dict, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for loss, by_size in part["seconds"].items():
        ax.plot(part["sizes"], [by_size[str(s)] * 1000 for s in part["sizes"]], marker="o", label=loss)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("corpus size (items)")
    ax.set_ylabel(f"ms per training step (batch {part['batch_size']})")
    ax.set_title("Training step time vs corpus size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part",
        choices=["all", "steptime", "quality", "report"],
        default="all",
        help="report: rewrite md/png",
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--step-batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="timed steps + 1 warm-up")
    parser.add_argument("--datasets", nargs="+", choices=list(DATASETS), default=list(DATASETS))
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--seeds", type=int, default=3, help="training seeds on ML-100K (109 users: noisy)")
    parser.add_argument("--synthetic-seeds", type=int, default=2, help="training seeds on the synthetic log")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    command_line = command("bench_losses", argv)
    args.out.mkdir(parents=True, exist_ok=True)

    def log(message):
        print(message, flush=True)

    new: dict = {}
    if args.part in ("all", "steptime"):
        new["steptime"] = {"command": command_line, **steptime(args.sizes, args.step_batch, args.steps, log)}
    if args.part in ("all", "quality"):
        seeds = {"ml100k": args.seeds, "synthetic": args.synthetic_seeds}
        new["quality"] = {
            name: {"command": command_line, **part}
            for name, part in quality(args.datasets, args.variants, seeds, log).items()
        }
    # Merge into the report on disk (read now, not at start: runs of one part or one
    # dataset can go side by side); each part and dataset keeps the command that made it.
    path = args.out / "bench_losses.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    if "results" in report.get("steptime", {}):  # an earlier layout: results nested
        report["steptime"] = {"command": report["steptime"]["command"], **report["steptime"]["results"]}
    if "steptime" in new:
        report["steptime"] = new["steptime"]
    for name, part in new.get("quality", {}).items():
        # A run of some variants replaces those rows only and adds its command to the list.
        earlier = report.setdefault("quality", {}).get(name)
        if earlier is not None:
            commands = earlier.get("commands", [earlier["command"]] if "command" in earlier else [])
            part["rankers"] = {**earlier["rankers"], **part["rankers"]}
            part["commands"] = [*commands, part.pop("command")]
        else:
            part["commands"] = [part.pop("command")]
        report["quality"][name] = part
    report["machine"] = machine("tensorflow", "numpy")
    if "steptime" in report:
        plot(report["steptime"], args.out / "bench_losses.png")
    write_report(args.out / "bench_losses", report, markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
