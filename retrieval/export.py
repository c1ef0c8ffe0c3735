"""Export: the serving bundle, written atomically.

Bundle layout (``artifacts/<run>/``)::

    manifest.json       config, metrics, versions, dimension, metric type, files, fingerprints, probe,
                        model_version
    models/             the SavedModels, laid out as TensorFlow Serving loads them
                        (``tensorflow_model_server --model_base_path=<bundle>/models/query``);
                        <version> is the manifest's model_version, the export's Unix time in seconds
      query/<version>/  serving_default(raw query features) -> {"embedding"}
      doc/<version>/    serving_default(raw item features) -> {"embedding"}
      topk/<version>/   serving_default(raw query features, exclude_item_ids) -> {"item_ids", "scores",
                        "fallback"}: query tower + every item embedding, exact top-k of the items
                        not excluded (optional: export.topk_model)
      models.config     TF Serving's model config listing them, base paths under /models (docker)
    index.faiss         FAISS inner-product index over every catalogue item
    item_ids.parquet    index row -> item id
    index.json          index factory, dimension, size, search parameters and measured recall
    seen_items/         each training user's distinct training items as index rows (CSR ``.npy``
                        files, ``retrieval.seen_items``): what serving excludes by default
    user_features.parquet
                        user_id and each raw user feature the query tower reads, one row per known
                        user (``retrieval.user_features``): serving fills the features a request
                        lacks from its user's row (feature towers only)
    user_histories/     each training user's last ``export.history_clicks`` training clicks as index
                        rows, newest first (CSR ``.npy`` files, ``retrieval.user_histories``): serving
                        fills the history of a query that lacks it (towers reading a click history only)
    item_features.parquet
                        item_id and the item feature table's string, number and list-of-string
                        columns, one row per indexed item it describes (``retrieval.item_features``):
                        for display (``POST /items``, the web page), never read by the towers
    config.yaml         the resolved config of the run (absolute data paths)
    train_log.csv       per-epoch training loss
    metrics.json        offline metrics (model and baselines)

Bundles exported before the versioned layout hold ``query_model/``, ``doc_model/`` and
``topk_model/`` (each a SavedModel) at the top and no model_version: they load as before,
since every reader finds a model through the manifest's ``files`` (``model_path``).

The files the bundle serves from are those under the entries of the
manifest's ``files`` (query_model, doc_model, topk_model, tf_serving_config, index.faiss,
item_ids.parquet, index.json, and whatever else is listed there); every entry is a
path inside the bundle. ``fingerprints`` records each of those files by its
path relative to the bundle: size, the blake2b-256 hash of the whole file
and, for files over ``FULL_HASH_MAX_BYTES`` (64 MiB), the hash of its first
and last ``HEAD_TAIL_BYTES`` (8 MiB) too: a default load checks those ends
(and the size), ``verify="full"`` the whole file (``check_fingerprints``).
``probe`` holds one training user's raw query, as a client would send it,
and the top-k item ids and scores the exported towers and index gave it:
serving reruns it at load and at every health check, which proves that
the query model and the index belong together.
``query_norms`` (``query_norm_record``) holds the smallest and largest norm of the query
embeddings of a sample of training users: serving refuses a query whose embedding lands far
outside that range (a feature value the towers never saw, e.g. an age of 1e20), naming the feature.

Everything is written under a hidden ``.<run>.partial-<pid>`` directory next
to the final one and renamed into place at the end, so a crash never leaves a
half bundle under the final name; ``.<run>.lock`` holds the name meanwhile.
The manifest is written last, so a scratch directory holding one (whose
fingerprints check) is a complete bundle: ``atomic_directory`` puts it back
under the final name when an overwrite was interrupted between its renames.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import platform
import shutil
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pandas as pd
import tensorflow as tf
import tensorflow_recommenders as tfrs

import retrieval
from retrieval.data.fingerprint import blake2b_hex
from retrieval.errors import UserError
from retrieval.index import INDEX_FILE, INDEX_INFO_FILE, ITEM_IDS_FILE, ItemIndex
from retrieval.item_features import ITEM_FEATURES_FILE, ItemFeatures
from retrieval.seen_items import SeenItems, UserRowTable
from retrieval.towers import id_lookups
from retrieval.training import embed_frame
from retrieval.user_features import USER_FEATURES_FILE, UserFeatures
from retrieval.user_histories import USER_HISTORIES_DIR, UserHistories

MANIFEST_FILE = "manifest.json"
MODELS_DIR = "models"
# Manifest ``files`` key of each SavedModel -> its TensorFlow Serving model name (its folder under models/).
SERVED_MODELS = {"query_model": "query", "doc_model": "doc", "topk_model": "topk"}
TF_SERVING_CONFIG = f"{MODELS_DIR}/models.config"
# Where TF Serving's docker image looks for models: models.config's base paths assume models/ is mounted here.
TF_SERVING_MOUNT = "/models"
# The topk model's input of item ids never to return: tf.string [batch, E], "" padded.
TOPK_EXCLUDE_INPUT = "exclude_item_ids"
SEEN_ITEMS_DIR = "seen_items"
# 2: the manifest holds fingerprints of the served files and a probe query.
BUNDLE_FORMAT_VERSION = 2
# Format 1 bundles still load (serving warns that their parts cannot be checked against the export).
READABLE_FORMAT_VERSIONS = (1, 2)
# Files up to this size are hashed whole at every load; larger ones by their size and both ends.
FULL_HASH_MAX_BYTES = 64 * 2**20
HEAD_TAIL_BYTES = 8 * 2**20
PROBE_K = 10  # ids the probe query records (fewer for a smaller catalogue)

log = logging.getLogger("retrieval.export")


class RunExistsError(UserError, FileExistsError):
    """The run directory exists and overwriting was not asked for."""


@contextmanager
def atomic_directory(final: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a scratch directory that becomes ``final`` only if the block succeeds.

    The name is locked (``flock`` on ``.<name>.lock`` beside it) for the whole
    block, so two jobs writing the same run cannot both finish: the second one
    fails at once instead of silently replacing the first one's result.
    ``overwrite`` replaces only an existing bundle (a directory holding
    ``manifest.json``); anything else at ``final`` is never deleted.

    On an exception the scratch directory is deleted (a failed run cannot be
    resumed from it: resuming uses the checkpoints) and ``final`` is
    untouched. Scratch directories of ``final`` left by processes that no
    longer run (killed with SIGKILL, so nothing cleaned up) are deleted, but
    first, when ``final`` is absent and some of them hold a complete bundle
    (an overwrite killed between moving the old bundle aside and moving the
    new one in), the newest of those (by its manifest's ``created_at``) is
    put back under ``final`` (``_recover_interrupted_swap``).

    Raises:
      RunExistsError: ``final`` exists and ``overwrite`` is false, or it
        exists and is not a bundle, or another process holds the name.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    with _name_lock(final):
        _recover_interrupted_swap(final)
        _check_replaceable(final, overwrite)
        for stale in _dead_scratch(final):
            shutil.rmtree(stale, ignore_errors=True)
        scratch = final.parent / f".{final.name}.partial-{os.getpid()}"
        if scratch.exists():
            shutil.rmtree(scratch)
        scratch.mkdir()
        try:
            yield scratch
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        # Again before deleting anything: the lock binds jobs, not a person or tool that created it meanwhile.
        _check_replaceable(final, overwrite)
        if final.exists():
            # Swap: move the old one aside first so a crash here still leaves one
            # complete bundle under some name.
            old = final.parent / f".{final.name}.old-{os.getpid()}"
            final.rename(old)
            scratch.rename(final)
            shutil.rmtree(old)
        else:
            scratch.rename(final)


def _dead_scratch(final: Path) -> list[Path]:
    """``.<name>.partial-<pid>`` and ``.<name>.old-<pid>`` beside ``final`` whose process no longer runs."""
    dead = []
    for stale in [*final.parent.glob(f".{final.name}.partial-*"), *final.parent.glob(f".{final.name}.old-*")]:
        pid = stale.name.rsplit("-", 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and not _process_alive(int(pid)):
            dead.append(stale)
    return dead


def _recover_interrupted_swap(final: Path) -> None:
    """Put the newest complete bundle left by dead processes back under ``final`` when ``final`` is absent.

    The overwrite swap renames ``final -> .<name>.old-<pid>`` and then ``scratch -> final``: a
    process killed between the two leaves no ``final`` and two complete bundles beside it.
    """
    if final.exists() or final.is_symlink():
        return
    complete = []
    for stale in _dead_scratch(final):
        manifest = _complete_bundle_manifest(stale)
        if manifest is not None:
            created = str(manifest.get("created_at", ""))
            complete.append((created, (stale / MANIFEST_FILE).stat().st_mtime, stale.name, stale))
    if complete:
        chosen = max(complete)[-1]
        chosen.rename(final)
        log.warning(
            "%s was missing and %s held a complete bundle (an overwrite was interrupted between its two renames): "
            "moved it back to %s", final, chosen.name, final.name,
        )


def _complete_bundle_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of ``directory`` if it is a complete bundle, else None.

    The manifest is written last, so one that parses says the rest was written; with
    fingerprints (format 2) the files are checked against them too (quick mode).
    """
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
        if not isinstance(manifest, dict):
            return None
        if "fingerprints" in manifest:
            check_fingerprints(directory, manifest)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return manifest


