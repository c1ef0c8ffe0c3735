"""Writing a bundle: towers, index and parts, then the manifest, last."""

from __future__ import annotations

import math
import platform
import subprocess
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pandas as pd
import tensorflow as tf
import tensorflow_recommenders as tfrs

import retrieval
from retrieval.bundle.manifest import BUNDLE_FORMAT_VERSION, Manifest, write_manifest
from retrieval.bundle.parts import (
    BundlePart,
    DisplayFeaturesPart,
    IndexPart,
    SavedModelsPart,
    SeenItemsPart,
    UserFeaturesPart,
    UserHistoriesPart,
)
from retrieval.bundle.seen_items import SeenItems
from retrieval.bundle.user_histories import UserHistories
from retrieval.index import ItemIndex
from retrieval.training import embed_frame

PROBE_K = 10  # ids the probe query records (fewer for a smaller catalogue)
# The manifest keys a caller of the writer may set: what the parts cannot know.
CALLER_KEYS = frozenset({"run", "config", "metrics", "derived", "popular_item_ids", "reindexed_from",
                         "user_input", "query_history", "parent", "disabled_item_ids"})
# Every other key of the manifest: the writer derives it from the parts and the time of writing.
WRITER_KEYS = frozenset(Manifest.model_fields) - CALLER_KEYS


def library_versions() -> dict[str, str]:
    return {
        "retrieval": retrieval.__version__,
        "tensorflow": tf.__version__,
        "tensorflow_recommenders": tfrs.__version__,
        "faiss": faiss.__version__,
        "python": platform.python_version(),
    }


def source_commit() -> str | None:
    """The commit of the git checkout this library runs from, ``<sha>-dirty`` with uncommitted changes;
    None for an installed package (the package is not the top of a checkout) or without git."""
    package = Path(retrieval.__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(package), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != package.parent:
        return None
    return git("describe", "--always", "--dirty", "--abbrev=40", "--exclude=*")


def write_bundle(
    directory: str | Path,
    *,
    query_tower: tf.keras.Model,
    doc_tower: tf.keras.Model,
    index: ItemIndex,
    manifest: Mapping[str, Any],
    item_embeddings: np.ndarray | None = None,
    topk_k: int | None = None,
    probe_query: pd.DataFrame | None = None,
    seen_items: SeenItems | None = None,
    user_features: pd.DataFrame | None = None,
    item_features: pd.DataFrame | None = None,
    user_histories: UserHistories | None = None,
    training_queries: pd.DataFrame | None = None,
) -> Manifest:
    """Write towers, index, parts and manifest into ``directory``; return the manifest written.

    The one writer of a new bundle: each part (``retrieval.bundle.parts``) writes its files and
    records, then the manifest is validated (``Manifest``) and written last. ``manifest`` holds the
    caller's keys (``CALLER_KEYS``: run, config, metrics, ...); a key the writer derives from the
    parts (``files``, ``format_version``, ``index``, ...) is refused, naming it, so a caller
    cannot replace what the files say.

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
    clash = sorted(WRITER_KEYS.intersection(manifest))
    if clash:
        raise ValueError(f"manifest keys {clash} are written by the bundle writer from the parts it is given; "
                         f"a caller sets only {sorted(CALLER_KEYS)}")
    directory = Path(directory)
    created = datetime.now(timezone.utc).replace(microsecond=0)
    version = int(created.timestamp())
    popular = manifest.get("popular_item_ids", ())
    topk = (list(index.item_ids), item_embeddings, topk_k, popular) \
        if item_embeddings is not None and topk_k is not None else None
    parts: list[BundlePart] = [SavedModelsPart(query_tower, doc_tower, version, topk), IndexPart(index)]
    if seen_items is not None:
        parts.append(SeenItemsPart(seen_items, len(index)))
    if user_features is not None:
        parts.append(UserFeaturesPart.from_frame(user_features, list(query_tower.input_names)))
    if user_histories is not None:
        parts.append(UserHistoriesPart(user_histories, len(index)))
    display = None if item_features is None else DisplayFeaturesPart.from_frame(item_features, list(index.item_ids))
    if display is not None:
        parts.append(display)
    probe = None
    if probe_query is not None:
        if len(probe_query) != 1:
            raise ValueError(f"probe_query must be one row of raw query features, got {len(probe_query)} rows")
        query = raw_query(probe_query, list(query_tower.input_names))
        probe = probe_record(query, embed_frame(query_tower, probe_query), index)
    files: dict[str, str] = {}
    records: dict[str, Any] = {}
    for part in parts:
        files.update(part.write(directory))
        records.update(part.info())
    if training_queries is not None and len(training_queries):
        records["query_norms"] = query_norm_record(embed_frame(query_tower, training_queries))
    written = {
        "format_version": BUNDLE_FORMAT_VERSION,
        "created_at": created.isoformat(timespec="seconds"),
        "versions": library_versions(),
        "source_commit": source_commit(),
        **records,
        "files": files,
        "probe": probe,
        **manifest,
    }
    return write_manifest(directory, Manifest.from_dict(written, source="the manifest to write"))


def rewrite_bundle(
    directory: str | Path, source: Manifest, *, index: ItemIndex, probe: dict[str, Any] | None,
    changes: Mapping[str, Any], parts: Sequence[BundlePart] = (), dropped_files: Sequence[str] = (),
) -> Manifest:
    """Write the manifest of a bundle copied into ``directory`` with its index rebuilt; return it.

    The caller has put every served file but the index (and ``parts``) in place; this writes
    ``index`` (its files, ``IndexPart``) and each of ``parts`` (their files and records replace the
    source's) and then the manifest: ``source``'s, less the ``files`` entries ``dropped_files`` (the
    caller has left those files out), with the new parts' records, the given ``probe`` (recorded
    through ``index``: ``probe_record``), a new ``created_at``, the current format version, fresh
    fingerprints and the caller's ``changes`` (only keys of ``CALLER_KEYS``). Re-indexing,
    catalogue edits and the serving benchmarks call it.
    """
    clash = sorted(WRITER_KEYS.intersection(changes))
    if clash:
        raise ValueError(f"manifest keys {clash} are written by the bundle writer from the parts it is given; "
                         f"a caller sets only {sorted(CALLER_KEYS)}")
    directory = Path(directory)
    written_parts: list[BundlePart] = [IndexPart(index), *parts]
    files = {key: path for key, path in source.files.items() if key not in dropped_files}
    records: dict[str, Any] = {}
    for part in written_parts:
        files.update(part.write(directory))
        records.update(part.info())
    written = {
        **source.to_dict(),
        **records,
        "format_version": BUNDLE_FORMAT_VERSION,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "source_commit": source_commit(),
        "files": files,
        "probe": probe,
        **changes,
    }
    return write_manifest(directory, Manifest.from_dict(written, source="the manifest to write"))


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
