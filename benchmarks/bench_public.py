"""Public benchmark splits: the default config and its variants vs popularity, tuned ALS and TFRS.

    python -m benchmarks.bench_public                       # or: make bench-public
    python -m benchmarks.bench_public --datasets ml-1m --variants default,popularity,als
    python -m benchmarks.bench_public --datasets ml-1m --variants default --max-epochs 1    # quick
    python -m benchmarks.bench_public --report              # rewrite md/png from the JSON

Every dataset folder under ``--data-dir`` (``$RETRIEVAL_DATA_DIR`` or ``../shared/datasets``)
that holds ``train.txt`` and ``valid.txt`` (the LightGCN format: ``uid iid iid ...``) is trained on
``train.txt`` and scored on ``valid.txt``, as the README's ``user-items`` command line does
(``split.kind: none``): full ranking over the catalogue, each user's training items masked,
recall@20 (over |relevant|) and NDCG@20. The held-back test part is never used.

Rows:

- ``popularity``; ``als``: implicit ALS (``retrieval/evaluation/baselines.py``) at every point of
  a grid (factors x regularization x alpha x iterations), the table showing the best point on
  valid (chosen on the data it is scored on: an optimistic baseline);
- model rows, each a list of ``--set`` overrides on configs/default.yaml (``VARIANTS``): the
  default itself, the TFRS tutorial recipe (``bench_losses.py``) with and without log-Q, and the
  default with one major option switched. A model row is the whole ``make train`` job (data,
  early stopping, training, index, evaluation, export); its seconds are the job's wall time.

Each finished row is appended to ``bench_public.json`` at once (a killed run keeps what
finished) and the Markdown and PNG are rewritten; a row already there for the same (dataset, row,
seed, overrides) is skipped unless ``--force``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import re
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import retrieval  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)
from benchmarks._harness import (
    RESULTS,
    command,
    cpu_model,
    data_dir,
    machine,
    markdown_table,
    pyplot,
    save_figure,
    write_json,
)
from benchmarks._quality import VARIANTS as LOSS_VARIANTS
from retrieval.config import ALSConfig, BaselinesConfig, Config, ConfigError, load_config
from retrieval.data import ITEM, USER, load_dataset
from retrieval.evaluation import EvalSet, build_eval_set, compare_rankers, item_click_counts
from retrieval.evaluation.baselines import als_ranking, ease_ranking, popularity_ranking
from retrieval.jobs import train_evaluate_export

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/default.yaml"
K = 20
RECALL, NDCG = f"recall@{K}", f"ndcg@{K}"

# https://www.tensorflow.org/recommenders/examples/basic_retrieval, as bench_losses.py defines it.
TFRS = LOSS_VARIANTS["TFRS tutorial recipe"]

CHEAP_SELECTION = ["train.validation_users=5000", "train.refit_from=best", "train.refit_epochs=2"]

# The published ID-only records at their own training length, selected as they were: early stopping on valid.txt
# itself (train.validation_part: test; optimistic, as the records' protocol is), so each row's validation recall
# after every epoch is its curve on valid (recall over valid clicks, of train.validation_users users; the row's end
# figure is recall over |relevant| of every user) and bench_public_curves.png draws it against epochs and wall time.
ON_VALID = ["train.validation_part=test", "train.refit=false"]
RECORDS: dict[str, list[str]] = {
    # MF + BSL (Wu et al. 2023) as its Gowalla log states: dimension 64, cosine, 800 uniform negatives, tau1 0.08,
    # tau2 1.22, Adam 1e-4, batch 1024, dropout 0.1, L2 1e-9, up to 400 epochs (its best test epoch: about 388).
    # The negatives are shared by the batch here (per-row draws: the bsl100-per-row row).
    "mf-bsl-record": ["model.embedding_dim=64", "model.loss.kind=bsl", "model.loss.negatives=uniform",
                      "model.loss.num_negatives=800", "model.temperature=0.08", "model.loss.bsl_temperature=1.22",
                      "model.log_q_correction=false", "model.embedding_dropout=0.1", "model.l2_regularization=1e-9",
                      "train.optimizer=adam", "train.learning_rate=0.0001", "train.batch_size=1024",
                      "train.epochs=400", "train.early_stopping_patience=10", *ON_VALID],
}

# Model rows: name -> overrides on configs/default.yaml. One line adds a row.
VARIANTS: dict[str, list[str]] = {
    "default": [],
    # The default until 2026-12-01 (1e6c69f; measured then with Keras fit; the rows keep their overrides explicit).
    "adam-T0.2": ["train.optimizer=adam", "model.temperature=0.2"],
    # The temperature sweep that chose model.temperature: auto (lazy_adam at fixed temperatures).
    "T0.2-lazy": ["model.temperature=0.2", "train.optimizer=lazy_adam"],
    "T0.14-lazy": ["model.temperature=0.14", "train.optimizer=lazy_adam"],
    "T0.1-lazy": ["model.temperature=0.1", "train.optimizer=lazy_adam"],
    "T0.07-lazy": ["model.temperature=0.07", "train.optimizer=lazy_adam"],
    "tfrs": TFRS,
    "tfrs+logq": [*TFRS, "model.log_q_correction=true"],  # log-Q as the default estimates it (streaming)
    "mixed": ["model.loss.negatives=mixed"],  # in-batch + 1024 uniform draws (Yang et al. 2020)
    "mixed-dim128": ["model.loss.negatives=mixed", "model.embedding_dim=128"],
    # The corrected log-Q (Khrylchenko et al., RecSys 2025), the default otherwise; and with mixed negatives.
    "corrected-logq": ["model.loss.log_q_variant=corrected"],
    "mixed-corrected-logq": ["model.loss.negatives=mixed", "model.loss.log_q_variant=corrected"],
    "corrected-logq-cheap": ["model.loss.log_q_variant=corrected", *CHEAP_SELECTION],
    "hard": ["model.loss.hard_negatives=in_batch_top_k", "model.loss.num_hard_negatives=100"],
    "kernel": ["model.loss.negatives=kernel", "model.loss.num_negatives=32"],  # Blanc & Rendle 2018, 32/query
    "dim32": ["model.embedding_dim=32"],
    "dim64": ["model.embedding_dim=64"],  # the default until 2026-12-02 (e79bcc5)
    "dim128": ["model.embedding_dim=128"],
    "dim512": ["model.embedding_dim=512"],  # tuned ALS on Gowalla gains up to 512 factors
    "batch256": ["train.batch_size=256"],
    "batch4096": ["train.batch_size=4096"],
    "temp0.07": ["model.temperature=0.07"],
    "temp0.1": ["model.temperature=0.1"],
    "temp0.5": ["model.temperature=0.5"],
    # The low-temperature probe: a low temperature, a fixed 12 epochs, no early stopping (so no refit), adam.
    "temp0.07-12ep": ["model.temperature=0.07", "train.epochs=12", "train.validation_fraction=0",
                      "train.optimizer=adam"],
    # Cheaper selection: early stopping watches 5,000 validation users, and the refit continues from the best
    # epoch's weights for 2 epochs instead of retraining from scratch.
    "default-cheap": [*CHEAP_SELECTION],
    # The published ID-only recipes' shape: cosine towers, thousands of uniform negatives shared by the batch,
    # a low temperature (many-negative sampled softmax), with the cheaper selection.
    "uniform2000-T0.05": ["model.loss.negatives=uniform", "model.loss.num_negatives=2000", "model.temperature=0.05",
                          *CHEAP_SELECTION],
    # MF-CCL (SimpleX's loss without the history): cosine contrastive, margin 0.9, negative weight 150, 800
    # uniform negatives (shared by the batch here; the authors draw per row), no log-Q.
    "ccl800": ["model.loss.kind=cosine_contrastive", "model.loss.negatives=uniform", "model.loss.num_negatives=800",
               "model.log_q_correction=false", *CHEAP_SELECTION],
    # BSL's MF Gowalla setting: tau1 0.08, tau2 1.22, 800 uniform negatives (shared by the batch).
    "bsl800": ["model.loss.kind=bsl", "model.loss.negatives=uniform", "model.loss.num_negatives=800",
               "model.temperature=0.08", "model.loss.bsl_temperature=1.22", *CHEAP_SELECTION],
    # Shared against per-row negatives, BSL's loss at a number of negatives per-row draws can afford on 2 cores
    # (each row's own 100 uniform draws: batch x 100 doc-tower rows a step, against 100 for the batch).
    "bsl100": ["model.loss.kind=bsl", "model.loss.negatives=uniform", "model.loss.num_negatives=100",
               "model.temperature=0.08", "model.loss.bsl_temperature=1.22", *CHEAP_SELECTION],
    "bsl100-per-row": ["model.loss.kind=bsl", "model.loss.negatives=uniform", "model.loss.num_negatives=100",
                       "model.loss.negatives_per_row=true", "model.temperature=0.08",
                       "model.loss.bsl_temperature=1.22", *CHEAP_SELECTION],
    # SimpleX's query side on a log without time: the user id plus the mean (or attention) of the user's other
    # training items (its latest 20 in log order, the row's own item left out), through the tower's projection.
    "history-mean": ["towers.query.history={pooling: mean, length: 20}", *CHEAP_SELECTION],
    "history-attention": ["towers.query.history={pooling: attention, length: 20}", *CHEAP_SELECTION],
    # Two tower pairs trained side by side and served as one scoring their mean (model.ensemble_members).
    "ensemble2": ["model.ensemble_members=2"],
    # No training item of a click's user among its negatives (model.remove_user_items), cheap selection.
    "default-cheap-user-items": ["model.remove_user_items=true", *CHEAP_SELECTION],
    # Two members of half the width (the same 256 floats an item) under the cheap selection.
    "ensemble2-dim128-cheap": ["model.ensemble_members=2", "model.embedding_dim=128", *CHEAP_SELECTION],
    # SimpleX's dropout (0.1) on both towers' embeddings, the default otherwise, cheap selection.
    "dropout0.1-cheap": ["model.embedding_dropout=0.1", *CHEAP_SELECTION],
    # A learned item bias outside the cosine (model.item_bias), alone and with the demo config's dropout 0.1.
    "item-bias-cheap": ["model.item_bias=true", *CHEAP_SELECTION],
    "item-bias-dropout0.1-cheap": ["model.item_bias=true", "model.embedding_dropout=0.1", *CHEAP_SELECTION],
    **RECORDS,
}
BASELINES = ["popularity", "als", "ease"]
GRIDS = ("als", "ease")  # baselines tuned on valid over a grid: the tables show each one's best point
ROWS = [*BASELINES, *VARIANTS]

# The ALS grid (every combination), keyed by ALSConfig field. alpha (the confidence of a click) and
# regularization interact (good points keep regularization / alpha near 0.5-5), and the best factors
# grow with the catalogue: a grid of factors alone at alpha 5 (the grid until aab2b1d) left Gowalla's best point
# at its edge (256) and ALS about 0.03 recall@20 short of its level there (0.1817 against 0.2116).
# 512 factors, regularization 100 and alpha 50 are edges; points past them, scored by Baselines.als
# as the grid's are (2026-12-02, not kept in the JSON), gained at most 0.0023: Gowalla 0.2095 at 1024
# factors (188 s a fit), 0.2111 at alpha 100, 0.2045 at regularization 300 (grid best 0.2116);
# ML-1M 0.2656 at 1024 factors (grid best 0.2633).
ALS_GRID: dict[str, list] = {
    "factors": [32, 64, 128, 256, 512],  # 32: the project's ALS default
    "regularization": [1.0, 10.0, 100.0],
    "alpha": [5.0, 20.0, 50.0],
    # In the earlier grid, 30 sweeps moved no point by more than 0.0021 and lost at both datasets' best.
    "iterations": [15],
}

# EASE (Steck, WWW 2019): a strong item-item reference on dense logs; its closed form inverts an
# [items, items] Gram matrix, so it runs only on catalogues up to EASE_MAX_ITEMS (ML-1M, not Gowalla).
EASE_L2 = [100.0, 300.0, 1000.0, 3000.0]
EASE_MAX_ITEMS = 20_000

# Set on every model row: the baselines are rows of their own, and no plots are needed.
BENCH_SETTINGS = ["evaluation.baselines.rankers=[]", "evaluation.plots=false"]


def find_datasets(data_dir: Path) -> dict[str, Path]:
    """Folders of ``data_dir`` holding both ``train.txt`` and ``valid.txt``, by name."""
    if not data_dir.is_dir():
        return {}
    return {
        folder.name: folder
        for folder in sorted(data_dir.iterdir())
        if (folder / "train.txt").is_file() and (folder / "valid.txt").is_file()
    }


def data_overrides(folder: Path) -> list[str]:
    """The README's ``user-items`` command line: train on train.txt, evaluate on valid.txt."""
    train, valid = json.dumps(str(folder / "train.txt")), json.dumps(str(folder / "valid.txt"))
    return [
        "data.source=files",
        f"data.clicks={{path: {train}, format: user-items}}",
        f"data.test_clicks={{path: {valid}, format: user-items}}",
        "split.kind=none",
    ]