def _check_replaceable(final: Path, overwrite: bool) -> None:
    if not (final.exists() or final.is_symlink()):
        return
    if not overwrite:
        raise RunExistsError(f"{final} already exists; choose another run.name or set run.overwrite=true")
    if final.is_symlink() or not (final / MANIFEST_FILE).is_file():
        raise RunExistsError(
            f"{final} exists and is not a run bundle (no {MANIFEST_FILE}); run.overwrite replaces only a "
            "bundle, so nothing was deleted: choose another run.name or move it away"
        )


@contextmanager
def _name_lock(final: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``.<name>.lock`` beside ``final``; the file is removed on release.

    The lock file is unlinked while still locked, so a process that opened it
    meanwhile finds, once it holds the lock, that the path names another file
    (or none) and retries on a fresh one: only one process ever holds the name.
    """
    path = final.parent / f".{final.name}.lock"
    while True:
        handle = open(path, "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise RunExistsError(
                f"another process is writing run {final.name!r} in {final.parent} ({path} is locked); "
                "wait for it or choose another run.name"
            ) from None
        try:
            same_file = os.path.samestat(os.fstat(handle.fileno()), os.stat(path))
        except FileNotFoundError:
            same_file = False
        if same_file:
            break
        handle.close()  # the holder released and removed it between our open and flock: retry
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        handle.close()


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only checks that the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True


def serving_signature(tower: tf.keras.Model) -> dict[str, tf.TensorSpec]:
    """The raw inputs a tower declares, as signature specs: name -> dtype and shape.

    E.g. ``user_id``: tf.string [batch]; ``age``: float32 [batch]; ``history``:
    tf.string [batch, 20] ("" padded). See ``retrieval.features.tables``.
    """
    return {
        name: tf.TensorSpec(tensor.shape, tensor.dtype, name=name)
        for name, tensor in zip(tower.input_names, tower.inputs)
    }


def describe_inputs(tower: tf.keras.Model) -> dict[str, dict[str, Any]]:
    """The manifest's view of ``serving_signature``: name -> {"dtype", "shape"} (None = any size)."""
    return {
        name: {"dtype": spec.dtype.name, "shape": spec.shape.as_list()}
        for name, spec in serving_signature(tower).items()
    }


def save_tower(tower: tf.keras.Model, directory: str | Path) -> None:
    """Save a tower as a SavedModel with a ``serving_default`` signature.

    The signature takes the tower's raw inputs by name (``serving_signature``:
    e.g. ``user_id``: tf.string [batch], raw ids as logged) and returns
    ``{"embedding": float32 [batch, dim]}``; load it with plain ``tf.saved_model.load``.
    A tower that reads id features (``retrieval.towers.id_lookups``) also returns
    ``"known_ids"``: bool [batch], True where every such id was in the training
    vocabulary (serving reports the others as embedded from their features alone).
    """
    module = tf.Module()
    module.tower = tower
    lookups = id_lookups(tower)

    @tf.function(input_signature=[serving_signature(tower)])
    def serve(features):
        outputs = {"embedding": tower(features, training=False)}
        if lookups:
            known = [lookup(features[name]) > 0 for name, lookup in lookups.items()]
            outputs["known_ids"] = tf.reduce_all(tf.stack(known, axis=1), axis=1)
        return outputs

    module.serve = serve
    tf.saved_model.save(module, str(directory), signatures={"serving_default": serve})


def save_topk_model(
    directory: str | Path,
    *,
    query_tower: tf.keras.Model,
    item_ids: Sequence[str],
    item_embeddings: np.ndarray,
    k: int,
    popular_item_ids: Sequence[str] = (),
) -> None:
    """Save a SavedModel that returns top-k item ids for raw query features by itself.

    For teams that serve only SavedModels (TensorFlow Serving): the query tower and every item
    embedding live inside it, and it scores all items (exact, like a Flat FAISS index). Signature
    ``serving_default(<the query tower's raw inputs>, exclude_item_ids)`` (``serving_signature``):
    ``exclude_item_ids`` is tf.string [batch, E], "" padded, the ids never to return for each
    query (ids not in the catalogue are ignored); a signature's inputs are fixed, so a caller
    with nothing to exclude sends ``[[""]]`` per query or a [batch, 0] tensor. It returns

    - ``item_ids``: tf.string [batch, k], best first; "" past the end where fewer than k
      items are left once the exclusions are taken out;
    - ``scores``: float32 [batch, k] dot products, NaN on fallback rows and past the end;
    - ``fallback``: bool [batch], True where the query embedding is the
      all-zero out-of-vocabulary row: those rows hold the most popular items
      (``popular_item_ids`` first, then catalogue order), the excluded ones left out.

    Excluded items are masked out of the scores before the top-k (no k + E over-fetch), so
    the answer is the exact top-k of the items left: ``Bundle.recommend(query, k,
    exclude_item_ids, exclude_seen=False)`` on a Flat index (on a fallback row too, except that
    ``Bundle`` stops where ``popular_item_ids`` run out and this goes on in catalogue order).
    Seen items are not inside it: a client sends them among the exclusions.

    Args:
      directory: where to write the SavedModel.
      query_tower: Keras model ``{raw query features} -> [batch, dim]``.
      item_ids: [num_items] item ids, aligned with ``item_embeddings``.
      item_embeddings: [num_items, dim] float32.
      k: ids per query (capped at num_items).
      popular_item_ids: most popular first, for unknown queries.
    """
    item_embeddings = np.asarray(item_embeddings, dtype=np.float32)
    ids = np.asarray([str(item) for item in item_ids], dtype=object)
    if item_embeddings.ndim != 2 or item_embeddings.shape[0] != len(ids):
        raise ValueError(f"item_embeddings must be [{len(ids)}, dim], got {item_embeddings.shape}")
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    signature = serving_signature(query_tower)
    if TOPK_EXCLUDE_INPUT in signature:
        raise ValueError(f"the query tower has an input named {TOPK_EXCLUDE_INPUT!r}, which the topk model's "
                         "exclusion list needs: rename that feature")
    k = min(k, len(ids))
    # The fallback order as a score per item: the popular ones first, then catalogue order.
    row_of = {item: row for row, item in enumerate(ids.tolist())}
    popular = [row_of[item] for item in dict.fromkeys(str(item) for item in popular_item_ids) if item in row_of]
    order = popular + sorted(set(range(len(ids))) - set(popular))
    priority = np.empty(len(ids), dtype=np.float32)
    priority[np.asarray(order, dtype=np.int64)] = -np.arange(len(ids), dtype=np.float32)

    module = tf.Module()
    module.tower = query_tower
    module.item_embeddings = tf.Variable(item_embeddings, trainable=False, name="item_embeddings")
    module.item_ids = tf.Variable(tf.constant(ids.tolist(), dtype=tf.string), trainable=False, name="item_ids")
    module.fallback_priority = tf.Variable(priority, trainable=False, name="fallback_priority")
    module.rows = tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(tf.constant(ids.tolist(), dtype=tf.string),
                                            tf.range(len(ids), dtype=tf.int64)),
        default_value=-1,
    )
    specs = {**signature, TOPK_EXCLUDE_INPUT: tf.TensorSpec([None, None], tf.string, name=TOPK_EXCLUDE_INPUT)}

    @tf.function(input_signature=[specs])
    def serve(inputs):
        features = dict(inputs)
        exclude = features.pop(TOPK_EXCLUDE_INPUT)
        embeddings = query_tower(features, training=False)
        unknown = tf.logical_not(tf.reduce_any(tf.not_equal(embeddings, 0.0), axis=1))
        scores = tf.matmul(embeddings, module.item_embeddings, transpose_b=True)  # [batch, num_items]
        scores = tf.where(unknown[:, None], module.fallback_priority[None, :], scores)
        # Excluded items: [batch, E] ids -> (query, row) pairs, their scores set to -inf.
        rows = module.rows.lookup(exclude)
        shape = tf.shape(rows, out_type=tf.int64)
        queries = tf.broadcast_to(tf.range(shape[0])[:, None], shape)
        listed = rows >= 0
        pairs = tf.stack([tf.boolean_mask(queries, listed), tf.boolean_mask(rows, listed)], axis=1)
        excluded = tf.scatter_nd(pairs, tf.ones(tf.shape(pairs)[:1], tf.int32), tf.shape(scores, out_type=tf.int64)) > 0
        scores = tf.where(excluded, float("-inf"), scores)
        top_scores, top_rows = tf.math.top_k(scores, k=k)
        past_end = tf.gather(excluded, top_rows, batch_dims=1)  # fewer than k items left
        blank = tf.logical_or(past_end, unknown[:, None])
        return {
            "item_ids": tf.where(past_end, "", tf.gather(module.item_ids, top_rows)),
            "scores": tf.where(blank, float("nan"), top_scores),
            "fallback": unknown,
        }

    module.serve = serve
    tf.saved_model.save(module, str(directory), signatures={"serving_default": serve})


