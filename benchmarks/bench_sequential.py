"""Sequential recommendation on Amazon Beauty: the transformer history against pooled history and the baselines.

    python -m benchmarks.bench_sequential                                  # or: make bench-sequential
    python -m benchmarks.bench_sequential --variants pooled-mean,transformer-in-batch
    python -m benchmarks.bench_sequential --throughput                     # trained pairs/s
    python -m benchmarks.bench_sequential --movielens-seeds 0,1,2          # long sequences, 3 seeds
    python -m benchmarks.bench_sequential --report                         # rewrite md/png from the JSON

The data is ``beauty/`` under ``--data-dir`` (``$RETRIEVAL_DATA_DIR`` or ``../shared/datasets``):
each user's items in time order, the file's last item per user held back elsewhere and never
read. ``configs/beauty.yaml`` holds out the last item here as the evaluation target and carves
the one before it for early stopping (leave-one-out one position earlier than the papers): full
ranking over the whole catalogue (``items.txt``), each user's training items excluded. A target
the user already has in training cannot be recommended, so the job drops those users from the
evaluation and says how many (``counts.test_clicks_repeating_a_training_click``); with one
target a user, HR@k is recall@k.

Rows: each variant is the whole ``make train`` job on configs/beauty.yaml with its overrides
(``VARIANTS``), its seconds the job's wall time; popularity and ALS are the job's own baselines,
taken from the first variant's run. Each finished row is appended to ``bench_sequential.json`` at
once (a killed run keeps what finished) and the Markdown and PNG are rewritten.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import retrieval  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)
from benchmarks._harness import (
    RESULTS,
    ROOT,
    data_dir,
    describe_machine,
    load_average,
    machine,
    markdown_table,
    pyplot,
    save_figure,
    timed,
    write_json,
)
from retrieval.config import load_config
from retrieval.jobs import train_evaluate_export

CONFIG = ROOT / "configs/beauty.yaml"
METRICS = ["recall@10", "ndcg@10", "recall@20", "ndcg@20"]
SASREC_PLUS = {"recall@10": 0.0533, "ndcg@10": 0.0327}  # Klenitskiy & Vasilev 2023, on the held-back item

# configs/beauty.yaml before its recipe became two members of dimension 128 with each sequence's own
# items kept out of its negatives: the rows measured then run with these first.
# configs/beauty.yaml before it fixed the number of epochs: early stopping (at most 30) on each user's last
# training item, then the chosen number again on everything (its refit).
EARLY_STOPPING = ["train.epochs=30", "train.validation_fraction=0.1"]
ONE_MEMBER_64 = [*EARLY_STOPPING, "model.embedding_dim=64", "model.remove_sequence_items=false",
                 "model.ensemble_members=1"]
ONE_MEMBER = [*EARLY_STOPPING, "model.remove_sequence_items=false", "model.ensemble_members=1"]

# name -> overrides on configs/beauty.yaml's transformer recipe (TRANSFORMER_ENSEMBLE, below).
VARIANTS: dict[str, list[str]] = {
    # Two members of dimension 128 trained side by side on each batch, served as one tower pair that
    # scores their mean (model.ensemble_members: 2), a sequence's own items never its negatives,
    # for the 10 epochs that early stopping chose (the next row), trained once on every item.
    "transformer-ensemble": [],
    "transformer-ensemble-early-stopping": EARLY_STOPPING,
    "transformer-ensemble-seed1": [*EARLY_STOPPING, "train.seed=1"],
    # The recipe with the corrected log-Q (Khrylchenko et al., RecSys 2025: the positive left out of the
    # sampled part, each row weighted by the model's chance of misclassifying it), beside the standard
    # correction the config states, both run on the same code one after the other.
    "transformer-ensemble-standard-logq": ["model.loss.log_q_variant=standard"],
    "transformer-ensemble-corrected-logq": ["model.loss.log_q_variant=corrected"],
    "transformer-ensemble-standard-logq-seed1": ["model.loss.log_q_variant=standard", "train.seed=1"],
    "transformer-ensemble-corrected-logq-seed1": ["model.loss.log_q_variant=corrected", "train.seed=1"],
    # One member of the same recipe, then without removing the sequence's items.
    "transformer-dim128-own-items": [*EARLY_STOPPING, "model.ensemble_members=1"],
    "transformer-dim128": ONE_MEMBER,
    "transformer-in-batch-dim256": ["model.embedding_dim=256", *ONE_MEMBER],
    # The pooled history given the same two members of dimension 128 (its clicks have no sequence windows).
    "pooled-attention-ensemble": [*EARLY_STOPPING, "model.remove_sequence_items=false", "train.examples=clicks",
                                  "towers.query.history.pooling=attention",
                                  "towers.query.features=[{name: user_id, kind: id}]", "train.optimizer=lazy_adam",
                                  "train.learning_rate=0.01", "train.batch_size=1024"],
}
# The pooled ensemble at the second seed transformer-ensemble-seed1 ran at: the two recipes side by side twice.
VARIANTS["pooled-attention-ensemble-seed1"] = [*VARIANTS["pooled-attention-ensemble"], "train.seed=1"]
# The pooled ensemble with a user's other training items kept out of its negatives (as the transformer
# ensemble keeps its sequence's items), reading the last 50 items, and with more members: four of 128,
# eight of 64 and sixteen of 32 (512 floats an item, where index.factory auto picks IVF over the 54,542
# items; eight of 64 also with the exact index every narrower row is ranked with), twelve of 64.
POOLED_ENSEMBLE = VARIANTS["pooled-attention-ensemble"]
VARIANTS |= {
    "pooled-attention-ensemble-own-items": [*POOLED_ENSEMBLE, "model.remove_user_items=true"],
    "pooled-attention-ensemble-length50": [*POOLED_ENSEMBLE, "towers.query.history.length=50"],
    "pooled-attention-ensemble-4": [*POOLED_ENSEMBLE, "model.ensemble_members=4"],
    "pooled-attention-ensemble-4-own-items": [*POOLED_ENSEMBLE, "model.ensemble_members=4",
                                              "model.remove_user_items=true"],
    "pooled-attention-ensemble-8x64": [*POOLED_ENSEMBLE, "model.ensemble_members=8", "model.embedding_dim=64"],
    "pooled-attention-ensemble-8x64-exact": [*POOLED_ENSEMBLE, "model.ensemble_members=8", "model.embedding_dim=64",
                                             "index.factory=Flat"],
    "pooled-attention-ensemble-16x32": [*POOLED_ENSEMBLE, "model.ensemble_members=16", "model.embedding_dim=32"],
    "pooled-attention-ensemble-12x64": [*POOLED_ENSEMBLE, "model.ensemble_members=12", "model.embedding_dim=64"],
    # The transformer ensemble at the pooled one's four members of 128 (its 10 epochs, trained once).
    "transformer-ensemble-4": ["model.ensemble_members=4"],
}
VARIANTS |= {name: [*ONE_MEMBER_64, *overrides] for name, overrides in {
    "transformer-in-batch": [],
    "transformer-in-batch-refit-best": ["train.refit_from=best", "train.refit_epochs=1"],
    # SASRec's dropout for its sparse logs (Kang & McAuley 2018: 0.5 on Beauty, 0.2 on MovieLens-1M).
    "transformer-in-batch-dropout-0.5": ["towers.query.history.transformer.dropout=0.5"],
    "transformer-mixed-2048": ["model.loss.negatives=mixed", "model.loss.num_negatives=2048"],
    "transformer-uniform-3000": ["model.loss.negatives=uniform", "model.loss.num_negatives=3000"],
    "transformer-full-softmax": ["model.loss.kind=full_softmax"],
    # The optimisation settings of SASRec+'s authors (antklen/sasrec-bert4rec-recsys23, SASRec.yaml):
    # dropout 0.1, Adam 1e-3, 128 sequences a step, patience 10; in-batch negatives kept.
    "transformer-in-batch-sasrec-settings": ["towers.query.history.transformer.dropout=0.1",
                                             "train.learning_rate=0.001", "train.batch_size=128",
                                             "train.early_stopping_patience=10"],
    # Raw dot products, as SASRec scores: no L2 normalisation, temperature 1.
    "transformer-in-batch-raw-dot": ["model.normalize=false", "model.temperature=1.0"],
    # More optimizer steps: 16 sequences a step (MovieLens-100K has 943 users: 8 steps an epoch at 128).
    "transformer-in-batch-batch16": ["train.batch_size=16"],
    # The user id beside the history, as the pooled rows have it (its embedding at every position).
    "transformer-in-batch-user-id": ["towers.query.features=[{name: user_id, kind: id}]"],
    "transformer-in-batch-batch16-user-id": ["train.batch_size=16",
                                             "towers.query.features=[{name: user_id, kind: id}]"],
    "transformer-in-batch-batch16-user-id-patience10": ["train.batch_size=16",
                                                        "towers.query.features=[{name: user_id, kind: id}]",
                                                        "train.early_stopping_patience=10"],
    # The query tower before the transformer: the user id and attention-pooled last items, one
    # example a click, with the settings its runs on MovieLens use (lazy_adam 0.01, batch 1024).
    "pooled-attention": ["train.examples=clicks", "towers.query.history.pooling=attention",
                         "towers.query.features=[{name: user_id, kind: id}]", "train.optimizer=lazy_adam",
                         "train.learning_rate=0.01", "train.batch_size=1024"],
    "pooled-mean": ["train.examples=clicks", "towers.query.history.pooling=mean",
                    "towers.query.features=[{name: user_id, kind: id}]", "train.optimizer=lazy_adam",
                    "train.learning_rate=0.01", "train.batch_size=1024"],
}.items()}
# Without the refit: the best epoch's weights as they are, the early-stopping item never a next-item target.
VARIANTS |= {f"{name}-no-refit": [*VARIANTS[name], "train.refit=false"]
             for name in ("transformer-in-batch", "transformer-mixed-2048", "pooled-attention")}
# Every row above ran on configs/beauty.yaml when it stated the transformer ensemble (until 2026-12-07):
# two causal transformer members of 128 over the newest 20 items, trained on every position of each
# sequence for 10 epochs, a sequence's own items kept out of its negatives. These keys restore it, before
# the data set's and the row's own (``run_variant``).
TRANSFORMER_ENSEMBLE = ["towers.query.features=[]", "towers.query.history.pooling=transformer",
                        "model.embedding_dim=128", "model.ensemble_members=2", "model.remove_sequence_items=true",
                        "train.examples=sequences", "train.optimizer=adam", "train.learning_rate=0.002",
                        "train.batch_size=256", "train.epochs=10"]
# The recipe configs/beauty.yaml states: the user id and attention-pooled history, eight members of 64,
# the 5 epochs early stopping chose for them (pooled-attention-ensemble-8x64), trained once on every item.
SHIPPED = "pooled-attention-ensemble-8x64-5-epochs"
ON_TRANSFORMER_RECIPE = frozenset(VARIANTS)
VARIANTS = {SHIPPED: [], **VARIANTS}
# Rows of another config than configs/beauty.yaml: name -> (config, overrides on it).
OTHER_CONFIGS: dict[str, Path] = {
    # SASRec+ inside the framework: the reference's every stated detail (docs/sequences.md).
    "sasrec-plus": ROOT / "configs/beauty-sasrec.yaml",
}
VARIANTS |= {name: [] for name in OTHER_CONFIGS}
# Beyond SASRec+: its settings with another loss (configs/beauty-sasrec.yaml and these overrides).
BEYOND_SASREC_PLUS: dict[str, list[str]] = {
    # gSASRec (Petrov & Macdonald, RecSys 2023): gBCE over 256 uniform negatives drawn for each position,
    # calibration t = 0.75, the authors' recommended setting (asash/gsasrec, Readme.md).
    "gsasrec": ["model.loss.kind=gbce", "model.loss.negatives=uniform", "model.loss.num_negatives=256",
                "model.loss.negatives_per_row=true", "model.loss.calibration=0.75"],
    # The same draws at t = 0 (beta = 1): plain binary cross-entropy, SASRec's loss with 256 negatives.
    "gsasrec-t0": ["model.loss.kind=gbce", "model.loss.negatives=uniform", "model.loss.num_negatives=256",
                   "model.loss.negatives_per_row=true", "model.loss.calibration=0.0"],
    # gBCE can take a while to start learning (the authors' README): three times SASRec+'s patience.
    "gsasrec-patience-30": ["model.loss.kind=gbce", "model.loss.negatives=uniform", "model.loss.num_negatives=256",
                            "model.loss.negatives_per_row=true", "model.loss.calibration=0.75",
                            "train.early_stopping_patience=30"],
    # Many negatives with the corrected log-Q (Khrylchenko et al., RecSys 2025): the batch's positives and
    # 2,048 uniform draws shared by the batch, the positive always in the denominator.
    "sasrec-many-negatives-corrected": ["model.loss.kind=softmax", "model.loss.negatives=mixed",
                                        "model.loss.mixed_corpus=uniform", "model.loss.num_negatives=2048",
                                        "model.loss.log_q_variant=corrected"],
}
OTHER_CONFIGS |= {name: ROOT / "configs/beauty-sasrec.yaml" for name in BEYOND_SASREC_PLUS}
VARIANTS |= BEYOND_SASREC_PLUS


def _machine() -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return machine("tensorflow", "faiss", commit=commit.stdout.strip())


# MovieLens-100K, where sequences are long (~106 ratings a user): the same recipe, leave-one-out on
# u.data's timestamps, a 50-item window, the best epoch's weights kept (its rows were measured so).
MOVIELENS = ["data.source=movielens-100k", "data.clicks=null", "data.item_features=null", "data.item_id_column=item_id",
             "towers.query.history.length=50", "train.batch_size=128", "train.validation_users=null",
             "train.refit=false"]
MOVIELENS_VARIANTS = ["transformer-in-batch", "transformer-in-batch-batch16", "transformer-in-batch-batch16-user-id",
                      "transformer-in-batch-batch16-user-id-patience10", "pooled-attention", "sasrec-plus",
                      *BEYOND_SASREC_PLUS]


def run_variant(name: str, overrides: list[str], data_dir: Path, extra: list[str],
                dataset: str = "beauty") -> dict[str, Any]:
    """The job on configs/beauty.yaml (on ``dataset``) with ``overrides``; its metrics and wall time."""
    beauty = data_dir / "beauty"
    where = [f"data.clicks.path={beauty / 'sequences.txt'}", f"data.item_features.path={beauty / 'items.txt'}"]
    if dataset == "ml-100k":
        where = [*MOVIELENS, f"data.movielens_dir={data_dir / 'ml-100k'}"]
    # The row's recipe first, then the data set's keys (MovieLens' batch size over the recipe's), then the row's.
    recipe = TRANSFORMER_ENSEMBLE if name in ON_TRANSFORMER_RECIPE else []
    with tempfile.TemporaryDirectory() as runs:
        config = load_config(OTHER_CONFIGS.get(name, CONFIG), [
            *recipe, *where, *overrides, *extra, f"run.output_dir={runs}", f"run.name={name}",
            "export.topk_model=false", "evaluation.plots=false",
        ])
        result = train_evaluate_export(config, config_name=name)
    metrics = result.metrics
    return {
        "variant": name,
        **({"config": str(OTHER_CONFIGS[name].relative_to(ROOT))} if name in OTHER_CONFIGS else {}),
        "overrides": overrides + extra,
        "seconds": round(result.seconds, 1),
        "training_seconds": metrics["timing"]["seconds"].get("training"),
        "model": {key: metrics["model"][key] for key in METRICS},
        "baselines": {ranker: {key: metrics[ranker][key] for key in METRICS}
                      for ranker in ("popularity", "als") if ranker in metrics},
        "counts": metrics["counts"],
        "epochs": metrics["timing"].get("epoch_seconds") and len(metrics["timing"]["epoch_seconds"]),
        "machine": _machine(),
        "date": datetime.date.today().isoformat(),
    }


def throughput(data_dir: Path, lengths: tuple[int, ...] = (50, 200), steps: int = 20) -> list[dict[str, Any]]:
    """Trained (query state, next item) pairs a second: the transformer's all-positions pass against
    the same tower trained one click a row (each row its own history), and the ID tower's step."""

    import tensorflow as tf

    from retrieval.jobs import train as jobs
    from retrieval.training import make_optimizer

    beauty = data_dir / "beauty"
    out = []
    for length in lengths:
        for examples in ("sequences", "clicks", "id"):
            overrides = [*TRANSFORMER_ENSEMBLE, f"data.clicks.path={beauty / 'sequences.txt'}",
                         f"data.item_features.path={beauty / 'items.txt'}",
                         f"towers.query.history.length={length}", "train.batch_size=256"]
            if examples == "id":
                overrides += ["train.examples=clicks", "towers.query.features=[{name: user_id, kind: id}]",
                              "towers.query.history=null"]
            else:
                overrides.append(f"train.examples={examples}")
            config = load_config(CONFIG, overrides)
            data = jobs.read_and_split(config)
            model = jobs.build_job_model(config, data)
            source = jobs._click_source(config, data, data.plan, data.counts.train_rows)
            optimizer = make_optimizer(config.train)
            model.compile(optimizer=optimizer)

            @tf.function
            def step(batch, model=model, optimizer=optimizer):
                with tf.GradientTape() as tape:
                    loss = model.compute_loss(batch, training=True)
                gradients = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(gradients, model.trainable_variables))
                return loss

            batches = iter(source.epoch(0).repeat())
            for _ in range(3):
                step(next(batches))
            pairs, clock = 0, time.perf_counter()
            for _ in range(steps):
                batch = next(batches)
                pairs += int(tf.reduce_sum(tf.cast(tf.not_equal(batch["item_id"], ""), tf.int32)))
                step(batch)
            seconds = time.perf_counter() - clock
            out.append({"length": length, "examples": examples, "pairs_per_second": round(pairs / seconds),
                        "step_ms": round(1000 * seconds / steps, 1), "pairs_per_step": pairs / steps})
            print(json.dumps(out[-1]))
    return out