def model_overrides(row: str, seed: int, extra: list[str], max_epochs: int | None, folder: Path) -> list[str]:
    """Everything a model row sets on configs/default.yaml: data, variant, seed, --set, epoch cap."""
    overrides = [*data_overrides(folder), *VARIANTS[row], *extra]
    if seed:  # seed 0 is the config's own seeds: the default row is exactly `make train`
        base = load_config(CONFIG, overrides)
        overrides += [f"train.seed={base.train.seed + seed}", f"model.loss.seed={base.model.loss.seed + seed}"]
    if max_epochs is not None and load_config(CONFIG, overrides).train.epochs > max_epochs:
        overrides.append(f"train.epochs={max_epochs}")
    return overrides


def train_row(row: str, seed: int, extra: list[str], max_epochs: int | None, folder: Path, work: Path) -> dict:
    """Run the job for one model row: recall/NDCG on valid, wall seconds, epochs trained, what early stopping chose."""
    name = f"{folder.name}-{row}-{seed}".replace("+", "-")
    overrides = model_overrides(row, seed, extra, max_epochs, folder)
    config = load_config(CONFIG, [*overrides, *BENCH_SETTINGS, f"run.output_dir={work}", f"run.name={name}"])
    result = train_evaluate_export(config, config_name=name)
    shutil.rmtree(result.directory, ignore_errors=True)
    model, training = result.metrics["model"], result.metrics["training"]
    row = {
        RECALL: model[RECALL],
        NDCG: model[NDCG],
        "seconds": round(result.seconds, 1),
        "epochs": training["epochs"],  # of the run whose weights are scored (train_log.csv's rows)
        "users": model["users"],
        "train_clicks": result.metrics["data"].get("train_clicks"),
    }
    selection = training["early_stopping"]
    if selection:  # what early stopping chose, so selections that differ only in cost can be compared epoch by epoch
        row["selection"] = {key: value for key, value in selection.items() if key != "message"}
    timing = result.metrics["timing"]
    for key in ("epoch_seconds", "hook_seconds"):  # each epoch's training and validation time: the curves' x
        if timing.get(key):
            row[key] = [round(value, 3) for value in timing[key]]
    return row


