"""Feature towers (DSSM, Huang et al. 2013; YouTube DNN, Covington et al. 2016).

Each declared feature is encoded by its own preprocessing + embedding, the
encodings are concatenated and an MLP maps them to the output embedding,
optionally L2-normalised. All preprocessing is inside the Keras model, so a
tower (and its SavedModel) takes raw values as ``retrieval.features.tables``
documents them:

========================  ================================================  ==========
kind                      encoding                                          width
========================  ================================================  ==========
id                        StringLookup (training ids, 1 zero-init OOV row)  dim
categorical               [prefix] -> StringLookup (+OOV rows) or Hashing   dim
multi_categorical         [split] -> lookup/hash -> mean over non-""        dim
numeric                   (x - mean) / std, is-missing                      2
timestamp                 age in days and log-days (normalised), missing    3
text                      hashed trigrams/words -> mean embedding           dim
history (query)           item lookup -> embedding -> mean / attention /    item dim
                          causal transformer (newest state)
========================  ================================================  ==========

The history can share the doc tower's item-id embedding table, so a clicked
item and a candidate item live in one space.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from retrieval.config import (
    CategoricalFeature,
    HistoryConfig,
    ModelConfig,
    MultiCategoricalFeature,
    TowerConfig,
    TowersConfig,
)
from retrieval.features import TowerStatistics, Vocabulary, feature_input
from retrieval.towers.id import IdEmbedding, lookup_vocabulary
from retrieval.towers.layers import (
    AttentionPooling,
    CausalSequenceEncoder,
    HashedText,
    IdDropout,
    Known,
    KnownFirst,
    MaskedMean,
    Newest,
    NormalizedNumber,
    NotPadding,
    Prefix,
    RepeatOverPositions,
    SplitPad,
    TimestampAge,
    ZeroUnlessAny,
)

_DTYPES = {"string": tf.string, "float32": tf.float32, "float64": tf.float64}


def build_towers(
    towers: TowersConfig, model: ModelConfig, stats: TowerStatistics, *, suffix: str = ""
) -> tuple[tf.keras.Model, tf.keras.Model]:
    """The query and doc feature towers, sharing the item-id embedding when the history asks to.

    Args:
      towers: features of both towers.
      model: output ``embedding_dim``, ``normalize`` and ``l2_regularization``.
      stats: training statistics of every feature.
      suffix: appended to the towers' names (``query_tower_1``: an ensemble member).

    Returns:
      ``(query_tower, doc_tower)``: functional Keras models from their raw
      input dict to [batch, model.embedding_dim] float32.
    """
    shared = None
    history = towers.query.history
    if history is not None and history.share_item_embedding:
        feature = towers.item_id_feature
        if feature is None:  # TowersConfig validation rejects this
            raise ValueError(
                "towers.query.history.share_item_embedding needs an id feature with source item_id in "
                "towers.doc.features (or set share_item_embedding: false)"
            )
        vocabulary = stats[feature.name]
        if not isinstance(vocabulary, Vocabulary):  # None: a hashed id feature (IdEmbedding.build's message)
            raise ValueError(f"feature {feature.name!r} has no training values to build a vocabulary from")
        shared = IdEmbedding.build(
            feature.name, vocabulary, feature.embedding_dim or model.embedding_dim, model.l2_regularization,
            init=model.embedding_init,
        )
    common: dict[str, Any] = dict(
        embedding_dim=model.embedding_dim, normalize=model.normalize, l2_regularization=model.l2_regularization,
        input_dropout=model.embedding_dropout, embedding_init=model.embedding_init,
    )
    query = feature_tower(towers.query, stats, item_embedding=shared, name=f"query_tower{suffix}", **common)
    doc = feature_tower(towers.doc, stats, item_embedding=shared, name=f"doc_tower{suffix}", **common)
    return query, doc


def feature_tower(
    tower: TowerConfig,
    stats: TowerStatistics,
    *,
    embedding_dim: int,
    normalize: bool = True,
    l2_regularization: float = 0.0,
    input_dropout: float = 0.0,
    item_embedding: IdEmbedding | None = None,
    embedding_init: str = "uniform",
    name: str = "feature_tower",
) -> tf.keras.Model:
    """A tower from raw features to an embedding.

    Args:
      tower: its features, history and MLP.
      stats: training statistics (vocabularies, means, variances, reference time).
      embedding_dim: output size D (and the default embedding size of features).
      normalize: L2-normalise the output.
      l2_regularization: L2 penalty on every embedding table.
      input_dropout: dropout on the concatenated feature encodings, before the MLP, training only.
      item_embedding: the item-id lookup + table to use for the doc tower's
        item-id feature and the query tower's history (shared), or None.
      embedding_init: the distribution of the tower's own id tables (``IdEmbedding.build``).
      name: Keras model name.

    Returns:
      A model taking ``{name: raw tensor}`` (see ``retrieval.features.tower_inputs``)
      and returning [batch, embedding_dim] float32.
    """
    if embedding_dim <= 0:
        raise ValueError(f"embedding_dim must be positive, got {embedding_dim}")
    inputs, parts = {}, []
    context = _Context(embedding_dim, l2_regularization, item_embedding, embedding_init)
    for feature in tower.features:
        spec = feature_input(feature)
        inputs[feature.name] = tf.keras.Input(
            shape=() if spec.width is None else (spec.width,), dtype=_DTYPES[spec.dtype], name=feature.name
        )
        parts.append(_ENCODERS[feature.kind](feature, stats[feature.name], context, inputs[feature.name]))
    states = None
    if tower.history is not None:
        history = tower.history
        inputs[history.name] = tf.keras.Input(shape=(history.length,), dtype=tf.string, name=history.name)
        pooled, states = _encode_history(history, stats, context, inputs[history.name])
        parts.append(pooled)
    head = [tf.keras.layers.Dropout(input_dropout, name="input_dropout")] if input_dropout else []
    head += [
        layer
        for i, width in enumerate(tower.mlp.widths)
        for layer in [tf.keras.layers.Dense(width, activation=tower.mlp.activation, name=f"hidden_{i}"),
                      *([tf.keras.layers.Dropout(tower.mlp.dropout, name=f"dropout_{i}")] if tower.mlp.dropout else [])]
    ]
    if tower.mlp.projection:
        head.append(tf.keras.layers.Dense(embedding_dim, name="projection"))
    else:  # the encoding itself is the output (SASRec's item table on both sides)
        width = sum(int(part.shape[-1]) for part in parts)
        if width != embedding_dim:
            raise ValueError(
                f"{name}: mlp.projection=false outputs the features' encoding itself, {width} wide, but "
                f"model.embedding_dim is {embedding_dim}: give the tower one encoding of that width "
                f"(e.g. one id feature without its own embedding_dim), or set mlp.projection=true"
            )
    if normalize:
        head.append(tf.keras.layers.UnitNormalization(axis=-1, name="l2_normalize"))

    def output(parts: list, concatenate_name: str):
        x = parts[0] if len(parts) == 1 else tf.keras.layers.Concatenate(axis=-1, name=concatenate_name)(parts)
        for layer in head:
            x = layer(x)
        return x

    outputs = output(parts, "features")
    if states is not None and len(parts) == 1:
        # A history alone, all of it padding or unknown: the zero embedding, which serving answers
        # with the popular items and says so (``Recommendations.fallback``).
        outputs = ZeroUnlessAny(name="no_history_no_embedding")(outputs, states[1])
    model = tf.keras.Model(inputs, outputs, name=name)
    if states is not None:  # the same layers at every position of the history: training on all of them
        assert tower.history is not None
        repeated = [RepeatOverPositions(tower.history.length, name=f"repeat_{i}")(part)
                    for i, part in enumerate(parts[:-1])]
        positions = tf.keras.Model(inputs, output([*repeated, states[0]], "position_features"),
                                   name=f"{name}_positions")
        model.position_states = PositionStates(positions)
    return model


@dataclass(frozen=True)
class PositionStates:
    """A sequence tower's output at every position of its history (``history.pooling: transformer``).

    ``model`` takes the tower's inputs and returns ``[batch, L, dim]``, newest first: position ``p``
    is the tower's output from the encoder's state at ``p``, which has seen the items at ``p`` and
    older only (``CausalSequenceEncoder``; learned positions are those of the window, as SASRec's),
    so position 0 is the tower's own output. It shares every layer with the tower. Held outside
    Keras' tracking (a plain attribute of the tower), so a SavedModel of the tower holds the tower.
    """

    model: tf.keras.Model


def position_states(tower: tf.keras.Model) -> PositionStates | None:
    """The ``PositionStates`` of a tower built with a transformer history, else None."""
    states = getattr(tower, "position_states", None)
    return states if isinstance(states, PositionStates) else None


@dataclass(frozen=True)
class _Context:
    embedding_dim: int
    l2_regularization: float
    item_embedding: IdEmbedding | None
    embedding_init: str = "uniform"


def _encode_id(feature, vocabulary, context: _Context, x):
    if context.item_embedding is not None and feature.column == "item_id":
        table = context.item_embedding
    else:
        dim = feature.embedding_dim or context.embedding_dim
        table = IdEmbedding.build(feature.name, vocabulary, dim, context.l2_regularization, context.embedding_init)
    ids = table.lookup(x)
    if feature.dropout:
        ids = IdDropout(feature.dropout, name=f"{feature.name}_dropout")(ids)
    return table.embedding(ids)


def _encode_categorical(feature, vocabulary, context: _Context, x):
    if feature.prefix:
        x = Prefix(feature.prefix, name=f"{feature.name}_prefix")(x)
    ids, rows = _category_ids(feature, vocabulary, x)
    return _embedding(feature, rows, context)(ids)


def _encode_multi_categorical(feature, vocabulary, context: _Context, x):
    if feature.separator is not None:
        x = SplitPad(feature.separator, feature.max_values, name=f"{feature.name}_split")(x)
    ids, rows = _category_ids(feature, vocabulary, x)
    mask = NotPadding(name=f"{feature.name}_mask")(x)
    return MaskedMean(name=f"{feature.name}_mean")(_embedding(feature, rows, context)(ids), mask)


def _encode_numeric(feature, stats, context: _Context, x):
    return NormalizedNumber(stats.mean, stats.std, feature.log, name=f"{feature.name}_normalized")(x)


def _encode_timestamp(feature, stats, context: _Context, x):
    return TimestampAge(
        feature.unit,
        stats.reference,
        (stats.age.mean, stats.age.std),
        (stats.log_age.mean, stats.log_age.std),
        name=f"{feature.name}_age",
    )(x)


def _encode_text(feature, stats, context: _Context, x):
    return HashedText(
        feature.text.buckets,
        feature.embedding_dim or context.embedding_dim,
        trigrams=feature.text.trigrams,
        words=feature.text.words,
        regularizer=_regularizer(context.l2_regularization),
        name=f"{feature.name}_text",
    )(x)


_ENCODERS: dict[str, Callable] = {
    "id": _encode_id,
    "categorical": _encode_categorical,
    "multi_categorical": _encode_multi_categorical,
    "numeric": _encode_numeric,
    "timestamp": _encode_timestamp,
    "text": _encode_text,
}


def _encode_history(history: HistoryConfig, stats: TowerStatistics, context: _Context, x):
    if history.share_item_embedding:
        if context.item_embedding is None:
            raise ValueError("history.share_item_embedding needs the doc tower's item embedding (use build_towers)")
        table = context.item_embedding
    else:
        dim = history.embedding_dim or context.embedding_dim
        table = IdEmbedding.build(history.name, stats.items, dim, context.l2_regularization, context.embedding_init)
    if history.pooling == "transformer":
        rows = table.lookup(x)
        known = Known(name=f"{history.name}_known")(rows)
        settings = history.transformer
        encoder = CausalSequenceEncoder(history.length, settings.blocks, settings.heads, settings.dropout,
                                        layout=settings.layout, name=f"{history.name}_transformer")
        # Every position's state, aligned with the input, is what training on every position reads.
        states = encoder(table.embedding(rows), known)
        # The tower's own output needs the newest state alone, of the history with its unknown items
        # dropped: an item new since training (often the newest click) must not blank the others.
        compact = KnownFirst(name=f"{history.name}_known_first")(rows)
        newest = encoder(table.embedding(compact), Known(name=f"{history.name}_known_compact")(compact),
                         newest_only=True)
        return Newest(name=f"{history.name}_newest")(newest), (states, known)
    mask = NotPadding(name=f"{history.name}_mask")(x)
    pooling = MaskedMean if history.pooling == "mean" else AttentionPooling
    return pooling(name=f"{history.name}_{history.pooling}")(table(x), mask), None


def _category_ids(feature: CategoricalFeature | MultiCategoricalFeature, vocabulary: Vocabulary | None, x):
    """Integer ids and the number of embedding rows for a categorical input of any shape."""
    if feature.hash_buckets is not None:
        return tf.keras.layers.Hashing(feature.hash_buckets, name=f"{feature.name}_hash")(x), feature.hash_buckets
    vocabulary = _need_values(feature.name, vocabulary)
    lookup = tf.keras.layers.StringLookup(
        vocabulary=lookup_vocabulary(vocabulary.ids),
        mask_token=None,
        num_oov_indices=feature.oov_buckets,
        name=f"{feature.name}_lookup",
    )
    return lookup(x), feature.oov_buckets + len(vocabulary)


def _embedding(
    feature: CategoricalFeature | MultiCategoricalFeature, rows: int, context: _Context
) -> tf.keras.layers.Embedding:
    return tf.keras.layers.Embedding(
        rows,
        feature.embedding_dim or context.embedding_dim,
        embeddings_regularizer=_regularizer(context.l2_regularization),
        name=f"{feature.name}_embedding",
    )


def _regularizer(l2: float):
    return tf.keras.regularizers.l2(l2) if l2 else None


def _need_values(name: str, vocabulary: Vocabulary | None) -> Vocabulary:  # same check as IdEmbedding.build
    if vocabulary is None or len(vocabulary) == 0:
        raise ValueError(f"feature {name!r} has no training values to build a vocabulary from")
    return vocabulary
