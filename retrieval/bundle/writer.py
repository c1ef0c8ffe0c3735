"""Writing a bundle: towers, index and parts, then the manifest, last."""

from __future__ import annotations

import math
import platform
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pandas as pd
import tensorflow as tf
import tensorflow_recommenders as tfrs

import retrieval
from retrieval.bundle.display_features import DISPLAY_FEATURES_FILE, DisplayFeatures
from retrieval.bundle.manifest import BUNDLE_FORMAT_VERSION, write_manifest
from retrieval.bundle.saved_models import (
    describe_inputs,
    model_dir,
    save_topk_model,
    save_tower,
    write_tf_serving_config,
)
from retrieval.bundle.seen_items import SeenItems, UserRowTable
from retrieval.bundle.user_features import USER_FEATURES_FILE, UserFeatures
from retrieval.bundle.user_histories import USER_HISTORIES_DIR, UserHistories
from retrieval.index import INDEX_FILE, INDEX_INFO_FILE, ITEM_IDS_FILE, ItemIndex
from retrieval.training import embed_frame

SEEN_ITEMS_DIR = "seen_items"


PROBE_K = 10  # ids the probe query records (fewer for a smaller catalogue)




def library_versions() -> dict[str, str]:
    return {
        "retrieval": retrieval.__version__,
        "tensorflow": tf.__version__,
        "tensorflow_recommenders": tfrs.__version__,
        "faiss": faiss.__version__,
        "python": platform.python_version(),
    }


def write_bundle(
    directory: str | Path,
    *,
    query_tower: tf.keras.Model,
    doc_tower: tf.keras.Model,
    index: ItemIndex,
    manifest: dict[str, Any],
    item_embeddings: np.ndarray | None = None,
    topk_k: int | None = None,
    probe_query: pd.DataFrame | None = None,
    seen_items: SeenItems | None = None,
    user_features: pd.DataFrame | None = None,
    item_features: pd.DataFrame | None = None,
    user_histories: UserHistories | None = None,
    training_queries: pd.DataFrame | None = None,
) -> dict[str, Any]:
    """Write towers, index and manifest into ``directory``; return the manifest written.

    The SavedModels go where TensorFlow Serving loads them, ``models/<name>/<version>/``
    (``model_dir``), version = the export's Unix time in seconds (the manifest's
    ``model_version``), with ``models/models.config`` listing them (``write_tf_serving_config``).
    The topk model (see ``save_topk_model``) is written when both
    ``item_embeddings`` [num_items, dim] (rows in index order) and ``topk_k`` are given.
    ``probe_query`` is one row of raw query features of a training user (as
    ``TowerTables.queries([user])`` gives it): its top-k through ``query_tower`` and
    ``index`` is recorded as the manifest's ``probe`` (see ``probe_record``), which
    serving reproduces at load. Without it the bundle has no probe (its fingerprints
    and the dimension check still tie its parts together). The manifest is written
    last, with the fingerprints of every file under its ``files`` (``write_manifest``).
    ``seen_items`` (each training user's items as rows of ``index``) goes to ``seen_items/``,
    which ``retrieval.serving`` excludes from what it serves; without it nothing is excluded.
    ``user_features`` (``user_id`` and raw query features, one row per known user, as
    ``TowerTables.user_features`` gives them) goes to ``user_features.parquet``, described by the
    manifest's ``user_features``; serving fills a request's missing features from it. Its feature
    columns must be query inputs.
    ``item_features`` (the raw item feature table, ``item_id`` and any columns) gives
    ``item_features.parquet``: its string, number and list-of-string columns for the indexed items
    it describes (``DisplayFeatures.from_frame``), described by the manifest's ``item_features``;
    serving shows them beside item ids. Nothing is written when no such column is left.
    ``user_histories`` (each training user's recent clicks as rows of ``index``, newest first) goes
    to ``user_histories/``, described by the manifest's ``user_histories``; serving fills the history
    input of a query that lacks it. Only for a query tower with a ``towers.query.history`` input.
    ``training_queries`` (raw query features of training users, as ``TowerTables.queries`` gives
    them) are embedded through ``query_tower``: the range of their norms is the manifest's
    ``query_norms`` (``query_norm_record``), outside which serving refuses a query; without them
    serving refuses only all-zero embeddings that one feature of the query explains.
    """
    directory = Path(directory)
    created = datetime.now(timezone.utc).replace(microsecond=0)
    version = int(created.timestamp())
    files = {"query_model": model_dir("query_model", version), "doc_model": model_dir("doc_model", version)}
    save_tower(query_tower, directory / files["query_model"])
    save_tower(doc_tower, directory / files["doc_model"])
    if item_embeddings is not None and topk_k is not None:
        files["topk_model"] = model_dir("topk_model", version)
        save_topk_model(
            directory / files["topk_model"],
            query_tower=query_tower,
            item_ids=list(index.item_ids),
            item_embeddings=item_embeddings,
            k=topk_k,
            popular_item_ids=manifest.get("popular_item_ids", ()),
        )
    files["tf_serving_config"] = write_tf_serving_config(directory, files)
    index.save(directory)
    files.update(index=INDEX_FILE, item_ids=ITEM_IDS_FILE, index_info=INDEX_INFO_FILE)
    probe = None
    if probe_query is not None:
        if len(probe_query) != 1:
            raise ValueError(f"probe_query must be one row of raw query features, got {len(probe_query)} rows")
        query = raw_query(probe_query, list(query_tower.input_names))
        probe = probe_record(query, embed_frame(query_tower, probe_query), index)
    if seen_items is not None:
        files["seen_items"] = _save_user_rows(seen_items, directory, SEEN_ITEMS_DIR, "seen_items", len(index))
    table = None
    if user_features is not None:
        table = UserFeatures.from_frame(user_features)
        strangers = [name for name in table.features if name not in query_tower.input_names]
        if strangers:
            raise ValueError(f"user_features columns {strangers} are not inputs of the query tower "
                             f"({list(query_tower.input_names)})")
        table.save(directory / USER_FEATURES_FILE)
        files["user_features"] = USER_FEATURES_FILE
    if user_histories is not None:
        files["user_histories"] = _save_user_rows(user_histories, directory, USER_HISTORIES_DIR, "user_histories",
                                                  len(index))
    display = None
    if item_features is not None:
        display = DisplayFeatures.from_frame(item_features, list(index.item_ids))
        if display.features:
            display.save(directory / DISPLAY_FEATURES_FILE)
            files["item_features"] = DISPLAY_FEATURES_FILE
        else:
            display = None
    full = {
        "format_version": BUNDLE_FORMAT_VERSION,
        "created_at": created.isoformat(timespec="seconds"),
        # The SavedModels' TensorFlow Serving version (their folder under models/<name>/).
        "model_version": version,
        "versions": library_versions(),
        "embedding_dim": index.dim,
        "metric": "inner_product",
        # Unit-norm item vectors: inner product is cosine similarity.
        "normalized": index.normalized,
        "num_items": len(index),
        "index": index.info(),
        "query_features": list(query_tower.input_names),
        "doc_features": list(doc_tower.input_names),
        # dtype and shape of each raw input of the serving signatures ("" pads lists, NaN = missing number).
        "query_inputs": describe_inputs(query_tower),
        "doc_inputs": describe_inputs(doc_tower),
        "files": files,
        "probe": probe,
        **({"query_norms": query_norm_record(embed_frame(query_tower, training_queries))}
           if training_queries is not None and len(training_queries) else {}),
        **({"seen_items": seen_items.info()} if seen_items is not None else {}),
        **({"user_features": table.info()} if table is not None else {}),
        **({"user_histories": user_histories.info()} if user_histories is not None else {}),
        **({"item_features": display.info()} if display is not None else {}),
        **manifest,
    }
    return write_manifest(directory, full)