class Baselines:
    """One dataset's evaluation set, built once, and its baseline rankers scored as the job scores them."""

    def __init__(self, folder: Path):
        self.config: Config = load_config(CONFIG, data_overrides(folder))
        dataset = load_dataset(self.config.data, self.config.split)
        self.train = dataset.train
        self.catalogue_ids = dataset.items[ITEM].astype(str).tolist()
        self.eval_set: EvalSet = build_eval_set(dataset.train, dataset.test, self.catalogue_ids, self.config.evaluation)

    def score(self, name: str, rank: Callable) -> dict:
        activity = self.train[USER].value_counts().reindex(self.eval_set.user_ids, fill_value=0).to_numpy()
        depth = max(self.config.evaluation.ks)
        ranker = partial(rank, self.train, self.catalogue_ids, self.eval_set, depth)
        counts = item_click_counts(self.train, self.catalogue_ids)
        results = compare_rankers({name: ranker}, self.eval_set, counts, activity, self.config.evaluation)
        return {
            RECALL: results[name][RECALL],
            NDCG: results[name][NDCG],
            "seconds": results["seconds"][name],
            "users": results[name]["users"],
        }

    def popularity(self) -> dict:
        return self.score("popularity", popularity_ranking)

    def als(self, point: dict, seed: int) -> dict:
        als = ALSConfig(**point, seed=seed)
        return self.score("als", partial(als_ranking, config=BaselinesConfig(rankers=("als",), als=als)))


