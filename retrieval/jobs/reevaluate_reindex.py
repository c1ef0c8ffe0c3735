"""Work on an exported bundle: re-evaluate it on the data its config names (the job's own phases), or
rebuild its index."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import tensorflow as tf

from retrieval.bundle.manifest import Manifest
from retrieval.bundle.run_directory import atomic_directory
from retrieval.bundle.seen_items import SeenItems
from retrieval.bundle.writer import probe_record, rewrite_bundle
from retrieval.config import Config, IndexConfig, apply_overrides, save_config
from retrieval.data import ITEM, DataError
from retrieval.evaluation import write_report
from retrieval.features import feature_arrays
from retrieval.index import build_index, check_index_fits
from retrieval.jobs.train import evaluate, evaluation_clicks, read_and_split
from retrieval.serving import Bundle


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
    # The job's own phases: the same split, evaluated users and baselines, over the bundle's catalogue.
    data = dataclasses.replace(read_and_split(config), catalogue_ids=list(bundle.index.item_ids))
    evaluated = evaluation_clicks(config, data)
    # Raw query features as a client would send them: user features and last training clicks.
    queries = data.tables.queries(evaluated.eval_set.user_ids).to_dict("records")
    embeddings = bundle.embed(queries) if queries else np.zeros((0, bundle.index.dim), np.float32)
    metrics = evaluate(config, bundle.index, embeddings, data, evaluated)
    metrics["data"] = data.summary(len(evaluated.eval_set.user_ids))
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
    The source is loaded and checked as serving would (``Bundle.load``); the
    copy gets fresh fingerprints and its probe query's top-k through the new
    index (a format 1 source, which has no probe, gives a copy without one). The SavedModels
    are copied unchanged, under the same paths and so the same TensorFlow Serving version
    (``model_version``): the models are the source's, and a bundle re-indexed after a newer one
    was trained must not look newer to a model repository that serves the highest version.

    The copy holds the served files only, named by the new directory: its manifest's ``run``
    is ``out``'s name, its ``config`` (and ``config.yaml``) names the new index, and
    ``reindexed_from`` says where it came from and what the source measured (``metrics``,
    ``index``). The source's run outputs (``metrics.json``, ``report.md``, plots, logs,
    re-evaluations), which describe the old index's ranking, are not copied: re-evaluate the
    copy (``evaluate_bundle``) for its own.
    """
    if isinstance(index_config, str):
        index_config = IndexConfig(factory=index_config)
    source = Path(directory)
    bundle = Bundle.load(source)
    manifest, old_index = bundle.manifest_model, bundle.index
    items = len(old_index)
    check_index_fits(index_config.factory_for(items, old_index.dim), items, index_config.train_sample_size)
    doc_model = tf.saved_model.load(str(source / manifest.files["doc_model"]))
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
    probe = manifest.probe
    if probe:
        probe = probe_record(probe["query"], bundle.embed([probe["query"]]), index)
    with atomic_directory(out, overwrite=overwrite) as scratch:
        # The served files but the index (rebuilt) and the manifest (written last: until then the copy
        # is not a complete bundle).
        for name, relative in manifest.files.items():
            if name in _INDEX_FILES:
                continue
            source_path, target = source / relative, scratch / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            if source_path.is_dir():
                shutil.copytree(source_path, target)
            else:
                shutil.copy2(source_path, target)
        seen_folder = manifest.files.get("seen_items")
        if seen_folder is not None and list(index.item_ids) != list(old_index.item_ids):
            # Seen items are index rows: follow the items to their new rows.
            new_rows = pd.Index(index.item_ids, dtype=object).get_indexer(pd.Index(old_index.item_ids, dtype=object))
            shutil.rmtree(scratch / seen_folder)
            SeenItems.load(source / seen_folder).remapped(new_rows).save(scratch / seen_folder)
        histories_folder = manifest.files.get("user_histories")
        if histories_folder is not None and list(index.item_ids) != list(old_index.item_ids):
            # Histories are index rows too, in time order: each click follows its item to the new row.
            new_rows = pd.Index(index.item_ids, dtype=object).get_indexer(pd.Index(old_index.item_ids, dtype=object))
            shutil.rmtree(scratch / histories_folder)
            assert bundle.user_histories is not None  # loaded from the same manifest entry
            bundle.user_histories.remapped(new_rows).save(scratch / histories_folder)
        config = {**(manifest.config or {}), "index": index_config.model_dump(mode="json")}
        config["run"] = {**config.get("run", {}), "name": Path(out).name}
        save_config(Config.from_dict(config, source=f"{source}/manifest.json config"), scratch / "config.yaml")
        rewrite_bundle(scratch, manifest, index=index, probe=probe, changes={
            "reindexed_from": {"path": str(source.resolve()), "run": bundle.version,
                               "index": manifest.index, "metrics": manifest.metrics},
            "metrics": None,
            "run": Path(out).name,
            "config": config,
        })
    return Path(out)


_INDEX_FILES = ("index", "index_info", "item_ids")  # manifest files entries the new index writes


def _doc_inputs(manifest: Manifest, ids: np.ndarray) -> dict[str, np.ndarray]:
    """The doc model's raw inputs for ``ids``: the ids alone for an ID tower; otherwise the
    catalogue's features, re-read from the data the run's config names."""
    if manifest.doc_features == [ITEM]:
        return {ITEM: ids}
    config = Config.from_dict(manifest.config or {}, source="manifest.json config")
    catalogue = read_and_split(config).tables.catalogue()
    rows = pd.Index(catalogue[ITEM].astype(str), dtype=object).get_indexer(pd.Index(ids.astype(str), dtype=object))
    if (rows < 0).any():
        raise DataError(f"{int((rows < 0).sum())} indexed items are no longer in the catalogue the config names")
    return feature_arrays(catalogue.iloc[rows].reset_index(drop=True), manifest.doc_features)
