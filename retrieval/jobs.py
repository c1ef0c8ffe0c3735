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
import pandas as pd
import tensorflow as tf

from retrieval.config import Config, IndexConfig, apply_overrides, save_config
from retrieval.data import ITEM, USER, load_dataset
from retrieval.evaluation import build_eval_set, evaluate_against_baselines, format_table, ranker_names, write_report
from retrieval.export import MANIFEST_FILE, atomic_directory, read_manifest, write_bundle
from retrieval.features import FeatureStatistics, TowerStatistics, TowerTables, feature_arrays
from retrieval.index import ItemIndex, build_index
from retrieval.model import build_model
from retrieval.serving import Bundle
from retrieval.towers import build_towers
from retrieval.training import embed_frame, fit, seed_everything

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
        tables = TowerTables.from_dataset(dataset, config.towers)
        examples = tables.examples()
        seed_everything(config.train.seed)  # before the towers are built: their init is random
        towers = catalogue = None  # None: build_model makes the ID towers
        if not config.towers.is_id_only:
            towers = build_towers(
                config.towers, config.model, TowerStatistics.fit(config.towers, examples, tables.reference_time)
            )
            catalogue = tables.catalogue()  # sampled negatives are embedded from their raw features
        model = build_model(
            config.model,
            stats,
            use_weights=config.train.use_weights,
            train_clicks=dataset.train,
            towers=towers,
            catalogue_features=catalogue,
        )
        if not model.servable_by_dot_product:
            raise ValueError(
                f"model.loss.kind={config.model.loss.kind!r} scores items by tree paths, not dot products, "
                "so it cannot be served from the FAISS index; it is a comparison loss (make bench-losses)"
            )

        log.info("training: %d clicks, %d epochs", len(dataset.train), config.train.epochs)
        history = fit(model, examples, config.train, log_dir=scratch, split=config.split)

        catalogue_ids = dataset.items[ITEM].astype(str).tolist()
        log.info("indexing %d catalogue items (%s)", len(catalogue_ids), config.index.factory)
        # Every catalogue item is embedded from its features, clicked in training or not.
        item_embeddings = embed_frame(model.doc_tower, tables.catalogue())
        # Approximate indexes are tuned on real queries: a sample of training users.
        tuning_users = _user_sample(dataset.train, config.index.tune_queries, config.index.seed)
        index = build_index(
            catalogue_ids,
            item_embeddings,
            config.index,
            embed_frame(model.query_tower, tables.queries(tuning_users)),
            "training users",
        )

        eval_set = build_eval_set(dataset.train, dataset.test, catalogue_ids, config.evaluation)
        log.info("evaluating %d test users over the full corpus", len(eval_set.user_ids))
        metrics = evaluate_against_baselines(
            index,
            embed_frame(model.query_tower, tables.queries(eval_set.user_ids)),
            eval_set,
            dataset.train,
            config.evaluation,
        )
        metrics["data"] = dataset.summary()
        metrics["final_train_loss"] = history["loss"][-1]
        (scratch / "metrics.json").write_text(json.dumps(metrics, indent=2))
        (scratch / "metrics.md").write_text(format_table(metrics) + "\n")
        write_report(scratch, metrics, title=f"Offline evaluation: {name}", plots=config.evaluation.plots)
        write_metric_summaries(scratch / "tensorboard" / "evaluation", metrics, step=config.train.epochs)

        write_bundle(
            scratch,
            query_tower=model.query_tower,
            doc_tower=model.doc_tower,
            index=index,
            item_embeddings=item_embeddings if config.export.topk_model else None,
            topk_k=config.export.topk_k,
            manifest={
                "run": name,
                "config": config.to_dict(),
                "metrics": {k: metrics[k] for k in [*ranker_names(metrics), "counts"]},
                "popular_item_ids": stats.item_popularity.ranked_item_ids(POPULAR_ITEMS_IN_MANIFEST),
            },
        )
    return RunResult(final, metrics, time.perf_counter() - started)


def write_metric_summaries(log_dir: str | Path, metrics: dict[str, Any], step: int) -> None:
    """Write every ranker's final metrics as TensorBoard scalars ``<ranker>/<metric@k>`` at ``step``."""
    writer = tf.summary.create_file_writer(str(log_dir))
    with writer.as_default():
        for ranker in ranker_names(metrics):
            for key, value in metrics[ranker].items():
                tf.summary.scalar(f"{ranker}/{key}", float(value), step=step)
    writer.close()


