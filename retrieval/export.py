"""Export: the serving bundle, written atomically.

Bundle layout (``artifacts/<run>/``)::

    manifest.json       config, metrics, versions, dimension, metric type, files
    query_model/        SavedModel: serving_default(raw query features) -> {"embedding"}
    doc_model/          SavedModel: serving_default(raw item features) -> {"embedding"}
    index.faiss         FAISS inner-product index over every catalogue item
    item_ids.parquet    index row -> item id
    index.json          index factory, dimension, size
    config.yaml         the resolved config of the run
    train_log.csv       per-epoch training loss
    metrics.json        offline metrics (model and baselines)

Everything is written under a hidden ``.<run>.partial-<pid>`` directory next
to the final one and renamed into place at the end, so a crash never leaves a
half bundle under the final name.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import faiss
import tensorflow as tf
import tensorflow_recommenders as tfrs

import retrieval
from retrieval.index import ItemIndex

MANIFEST_FILE = "manifest.json"
QUERY_MODEL_DIR = "query_model"
DOC_MODEL_DIR = "doc_model"
BUNDLE_FORMAT_VERSION = 1


class RunExistsError(FileExistsError):
    """The run directory exists and overwriting was not asked for."""


@contextmanager
def atomic_directory(final: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a scratch directory that becomes ``final`` only if the block succeeds.

    On an exception the scratch directory is left in place (renamed
    ``.<name>.failed-<pid>``) for inspection, and ``final`` is untouched.
    """
    final = Path(final)
    if final.exists() and not overwrite:
        raise RunExistsError(f"{final} already exists; choose another run.name or set run.overwrite=true")
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = final.parent / f".{final.name}.partial-{os.getpid()}"
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir()
    try:
        yield scratch
    except BaseException:
        failed = final.parent / f".{final.name}.failed-{os.getpid()}"
        shutil.rmtree(failed, ignore_errors=True)
        scratch.rename(failed)
        raise
    if final.exists():
        # Swap: move the old one aside first so a crash here still leaves one
        # complete bundle under some name.
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        final.rename(old)
        scratch.rename(final)
        shutil.rmtree(old)
    else:
        scratch.rename(final)


def save_tower(tower: tf.keras.Model, feature: str, directory: str | Path) -> None:
    """Save a tower as a SavedModel with a ``serving_default`` signature.

    The signature takes ``feature``: tf.string [batch] (raw ids, as logged) and
    returns ``{"embedding": float32 [batch, dim]}``; load it with plain
    ``tf.saved_model.load``.
    """
    module = tf.Module()
    module.tower = tower

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name=feature)])
    def serve(values):
        return {"embedding": tower({feature: values}, training=False)}

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
    query_feature: str,
    doc_tower: tf.keras.Model,
    doc_feature: str,
    index: ItemIndex,
    manifest: dict[str, Any],
) -> dict[str, Any]:
    """Write towers, index and manifest into ``directory``; return the manifest written."""
    directory = Path(directory)
    save_tower(query_tower, query_feature, directory / QUERY_MODEL_DIR)
    save_tower(doc_tower, doc_feature, directory / DOC_MODEL_DIR)
    index.save(directory)
    full = {
        "format_version": BUNDLE_FORMAT_VERSION,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": library_versions(),
        "embedding_dim": index.dim,
        "metric": "inner_product",
        "num_items": len(index),
        "query_features": [query_feature],
        "doc_features": [doc_feature],
        "files": {
            "query_model": QUERY_MODEL_DIR,
            "doc_model": DOC_MODEL_DIR,
            "index": "index.faiss",
            "item_ids": "item_ids.parquet",
        },
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