@functools.lru_cache(maxsize=1)  # the rows of one dataset share it; the next dataset replaces it
def baselines_of(folder: Path) -> Baselines:
    return Baselines(folder)


def popularity_row(folder: Path) -> dict:
    return baselines_of(folder).popularity()


def als_row(folder: Path, point: dict, seed: int) -> dict:
    return baselines_of(folder).als(point, seed)


def ease_row(folder: Path, l2: float) -> dict:
    baselines = baselines_of(folder)
    return baselines.score("ease", partial(ease_ranking, l2=l2))


def als_grid() -> list[dict]:
    """Every point of ALS_GRID as {ALSConfig field: value}."""
    return [dict(zip(ALS_GRID, values)) for values in itertools.product(*ALS_GRID.values())]


# -- results file ----------------------------------------------------------------------------


def row_key(entry: dict) -> tuple:
    return entry["dataset"], entry["row"], entry["seed"], tuple(entry["overrides"]), tuple(entry["extra"])


def read_report(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"rows": []}


def append_row(path: Path, entry: dict) -> dict:
    """Add ``entry`` to the JSON file (replacing one with the same key), written whole or not at all."""
    report = read_report(path)
    report["rows"] = [r for r in report["rows"] if row_key(r) != row_key(entry)] + [entry]
    report["machine"] = machine("numpy", "tensorflow", "faiss", "implicit")
    write_json(path, report)
    return report