def _user_sample(train, size: int, seed: int) -> list[str]:
    users = np.sort(train[USER].astype(str).unique())
    if len(users) > size:
        users = users[np.sort(np.random.default_rng(seed).choice(len(users), size, replace=False))]
    return users.tolist()


def evaluate_bundle(
    directory: str | Path, overrides: list[str] | None = None, *, out: str | Path | None = None
) -> dict[str, Any]:
    """Re-evaluate an exported bundle on the data and split its config names.

    The query embeddings come from the bundle's SavedModel and the ranking from
    its FAISS index, so this checks exactly what would be served. ``overrides``
    (``section.key=value``) change e.g. ``evaluation.ks`` or the test data.
    When ``out`` is given, ``metrics.json``, ``report.md`` and the plots are
    written there (the folder is created).
    """
    bundle = Bundle.load(directory)
    raw = apply_overrides(bundle.manifest["config"], overrides or [])
    config = Config.from_dict(raw, source=f"{directory}/manifest.json config")
    dataset = load_dataset(config.data, config.split)
    eval_set = build_eval_set(dataset.train, dataset.test, list(bundle.index.item_ids), config.evaluation)
    # Raw query features as a client would send them: user features and last training clicks.
    queries = TowerTables.from_dataset(dataset, config.towers).queries(eval_set.user_ids).to_dict("records")
    metrics = evaluate_against_baselines(
        bundle.index,
        bundle.embed(queries) if queries else np.zeros((0, bundle.index.dim), np.float32),
        eval_set,
        dataset.train,
        config.evaluation,
    )
    metrics["data"] = dataset.summary()
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
        write_report(out, metrics, title=f"Re-evaluation of {Path(directory).name}", plots=config.evaluation.plots)
    return metrics


def reindex_bundle(
    directory: str | Path, out: str | Path, index_config: IndexConfig | str, *, overwrite: bool = False
) -> Path:
    """Copy a bundle with its index rebuilt from the doc model under another FAISS factory.

    Every catalogue item in ``item_ids.parquet`` is re-embedded by the bundle's
    own doc SavedModel, so the new index holds exactly what the old one did.
    ``index_config`` is an IndexConfig or just a factory string (other keys at
    their defaults). No query log is at hand here, so an approximate index is
    tuned with item embeddings standing in for queries (the manifest says so).
    """
    if isinstance(index_config, str):
        index_config = IndexConfig(factory=index_config)
    factory = index_config.factory
    source = Path(directory)
    manifest = read_manifest(source)
    old_index = ItemIndex.load(source)
    doc_model = tf.saved_model.load(str(source / manifest["files"]["doc_model"]))
    serve = doc_model.signatures["serving_default"]
    ids = np.asarray(old_index.item_ids, dtype=object)
    inputs = _doc_inputs(manifest, ids)
    embeddings = np.concatenate(
        [
            serve(**{name: tf.constant(values[i : i + 8192]) for name, values in inputs.items()})["embedding"].numpy()
            for i in range(0, len(ids), 8192)
        ]
    )
    index = build_index(list(ids), embeddings, index_config)
    with atomic_directory(out, overwrite=overwrite) as scratch:
        shutil.copytree(source, scratch, dirs_exist_ok=True)
        index.save(scratch)
        manifest["config"]["index"] = index_config.model_dump(mode="json")
        manifest["index"] = index.info()
        manifest["normalized"] = index.normalized
        manifest["reindexed_from"] = str(source)
        (scratch / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
    return Path(out)


def _doc_inputs(manifest: dict[str, Any], ids: np.ndarray) -> dict[str, np.ndarray]:
    """The doc model's raw inputs for ``ids``: the ids alone for an ID tower; otherwise the
    catalogue's features, re-read from the data the run's config names."""
    if manifest["doc_features"] == [ITEM]:
        return {ITEM: ids}
    config = Config.from_dict(manifest["config"], source="manifest.json config")
    dataset = load_dataset(config.data, config.split)
    catalogue = TowerTables.from_dataset(dataset, config.towers).catalogue()
    rows = pd.Index(catalogue[ITEM].astype(str), dtype=object).get_indexer(pd.Index(ids.astype(str), dtype=object))
    if (rows < 0).any():
        raise ValueError(f"{int((rows < 0).sum())} indexed items are no longer in the catalogue the config names")
    return feature_arrays(catalogue.iloc[rows].reset_index(drop=True), manifest["doc_features"])