def model_dir(key: str, version: int) -> str:
    """Where a bundle keeps the SavedModel of manifest ``files`` key ``key``, relative to it.

    ``models/<name>/<version>``, the layout ``tensorflow_model_server
    --model_base_path=<bundle>/models/<name>`` loads: ``name`` from ``SERVED_MODELS``
    ("query", "doc", "topk"), ``version`` a positive integer (the export's Unix time in seconds).
    Bundles exported before this layout keep their models at ``query_model/`` etc.: always
    find a bundle's models through its manifest (``model_path``), never by this name alone.
    """
    if key not in SERVED_MODELS:
        raise ValueError(f"{key!r} is not a bundle model; the models are {sorted(SERVED_MODELS)}")
    if isinstance(version, bool) or not isinstance(version, int) or version <= 0:
        raise ValueError(f"a model version must be a positive integer, got {version!r}")
    return f"{MODELS_DIR}/{SERVED_MODELS[key]}/{version}"


def model_path(directory: str | Path, key: str, manifest: Mapping[str, Any] | None = None) -> Path:
    """The SavedModel directory of ``key`` ("query_model", "doc_model", "topk_model") in a bundle.

    Read from the manifest's ``files`` (``manifest``, else the bundle's manifest.json), so it
    finds both layouts: ``models/<name>/<version>`` and the older ``query_model/``.

    Raises:
      ValueError: the bundle has no such model (a topk model is written only with export.topk_model).
    """
    manifest = read_manifest(directory) if manifest is None else manifest
    relative = manifest["files"].get(key)
    if relative is None:
        raise ValueError(f"{directory}: the bundle has no {key} "
                         f"(manifest.json files lists {sorted(manifest['files'])})")
    return Path(directory) / str(relative)