def write_report(rows: list[dict[str, Any]]) -> None:
    lines = [
        "# Sequential recommendation: Amazon Beauty",
        "",
        "`python -m benchmarks.bench_sequential` (configs/beauty.yaml and each row's overrides; \"the transformer",
        "recipe\": the config until 2026-12-07, two causal transformer members of 128 trained on every position for",
        "10 epochs, `TRANSFORMER_ENSEMBLE` in the script, which its rows list their overrides on): the last",
        "item of each user's sequence here is the target, the one before it early stopping's; full ranking over the",
        "54,542-item catalogue, training items excluded; users whose target repeats a training item are not",
        "evaluated (the count below). HR@k = recall@k (one target a user). SASRec+ (full cross-entropy,",
        f"Klenitskiy & Vasilev 2023) reports HR@10 {SASREC_PLUS['recall@10']} / NDCG@10 {SASREC_PLUS['ndcg@10']} "
        "on the item held back one position later (not the same target: a reference level, not a comparison).",
        "The popularity and ALS rows are the job's own baselines (`evaluation.baselines`) at their defaults when the "
        "newest row ran (ALS: regularization 100, alpha 20, factors from the log's size).",
        "",
        "| row | HR@10 | NDCG@10 | HR@20 | NDCG@20 | epochs of its last run | seconds | overrides |",
        "|---|---|---|---|---|---|---|---|",
    ]
    # The newest row's: the job's own baselines at their current defaults (the ALS defaults changed on
    # 2026-12-04; rows run before keep theirs in the JSON).
    baselines = next((row["baselines"] for row in reversed(rows) if row.get("baselines")), {})
    for ranker, values in baselines.items():
        lines.append(f"| {ranker} | " + " | ".join(f"{values[k]:.4f}" for k in METRICS) + " | | | |")
    for row in rows:
        values = row["model"]
        overrides = " ".join(shlex.quote(o) for o in row["overrides"])
        if row.get("config"):  # a row of another config: its name, then its overrides
            overrides = f"({row['config']}) {overrides}".strip()
        elif row["variant"] in ON_TRANSFORMER_RECIPE:  # its overrides are on that recipe
            overrides = f"(the transformer recipe) {overrides}".strip()
        overrides = overrides or "(configs/beauty.yaml)"
        lines.append(f"| {row['variant']} | " + " | ".join(f"{values[k]:.4f}" for k in METRICS)
                     + f" | {row['epochs']} | {row['seconds']:.0f} | `{overrides}` |")
    notes = [f"- {row['variant']}: {row['note']}" for row in rows if row.get("note")]
    if notes:
        lines += ["", *notes]
    if rows:
        counts, machine = rows[0]["counts"], rows[-1]["machine"]
        lines += ["", f"Evaluated users: {counts.get('evaluated_users')}; targets repeating a training item: "
                  f"{counts.get('test_clicks_repeating_a_training_click')}. Machine: {describe_machine(machine)}; "
                  f"commits {', '.join(sorted({row['machine']['commit'] for row in rows}))}, {rows[-1]['date']}."]
    lines += _movielens_lines() + _throughput_lines() + _serving_lines()
    (RESULTS / "bench_sequential.md").write_text("\n".join(lines) + "\n")  # the JSON is written row by row
    _plot(rows)


