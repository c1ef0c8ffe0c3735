"""A learned per-item bias outside the dot product (``model.item_bias``), served by the same index.

A click's log-probability often splits into an item's popularity and a taste match:
``log p(i | u) = log pop(i) + log affinity(u, i)``. L2-normalised towers score a cosine in
``[-1, 1]`` divided by the temperature, so one cosine has to carry both the popularity spread
(several nats over a catalogue) and the taste signal. With a bias the logit is

    (cos(q, d) + b_i) / temperature

and the cosine is left with the taste. The index stays an inner product: the query tower appends
1 and the doc tower appends ``b_i``, so ``[q, 1] . [d, b_i] = q . d + b_i`` and FAISS,
the exact top-k, the bundle and every loss that scores dot products rank as the model does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from retrieval.data import ITEM
from retrieval.towers.feature import PositionStates, position_states
from retrieval.towers.id import IdEmbedding, IdLookup, lookup_vocabulary


class AppendOne(tf.keras.layers.Layer):
    """``[..., D]`` -> ``[..., D + 1]`` ending in 1 (the query side of the bias), or in 0 where the
    embedding is all zeros: the towers' out-of-vocabulary query stays all zeros, which serving
    answers with the popular items and says so, instead of ranking by the biases alone."""

    def call(self, embeddings):
        known = tf.reduce_any(tf.not_equal(embeddings, 0.0), axis=-1, keepdims=True)
        return tf.concat([embeddings, tf.cast(known, embeddings.dtype)], axis=-1)


def log_popularity_bias(counts: np.ndarray, temperature: float) -> np.ndarray:
    """Starting biases ``temperature * (log(count + 1) - mean)``: ``[len(counts)]``.

    The bias enters the logit divided by the temperature, so this starts each item's logit at its
    centred log training count: the model begins where a popularity ranker ends, and the first
    epochs learn taste instead of popularity. ``counts[0]`` (the OOV slot) is ignored.
    """
    counts = np.asarray(counts, dtype=np.float64)
    logs = np.log1p(counts)
    logs[1:] -= logs[1:].mean() if len(logs) > 1 else 0.0
    logs[0] = 0.0
    return (temperature * logs).astype(np.float32)


def with_item_bias(
    query_tower: tf.keras.Model,
    doc_tower: tf.keras.Model,
    item_ids: Sequence[str],
    initial: np.ndarray,
) -> tuple[tf.keras.Model, tf.keras.Model]:
    """The towers with a learned item bias: query ``[batch, D + 1]`` ending in 1 (0 for an all-zero
    query, the unknown user's), doc ``[batch, D + 1]`` ending in the item's bias (``initial``
    ``[len(item_ids) + 1]`` to start, row 0 the unknown item's, kept 0), so their dot product is
    ``q . d + b_item``.

    The doc tower must read ``item_id`` (the bias is a row per item); a transformer query tower's
    ``position_states`` get the same column of ones, so sequence training scores the same logits.

    Raises:
      ValueError: the doc tower does not read ``item_id``.
    """
    if ITEM not in doc_tower.input_names:
        raise ValueError(
            f"model.item_bias needs a doc tower that reads {ITEM!r} (the bias is one learned value per "
            f"item), but it reads {sorted(doc_tower.input_names)}: add an id feature named {ITEM!r} to "
            "towers.doc.features, or set model.item_bias=false"
        )
    query = _extended(query_tower, AppendOne(name="bias_one"), name=query_tower.name)
    states = position_states(query_tower)
    if states is not None:
        query.position_states = PositionStates(
            _extended(states.model, AppendOne(name="bias_one_positions"), name=states.model.name)
        )
    initial = np.asarray(initial, dtype=np.float32).reshape(-1, 1).copy()
    initial[0] = 0.0  # the unknown item's row
    if len(initial) != len(item_ids) + 1:
        raise ValueError(f"initial biases have {len(initial)} rows; expected {len(item_ids) + 1} "
                         "(one per item after the out-of-vocabulary row)")
    # A one-wide id table, zero-initialised and then set: the starting biases live in the weights only (an
    # initializer holding them would copy the whole catalogue into every saved layer config).
    bias = IdEmbedding(
        IdLookup(vocabulary=lookup_vocabulary(item_ids), mask_token=None, num_oov_indices=1, name="item_bias_lookup"),
        tf.keras.layers.Embedding(len(initial), 1, embeddings_initializer="zeros", name="item_bias"),
    )
    inputs = _inputs_like(doc_tower)
    doc = tf.keras.Model(
        inputs,
        tf.keras.layers.Concatenate(axis=-1, name="with_item_bias")([doc_tower(inputs), bias(inputs[ITEM])]),
        name=doc_tower.name,
    )
    bias.embedding.set_weights([initial])
    return query, doc


def _extended(tower: tf.keras.Model, layer: tf.keras.layers.Layer, name: str) -> tf.keras.Model:
    inputs = _inputs_like(tower)
    return tf.keras.Model(inputs, layer(tower(inputs)), name=name)


def _inputs_like(tower: tf.keras.Model) -> dict:
    return {
        name: tf.keras.Input(shape=tensor.shape[1:], dtype=tensor.dtype, name=name)
        for name, tensor in zip(tower.input_names, tower.inputs, strict=True)
    }
