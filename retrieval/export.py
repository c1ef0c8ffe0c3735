"""Export: the serving bundle, written atomically.

Bundle layout (``artifacts/<run>/``)::

    manifest.json       config, metrics, versions, dimension, metric type, files
    query_model/        SavedModel: serving_default(raw query features) -> {"embedding"}
    doc_model/          SavedModel: serving_default(raw item features) -> {"embedding"}
    topk_model/         SavedModel: serving_default(raw query features) -> {"item_ids", "scores",
                        "fallback"}: query tower + every item embedding, brute-force top-k
                        (optional: export.topk_model)
    index.faiss         FAISS inner-product index over every catalogue item
    item_ids.parquet    index row -> item id
    index.json          index factory, dimension, size, search parameters and measured recall
    config.yaml         the resolved config of the run
    train_log.csv       per-epoch training loss
    metrics.json        offline metrics (model and baselines)

Everything is written under a hidden ``.<run>.partial-<pid>`` directory next
to the final one and renamed into place at the end, so a crash never leaves a
half bundle under the final name; ``.<run>.lock`` holds the name meanwhile.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import tensorflow as tf
import tensorflow_recommenders as tfrs

import retrieval
from retrieval.errors import UserError
from retrieval.index import ItemIndex
from retrieval.towers import id_lookups

MANIFEST_FILE = "manifest.json"
QUERY_MODEL_DIR = "query_model"
DOC_MODEL_DIR = "doc_model"
TOPK_MODEL_DIR = "topk_model"
BUNDLE_FORMAT_VERSION = 1


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
    longer run (killed with SIGKILL, so nothing cleaned up) are deleted.

    Raises:
      RunExistsError: ``final`` exists and ``overwrite`` is false, or it
        exists and is not a bundle, or another process holds the name.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    with _name_lock(final):
        _check_replaceable(final, overwrite)
        for stale in [*final.parent.glob(f".{final.name}.partial-*"), *final.parent.glob(f".{final.name}.old-*")]:
            pid = stale.name.rsplit("-", 1)[1]
            if pid.isdigit() and int(pid) != os.getpid() and not _process_alive(int(pid)):
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

    For teams that serve only SavedModels: the query tower and every item
    embedding live inside it, and ``tfrs.layers.factorized_top_k.BruteForce``
    scores all items (exact, like a Flat FAISS index). Signature
    ``serving_default(<the query tower's raw inputs>)`` (``serving_signature``) returns

    - ``item_ids``: tf.string [batch, k], best first;
    - ``scores``: float32 [batch, k] dot products, NaN on fallback rows;
    - ``fallback``: bool [batch], True where the query embedding is the
      all-zero out-of-vocabulary row: those rows hold the most popular items
      (``popular_item_ids`` first, then catalogue order), as ``Bundle`` serves.

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
    k = min(k, len(ids))
    brute_force = tfrs.layers.factorized_top_k.BruteForce(k=k)
    brute_force.index(tf.constant(item_embeddings), tf.constant(ids, dtype=tf.string))
    known = set(ids.tolist())
    popular = list(dict.fromkeys(str(item) for item in popular_item_ids if str(item) in known))[:k]
    taken = set(popular)
    fallback_ids = popular + [item for item in ids[: k + len(popular)] if item not in taken][: k - len(popular)]

    module = tf.Module()
    module.tower = query_tower
    module.brute_force = brute_force
    module.fallback_ids = tf.Variable(tf.constant(fallback_ids, dtype=tf.string), trainable=False)

    @tf.function(input_signature=[serving_signature(query_tower)])
    def serve(features):
        embeddings = query_tower(features, training=False)
        scores, top_ids = brute_force(embeddings, k=k)
        unknown = tf.logical_not(tf.reduce_any(tf.not_equal(embeddings, 0.0), axis=1))
        rows = tf.shape(top_ids)[0]
        return {
            "item_ids": tf.where(unknown[:, None], tf.tile(module.fallback_ids[None, :], [rows, 1]), top_ids),
            "scores": tf.where(unknown[:, None], tf.fill(tf.shape(scores), float("nan")), scores),
            "fallback": unknown,
        }

    module.serve = serve
    tf.saved_model.save(module, str(directory), signatures={"serving_default": serve})


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
) -> dict[str, Any]:
    """Write towers, index and manifest into ``directory``; return the manifest written.

    ``topk_model/`` (see ``save_topk_model``) is written when both
    ``item_embeddings`` [num_items, dim] (rows in index order) and ``topk_k`` are given.
    """
    directory = Path(directory)
    save_tower(query_tower, directory / QUERY_MODEL_DIR)
    save_tower(doc_tower, directory / DOC_MODEL_DIR)
    index.save(directory)
    files = {
        "query_model": QUERY_MODEL_DIR,
        "doc_model": DOC_MODEL_DIR,
        "index": "index.faiss",
        "item_ids": "item_ids.parquet",
    }
    if item_embeddings is not None and topk_k is not None:
        save_topk_model(
            directory / TOPK_MODEL_DIR,
            query_tower=query_tower,
            item_ids=list(index.item_ids),
            item_embeddings=item_embeddings,
            k=topk_k,
            popular_item_ids=manifest.get("popular_item_ids", ()),
        )
        files["topk_model"] = TOPK_MODEL_DIR
    full = {
        "format_version": BUNDLE_FORMAT_VERSION,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
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
        **manifest,
    }
    (directory / MANIFEST_FILE).write_text(json.dumps(full, indent=2, default=str))
    return full


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a bundle: {MANIFEST_FILE} is missing")
    manifest = json.loads(path.read_text())
    if manifest.get("format_version") != BUNDLE_FORMAT_VERSION:
        raise ValueError(
            f"{path}: bundle format {manifest.get('format_version')!r}, this library reads {BUNDLE_FORMAT_VERSION}"
        )
    return manifest