def _movielens_lines() -> list[str]:
    path = RESULTS / "bench_sequential_ml100k.json"
    if not path.exists():
        return []
    import statistics

    runs = json.loads(path.read_text())
    lines = ["", "## MovieLens-100K: long sequences", "",
             "`python -m benchmarks.bench_sequential --movielens-seeds 0,1,2`: each row's recipe (configs/beauty.yaml "
             "with the row's overrides, or the config named beside the row) on u.data "
             f"(`{' '.join(MOVIELENS)}`), leave-one-out by timestamp, each row at every train.seed; mean ± "
             "standard deviation over the seeds (943 users: the spread matters). Of these keys, the SASRec+ "
             "config (sasrec-plus) differs only in the data's and in validation_users (10,000 there; null, "
             "every user, here: 943 users are fewer).", "",
             "| row | seeds | HR@10 | NDCG@10 | HR@20 | seconds |", "|---|---|---|---|---|---|"]
    for name in MOVIELENS_VARIANTS:
        mine = [r for r in runs if r["variant"] == name]
        if not mine:
            continue

        def spread(key: str, mine=mine) -> str:
            values = [r["model"][key] for r in mine]
            deviation = statistics.stdev(values) if len(values) > 1 else 0.0
            return f"{statistics.mean(values):.4f} ± {deviation:.4f}"

        seconds = statistics.mean(r["seconds"] for r in mine)
        label = f"{name} ({mine[0]['config']})" if mine[0].get("config") else name
        lines.append(f"| {label} | {len(mine)} | {spread('recall@10')} | {spread('ndcg@10')} | {spread('recall@20')} "
                     f"| {seconds:.0f} |")
    baselines = runs[0].get("baselines", {}) if runs else {}
    for ranker, values in baselines.items():
        cells = " | ".join(f"{values[key]:.4f}" for key in ("recall@10", "ndcg@10", "recall@20"))
        lines.append(f"| {ranker} | | {cells} | |")
    notes = {f"- {r['variant']}: {r['note']}" for r in runs if r.get("note") and r["variant"] in MOVIELENS_VARIANTS}
    # Rows of another config than configs/beauty.yaml: which, with their own overrides under the MovieLens ones.
    configs: dict[str, dict[str, None]] = {}
    for r in runs:
        if r.get("config") and r["variant"] in MOVIELENS_VARIANTS:
            configs.setdefault(r["config"], {})[r["variant"]] = None
    notes |= {f"- {', '.join(names)}: rows of {config}, each with its overrides (in the JSON), then the MovieLens "
              "ones above" for config, names in configs.items()}
    return lines + (["", *sorted(notes)] if notes else [])