def summarise(rows: list[dict]) -> list[dict]:
    """Rows grouped by (dataset, row, overrides, extra): mean and std over seeds."""
    groups: dict[tuple, list[dict]] = {}
    for entry in rows:
        groups.setdefault(row_key(entry)[:2] + row_key(entry)[3:], []).append(entry)
    summary = []
    for (dataset, row, overrides, extra), runs in groups.items():
        item: dict[str, Any] = {"dataset": dataset, "row": row, "overrides": list(overrides), "extra": list(extra),
                                "seeds": len(runs), "users": runs[0].get("users"),
                                "cpu": " / ".join(dict.fromkeys(r["cpu"] for r in runs if r.get("cpu")))}
        for key in (RECALL, NDCG, "seconds", "epochs", "best_epoch"):
            values = [value for run in runs if (value := _run_value(run, key)) is not None]
            if values:
                item[key] = statistics.fmean(values)
                item[f"{key}_std"] = statistics.pstdev(values) if len(values) > 1 else 0.0
        summary.append(item)
    return summary


def _run_value(run: dict, key: str) -> float | None:
    """A recorded figure of one run; ``best_epoch`` is the epoch its early stopping chose (None before recorded)."""
    if key == "best_epoch":
        return (run.get("selection") or {}).get("best_epoch")
    return run.get(key)


def table_rows(summary: list[dict], dataset: str) -> list[dict]:
    """One dataset's rows in ROWS order; each baseline grid (ALS, EASE) collapses to its best point (labelled)."""
    mine = [s for s in summary if s["dataset"] == dataset]
    shown = [s for s in mine if s["row"] not in GRIDS]
    for name in GRIDS:
        grid = [s for s in mine if s["row"] == name]
        if grid:
            best = max(grid, key=lambda s: s[RECALL])
            shown.append({**best, "short": f"{name} (tuned on valid)",
                          "label": f"{name}, tuned on valid ({', '.join(best['overrides'])}; best of {len(grid)})"})
    order = {name: i for i, name in enumerate(ROWS)}
    shown.sort(key=lambda s: (order.get(s["row"], len(order)), s["extra"]))
    for s in shown:
        s.setdefault("short", s["row"] + (f" [{' '.join(s['extra'])}]" if s["extra"] else ""))
        s.setdefault("label", s["short"])
    return shown


def _cell(s: dict | None, key: str) -> str:
    if s is None or key not in s:
        return ""
    return f"{s[key]:.4f}" + (f" ± {s[f'{key}_std']:.4f}" if s["seeds"] > 1 else "")


