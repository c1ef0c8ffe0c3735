"""The two-tower model: wires towers, log-Q and the loss, and nothing else."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import tensorflow_recommenders as tfrs

from retrieval.config import ModelConfig
from retrieval.data import ITEM, USER, WEIGHT
from retrieval.features import FeatureStatistics
from retrieval.losses import in_batch_softmax_task, relative_sampling_probability
from retrieval.towers import id_tower


class TwoTowerModel(tfrs.Model):
    """Query tower + doc tower joined by a dot product, trained in-batch.

    Each training batch is a dict of [B] tensors holding at least every input
    of both towers (e.g. ``"user_id"``, ``"item_id"``: string), ``"item_id"``
    (log-Q and accidental hits key on it) and ``"weight"`` (float32) when
    click weights are used. Row i's item is the positive for row i's query and
    a negative for every other row.
    """

    def __init__(
        self,
        query_tower: tf.keras.Model,
        doc_tower: tf.keras.Model,
        task: tfrs.tasks.Retrieval,
        *,
        item_ids: tuple[str, ...],
        item_probability: np.ndarray | None,
        log_q_strength: float = 1.0,
        use_weights: bool = False,
    ):
        super().__init__()
        self.query_tower = query_tower
        self.doc_tower = doc_tower
        self.task = task
        self.use_weights = use_weights
        # A separate lookup (same vocabulary as the doc tower) gives the integer
        # item ids the loss needs for log-Q and for accidental-hit removal.
        self._item_index = tf.keras.layers.StringLookup(
            vocabulary=list(item_ids), mask_token=None, num_oov_indices=1
        )
        self._item_probability = (
            None
            if item_probability is None
            # Q ** s gives logit - s * log Q after TFRS takes the log.
            else tf.constant(relative_sampling_probability(item_probability) ** log_q_strength, name="item_q")
        )

    def compute_loss(self, features, training: bool = False) -> tf.Tensor:
        query_embeddings = self.query_tower(tower_inputs(self.query_tower, features), training=training)
        doc_embeddings = self.doc_tower(tower_inputs(self.doc_tower, features), training=training)
        item_index = self._item_index(features[ITEM])
        sampling_probability = (
            None if self._item_probability is None else tf.gather(self._item_probability, item_index)
        )
        return self.task(
            query_embeddings,
            doc_embeddings,
            sample_weight=features[WEIGHT] if self.use_weights else None,
            candidate_sampling_probability=sampling_probability,
            candidate_ids=item_index,
            compute_metrics=False,
            compute_batch_metrics=False,
        )


def tower_inputs(tower: tf.keras.Model, features: dict) -> dict:
    """The subset of a batch's features that ``tower`` reads."""
    return {name: features[name] for name in tower.input_names}


def build_model(config: ModelConfig, stats: FeatureStatistics, *, use_weights: bool = False) -> TwoTowerModel:
    """Build towers and loss from the config and the training statistics."""
    query_tower = id_tower(
        USER,
        stats.users,
        config.embedding_dim,
        normalize=config.normalize,
        l2_regularization=config.l2_regularization,
        name="query_tower",
    )
    doc_tower = id_tower(
        ITEM,
        stats.items,
        config.embedding_dim,
        normalize=config.normalize,
        l2_regularization=config.l2_regularization,
        name="doc_tower",
    )
    task = in_batch_softmax_task(
        temperature=config.temperature, remove_accidental_hits=config.remove_accidental_hits
    )
    return TwoTowerModel(
        query_tower,
        doc_tower,
        task,
        item_ids=stats.items.ids,
        item_probability=stats.item_popularity.probability if config.log_q_correction else None,
        log_q_strength=config.log_q_strength,
        use_weights=use_weights,
    )