def _throughput_lines() -> list[str]:
    path = RESULTS / "bench_sequential_throughput.json"
    if not path.exists():
        return []
    record = json.loads(path.read_text())
    what = {"sequences": "transformer, every position of 256 sequences a step (train.examples: sequences)",
            "clicks": "transformer, 256 clicks a step, each its own window (train.examples: clicks)",
            "id": "ID towers, 256 clicks a step"}
    lines = ["", "## Throughput", "",
             "`python -m benchmarks.bench_sequential --throughput`: trained (query state, next item) pairs a "
             "second on Beauty, in-batch softmax, Adam, one process; the rows ran one after another in one run.", "",
             *markdown_table(["history length", "step", "pairs a step", "ms a step", "pairs/s"],
                             [[row["length"], what[row["examples"]], f"{row['pairs_per_step']:.0f}", row["step_ms"],
                               f"{row['pairs_per_second']:,}"] for row in record["rows"]])]
    lines += ["", f"Machine: {describe_machine(record['machine'])}; commit {record['machine']['commit']}, "
              f"{record['date']}."]
    return lines


# The towers the serving rows measure: (config, its history length; None: the length it ships with).
SERVING_TOWERS: list[tuple[Path, int | None]] = [
    (CONFIG, None), (CONFIG, 200), (OTHER_CONFIGS["sasrec-plus"], None), (OTHER_CONFIGS["sasrec-plus"], 200),
]


