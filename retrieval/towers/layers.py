"""Preprocessing and pooling layers of the feature towers.

Each layer is plain TensorFlow ops on raw values, so it traces into the
exported SavedModel and serving needs no project code. Statistics (means,
variances, reference times) are baked in as constants from
``retrieval.features.TowerStatistics``; the numpy functions of
``retrieval.features.tower_statistics`` are the reference they are tested against.
"""

from __future__ import annotations

import tensorflow as tf

from retrieval.features.tower_statistics import DAYS_PER_YEAR, SECONDS_PER_DAY, UNIT_SECONDS


def text_tokens(texts: tf.Tensor, *, trigrams: bool = True, words: bool = True) -> tf.RaggedTensor:
    """Tokens of each text: DSSM letter trigrams and/or whole words.

    Text is lower-cased (UTF-8) and split on every run of characters that are
    neither letters nor digits; each word becomes ``#word#`` (the boundary
    marks of DSSM word hashing, Huang et al., CIKM 2013). Trigrams are the
    letter trigrams of ``#word#`` (``#ca``, ``cat``, ``at#``), then come the
    words themselves.

    Args:
      texts: [batch] tf.string.

    Returns:
      [batch, None] ragged tf.string: all trigrams of a text (word by word), then its words.
    """
    if not (trigrams or words):
        raise ValueError("text_tokens needs trigrams or words")
    cleaned = tf.strings.regex_replace(tf.strings.lower(texts, encoding="utf-8"), r"[^\p{L}\p{N}]+", " ")
    marked = tf.ragged.map_flat_values(lambda w: tf.strings.join(["#", w, "#"]), tf.strings.split(cleaned))
    parts = []
    if trigrams:
        letters = tf.strings.unicode_split(marked, "UTF-8")  # [batch, words, letters]
        parts.append(tf.strings.ngrams(letters, 3, separator="").merge_dims(1, 2))
    if words:
        parts.append(marked)
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=1)


class HashedText(tf.keras.layers.Layer):
    """Mean embedding of a text's hashed tokens (``text_tokens``); 0 for a text without tokens.

    Equivalent to DSSM's linear layer on the (count-normalised) bag of hashed
    trigrams, with the hash keeping the vocabulary bounded and open.

    Input [batch] tf.string; output [batch, dim] float32.
    """

    def __init__(self, buckets: int, dim: int, *, trigrams: bool, words: bool, regularizer=None, **kwargs):
        super().__init__(**kwargs)
        if buckets <= 0 or dim <= 0:
            raise ValueError(f"buckets and dim must be positive, got {buckets} and {dim}")
        self.buckets, self.dim, self.trigrams, self.words = buckets, dim, trigrams, words
        self.regularizer = regularizer

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(self.buckets, self.dim),
            initializer=tf.keras.initializers.RandomUniform(-0.05, 0.05),
            regularizer=self.regularizer,
        )
        super().build(input_shape)

    def call(self, texts):
        tokens = text_tokens(texts, trigrams=self.trigrams, words=self.words)
        ids = tf.strings.to_hash_bucket_fast(tokens.flat_values, self.buckets)
        vectors = tf.gather(self.embeddings, ids)
        return tf.math.unsorted_segment_mean(vectors, tokens.value_rowids(), num_segments=tf.shape(texts)[0])

    def get_config(self):
        return super().get_config() | {
            "buckets": self.buckets, "dim": self.dim, "trigrams": self.trigrams, "words": self.words
        }


class Prefix(tf.keras.layers.Layer):
    """The first ``length`` characters (UTF-8) of each string: zip code -> region."""

    def __init__(self, length: int, **kwargs):
        super().__init__(**kwargs)
        self.length = length

    def call(self, values):
        return tf.strings.substr(values, 0, self.length, unit="UTF8_CHAR")

    def get_config(self):
        return super().get_config() | {"length": self.length}


