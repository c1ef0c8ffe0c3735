"""The main job: data -> train -> index -> evaluate -> export, in one run directory."""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from retrieval.config import Config, apply_overrides, save_config
from retrieval.data import ITEM, USER, load_dataset
from retrieval.evaluation import build_eval_set, evaluate_against_baselines, format_table
from retrieval.export import MANIFEST_FILE, atomic_directory, read_manifest, write_bundle
from retrieval.features import FeatureStatistics
from retrieval.index import ItemIndex
from retrieval.model import build_model
from retrieval.serving import Bundle
from retrieval.training import embed, fit, seed_everything

log = logging.getLogger("retrieval")

POPULAR_ITEMS_IN_MANIFEST = 1000


@dataclass(frozen=True)
class RunResult:
    directory: Path
    metrics: dict[str, Any]
    seconds: float


def default_run_name(config_name: str) -> str:
    return f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{config_name}"


def train_evaluate_export(config: Config, *, config_name: str = "default") -> RunResult:
    """Run the whole job; the run directory appears only when every step succeeded."""
    started = time.perf_counter()
    name = config.run.name or default_run_name(config_name)
    final = Path(config.run.output_dir) / name
    with atomic_directory(final, overwrite=config.run.overwrite) as scratch:
        save_config(config, scratch / "config.yaml")
        dataset = load_dataset(config.data, config.split)
        log.info("data: %s", json.dumps(dataset.summary()))
        stats = FeatureStatistics.from_training_clicks(dataset.train)
        seed_everything(config.train.seed)  # before the towers are built: their init is random
        model = build_model(config.model, stats, use_weights=config.train.use_weights)

        log.info("training: %d clicks, %d epochs", len(dataset.train), config.train.epochs)
        history = fit(model, dataset.train, config.train, log_dir=scratch)

        catalogue_ids = dataset.items[ITEM].astype(str).tolist()
        log.info("indexing %d catalogue items (%s)", len(catalogue_ids), config.index.factory)
        index = ItemIndex.build(catalogue_ids, embed(model.doc_tower, ITEM, catalogue_ids), config.index.factory)

        eval_set = build_eval_set(dataset.train, dataset.test, catalogue_ids, config.evaluation)
        log.info("evaluating %d test users over the full corpus", len(eval_set.user_ids))
        metrics = evaluate_against_baselines(
            index,
            embed(model.query_tower, USER, eval_set.user_ids),
            eval_set,
            dataset.train,
            config.evaluation.ks,
            config.evaluation.query_batch_size,
        )
        metrics["data"] = dataset.summary()
        metrics["final_train_loss"] = history["loss"][-1]
        (scratch / "metrics.json").write_text(json.dumps(metrics, indent=2))
        (scratch / "metrics.md").write_text(format_table(metrics) + "\n")

        write_bundle(
            scratch,
            query_tower=model.query_tower,
            query_feature=USER,
            doc_tower=model.doc_tower,
            doc_feature=ITEM,
            index=index,
            manifest={
                "run": name,
                "config": config.to_dict(),
                "metrics": {k: metrics[k] for k in ("model", "popularity", "counts")},
                "popular_item_ids": stats.item_popularity.ranked_item_ids(POPULAR_ITEMS_IN_MANIFEST),
            },
        )
    return RunResult(final, metrics, time.perf_counter() - started)


def evaluate_bundle(directory: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Re-evaluate an exported bundle on the data and split its config names.

    The query embeddings come from the bundle's SavedModel and the ranking from
    its FAISS index, so this checks exactly what would be served. ``overrides``
    (``section.key=value``) change e.g. ``evaluation.ks`` or the test data.
    """
    bundle = Bundle.load(directory)
    raw = apply_overrides(bundle.manifest["config"], overrides or [])
    config = Config.from_dict(raw, source=f"{directory}/manifest.json config")
    dataset = load_dataset(config.data, config.split)
    eval_set = build_eval_set(dataset.train, dataset.test, list(bundle.index.item_ids), config.evaluation)
    queries = [{USER: user} for user in eval_set.user_ids]
    metrics = evaluate_against_baselines(
        bundle.index,
        bundle.embed(queries) if queries else np.zeros((0, bundle.index.dim), np.float32),
        eval_set,
        dataset.train,
        config.evaluation.ks,
        config.evaluation.query_batch_size,
    )
    metrics["data"] = dataset.summary()
    return metrics


def reindex_bundle(directory: str | Path, out: str | Path, factory: str, *, overwrite: bool = False) -> Path:
    """Copy a bundle with its index rebuilt from the doc model under another FAISS factory.

    Every catalogue item in ``item_ids.parquet`` is re-embedded by the bundle's
    own doc SavedModel, so the new index holds exactly what the old one did.
    """
    source = Path(directory)
    manifest = read_manifest(source)
    old_index = ItemIndex.load(source)
    doc_model = tf.saved_model.load(str(source / manifest["files"]["doc_model"]))
    serve = doc_model.signatures["serving_default"]
    ids = np.asarray(old_index.item_ids, dtype=object)
    embeddings = np.concatenate(
        [serve(**{ITEM: tf.constant(ids[i : i + 8192])})["embedding"].numpy() for i in range(0, len(ids), 8192)]
    )
    index = ItemIndex.build(list(ids), embeddings, factory)
    with atomic_directory(out, overwrite=overwrite) as scratch:
        shutil.copytree(source, scratch, dirs_exist_ok=True)
        index.save(scratch)
        manifest["config"]["index"]["factory"] = factory
        manifest["reindexed_from"] = str(source)
        (scratch / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
    return Path(out)