def serving_latency(data_dir: Path, history_items: int = 200, users: int = 2000, requests: int = 1000,
                    k: int = 10) -> dict[str, Any]:
    """Single-query latency of ``retrieval serve`` over HTTP answering raw ``history_items``-item histories.

    One bundle per tower of ``SERVING_TOWERS`` (configs/beauty.yaml and configs/beauty-sasrec.yaml as
    they ship, each reading the newest ``towers.query.history.length`` items of a longer history, and
    each at ``length = history_items``, reading all of them), one after the other. Each is trained one
    epoch on the first ``users`` users' sequences with the whole 54,542-item catalogue in an IVF index
    (the nlist of ``index.factory: auto``, its nprobe tuned to ``index.target_recall`` on the training
    users' queries: the nprobe, and so the IVF row's latency, depends on this short-trained model),
    then copied with the exact index (``reindex_bundle``, ``Flat``); both are served with the server's
    default flags, answering in turn, a chunk of requests each (``_serve_histories``: the rows share
    the machine's load, not its cores), and as the model is the same, the IVF row's recall@k is
    measured against the exact row's answers to the same requests. Each request is a history of
    ``history_items`` distinct trained items drawn at random (seed 0), newest first, the history's
    items excluded (the default); sequential requests, one client, after 20 warm-up requests.
    """
    beauty = data_dir / "beauty"
    rows = []
    for config_path, length in SERVING_TOWERS:
        rows += _serving_rows(beauty, config_path, length, history_items, users, requests, k)
        for row in rows[-2:]:
            print(json.dumps({key: row.get(key) for key in ("config", "length", "index", "recall_vs_exact",
                                                             "sequential_p50_ms", "sequential_p99_ms")}), flush=True)
    return {"history_items": history_items, "k": k, "catalogue_items": len((beauty / "items.txt").read_text().split()),
            "training_users": users, "rows": rows, "machine": _machine(), "date": datetime.date.today().isoformat()}


