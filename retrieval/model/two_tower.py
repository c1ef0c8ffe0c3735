"""The two-tower model: wires towers, sampler and loss, and nothing else.

``build_model`` builds it from the config, with the parts that
``retrieval.model.parts`` maps the config's names to.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
import tensorflow as tf
import tensorflow_recommenders as tfrs

from retrieval.common.replicas import across_replicas, replicas_in_step
from retrieval.config import ModelConfig
from retrieval.data import ITEM, USER, WEIGHT
from retrieval.features import FeatureStatistics, feature_arrays
from retrieval.losses import (
    LossInputs,
    OwnItems,
    RetrievalLoss,
    gather_across_replicas,
)
from retrieval.model.parts import build_miner, build_objective, build_sampler, resolved, users_training_items
from retrieval.samplers import FaissHardNegativeMiner, Sampler, UserHistory
from retrieval.towers import ensemble_towers, id_tower, member_embeddings, position_states
from retrieval.towers.bias import log_popularity_bias, with_item_bias
from retrieval.towers.id import lookup_vocabulary

# Placeholder id of catalogue row 0 (the OOV row): blank ids never reach a vocabulary.
_OOV_ITEM = ""


class TwoTowerModel(tfrs.Model):
    """Query tower + doc tower joined by a dot product, trained with any sampler and loss.

    Each training batch is a dict of [B] tensors holding at least every input
    of both towers (e.g. ``"user_id"``, ``"item_id"``: string), ``"item_id"``
    (log Q and accidental hits key on it) and ``"weight"`` (float32) when
    click weights are used. Row i's item is row i's positive.

    Sampled items are tower indices; the model embeds them by gathering their
    rows of ``catalogue_features`` (the doc tower's raw inputs for every tower
    index) and running the doc tower, so any doc tower works, not only ID ones.

    Args:
      query_tower, doc_tower: Keras models from a feature dict to ``[batch, dim]``.
      objective: the loss (``retrieval.losses``).
      sampler: the candidate sampler (``retrieval.samplers``).
      item_ids: the item vocabulary; tower index ``i + 1`` is ``item_ids[i]``.
      catalogue_features: the doc tower's inputs, each ``[len(item_ids) + 1, ...]``
        in tower-index order (row 0 = OOV); None = ``{"item_id": ["", *item_ids]}``.
      miner: optional hard-negative miner (needs ``user_ids``).
      user_ids: the user vocabulary, rows of the miner's ``UserHistory``.
      use_weights: weight each example's loss by the batch's ``"weight"``.
      ensemble_members: K: the towers are an ensemble of K members (``towers.ensemble_towers``)
        and the loss is the sum of one loss a member, on its own part of the embeddings.
      remove_sequence_items: in a batch of sequences, no item of a pair's sequence window is
        among its negatives (``LossInputs.own_items``; masked where the loss removes accidental hits).
      user_items: each user's training items (rows of ``user_ids``): in a batch of clicks, none of
        a row's user's items is among its negatives (``LossInputs.own_items``, as above).
    """

    def __init__(
        self,
        query_tower: tf.keras.Model,
        doc_tower: tf.keras.Model,
        objective: RetrievalLoss,
        sampler: Sampler,
        *,
        item_ids: tuple[str, ...],
        catalogue_features: Mapping[str, np.ndarray] | None = None,
        miner: FaissHardNegativeMiner | None = None,
        user_ids: tuple[str, ...] | None = None,
        use_weights: bool = False,
        remove_sequence_items: bool = False,
        user_items: UserHistory | None = None,
        ensemble_members: int = 1,
    ):
        super().__init__()
        self.ensemble_members = int(ensemble_members)
        self.remove_sequence_items = remove_sequence_items
        self.query_tower = query_tower
        self.doc_tower = doc_tower
        self.objective = objective
        self.sampler = sampler
        self.miner = miner
        self.use_weights = use_weights
        self.num_items = len(item_ids)
        # A separate lookup (same vocabulary as the doc tower) gives the tower
        # indices the sampler and the loss key on.
        self._item_index = tf.keras.layers.StringLookup(
            vocabulary=lookup_vocabulary(item_ids), mask_token=None, num_oov_indices=1
        )
        self._item_ids = tuple(item_ids)
        if catalogue_features is None:
            catalogue_features = {ITEM: np.asarray([_OOV_ITEM, *item_ids], dtype=object)}
        self._catalogue: dict[str, tf.Tensor] = {}
        self.set_catalogue_features(catalogue_features)
        self._user_index: tf.keras.layers.StringLookup | None = None
        if miner is not None or user_items is not None:
            if user_ids is None:
                raise ValueError("a hard-negative miner or user_items needs user_ids (the rows of its UserHistory)")
            self._user_index = tf.keras.layers.StringLookup(
                vocabulary=lookup_vocabulary(user_ids), mask_token=None, num_oov_indices=1
            )
        self._user_items: tuple[tf.Tensor, tf.Tensor] | None = None
        if user_items is not None:  # CSR: a user's tower indices, sorted, at items[offsets[u]:offsets[u + 1]]
            self._user_items = (tf.constant(user_items.offsets, tf.int64), tf.constant(user_items.items, tf.int64))

    def set_catalogue_features(self, features) -> None:
        """Set the doc tower's raw inputs for every tower index (after replacing the doc tower).

        Args:
          features: a mapping of arrays ``[num_items + 1, ...]`` in tower-index
            order (row 0 = OOV), or a frame with an ``item_id`` column and the doc
            tower's inputs, one row per catalogue item in any order (rows of items
            outside the vocabulary are ignored; the OOV row copies tower index 1's).
        """
        if isinstance(features, pd.DataFrame):
            if ITEM not in features:
                raise ValueError(
                    f"the catalogue frame needs an {ITEM!r} column, got {list(features.columns)}"
                )
            position = pd.Index(features[ITEM].astype(str)).get_indexer(
                pd.Index(self._item_ids, dtype=object)
            )
            if np.any(position < 0):
                missing_id = self._item_ids[int(np.flatnonzero(position < 0)[0])]
                raise ValueError(f"the catalogue frame lacks vocabulary item {missing_id!r}")
            rows = features.iloc[np.r_[position[:1], position]]
            features = feature_arrays(rows)
            if ITEM in features:
                features[ITEM] = features[ITEM].copy()
                features[ITEM][0] = _OOV_ITEM
        missing = [name for name in self.doc_tower.input_names if name not in features]
        if missing:
            raise ValueError(f"catalogue features lack doc-tower inputs {missing}")
        features = {name: features[name] for name in self.doc_tower.input_names}
        catalogue = {}
        for name in features:
            values = np.asarray(features[name])
            if len(values) != self.num_items + 1:
                raise ValueError(
                    f"catalogue feature {name!r} has {len(values)} rows; expected {self.num_items + 1} "
                    "(one per tower index, row 0 = OOV)"
                )
            catalogue[name] = tf.constant(values)
        self._catalogue = catalogue

    @property
    def servable_by_dot_product(self) -> bool:
        """Whether the FAISS inner-product index of doc embeddings ranks as the model does."""
        return self.objective.scores_by_dot_product

    def item_index(self, item_ids) -> tf.Tensor:
        """Tower indices of string item ids (0 = not in the vocabulary), same shape."""
        return self._item_index(item_ids)

    def embed_items(self, ids: tf.Tensor, training: bool = False) -> tf.Tensor:
        """Doc embeddings of tower indices of any shape: ``[*ids.shape, dim]``."""
        dim = self.doc_tower.output_shape[-1]
        if ids.shape.num_elements() == 0:
            return tf.zeros(ids.shape.as_list() + [dim])
        flat = tf.reshape(ids, [-1])
        inputs = {name: tf.gather(values, flat) for name, values in self._doc_catalogue().items()}
        embeddings = self.doc_tower(inputs, training=training)
        return tf.reshape(embeddings, tf.concat([tf.shape(ids), [dim]], axis=0))

    def embed_catalogue(self) -> tf.Tensor:
        """Doc embeddings of every tower index, ``[num_items + 1, dim]`` (row 0 = OOV)."""
        return self.doc_tower(self._doc_catalogue(), training=False)

    def catalogue_embeddings(self, batch_size: int = 8192) -> tf.Tensor:
        """``embed_catalogue`` run eagerly over ``batch_size`` tower indices at a time.

        The same ``[num_items + 1, dim]`` values; a feature tower's intermediate
        activations (a text encoder's ``[items, words, dim]``) then take memory
        for one batch, not for the whole catalogue.
        """
        return tf.constant(self.catalogue_array(batch_size))

    def catalogue_array(self, batch_size: int = 8192) -> np.ndarray:
        """``catalogue_embeddings`` as a numpy ``[num_items + 1, dim]`` array.

        Each batch leaves TensorFlow as soon as it is embedded: under oneDNN
        TensorFlow's CPU allocator keeps the most it ever held, and the batches
        kept as tensors and concatenated there held two catalogues' worth
        (0.5 GB at 1M items x 64) for the rest of the run.
        """
        catalogue = self._doc_catalogue()
        return np.concatenate([
            self.doc_tower({name: values[start : start + batch_size] for name, values in catalogue.items()},
                           training=False).numpy()
            for start in range(0, self.num_items + 1, batch_size)
        ])

    def _doc_catalogue(self) -> dict:
        missing = [name for name in self.doc_tower.input_names if name not in self._catalogue]
        if missing:
            raise ValueError(
                f"the doc tower reads {missing}, which the catalogue features lack: call "
                "set_catalogue_features() after replacing the doc tower"
            )
        return {name: self._catalogue[name] for name in self.doc_tower.input_names}

    def item_scores(self, query_embeddings: tf.Tensor, item_embeddings: tf.Tensor | None = None) -> tf.Tensor:
        """The model's ranking scores of every tower index, ``[num_queries, num_items + 1]``.

        ``item_embeddings``: ``catalogue_embeddings()`` computed once for many calls (default: embedded now).
        """
        if item_embeddings is None:
            item_embeddings = self.embed_catalogue()
        return self.objective.item_scores(query_embeddings, item_embeddings)

    def compute_loss(self, features, training: bool = False) -> tf.Tensor:
        """The batch's loss: one (query, positive) pair a row, or with ``[batch, L]`` item ids
        (``training.SequenceClicks``) one pair a non-padded position of each sequence."""
        if features[ITEM].shape.rank == 2:
            queries, positive_ids, sample_weight, own_items = self._position_pairs(features, training)
            positives = self.embed_items(positive_ids, training)
        else:
            queries = self.query_tower(tower_inputs(self.query_tower, features), training=training)
            positives = self.doc_tower(tower_inputs(self.doc_tower, features), training=training)
            positive_ids = self._item_index(features[ITEM])
            sample_weight = features[WEIGHT] if self.use_weights else None
            own_items = None if self._user_items is None else self._users_items(features[USER])
        if training:
            # Under tf.distribute every replica observes the global batch (once per step, as on one device).
            self.sampler.observe(across_replicas(positive_ids))
        negatives = [self.sampler.sample(positive_ids, queries=queries, embed_catalogue=self.embed_catalogue)]
        if self.miner is not None and training:
            assert self._user_index is not None  # __init__ builds it whenever there is a miner
            user_rows = self._user_index(features[USER]) - 1  # -1 = unknown user
            negatives.append(self.miner.sample(positive_ids, queries, user_rows, self.embed_catalogue))
        inputs = LossInputs(
            queries=queries,
            positives=positives,
            positive_ids=positive_ids,
            negatives=tuple(negatives),
            negative_embeddings=tuple(self.embed_items(n.ids, training) for n in negatives),
            includes_batch_positives=self.sampler.includes_batch_positives,
            sample_weight=sample_weight,
            own_items=own_items,
        )
        if self.ensemble_members == 1:
            # Under tf.distribute: in-batch candidates from every replica; this replica's share of the loss.
            return self.objective.compute(gather_across_replicas(inputs))
        # One loss a member on its own embeddings: each member trains as it would alone.
        members = [member_embeddings(x, self.ensemble_members)
                   for x in (inputs.queries, inputs.positives, *inputs.negative_embeddings)]
        return tf.add_n([
            self.objective.compute(gather_across_replicas(inputs._replace(
                queries=q, positives=d, negative_embeddings=tuple(n[k] for n in members[2:]))))
            for k, (q, d) in enumerate(zip(members[0], members[1], strict=True))
        ])

    def _position_pairs(
        self, features, training: bool
    ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor | None, OwnItems | None]:
        """``(queries [N, dim], positive tower indices [N], weights [N] or None, own items)`` of a
        sequence batch: the query tower's state at every position whose next item is not padding.
        With ``remove_sequence_items`` each pair's own items are its sequence's window (history and
        next items), else None."""
        states = position_states(self.query_tower)
        if states is None:
            raise ValueError("a batch of sequences needs a query tower with a transformer history "
                             "(towers.query.history.pooling: transformer)")
        if self.miner is not None:
            raise ValueError("model.loss.hard_negatives='mined' is not yet supported with train.examples: sequences")
        per_position = states.model(tower_inputs(states.model, features), training=training)  # [B, L, dim]
        targets = features[ITEM]
        trained = tf.not_equal(targets, "")
        weights = tf.boolean_mask(features[WEIGHT], trained) if self.use_weights else None
        own_items = None
        if self.remove_sequence_items:
            histories = [features[name] for name in states.model.input_names if features[name].shape.rank == 2]
            window = self._item_index(tf.concat([*histories, targets], axis=1))  # 0: padding or unknown
            rows = tf.broadcast_to(tf.range(tf.shape(targets)[0])[:, tf.newaxis], tf.shape(targets))
            own_items = OwnItems(tf.where(window > 0, window, -1), tf.boolean_mask(rows, trained))
        positive_ids = self._item_index(tf.boolean_mask(targets, trained))
        return tf.boolean_mask(per_position, trained), positive_ids, weights, own_items

    def _users_items(self, users: tf.Tensor) -> OwnItems:
        """Each row's user's training items, ``-1`` padded to the longest in the batch (none for a
        user the model does not know): the own items of a batch of clicks."""
        assert self._user_index is not None and self._user_items is not None
        offsets, items = self._user_items
        rows = self._user_index(users) - 1  # -1: unknown user
        known = rows >= 0
        safe = tf.where(known, rows, 0)
        starts = tf.gather(offsets, safe)
        lengths = tf.where(known, tf.gather(offsets, safe + 1) - starts, tf.zeros_like(starts))
        positions = tf.ragged.range(starts, starts + lengths)
        owned = tf.RaggedTensor.from_row_lengths(tf.gather(items, positions.flat_values), lengths)
        return OwnItems(owned.to_tensor(default_value=-1), tf.range(tf.shape(users)[0]))

    def train_step(self, inputs):
        """``tfrs.Model.train_step``, exact under a ``tf.distribute`` strategy.

        tf-keras sums the replicas' gradients (optimizer) and logged values
        (``distribute_reduction_method="auto"`` is "sum" off TPU), so each
        replica contributes its share: ``compute_loss`` returns its share of the
        global mean and the regularization is divided by the number of replicas
        (``tf.nn.scale_regularization_loss``). On one device it is tfrs's step.
        """
        self._check_distributable()
        with tf.GradientTape() as tape:
            loss = self.compute_loss(inputs, training=True)
            regularization_loss = self._regularization_share()
            total_loss = loss + regularization_loss
        gradients = tape.gradient(total_loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        return self._step_logs(loss, regularization_loss, total_loss)

    def _regularization_share(self) -> tf.Tensor:
        return tf.nn.scale_regularization_loss(tf.reduce_sum([tf.reduce_sum(loss) for loss in self.losses]))

    def _step_logs(self, loss, regularization_loss, total_loss) -> dict:
        logs = {metric.name: metric.result() for metric in self.metrics}
        return {**logs, "loss": loss, "regularization_loss": regularization_loss, "total_loss": total_loss}

    def _check_distributable(self) -> None:
        # Both keep numpy state (a FAISS index, a kernel tree) that replicas would share.
        if replicas_in_step() == 1:
            return
        if self.miner is not None:
            unsupported = "model.loss.hard_negatives='mined'"
        elif self.sampler is not None and not self.sampler.supports_replicas:
            unsupported = f"model.loss.negatives with {type(self.sampler).__name__}"
        else:
            return
        raise ValueError(
            f"{unsupported} is not yet supported with several tf.distribute replicas "
            "(train.distribute); train on one device"
        )


def tower_inputs(tower: tf.keras.Model, features: dict) -> dict:
    """The subset of a batch's features that ``tower`` reads."""
    return {name: features[name] for name in tower.input_names}


def build_model(
    config: ModelConfig,
    stats: FeatureStatistics,
    *,
    use_weights: bool = False,
    train_clicks: pd.DataFrame | None = None,
    user_history: UserHistory | None = None,
    towers: tuple[tf.keras.Model, tf.keras.Model] | None = None,
    catalogue_features: Mapping[str, np.ndarray] | None = None,
) -> TwoTowerModel:
    """Build towers, sampler and loss from the config and the training statistics.

    Args:
      config: the model section.
      stats: vocabularies and popularity from the training clicks.
      use_weights: weight examples by the click weight.
      train_clicks: the training clicks; needed by mined hard negatives and
        ``remove_user_items`` (to exclude each user's clicks) unless ``user_history`` is given.
      user_history: each user's training items, for mined hard negatives and
        ``remove_user_items`` (``UserHistory`` over rows of ``stats.users``); overrides ``train_clicks``.
      towers: ``(query_tower, doc_tower)``; None = ID towers.
      catalogue_features: the doc tower's inputs per tower index (see
        ``TwoTowerModel``); None = item ids.

    Settings derived from the data (``model.temperature: auto``) are resolved
    from ``stats`` first (``resolved``).
    """
    config = resolved(config, stats)
    if towers is None:
        common: dict[str, Any] = dict(normalize=config.normalize, l2_regularization=config.l2_regularization,
                                      dropout=config.embedding_dropout, embedding_init=config.embedding_init)
        suffixes = [""] if config.ensemble_members == 1 else [f"_{k}" for k in range(config.ensemble_members)]
        towers = ensemble_towers([
            (id_tower(USER, stats.users, config.embedding_dim, name=f"query_tower{suffix}", **common),
             id_tower(ITEM, stats.items, config.embedding_dim, name=f"doc_tower{suffix}", **common))
            for suffix in suffixes
        ])
    counts = stats.item_popularity.counts
    query_tower, doc_tower = towers
    if config.item_bias:
        assert isinstance(config.temperature, float)  # resolved above
        query_tower, doc_tower = with_item_bias(
            query_tower, doc_tower, stats.items.ids, log_popularity_bias(counts, config.temperature)
        )
    if config.reads_users_training_items:  # coded once for the miner and the loss
        needed_by = "model.remove_user_items" if config.remove_user_items else "model.loss.hard_negatives='mined'"
        user_history = users_training_items(stats, train_clicks, user_history, needed_by=needed_by)
    return TwoTowerModel(
        query_tower,
        doc_tower,
        build_objective(config, counts, query_tower.output_shape[-1]),
        build_sampler(config.loss, counts),
        item_ids=stats.items.ids,
        catalogue_features=catalogue_features,
        miner=build_miner(config.loss, stats, train_clicks, user_history),
        user_ids=stats.users.ids,
        use_weights=use_weights,
        remove_sequence_items=config.remove_sequence_items,
        user_items=user_history if config.remove_user_items else None,
        ensemble_members=config.ensemble_members,
    )