def write_tf_serving_config(directory: str | Path, files: Mapping[str, str]) -> str:
    """Write ``models/models.config``, TensorFlow Serving's model config for the bundle's models.

    A ``model_config_list`` text proto with one entry per SavedModel of ``files`` (those under
    ``models/``), named as in ``SERVED_MODELS``. TF Serving wants absolute base paths, and a
    bundle moves, so they name ``TF_SERVING_MOUNT`` (/models), where the tensorflow/serving
    docker image mounts the bundle's models/ folder. Returns its path relative to the bundle.
    """
    entries = []
    for key, name in SERVED_MODELS.items():
        relative = files.get(key)
        if relative is None or not relative.startswith(f"{MODELS_DIR}/"):
            continue
        base = Path(relative).parent.relative_to(MODELS_DIR).as_posix()
        entries.append(
            f'  config {{\n    name: "{name}"\n    base_path: "{TF_SERVING_MOUNT}/{base}"\n'
            '    model_platform: "tensorflow"\n  }\n'
        )
    text = (
        "# TensorFlow Serving model config of this bundle's SavedModels. The base paths assume the bundle's\n"
        f"# models/ folder is mounted at {TF_SERVING_MOUNT}, e.g.\n"
        f"#   docker run -p 8501:8501 -v \"$PWD/models:{TF_SERVING_MOUNT}\" tensorflow/serving "
        f"--model_config_file={TF_SERVING_MOUNT}/models.config\n"
        "model_config_list {\n" + "".join(entries) + "}\n"
    )
    path = Path(directory) / TF_SERVING_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return TF_SERVING_CONFIG


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
    it describes (``ItemFeatures.from_frame``), described by the manifest's ``item_features``;
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
        display = ItemFeatures.from_frame(item_features, list(index.item_ids))
        if display.features:
            display.save(directory / ITEM_FEATURES_FILE)
            files["item_features"] = ITEM_FEATURES_FILE
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