def _serving_rows(beauty: Path, config_path: Path, length: int | None, history_items: int, users: int, requests: int,
                  k: int) -> list[dict[str, Any]]:
    """The exact row and the IVF row of one tower (``serving_latency``)."""
    from retrieval.config import IndexConfig
    from retrieval.jobs.reevaluate_reindex import reindex_bundle

    with tempfile.TemporaryDirectory() as work:
        lines = (beauty / "sequences.txt").read_text().splitlines()[:users]
        (Path(work) / "sequences.txt").write_text("\n".join(lines) + "\n")
        config = load_config(config_path, [
            f"data.clicks.path={Path(work) / 'sequences.txt'}", f"data.item_features.path={beauty / 'items.txt'}",
            *([f"towers.query.history.length={length}"] if length else []), "train.epochs=1",
            "train.validation_fraction=0", "evaluation.baselines.rankers=[popularity]", "evaluation.plots=false",
            # index.factory auto's IVF (nlist the power of 2 nearest 4 sqrt(items)) below its exact threshold,
            # nprobe tuned on the training users' queries; the same model's exact index is the copy below.
            f"run.output_dir={work}", "run.name=serving", "export.topk_model=false", "index.exact_max_items=1",
        ])
        ivf = train_evaluate_export(config, config_name="serving").directory
        exact = reindex_bundle(ivf, Path(work) / "serving-exact", IndexConfig(factory="Flat"))
        trained = sorted({item for line in lines for item in line.split()[1:]})
        rng = np.random.default_rng(0)
        histories = [list(rng.choice(trained, size=history_items, replace=False)) for _ in range(requests + 20)]
        history = config.towers.query.history
        assert history is not None, f"{config_path} has no history tower"
        tower = {"config": str(config_path.relative_to(ROOT)), "length": history.length,
                 "ensemble_members": config.model.ensemble_members, "embedding_dim": config.model.embedding_dim}
        (exact_row, exact_answers), (ivf_row, ivf_answers) = _serve_histories([exact, ivf], histories, k)
    ivf_row["recall_vs_exact"] = float(np.mean([len(set(a) & set(b)) / len(b) for a, b in
                                                zip(ivf_answers, exact_answers, strict=True)]))
    return [{**tower, **exact_row}, {**tower, **ivf_row}]


