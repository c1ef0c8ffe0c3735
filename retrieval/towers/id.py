"""The ID-only tower: one string id -> its embedding.

A tower owns all of its preprocessing (string lookup included), so the exported
query tower takes raw ids exactly as the click log has them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from retrieval.features import Vocabulary


def lookup_vocabulary(ids: Sequence[str]) -> np.ndarray:
    """A ``StringLookup`` vocabulary as a [num_ids] object array, never a list.

    tf-keras wraps a list attribute in a tracked ``ListWrapper``, and every
    eager call of a model walks its layers' tracked attributes element by
    element: with a 1M-id list, 3.5 s a call of an ID tower instead of 12 ms
    (an array is not walked).
    """
    return np.asarray(ids, dtype=object)


EMBEDDING_INITS = ("uniform", "normal")  # ModelConfig.embedding_init


class _ZeroOutOfVocabulary(tf.keras.initializers.Initializer):
    """Random rows, uniform(-scale, scale) or normal(0, scale), except row 0 (the OOV bucket) which
    starts at zero.

    Ids never seen in training all share row 0. An ID model has learnt nothing
    about them, and in-batch softmax never updates that row, so a zero vector
    (score exactly 0 against every query) is the honest "don't know" instead of
    a random direction that could put every unknown item at the top.
    """

    def __init__(self, scale: float = 0.05, distribution: str = "uniform"):
        if distribution not in EMBEDDING_INITS:
            raise ValueError(f"distribution must be one of {', '.join(EMBEDDING_INITS)}, got {distribution!r}")
        self.scale, self.distribution = scale, distribution

    def __call__(self, shape, dtype=None, **kwargs):
        # Drawn in numpy and handed to TensorFlow once. Built from TF ops (uniform, then row 0
        # zeroed) a table passed through three table-sized TF buffers, and with oneDNN on
        # (retrieval/__init__.py) TF's pooling CPU allocator keeps such a high-water mark for the
        # whole run: +0.5 GB of RSS for two 1M x 64 tables. The seed comes from a TF random op,
        # so tf.random.set_seed still fixes every table.
        seed = int(tf.random.uniform([], 0, 2**31 - 1, dtype=tf.int64))
        rng = np.random.default_rng(seed)
        if self.distribution == "normal":
            values = rng.standard_normal(tuple(shape), dtype=np.float32)
            values *= self.scale
        else:
            values = rng.random(tuple(shape), dtype=np.float32)
            values *= 2 * self.scale
            values -= self.scale
        values[0] = 0.0
        return tf.cast(tf.convert_to_tensor(values), tf.as_dtype(dtype or tf.float32))

    def get_config(self):
        return {"scale": self.scale, "distribution": self.distribution}


class IdLookup(tf.keras.layers.StringLookup):
    """The string lookup of an id feature (a ``StringLookup`` with one OOV index, 0).

    Its own class so the exported query model can tell a known id from an
    unknown one (``id_lookups``) without any other record of the tower's config.
    """


def id_lookups(tower: tf.keras.Model) -> dict[str, IdLookup]:
    """Input name -> the lookup of each id feature the tower reads directly (e.g. ``user_id``).

    A click-history input looks items up too, but it is not the query's own id,
    so only lookups named ``<input>_lookup`` count.
    """
    by_name = {layer.name: layer for layer in tower.layers if isinstance(layer, IdLookup)}
    return {name: by_name[f"{name}_lookup"] for name in tower.input_names if f"{name}_lookup" in by_name}


@dataclass(frozen=True)
class IdEmbedding:
    """A string lookup and its embedding table, callable on ids of any shape; shareable between towers.

    Index 0 is the single out-of-vocabulary row, zero-initialised (see ``_ZeroOutOfVocabulary``).
    """

    lookup: tf.keras.layers.StringLookup
    embedding: tf.keras.layers.Embedding

    @classmethod
    def build(cls, name: str, vocabulary: Vocabulary, dim: int, l2_regularization: float = 0.0,
              init: str = "uniform") -> IdEmbedding:
        """Layers ``{name}_lookup`` and ``{name}_embedding``: one row per vocabulary id after the OOV row.

        ``init``: the rows' distribution, ``uniform`` (-0.05, 0.05) or ``normal`` (0, 0.02: BERT's and
        the SASRec+ reference's); the OOV row starts at zero either way."""
        if vocabulary is None or len(vocabulary) == 0:
            raise ValueError(f"feature {name!r} has no training values to build a vocabulary from")
        if dim <= 0:
            raise ValueError(f"embedding_dim must be positive, got {dim}")
        return cls(
            IdLookup(
                vocabulary=lookup_vocabulary(vocabulary.ids), mask_token=None, num_oov_indices=1,
                name=f"{name}_lookup",
            ),
            tf.keras.layers.Embedding(
                len(vocabulary) + 1,
                dim,
                embeddings_initializer=(_ZeroOutOfVocabulary(0.02, "normal") if init == "normal"
                                        else _ZeroOutOfVocabulary(0.05, init)),
                embeddings_regularizer=tf.keras.regularizers.l2(l2_regularization) if l2_regularization else None,
                name=f"{name}_embedding",
            ),
        )

    @property
    def dim(self) -> int:
        return self.embedding.output_dim

    def __call__(self, ids):
        """Ids of any shape -> embeddings ``[*ids.shape, dim]``."""
        return self.embedding(self.lookup(ids))


def id_tower(
    feature: str,
    vocabulary: Vocabulary,
    embedding_dim: int,
    *,
    normalize: bool = True,
    l2_regularization: float = 0.0,
    dropout: float = 0.0,
    embedding_init: str = "uniform",
    name: str | None = None,
) -> tf.keras.Model:
    """An ID-embedding tower.

    Args:
      feature: name of the string feature it reads, e.g. ``"user_id"``.
      vocabulary: training ids; anything else maps to the OOV row.
      embedding_dim: output size D.
      normalize: L2-normalise the output (dot product becomes cosine).
      l2_regularization: L2 penalty on the embedding table.
      dropout: dropout on the embedding, training only (before the normalisation).
      embedding_init: the table's distribution (``IdEmbedding.build``).
      name: Keras model name.

    Returns:
      A model taking ``{feature: tf.string [batch]}`` and returning
      ``[batch, embedding_dim]`` float32.
    """
    if embedding_dim <= 0:
        raise ValueError(f"embedding_dim must be positive, got {embedding_dim}")
    inputs = {feature: tf.keras.Input(shape=(), dtype=tf.string, name=feature)}
    outputs = IdEmbedding.build(feature, vocabulary, embedding_dim, l2_regularization, embedding_init)(inputs[feature])
    if dropout:
        outputs = tf.keras.layers.Dropout(dropout, name="embedding_dropout")(outputs)
    if normalize:
        outputs = tf.keras.layers.UnitNormalization(axis=-1, name="l2_normalize")(outputs)
    return tf.keras.Model(inputs, outputs, name=name or f"{feature}_tower")