def markdown(report: dict) -> str:
    summary = summarise(report["rows"])
    datasets = sorted({s["dataset"] for s in summary})
    lines = [
        "# Public benchmark splits: trained on train.txt, scored on valid.txt\n",
        f"Full ranking over each catalogue, the user's training items masked; recall@{K} over |relevant| and "
        f"NDCG@{K} on `valid.txt` (the held-back test part is never used, so these are not test figures). Model "
        "rows are `make train` with configs/default.yaml plus the row's overrides (`VARIANTS` in "
        "benchmarks/bench_public.py); their seconds are the whole job's wall time (load, early stopping, "
        "training, index, evaluation, export) on the CPU their row names (2-core VMs whose CPU changed between "
        "sessions; rows run before the CPU was recorded leave it blank): compare seconds within one CPU only. "
        "Epochs are those of the run whose weights are scored, with the epoch early stopping chose in brackets "
        "where the row recorded it (a refit from the best weights trains only `train.refit_epochs` more). "
        "ALS is the best point of a grid "
        "(factors x regularization x alpha x iterations) chosen on valid itself, an optimistic baseline; EASE "
        "(Steck 2019, the l2 grid chosen on valid too) is a second, item-item reference, on catalogues of at most "
        f"{EASE_MAX_ITEMS:,} items. "
        "Mean ± std over seeds where a row has several. Rows whose JSON entry carries a `note` say which "
        "code ran them: `adam-T0.2` (the default until 2026-12-01, 1e6c69f), the `T*-lazy` sweep and `temp0.07-12ep` "
        "ran on the code before ad04f46 (Keras `fit`) while other jobs shared the 2 cores, so their seconds are "
        "not comparable with `default`'s (the one training loop). On 2026-12-02 (e79bcc5) the default's "
        "`model.embedding_dim` rose from 64 to 256: rows run before it show `model.embedding_dim=64` among their "
        "overrides (`dim64` is the old default), as they ran. On 2026-12-06 the default's `train.validation_users` "
        "fell from every validation user to 10,000: rows run before it ranked every user each epoch (on Gowalla, "
        "benchmarks/results/bench_public_selection/ measured the same chosen epoch and model).\n",
        f"## recall@{K} (rows x datasets)\n",
    ]
    by_dataset = {d: {s["short"]: s for s in table_rows(summary, d)} for d in datasets}
    lines += markdown_table(
        ["row", *datasets],
        [[short, *(_cell(by_dataset[d].get(short), RECALL) for d in datasets)]
         for short in dict.fromkeys(name for rows in by_dataset.values() for name in rows)],
    )
    lines.append("")
    for d in datasets:
        rows = list(by_dataset[d].values())
        als = next((s for s in rows if s["row"] == "als"), None)
        tfrs = next((s for s in rows if s["row"] == "tfrs+logq" and not s["extra"]), None)
        users = rows[0].get("users") if rows else None
        lines.append(f"## {d}: {users} users evaluated\n")
        table = []
        for s in rows:
            ratio_als = f"{s[RECALL] / als[RECALL]:.2f}" if als and als[RECALL] else ""
            ratio_tfrs = f"{s[RECALL] / tfrs[RECALL]:.2f}" if tfrs and tfrs[RECALL] else ""
            epochs = f"{s['epochs']:.1f}" if "epochs" in s else ""
            if "best_epoch" in s:
                epochs += f" (best {s['best_epoch']:.1f})"
            overrides = " ".join(s["extra"] if s["row"] in GRIDS else [*s["overrides"], *s["extra"]])
            table.append([s["label"], _cell(s, RECALL), _cell(s, NDCG), ratio_als, ratio_tfrs, epochs,
                          f"{s.get('seconds', 0):.0f}", s.get("cpu", ""), s["seeds"],
                          "`" + overrides + "`" if overrides else ""])
        lines += markdown_table(
            ["row", f"recall@{K}", f"NDCG@{K}", "× tuned ALS", "× TFRS + log-Q", "epochs", "seconds", "CPU", "seeds",
             "overrides"],
            table,
        )
        for name in GRIDS:
            grid = sorted((s for s in summarise(report["rows"]) if s["dataset"] == d and s["row"] == name),
                          key=lambda s: -s[RECALL])
            if grid:
                lines += ["", f"{name.upper()} grid on {d} (best first):\n"]
                lines += markdown_table(
                    ["point", f"recall@{K}", f"NDCG@{K}", "seconds"],
                    [[" ".join(s["overrides"]), _cell(s, RECALL), _cell(s, NDCG), f"{s['seconds']:.0f}"] for s in grid],
                )
        lines.append("")
    if found := curves(report):
        lines += ["## Records at their own length: the curves\n",
                  f"Valid recall@{K} over valid clicks after each epoch (early stopping's watch, on valid.txt itself), "
                  "drawn against epochs and wall time in bench_public_curves.png. \"Gain, last 10 epochs\" is the "
                  "recall after the last epoch less the recall ten epochs before it: positive where the curve still "
                  "rose when the run ended.\n"]
        lines += markdown_table(
            ["run", "epochs run", "best epoch", "best valid recall", "last", "gain, last 10 epochs", "minutes"],
            [[c["label"], len(c["recall"]), c["best_epoch"], f"{max(c['recall']):.4f}", f"{c['recall'][-1]:.4f}",
              f"{c['recall'][-1] - c['recall'][max(0, len(c['recall']) - 11)]:+.4f}", f"{c['wall'][-1] / 60:.1f}"]
             for c in found],
        )
        lines.append("")
    # Rows recorded before the benchmarks ran as modules name the script: the same command.
    commands = list(dict.fromkeys(re.sub(r"python3? benchmarks/(\w+)\.py", r"python -m benchmarks.\1", r["command"])
                                  for r in report["rows"] if "command" in r))
    machine = report.get("machine", {})
    lines += ["## Commands\n", *(f"- `{c}`" for c in commands), "",
              f"Machine: {machine.get('platform', '?')}, {machine.get('cpus', '?')} CPUs (shared with other jobs).", ""]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    import numpy as np

    summary = summarise(report["rows"])
    datasets = sorted({s["dataset"] for s in summary})
    by_dataset = {d: {s["short"]: s for s in table_rows(summary, d)} for d in datasets}
    labels = list(dict.fromkeys(name for rows in by_dataset.values() for name in rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(labels) * max(len(datasets), 1)), 4.5))
    width = 0.8 / max(len(datasets), 1)
    for i, d in enumerate(datasets):
        lookup = by_dataset[d]
        values = [lookup[label][RECALL] if label in lookup else np.nan for label in labels]
        errors = [lookup[label].get(f"{RECALL}_std", 0.0) if label in lookup else 0.0 for label in labels]
        ax.bar(np.arange(len(labels)) + i * width, values, width, yerr=errors, label=d)
    ax.set_xticks(np.arange(len(labels)) + width * (len(datasets) - 1) / 2)
    ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel(f"recall@{K} on valid.txt")
    ax.set_title("Public benchmark splits (train.txt -> valid.txt)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def curves(report: dict) -> list[dict]:
    """The record rows' runs with a validation curve and its epoch times: label, recall per epoch, wall seconds
    after each epoch (training plus the validation pass), the epoch early stopping kept."""
    found = []
    for run in report["rows"]:
        selection = run.get("selection") or {}
        recalls = selection.get(f"val_recall@{K}")
        if run["row"] not in RECORDS or not recalls or not run.get("epoch_seconds"):
            continue
        seconds = [a + b for a, b in zip(run["epoch_seconds"], run.get("hook_seconds") or [0.0] * len(recalls))]
        label = f"{run['dataset']} {run['row']}" + (f" [{' '.join(run['extra'])}]" if run["extra"] else "")
        found.append({"label": label, "recall": recalls, "wall": list(itertools.accumulate(seconds)),
                      "best_epoch": selection["best_epoch"]})
    return found


def plot_curves(found: list[dict], path: Path) -> None:
    """Validation recall against epochs and against cumulative wall seconds, a line per record run."""
    plt = pyplot()
    fig, (by_epoch, by_time) = plt.subplots(1, 2, figsize=(11, 4.2))
    for curve in found:
        epochs = range(1, len(curve["recall"]) + 1)
        line, = by_epoch.plot(epochs, curve["recall"], label=curve["label"])
        by_time.plot([s / 60 for s in curve["wall"]], curve["recall"], color=line.get_color())
        best = curve["best_epoch"] - 1
        by_epoch.plot([best + 1], [curve["recall"][best]], "o", color=line.get_color())
    by_epoch.set_xlabel("epoch")
    by_time.set_xlabel("minutes (training + validation pass)")
    for ax in (by_epoch, by_time):
        ax.set_ylabel(f"recall@{K} over valid clicks")
        ax.grid(True, alpha=0.3)
    by_epoch.legend(fontsize=8)
    fig.suptitle("Records at their own length: valid recall each epoch (dot: the epoch kept)")
    save_figure(fig, path)


def write_report(report: dict, out: Path) -> None:
    (out / "bench_public.md").write_text(markdown(report))
    if report["rows"]:
        plot(report, out / "bench_public.png")
    if found := curves(report):
        plot_curves(found, out / "bench_public_curves.png")


# -- main ------------------------------------------------------------------------------------


def _names(values: list[str], valid: list[str], what: str) -> list[str]:
    names = [name for value in values for name in value.split(",") if name]
    unknown = [name for name in names if name not in valid]
    if unknown:
        raise SystemExit(f"error: unknown {what} {', '.join(unknown)}; valid: {', '.join(valid)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=data_dir(),
                        help="folder of dataset folders (default: $RETRIEVAL_DATA_DIR or ../shared/datasets)")
    parser.add_argument("--datasets", nargs="+", default=[], help="dataset folder names (default: every one found)")
    parser.add_argument("--variants", nargs="+", default=[],
                        help=f"rows, comma- or space-separated (default: all): {', '.join(ROWS)}")
    parser.add_argument("--seeds", type=int, default=1, help="training seeds of each model and ALS row")
    parser.add_argument("--max-epochs", type=int, help="cap train.epochs of every model row (quick runs)")
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                        help="override applied to every model row (repeatable)")
    parser.add_argument("--force", action="store_true", help="rerun rows already in the JSON")
    parser.add_argument("--report", action="store_true", help="only rewrite md/png from the JSON")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_public.json"
    if args.report:
        write_report(read_report(path), args.out)
        return 0

    found = find_datasets(args.data_dir)
    if not found:
        print(f"no dataset folder with train.txt and valid.txt under {args.data_dir} "
              "(set --data-dir or $RETRIEVAL_DATA_DIR)", file=sys.stderr)
        return 2
    datasets = _names(args.datasets, list(found), "dataset") or list(found)
    rows = _names(args.variants, ROWS, "row") or ROWS
    if args.max_epochs is not None and args.max_epochs < 1:
        raise SystemExit(f"error: --max-epochs must be at least 1, got {args.max_epochs}")
    for row in rows:  # a bad --set fails here, before hours of training
        if row in VARIANTS:
            try:
                load_config(CONFIG, model_overrides(row, 0, args.extra, args.max_epochs, found[datasets[0]]))
            except ConfigError as error:
                raise SystemExit(f"error: row {row}: {error}") from None
    command_line = command("bench_public", argv)
    done = {row_key(r) for r in read_report(path)["rows"]}
    cpu = cpu_model()  # once: every row of this run ran on it

    def record(dataset: str, row: str, seed: int, overrides: list[str], extra: list[str], run: Callable[[], dict]):
        entry = {"dataset": dataset, "row": row, "seed": seed, "overrides": overrides, "extra": extra}
        if row_key(entry) in done and not args.force:
            print(f"{dataset} | {row} {' '.join(overrides)} | seed {seed}: already in {path.name}, skipped")
            return
        entry.update(run())
        finished = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        entry.update(command=command_line, finished=finished, cpu=cpu)
        write_report(append_row(path, entry), args.out)
        print(f"{dataset} | {row} {' '.join(overrides)} | seed {seed}: {RECALL} {entry[RECALL]:.4f}, "
              f"{NDCG} {entry[NDCG]:.4f}, {entry['seconds']:.0f} s", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-public-") as work:
        for dataset in datasets:
            folder = found[dataset]
            for row in rows:
                if row == "popularity":
                    record(dataset, row, 0, [], [], partial(popularity_row, folder))
                elif row == "ease":
                    if len(baselines_of(folder).catalogue_ids) > EASE_MAX_ITEMS:
                        print(f"{dataset} | ease: skipped, {len(baselines_of(folder).catalogue_ids):,} items is more "
                              f"than EASE_MAX_ITEMS={EASE_MAX_ITEMS:,} (a dense [items, items] inverse)")
                        continue
                    for l2 in EASE_L2:
                        record(dataset, row, 0, [f"l2={l2:g}"], [], partial(ease_row, folder, l2))
                elif row == "als":
                    for point, seed in itertools.product(als_grid(), range(args.seeds)):
                        overrides = [f"{key}={value}" for key, value in point.items()]
                        record(dataset, row, seed, overrides, [], partial(als_row, folder, point, seed))
                else:
                    extra = [*args.extra, *([f"train.epochs<={args.max_epochs}"] if args.max_epochs else [])]
                    for seed in range(args.seeds):
                        record(dataset, row, seed, VARIANTS[row], extra,
                               partial(train_row, row, seed, args.extra, args.max_epochs, folder, Path(work)))
    write_report(read_report(path), args.out)
    print(markdown(read_report(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
