"""The bundle's SavedModels, laid out as TensorFlow Serving loads them.

``models/<name>/<version>/`` (``tensorflow_model_server --model_base_path=<bundle>/models/query``),
<version> the manifest's model_version, the export's Unix time in seconds::

    query/<version>/  serving_default(raw query features) -> {"embedding"}
    doc/<version>/    serving_default(raw item features) -> {"embedding"}
    topk/<version>/   serving_default(raw query features, exclude_item_ids) -> {"item_ids", "scores",
                      "fallback"}: query tower + every item embedding, exact top-k of the items
                      not excluded (optional: export.topk_model)
    models.config     TF Serving's model config listing them, base paths under /models (docker)

Bundles exported before the versioned layout hold ``query_model/``, ``doc_model/`` and
``topk_model/`` (each a SavedModel) at the top and no model_version: they load as before,
since every reader finds a model through the manifest's ``files`` (``model_path``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from retrieval.bundle.manifest import Manifest, read_manifest
from retrieval.towers import id_lookups

MODELS_DIR = "models"


# Manifest ``files`` key of each SavedModel -> its TensorFlow Serving model name (its folder under models/).
SERVED_MODELS = {"query_model": "query", "doc_model": "doc", "topk_model": "topk"}


TF_SERVING_CONFIG = f"{MODELS_DIR}/models.config"


# Where TF Serving's docker image looks for models: models.config's base paths assume models/ is mounted here.
TF_SERVING_MOUNT = "/models"


# The topk model's input of item ids never to return: tf.string [batch, E], "" padded.
TOPK_EXCLUDE_INPUT = "exclude_item_ids"


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


def model_path(directory: str | Path, key: str, manifest: Manifest | None = None) -> Path:
    """The SavedModel directory of ``key`` ("query_model", "doc_model", "topk_model") in a bundle.

    Read from the manifest's ``files`` (``manifest``, else the bundle's manifest.json), so it
    finds both layouts: ``models/<name>/<version>`` and the older ``query_model/``.

    Raises:
      ValueError: the bundle has no such model (a topk model is written only with export.topk_model).
    """
    files = (read_manifest(directory) if manifest is None else manifest).files
    relative = files.get(key)
    if relative is None:
        raise ValueError(f"{directory}: the bundle has no {key} (manifest.json files lists {sorted(files)})")
    return Path(directory) / relative


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