def write_manifest(directory: str | Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Write ``manifest`` (with ``fingerprints`` of the files under its ``files``) to manifest.json; return it.

    Call it after every served file is in place: the fingerprints are taken now.
    """
    directory = Path(directory)
    manifest = {**manifest, "fingerprints": fingerprint_files(directory, manifest["files"])}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, default=str))
    return manifest


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a bundle: {MANIFEST_FILE} is missing")
    manifest = json.loads(path.read_text())
    if not isinstance(manifest, dict) or manifest.get("format_version") not in READABLE_FORMAT_VERSIONS:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise ValueError(
            f"{path}: bundle format {version!r}, this library reads {list(READABLE_FORMAT_VERSIONS)}"
        )
    return manifest


# --- What ties a bundle's parts together: fingerprints of its files, a probe query. ---


def served_files(directory: str | Path, files: Mapping[str, Any]) -> dict[str, Path]:
    """Every file under the entries of a manifest's ``files``, by path relative to the bundle (sorted).

    A directory entry is walked recursively (symlinks followed, each one
    checked). Nothing outside the bundle is ever named or opened.

    Raises:
      ValueError naming the entry or file: an entry that is not a relative path,
        a path (``..``, absolute, or a symlink) that resolves outside the bundle,
        a missing entry, or something that is neither a file nor a directory.
    """
    directory = Path(directory)
    root = directory.resolve()
    found: dict[str, Path] = {}
    for key, entry in files.items():
        if not isinstance(entry, str) or not entry:
            raise ValueError(f"manifest.json files.{key} {_bounded(entry)} is not a path")
        if Path(entry).is_absolute():
            raise ValueError(f"manifest.json files.{key} {_bounded(entry)} points outside the bundle: "
                             "every served path must be relative to it")
        name = Path(os.path.normpath(entry)).as_posix()
        path = directory / name
        _check_inside(root, path, f"manifest.json files.{key} {_bounded(entry)}")
        if not path.exists():
            raise ValueError(f"{name}: listed in manifest.json files.{key} but missing")
        _collect(root, path, name, found, visited=set())
    return dict(sorted(found.items()))


def _collect(root: Path, path: Path, name: str, found: dict[str, Path], visited: set[Path]) -> None:
    if path.is_symlink():
        _check_inside(root, path, f"{name} (a symlink)")
    if path.is_file():
        found[name] = path
    elif path.is_dir():
        real = path.resolve()
        if real in visited:
            raise ValueError(f"{name}: a symlink loops back to a directory above it")
        for child in sorted(path.iterdir()):
            _collect(root, child, f"{name}/{child.name}", found, visited | {real})
    else:
        raise ValueError(f"{name}: neither a file nor a directory")


def _check_inside(root: Path, path: Path, what: str) -> None:
    if not path.resolve().is_relative_to(root):
        raise ValueError(f"{what} points outside the bundle: every served path must stay inside it")


def _bounded(value: Any, quote: bool = True) -> str:
    """``value`` for a message, at most 80 characters (a manifest may hold anything)."""
    text = repr(value) if quote or not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


def _digest(path: Path, *, head_tail: int | None = None) -> str:
    """blake2b-256 of the whole file, or of its first and last ``head_tail`` bytes."""
    with open(path, "rb") as handle:
        if head_tail is None:
            return blake2b_hex(handle, digest_size=32)
        digest = hashlib.blake2b(digest_size=32)
        digest.update(handle.read(head_tail))
        handle.seek(max(os.fstat(handle.fileno()).st_size - head_tail, 0))
        digest.update(handle.read(head_tail))
    return digest.hexdigest()


def fingerprint_files(directory: str | Path, files: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's ``fingerprints``: each served file's size and blake2b-256 (``served_files``).

    ``{"algorithm", "head_tail_bytes", "files": {relative path: {"size", "blake2b",
    "quick_check", ["head_tail_blake2b"]}}}``. ``quick_check`` says what a default
    load compares: ``"whole"`` (the full hash) for files up to ``FULL_HASH_MAX_BYTES``,
    ``"head+tail"`` (size and the hash of the first and last ``HEAD_TAIL_BYTES``) above.
    """
    records = {}
    for name, path in served_files(directory, files).items():
        size = path.stat().st_size
        record: dict[str, Any] = {"size": size, "blake2b": _digest(path), "quick_check": "whole"}
        if size > FULL_HASH_MAX_BYTES:
            record.update(quick_check="head+tail", head_tail_blake2b=_digest(path, head_tail=HEAD_TAIL_BYTES))
        records[name] = record
    return {"algorithm": "blake2b-256", "head_tail_bytes": HEAD_TAIL_BYTES, "files": records}


def check_fingerprints(directory: str | Path, manifest: Mapping[str, Any], *, full: bool = False) -> None:
    """Check the files under the manifest's ``files`` against its ``fingerprints``.

    ``full`` hashes every file whole; otherwise files recorded with
    ``quick_check: "head+tail"`` are checked by size and both ends.

    Raises:
      ValueError naming the file: content that differs, a file missing or one
        the fingerprints do not list, or a path outside the bundle (``served_files``).
    """
    record = manifest.get("fingerprints")
    if not isinstance(record, Mapping) or not isinstance(record.get("files"), Mapping):
        raise ValueError("manifest.json has no fingerprints of its files: re-export the bundle")
    expected: Mapping[str, Any] = record["files"]
    found = served_files(directory, manifest["files"])
    for name in expected:
        if name not in found:
            raise ValueError(
                f"{_bounded(name, quote=False)}: in the manifest's fingerprints but missing from the bundle"
            )
    for name, path in found.items():
        if name not in expected:
            raise ValueError(f"{name}: in the bundle's served files but not in the manifest's fingerprints")
        want = expected[name]
        size = path.stat().st_size
        if size != want["size"]:
            same = False
        elif full or want.get("quick_check") != "head+tail":
            same = _digest(path) == want["blake2b"]
        else:
            same = _digest(path, head_tail=int(record["head_tail_bytes"])) == want["head_tail_blake2b"]
        if not same:
            raise ValueError(f"{name}: content differs from the manifest's fingerprint")


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