class SplitPad(tf.keras.layers.Layer):
    """Split each string on ``separator`` into exactly ``width`` values: first ones kept, "" padded.

    Input [batch] tf.string; output [batch, width] tf.string.
    """

    def __init__(self, separator: str, width: int, **kwargs):
        super().__init__(**kwargs)
        self.separator, self.width = separator, width

    def call(self, values):
        return tf.strings.split(values, self.separator).to_tensor(default_value="", shape=[None, self.width])

    def get_config(self):
        return super().get_config() | {"separator": self.separator, "width": self.width}


class MaskedMean(tf.keras.layers.Layer):
    """Mean over the unmasked positions; 0 where none is.

    Inputs: values [batch, width, dim] and mask [batch, width] bool. Output [batch, dim].
    """

    def call(self, values, mask):
        weights = tf.cast(mask, values.dtype)[..., None]
        return tf.reduce_sum(values * weights, axis=1) / tf.maximum(tf.reduce_sum(weights, axis=1), 1.0)


class AttentionPooling(tf.keras.layers.Layer):
    """Softmax-weighted sum over the unmasked positions, with learned scores.

    ``score_i = <v_i, w> / sqrt(dim) + b_position(i)``: a learned direction
    and a learned bias per position (recency), both zero-initialised so
    training starts from the mean. 0 where nothing is unmasked.

    Inputs: values [batch, width, dim] and mask [batch, width] bool. Output [batch, dim].
    """

    def build(self, input_shape):
        width, dim = int(input_shape[-2]), int(input_shape[-1])
        self.direction = self.add_weight(name="direction", shape=(dim,), initializer="zeros")
        self.position_bias = self.add_weight(name="position_bias", shape=(width,), initializer="zeros")
        self.scale = 1.0 / float(dim) ** 0.5
        super().build(input_shape)

    def call(self, values, mask):
        scores = tf.einsum("bwd,d->bw", values, self.direction) * self.scale + self.position_bias
        scores = tf.where(mask, scores, tf.fill(tf.shape(scores), tf.constant(-1e9, scores.dtype)))
        weights = tf.nn.softmax(scores, axis=-1) * tf.cast(mask, values.dtype)
        return tf.reduce_sum(values * weights[..., None], axis=1)