# Requests a server answers before the next one takes over (``_serve_histories``).
SERVING_CHUNK = 100


def _serve_histories(bundles: list[Path], histories: list[list[str]],
                     k: int) -> list[tuple[dict[str, Any], list[list[str]]]]:
    """Each bundle served over HTTP (``retrieval serve``, default flags), all started at once and
    answering one at a time: the first 20 ``histories`` warm each up, then each server answers the next
    ``SERVING_CHUNK`` requests while the others wait idle, in turn (the order reversed every chunk), so
    the rows share the machine's load without one server's threads competing with another's answer
    (TensorFlow's, OpenMP's and OpenBLAS's threads spin a while after their work). Per bundle, its
    latency row and its answers to ``histories[20:]``."""
    import httpx

    from benchmarks._serving_http import Server
    from benchmarks._serving_index import percentiles
    from retrieval.bundle.manifest import read_manifest

    servers: list[Server] = []
    try:
        for bundle in bundles:
            servers.append(Server(bundle))
        latencies: list[list[float]] = [[] for _ in bundles]
        served: list[list[list[str]]] = [[] for _ in bundles]
        clients = [httpx.Client(base_url=server.url, timeout=60) for server in servers]

        def ask(b: int, history: list[str]) -> tuple[float, list[str]]:
            with timed() as clock:
                reply = clients[b].post("/recommend", json={"query": {"history": history}, "k": k,
                                                             "history_order": "newest_first"})
            reply.raise_for_status()
            return clock.seconds, reply.json()["item_ids"]

        try:
            for b in range(len(servers)):
                for history in histories[:20]:
                    ask(b, history)
            load_at_start = load_average()
            cpu_at_start = [_cpu_seconds(server.process.pid) for server in servers]
            for chunk, start in enumerate(range(20, len(histories), SERVING_CHUNK)):
                order = range(len(servers)) if chunk % 2 == 0 else reversed(range(len(servers)))
                for b in order:
                    for history in histories[start : start + SERVING_CHUNK]:
                        seconds, items = ask(b, history)
                        latencies[b].append(seconds)
                        served[b].append(items)
        finally:
            for client in clients:
                client.close()
        load_at_end = load_average()
        cpu = [_cpu_seconds(server.process.pid) - start for server, start in zip(servers, cpu_at_start, strict=True)]
    finally:
        for server in servers:
            server.stop()
    measured = []
    for bundle, times, answers, seconds in zip(bundles, latencies, served, cpu, strict=True):
        overlap = sum(len(set(items) & set(history)) for items, history in zip(answers, histories[20:], strict=True))
        index = read_manifest(bundle).index or {}
        measured.append(({"index": index.get("factory"), "search_params": index.get("search_params"),
                          "requests": len(times), "history_items_served": overlap,
                          "load_average": {"start": load_at_start, "end": load_at_end},
                          # the server's CPU time a request (after the warm-up): its work, whatever the load
                          "server_cpu_ms_per_request": 1e3 * seconds / len(times),
                          **percentiles(times, "sequential")}, answers))
    return measured


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` (all its threads) has used so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _serving_lines() -> list[str]:
    path = RESULTS / "bench_sequential_serving.json"
    if not path.exists():
        return []
    r = json.loads(path.read_text())
    lines = ["", "## Serving a history", "",
             "`python -m benchmarks.bench_sequential --serving`: `retrieval serve` (default flags) over HTTP on "
             f"loopback, one client, sequential `POST /recommend` with a raw {r['history_items']}-item history "
             f"(distinct trained items, newest first, its items excluded), k = {r['k']}, over the "
             f"{r['catalogue_items']:,}-item catalogue. Each tower (configs/beauty.yaml and configs/beauty-sasrec.yaml "
             "as they ship, reading the newest items of the history up to their length, and each at length "
             f"{r['history_items']}, reading all of them) is trained one epoch on the first "
             f"{r.get('training_users', 2000):,} users (a short training: the exact rows' latency does not depend on "
             "how well the model ranks, the IVF rows' nprobe does), served with an IVF index (index.factory auto's "
             "nlist, nprobe tuned to index.target_recall on the training users' queries) and, the same model, with "
             "the exact index (Flat, `retrieval.jobs.reevaluate_reindex`); the two servers started at once and, "
             f"after 20 warm-up requests each, answering in turn, {SERVING_CHUNK} requests each while the other "
             "waits idle (the order reversed every turn), so the rows share the machine's load but neither "
             f"server's threads compete with the other's answer; the IVF row's recall@{r['k']} is against the "
             "exact row's answers to the same requests. Server CPU ms a request: the server process's CPU time "
             "(all threads) over the measured requests divided by their number: its work, which the other "
             "processes on the machine do not inflate as they do the wall time.", "",
             *markdown_table(
                 ["tower", "history length", "members × dim", "index", "recall vs exact", "requests", "p50 ms",
                  "p99 ms", "mean ms", "server CPU ms a request", "history items served",
                  "load average at the first / last request"],
                 [[row.get("config", "configs/beauty.yaml"), row["length"],
                   f"{row.get('ensemble_members', r.get('ensemble_members'))} × "
                   f"{row.get('embedding_dim', r.get('embedding_dim'))}",
                   " ".join(filter(None, [row.get("index", "Flat"), row.get("search_params")])),
                   f"{row['recall_vs_exact']:.3f}" if "recall_vs_exact" in row else "",
                   row["requests"], f"{row['sequential_p50_ms']:.2f}", f"{row['sequential_p99_ms']:.2f}",
                   f"{row['sequential_mean_ms']:.2f}",
                   f"{row['server_cpu_ms_per_request']:.2f}" if "server_cpu_ms_per_request" in row else "",
                   row["history_items_served"],
                   f"{row['load_average']['start'][0]} / {row['load_average']['end'][0]}"] for row in r["rows"]],
             )]
    return lines + ["", f"Machine: {describe_machine(r['machine'])}; commit {r['machine']['commit']}, {r['date']}."]


def _plot(rows: list[dict[str, Any]]) -> None:
    plt = pyplot()
    baselines = next((row["baselines"] for row in reversed(rows) if row.get("baselines")), {})
    names = list(baselines) + [row["variant"] for row in rows]
    values = [baselines[n]["recall@10"] for n in baselines] + [row["model"]["recall@10"] for row in rows]
    figure, axis = plt.subplots(figsize=(8, 0.45 * len(names) + 1.2))
    axis.barh(names, values, color="#4a7ab5")
    axis.axvline(SASREC_PLUS["recall@10"], color="#b5544a", linestyle="--", label="SASRec+ (held-back item)")
    axis.set_xlabel("HR@10 (the last item here)")
    axis.invert_yaxis()
    axis.legend(loc="lower right")
    save_figure(figure, RESULTS / "bench_sequential.png", dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated rows of VARIANTS")
    parser.add_argument("--data-dir", type=Path,
                        default=data_dir())
    parser.add_argument("--set", dest="extra", action="append", default=[], help="an override for every row")
    parser.add_argument("--report", action="store_true", help="rewrite the md/png from the JSON only")
    parser.add_argument("--throughput", action="store_true", help="measure trained pairs/s instead of the rows")
    parser.add_argument("--serving", action="store_true",
                        help="measure single-query HTTP latency with a 200-item history instead of the rows")
    parser.add_argument("--movielens-seeds", default=None,
                        help="e.g. 0,1,2: the MovieLens-100K rows of --variants at each train.seed, not Beauty's")
    args = parser.parse_args(argv)
    if args.serving:
        write_json(RESULTS / "bench_sequential_serving.json", serving_latency(args.data_dir))
        args.report = True
    elif args.throughput:
        rates = throughput(args.data_dir)
        write_json(RESULTS / "bench_sequential_throughput.json",
                   {"rows": rates, "machine": _machine(), "date": datetime.date.today().isoformat()})
        return
    if args.movielens_seeds:
        path = RESULTS / "bench_sequential_ml100k.json"
        runs = json.loads(path.read_text()) if path.exists() else []
        chosen = set(filter(None, args.variants.split(",")))
        for seed in args.movielens_seeds.split(","):
            for name in (n for n in MOVIELENS_VARIANTS if n in chosen):
                row = run_variant(name, [*VARIANTS[name], f"train.seed={seed}"], args.data_dir, args.extra, "ml-100k")
                row["seed"] = int(seed)
                runs = [r for r in runs if (r["variant"], r["seed"]) != (name, int(seed))] + [row]
                write_json(path, runs)
                print(json.dumps({"variant": name, "seed": seed, **row["model"], "seconds": row["seconds"]}))
        args.report = True  # the MovieLens rows only: --variants chose among them
    results = RESULTS / "bench_sequential.json"
    rows = json.loads(results.read_text()) if results.exists() else []
    if not args.report:
        if not (args.data_dir / "beauty" / "sequences.txt").is_file():
            raise SystemExit(f"no beauty/sequences.txt under {args.data_dir}: set --data-dir or $RETRIEVAL_DATA_DIR")
        for name in filter(None, args.variants.split(",")):
            if name not in VARIANTS:
                raise SystemExit(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
            row = run_variant(name, VARIANTS[name], args.data_dir, args.extra)
            rows = [r for r in rows if r["variant"] != name] + [row]
            write_json(results, rows)
            write_report(rows)
            print(json.dumps({"variant": name, **row["model"], "seconds": row["seconds"]}))
    write_report(rows)


if __name__ == "__main__":
    main()