def raw_query(frame: pd.DataFrame, features: Sequence[str]) -> dict[str, Any]:
    """The first row of a frame of raw query features as a client sends it: plain JSON values.

    Numbers become floats or ints (NaN: None, missing), lists of ids lists of strings.
    """
    row = frame.iloc[0]
    return {feature: _plain(row[feature]) for feature in features}


def _plain(value: Any) -> Any:
    if isinstance(value, (tuple, list, np.ndarray)):
        return [_plain(v) for v in value]
    if value is None or value is pd.NA:
        return None
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _save_user_rows(table: UserRowTable, directory: Path, part: str, name: str, num_items: int) -> str:
    """Save a per-user table of index rows (seen items, histories) as the bundle's ``part``, refusing
    rows past the ``num_items`` of the index; return ``part`` for the manifest's files."""
    if len(table.item_rows) and int(table.item_rows.max()) >= num_items:
        raise ValueError(f"{name} holds index rows up to {int(table.item_rows.max())}, "
                         f"past the {num_items} items of the index")
    table.save(directory / part)
    return part


def query_norm_record(embeddings: np.ndarray) -> dict[str, Any]:
    """The manifest's ``query_norms``: ``{"min", "max", "queries"}`` of the L2 norms of [n, dim] query
    embeddings of training users (n >= 1), which serving compares each request's embedding with."""
    norms = np.linalg.norm(np.asarray(embeddings, dtype=np.float64), axis=1)
    if not len(norms) or not np.isfinite(norms).all():
        raise ValueError(f"query norms need finite embeddings of at least one query, got {len(norms)} rows")
    return {"min": float(norms.min()), "max": float(norms.max()), "queries": len(norms)}


def probe_record(query: dict[str, Any], embedding: np.ndarray, index: ItemIndex) -> dict[str, Any]:
    """The manifest's ``probe``: a raw query and its top-k through ``index``.

    Args:
      query: raw query features, plain JSON values (``raw_query``).
      embedding: [1, dim] the query tower's embedding of ``query``.
      index: the index the bundle serves from.

    Returns:
      ``{"query", "k", "item_ids", "scores"}`` with k = min(PROBE_K, catalogue size).
    """
    k = min(PROBE_K, len(index))
    top = index.search(np.asarray(embedding, dtype=np.float32).reshape(1, -1), k)
    rows = top.rows[0][top.rows[0] >= 0]
    return {
        "query": query,
        "k": k,
        "item_ids": [str(item) for item in index.item_ids[rows]],
        "scores": [float(score) for score in top.scores[0][: len(rows)]],
    }
