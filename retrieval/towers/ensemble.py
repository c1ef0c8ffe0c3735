"""Ensembles of towers: K independently trained members served as one pair of towers.

Each member is a whole (query tower, doc tower) pair with its own tables and layers. The
ensemble's towers concatenate the members' outputs, each scaled by ``1 / sqrt(K)``, so

    q . d = (1 / K) * sum_k q_k . d_k

the mean of the members' scores (of their cosines when they are L2-normalised, and then
``|q| = |d| = 1`` again): one dot product, one FAISS index and one query SavedModel serve the
ensemble as they serve one model. Training keeps the members apart: ``member_embeddings``
recovers member k's own output from an ensemble embedding, and the model sums one loss a member
(``TwoTowerModel``), so no member's gradient comes from another's scores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import tensorflow as tf

from retrieval.config import ModelConfig, TowersConfig
from retrieval.features import TowerStatistics
from retrieval.towers.feature import PositionStates, build_towers, position_states


class ScaledConcatenation(tf.keras.layers.Layer):
    """``concat(x_1, ..., x_K) / sqrt(K)`` on the last axis: member outputs -> the ensemble's."""

    def call(self, members):
        return tf.concat(members, axis=-1) / tf.cast(tf.sqrt(float(len(members))), members[0].dtype)


def ensemble_towers(
    members: Sequence[tuple[tf.keras.Model, tf.keras.Model]],
) -> tuple[tf.keras.Model, tf.keras.Model]:
    """One (query tower, doc tower) pair from K member pairs of the same inputs and output width.

    Args:
      members: K >= 1 pairs, each ``[batch, D]`` out; member k's towers are named apart
        (``query_tower_k``...) so their variables are.

    Returns:
      Towers taking the members' raw inputs and returning ``[batch, K * D]``: member k's output
      at ``[k * D, (k + 1) * D)``, scaled by ``1 / sqrt(K)``. With a transformer history the query
      tower's ``position_states`` are the members' states joined the same way. One member is
      returned as it is.
    """
    if not members:
        raise ValueError("an ensemble needs at least one member")
    if len(members) == 1:
        return members[0]
    widths = {int(tower.output_shape[-1]) for pair in members for tower in pair}
    if len(widths) != 1:
        raise ValueError(f"ensemble members must all output one width, got {sorted(widths)}")
    query = _joined([q for q, _ in members], "query_tower")
    doc = _joined([d for _, d in members], "doc_tower")
    states = [position_states(q) for q, _ in members]
    if all(s is not None for s in states):
        query.position_states = PositionStates(_joined([s.model for s in states if s is not None],
                                                       "query_tower_positions"))
    elif any(s is not None for s in states):
        raise ValueError("ensemble members must all have a transformer history, or none")
    return query, doc


def build_ensemble_towers(
    towers: TowersConfig, model: ModelConfig, stats: TowerStatistics
) -> tuple[tf.keras.Model, tf.keras.Model]:
    """``build_towers`` once per member (``model.ensemble_members``), joined by ``ensemble_towers``."""
    members = model.ensemble_members
    if members == 1:
        return build_towers(towers, model, stats)
    return ensemble_towers([build_towers(towers, model, stats, suffix=f"_{k}") for k in range(members)])


def member_embeddings(embeddings: tf.Tensor, members: int) -> list[tf.Tensor]:
    """The K members' own outputs ``[..., D]`` from ensemble embeddings ``[..., K * D]`` (the
    inverse of the towers' scaled concatenation)."""
    if members == 1:
        return [embeddings]
    return [part * math.sqrt(members) for part in tf.split(embeddings, members, axis=-1)]


def _joined(towers: list[tf.keras.Model], name: str) -> tf.keras.Model:
    names = [tuple(sorted(t.input_names)) for t in towers]
    if len(set(names)) != 1:
        raise ValueError(f"ensemble members must read the same inputs, got {sorted(set(names))}")
    first = towers[0]
    inputs = {n: tf.keras.Input(shape=_input_of(first, n).shape[1:], dtype=_input_of(first, n).dtype, name=n)
              for n in first.input_names}
    outputs = ScaledConcatenation(name=f"{name}_members")([t({n: inputs[n] for n in t.input_names}) for t in towers])
    return tf.keras.Model(inputs, outputs, name=name)


def _input_of(tower: tf.keras.Model, name: str):
    return tower.inputs[tower.input_names.index(name)]