class NormalizedNumber(tf.keras.layers.Layer):
    """``[(v - mean) / std, is_missing]`` with v = x or log1p(max(x, 0)); missing (NaN) -> ``[0, 1]``.

    Input [batch] float32; output [batch, 2] float32.
    """

    def __init__(self, mean: float, std: float, log: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.mean, self.std, self.log = float(mean), float(std), bool(log)

    def call(self, values):
        values = tf.cast(values, tf.float32)
        missing = tf.math.is_nan(values)
        if self.log:
            values = tf.math.log1p(tf.maximum(values, 0.0))
        normalized = tf.where(missing, 0.0, (values - self.mean) / self.std)
        return tf.stack([normalized, tf.cast(missing, tf.float32)], axis=-1)

    def get_config(self):
        return super().get_config() | {"mean": self.mean, "std": self.std, "log": self.log}


class TimestampAge(tf.keras.layers.Layer):
    """A time as its age in days at the end of training: ``[z(age), z(log1p(max(age, 0))), is_missing]``.

    Input [batch] float64 (seconds or days since the epoch, or a calendar
    year, as ``unit`` says); output [batch, 3] float32. The age is computed
    in float64, so epoch seconds keep their precision.
    """

    def __init__(self, unit: str, reference: float, age: tuple[float, float], log_age: tuple[float, float], **kwargs):
        super().__init__(**kwargs)
        if unit not in ("seconds", "days", "years"):
            raise ValueError(f"unit must be seconds, days or years, got {unit!r}")
        self.unit, self.reference = unit, float(reference)
        self.age, self.log_age = tuple(map(float, age)), tuple(map(float, log_age))

    def call(self, values):
        values = tf.cast(values, tf.float64)
        missing = tf.math.is_nan(values)
        if self.unit == "years":
            seconds = (values - 1970.0) * (DAYS_PER_YEAR * SECONDS_PER_DAY)
        else:
            seconds = values * UNIT_SECONDS[self.unit]
        age = (self.reference - seconds) / SECONDS_PER_DAY
        log_age = tf.math.log1p(tf.maximum(age, 0.0))
        z_age = tf.cast((age - self.age[0]) / self.age[1], tf.float32)
        z_log = tf.cast((log_age - self.log_age[0]) / self.log_age[1], tf.float32)
        return tf.stack(
            [tf.where(missing, 0.0, z_age), tf.where(missing, 0.0, z_log), tf.cast(missing, tf.float32)], axis=-1
        )

    def get_config(self):
        return super().get_config() | {
            "unit": self.unit, "reference": self.reference, "age": self.age, "log_age": self.log_age
        }


class NotPadding(tf.keras.layers.Layer):
    """``values != ""``: the mask of padded string inputs (lists, histories). Same shape, bool."""

    def call(self, values):
        return tf.not_equal(values, "")


class IdDropout(tf.keras.layers.Layer):
    """Training only: each id index becomes 0 (the OOV row) with probability ``rate``.

    The tower then also learns to place an id it does not know from its other
    features, which is what it must do for cold users and items at serving
    time (DropoutNet, Volkovs et al., NeurIPS 2017). Inference leaves ids unchanged.
    """

    def __init__(self, rate: float, **kwargs):
        super().__init__(**kwargs)
        if not 0 <= rate < 1:
            raise ValueError(f"rate must be in [0, 1), got {rate}")
        self.rate = float(rate)

    def call(self, ids, training=None):
        if not training or not self.rate:
            return ids
        keep = tf.random.uniform(tf.shape(ids)) >= self.rate
        return tf.where(keep, ids, tf.zeros_like(ids))

    def get_config(self):
        return super().get_config() | {"rate": self.rate}


LAYOUTS = ("pre_norm", "sasrec")  # CausalSequenceEncoder's blocks (TransformerConfig.layout)
REFERENCE_STDDEV = 0.02  # the SASRec+ reference's normal initialisation (BERT's initializer_range)


class ReferenceAttention(tf.keras.layers.MultiHeadAttention):
    """Multi-head attention initialised as PyTorch's ``nn.MultiheadAttention`` inside the SASRec+
    reference: the query, key and value kernels Xavier-uniform over the fused ``[3 dim, dim]`` input
    projection (bound ``sqrt(6 / (dim + 3 dim))``), the output kernel normal(0, 0.02) (the
    reference re-initialises every ``nn.Linear``), every bias zero. Keras' default Glorot-uniform
    reads a ``[dim, heads, dim / heads]`` kernel's fans as ``(dim, dim * dim)``, which makes the query,
    key and value kernels several times smaller and the output kernel several times larger."""

    def __init__(self, num_heads: int, key_dim: int, **kwargs):
        dim = num_heads * key_dim
        bound = (6.0 / (dim + 3 * dim)) ** 0.5
        kwargs.setdefault("kernel_initializer", tf.keras.initializers.RandomUniform(-bound, bound))
        super().__init__(num_heads, key_dim, **kwargs)

    def _make_output_dense(self, free_dims, common_kwargs, name=None):
        common_kwargs = dict(common_kwargs, kernel_initializer=tf.keras.initializers.RandomNormal(
            stddev=REFERENCE_STDDEV))
        return super()._make_output_dense(free_dims, common_kwargs, name=name)


class CausalSequenceEncoder(tf.keras.layers.Layer):
    """Causal self-attention over a history in time order (SASRec, Kang & McAuley 2018): the state of
    every position, each seeing only itself and older items.

    Inputs ``[batch, L, dim]`` item embeddings and their ``[batch, L]`` bool mask, **newest first**
    (the project's history layout: position 0 is the latest click, "" padding at the end). Inside,
    the history is reversed to time order with the padding first, so the newest item always sits at
    the last learned position; each of ``blocks`` blocks is pre-norm multi-head attention under a
    causal and a padding mask, then a two-layer feed-forward network, both residual, with dropout.
    Output ``[batch, L, dim]``, newest first again: position ``p`` is the state after the items at
    ``p, p + 1, ...`` (older), so position 0 encodes the whole history; padded positions are zeros.

    ``layout`` picks the block: ``pre_norm`` (the default) is the standard pre-norm block,
    ``x + drop(attention(norm(x), x))`` then ``x + drop(ffn(norm(x)))``, dropout after each
    sub-layer. ``sasrec`` is the block of the SASRec reference code (Kang & McAuley's and its
    PyTorch port that SASRec+ trains): the item embeddings scaled by ``sqrt(dim)`` before the
    positions are added, the residual taken from the *normalised* query
    (``q = norm(x); x = q + attention(q, x)``), the feed-forward input normalised and its residual
    taken from that (``h = norm(x); x = h + ffn(h)``), dropout on the attention weights and inside
    the feed-forward layer only, layer norms with epsilon 1e-8, and the reference's positions and
    initialisation: position ``i`` is the ``i``-th item of the window counted from its oldest (so a
    user's first item always has position 0, whatever the padding), positions and feed-forward
    kernels normal(0, 0.02), attention as ``ReferenceAttention``. ``pre_norm`` numbers the positions
    from the window's start (the newest item at the last one) and keeps Keras' initialisers.
    """

    def __init__(self, length: int, blocks: int, heads: int, dropout: float, layout: str = "pre_norm", **kwargs):
        super().__init__(**kwargs)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        self.length, self.blocks, self.heads, self.dropout = int(length), int(blocks), int(heads), float(dropout)
        self.layout = layout

    def build(self, input_shape):
        dim = int(input_shape[-1])
        if dim % self.heads:
            raise ValueError(f"the item dimension {dim} does not divide by {self.heads} attention heads")
        sasrec = self.layout == "sasrec"
        self.positions = self.add_weight(
            name="positions", shape=(self.length, dim),
            initializer=(tf.keras.initializers.RandomNormal(stddev=REFERENCE_STDDEV) if sasrec
                         else tf.keras.initializers.TruncatedNormal(stddev=0.02)),
        )
        attention_layer = ReferenceAttention if sasrec else tf.keras.layers.MultiHeadAttention
        self.attention = [
            attention_layer(self.heads, dim // self.heads, dropout=self.dropout, name=f"attention_{b}")
            for b in range(self.blocks)
        ]
        def kernel():  # one instance a layer: an unseeded initializer called twice repeats its values
            return tf.keras.initializers.RandomNormal(stddev=REFERENCE_STDDEV) if sasrec else "glorot_uniform"

        self.feed_forward = [
            (tf.keras.layers.Dense(dim, activation="relu", kernel_initializer=kernel(), name=f"feed_forward_{b}_in"),
             tf.keras.layers.Dense(dim, kernel_initializer=kernel(), name=f"feed_forward_{b}_out"))
            for b in range(self.blocks)
        ]
        epsilon = 1e-8 if self.layout == "sasrec" else 1e-6
        self.norms = [
            (tf.keras.layers.LayerNormalization(epsilon=epsilon, name=f"attention_norm_{b}"),
             tf.keras.layers.LayerNormalization(epsilon=epsilon, name=f"feed_forward_norm_{b}"))
            for b in range(self.blocks)
        ]
        self.final_norm = tf.keras.layers.LayerNormalization(epsilon=epsilon, name="final_norm")
        self.input_scale = float(dim) ** 0.5 if self.layout == "sasrec" else 1.0
        self.drop = tf.keras.layers.Dropout(self.dropout)
        super().build(input_shape)

    def call(self, embeddings, mask, training=None, newest_only=False):
        """``newest_only``: return ``[batch, 1, dim]``, the state at position 0 alone. Its last block
        attends from that one position (the earlier blocks still run over every position, whose
        states it reads), which halves a two-block encoder's cost where only the query is needed."""
        x = tf.reverse(embeddings, axis=[1])  # time order, padding first
        keep = tf.reverse(mask, axis=[1])
        keep_f = tf.cast(keep, x.dtype)[..., None]
        if self.input_scale != 1.0:
            x = x * self.input_scale
        if self.layout == "sasrec":  # counted from the oldest item: the padding's amount moves no item's position
            positions = tf.gather(self.positions, tf.maximum(tf.cumsum(tf.cast(keep, tf.int32), axis=1) - 1, 0))
        else:  # counted from the window's start: the newest item at the last position
            positions = self.positions[None]
        x = self.drop(x + positions, training=training) * keep_f
        causal = tf.linalg.band_part(tf.ones([self.length, self.length], tf.bool), -1, 0)  # [query, key]: key <= query
        attend = tf.logical_and(causal[None], keep[:, None, :])
        sasrec = self.layout == "sasrec"
        for block, (attention, (inner, outer), (attention_norm, feed_norm)) in enumerate(zip(
            self.attention, self.feed_forward, self.norms, strict=True
        )):
            h = attention_norm(x)
            if newest_only and block == self.blocks - 1:  # from here on only the newest position
                h, attend, keep_f, residual = h[:, -1:], attend[:, -1:], keep_f[:, -1:], x[:, -1:]
            else:
                residual = x
            attended = attention(h, x, attention_mask=attend, training=training)
            if sasrec:  # the residual from the normalised query; dropout on the attention weights only
                x = h + attended
                h = feed_norm(x)
                x = h + self.drop(outer(self.drop(inner(h), training=training)), training=training)
            else:
                x = residual + self.drop(attended, training=training)
                h = feed_norm(x)
                x = x + self.drop(outer(self.drop(inner(h), training=training)), training=training)
            x = x * keep_f
        return tf.reverse(self.final_norm(x) * keep_f, axis=[1])

    def get_config(self):
        return super().get_config() | {
            "length": self.length, "blocks": self.blocks, "heads": self.heads, "dropout": self.dropout,
            "layout": self.layout,
        }


class KnownFirst(tf.keras.layers.Layer):
    """Lookup rows ``[batch, L]`` with the known ones (row > 0) moved to the front in their order and
    the out-of-vocabulary and padding rows (0) after them: a history whose unknown items are dropped,
    the rest closing ranks, so it encodes as it would without them. Same shape and dtype."""

    def call(self, rows):
        order = tf.argsort(tf.cast(rows <= 0, tf.int32), axis=1, stable=True)
        return tf.gather(rows, order, batch_dims=1)


class Newest(tf.keras.layers.Layer):
    """Position 0 of a newest-first sequence of states: ``[batch, L, dim] -> [batch, dim]``."""

    def call(self, states):
        return states[:, 0]


class RepeatOverPositions(tf.keras.layers.Layer):
    """A per-user encoding for every position of a sequence: ``[batch, w] -> [batch, length, w]``."""

    def __init__(self, length: int, **kwargs):
        super().__init__(**kwargs)
        self.length = int(length)

    def call(self, values):
        return tf.repeat(values[:, None], self.length, axis=1)

    def get_config(self):
        return super().get_config() | {"length": self.length}


class Known(tf.keras.layers.Layer):
    """``rows > 0``: the ids a StringLookup found (row 0 is out of vocabulary, "" included). Same shape, bool."""

    def call(self, rows):
        return tf.greater(rows, 0)


class ZeroUnlessAny(tf.keras.layers.Layer):
    """``[batch, dim]`` values, zeroed in the rows whose ``[batch, L]`` mask holds no True."""

    def call(self, values, mask):
        return values * tf.cast(tf.reduce_any(mask, axis=1), values.dtype)[:, None]
