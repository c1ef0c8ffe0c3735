"""Log-Q sources: how often an item is a training positive, for in-batch negatives.

In-batch negatives are the other rows' positives, so an item's expected count
among them is ``batch_size * p(i)`` with ``p`` the probability that a training
example's positive is ``i``. Two ways to know ``p``:

- ``StaticFrequency``: click counts of the training log (fixed for the run);
- ``StreamingFrequency``: estimated online from the batches themselves (Yi et
  al., "Sampling-Bias-Corrected Neural Modeling for Large Corpus Item
  Recommendations", RecSys 2019, Algorithm 2 with multiple hashings), for logs
  whose popularity drifts or whose corpus grows while training.

Both answer ``log_probability(ids)``: log per-draw probability, ``[...]`` float32.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from retrieval.samplers.base import check_probability

# Odd 64-bit multipliers for the multiplicative hashes (golden ratio and friends).
_HASH_MULTIPLIERS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)


class StaticFrequency(tf.Module):
    """Per-draw probability from training click counts.

    Args:
      counts: ``[num_items + 1]`` clicks per tower index; entry 0 (OOV) is 0.
        Items without clicks get half a click's probability, so their log is finite.
    """

    def __init__(self, counts, name: str = "static_frequency"):
        super().__init__(name=name)
        counts = np.asarray(counts, dtype=np.float64).copy()
        counts[0] = 0.0
        probability = check_probability(counts, "counts")
        floor = 0.5 / counts.sum()
        self._log_p = tf.constant(np.log(np.maximum(probability, floor)), tf.float32, name="log_p")

    def log_probability(self, ids: tf.Tensor) -> tf.Tensor:
        """log p(ids), same shape as ``ids``."""
        return tf.gather(self._log_p, ids)

    def update(self, ids: tf.Tensor) -> None:
        del ids  # fixed by the training log


class StreamingFrequency(tf.Module):
    """Streaming frequency estimation (Yi et al., RecSys 2019).

    For each of ``num_hashes`` hash functions h, two arrays of ``num_buckets``:
    ``A[h(y)]``, the last step item y was seen, and ``B[h(y)]``, the estimated
    number of steps between two occurrences. Each occurrence at step t updates

        B <- (1 - lr) * B + lr * (t - A);   A <- t

    so ``1 / B`` estimates the item's occurrences per step. An item seen ``c``
    times in one batch gets ``c`` sequential updates, the first with gap
    ``t - A`` and the rest with gap 0, which in closed form is
    ``B <- (1 - lr)^c B + lr (1 - lr)^(c - 1) (t - A)``; at the fixed point
    ``1 / B`` is the expected number of occurrences per step, also above 1. On
    an item's first occurrence B is set to the steps since the start (there is
    no earlier gap to average). Collisions only shrink a bucket's gap, so the
    estimate over several hashings takes the largest gap (Yi et al., Alg. 3).
    The per-draw probability is ``1 / (B * draws per step)``, the draws per
    step being a running mean of the batch size.

    All state is in ``tf.Variable`` s, so it is saved with a checkpoint.
    Under a ``tf.distribute`` strategy the model hands every replica the ids
    of the whole global batch, so the estimator advances once per global step
    over the global batch, as on one device; the variables keep the first
    replica's (identical) update (``ONLY_FIRST_REPLICA``). Under
    ``ParameterServerStrategy`` each worker's step folds in its own batch, the
    workers asynchronously, so steps may land out of order (a gap is then
    taken as 0, never negative).

    Keys are int64: tower indices here; a corpus that grows while training
    can key on ``tf.strings.to_hash_bucket_fast(item_id, 2**62)`` instead.

    Args:
      num_buckets: size of each hash array; ≥ the number of live items keeps collisions rare.
      num_hashes: independent hash functions.
      learning_rate: EMA rate of the gap estimate (``alpha`` in the paper):
        larger tracks changes faster, smaller is less noisy.
      initial_gap: gap reported for items never seen.
    """

    def __init__(
        self,
        num_buckets: int = 1 << 18,
        num_hashes: int = 2,
        learning_rate: float = 0.05,
        initial_gap: float = 1e4,
        name: str = "streaming_frequency",
    ):
        super().__init__(name=name)
        if num_buckets <= 0:
            raise ValueError(f"num_buckets must be positive, got {num_buckets}")
        if not 1 <= num_hashes <= len(_HASH_MULTIPLIERS):
            raise ValueError(f"num_hashes must be in 1..{len(_HASH_MULTIPLIERS)}, got {num_hashes}")
        if not 0 < learning_rate <= 1:
            raise ValueError(f"learning_rate must be in (0, 1], got {learning_rate}")
        if initial_gap <= 0:
            raise ValueError(f"initial_gap must be positive, got {initial_gap}")
        self.num_buckets = int(num_buckets)
        self.num_hashes = int(num_hashes)
        self.learning_rate = float(learning_rate)
        # Every replica computes the same update (see above): keep the first one's.
        first = dict(trainable=False, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self.step = tf.Variable(0, dtype=tf.int64, name="step", **first)
        self.last_step = tf.Variable(
            tf.fill([num_hashes, num_buckets], tf.constant(-1, tf.int64)), name="last_step", **first
        )
        self.gap = tf.Variable(
            tf.fill([num_hashes, num_buckets], tf.constant(initial_gap, tf.float32)), name="gap", **first
        )
        self.draws_per_step = tf.Variable(0.0, dtype=tf.float32, name="draws_per_step", **first)
        self._multipliers = tf.constant(
            [np.uint64(m).astype(np.int64) for m in _HASH_MULTIPLIERS[:num_hashes]], tf.int64
        )

    def buckets(self, keys: tf.Tensor) -> tf.Tensor:
        """Bucket of each key under each hash: int64 ``[num_hashes, *keys.shape]``."""
        keys = tf.cast(keys, tf.int64)
        shape = tf.concat([[self.num_hashes], tf.ones([tf.rank(keys)], tf.int32)], axis=0)
        mixed = tf.reshape(self._multipliers, shape) * keys[tf.newaxis]  # wraps modulo 2^64
        # The high bits of a multiplicative hash are the well-mixed ones.
        return tf.math.floormod(tf.bitwise.right_shift(mixed, 20), self.num_buckets)

    def update(self, keys: tf.Tensor) -> None:
        """Advance one step and fold in this batch's keys (int64 ``[batch_size]``)."""
        keys = tf.reshape(tf.cast(keys, tf.int64), [-1])
        # The increment must wait for the batch: otherwise, inside Keras's train
        # function, it can run beside the iterator's get_next and count the
        # call that only finds the end of the data.
        with tf.control_dependencies([keys]):
            step = self.step.assign_add(1)
        rate = self.learning_rate
        size = tf.cast(tf.size(keys), tf.float32)
        # A running mean too, started at the first batch's size.
        self.draws_per_step.assign(
            tf.where(step == 1, size, (1.0 - rate) * self.draws_per_step + rate * size)
        )
        for h in range(self.num_hashes):
            buckets = self.buckets(keys)[h]
            unique, position = tf.unique(buckets)
            count = tf.cast(
                tf.math.unsorted_segment_sum(tf.ones_like(position), position, tf.size(unique)), tf.float32
            )
            index = tf.stack([tf.fill(tf.shape(unique), tf.constant(h, tf.int64)), unique], axis=1)
            last = tf.gather_nd(self.last_step, index)
            old = tf.gather_nd(self.gap, index)
            # Never negative: under ParameterServerStrategy workers update asynchronously, and a step can
            # read a last_step a later step already wrote (a negative gap would make log-Q NaN).
            elapsed = tf.cast(tf.maximum(step - last, 0), tf.float32)
            decayed = tf.pow(1.0 - rate, count - 1.0)
            updated = (1.0 - rate) * decayed * old + rate * decayed * elapsed
            # First sight (last == -1): the steps since the start are the only gap there is.
            first_sight = tf.cast(step, tf.float32) / count
            new_gap = tf.where(last < 0, first_sight, updated)
            _scatter_nd_update(self.gap, index, new_gap)
            _scatter_nd_update(self.last_step, index, tf.fill(tf.shape(unique), step))

    def expected_count_per_step(self, keys: tf.Tensor) -> tf.Tensor:
        """Estimated occurrences per step, ``1 / max_h B[h(key)]``, same shape as ``keys``."""
        buckets = self.buckets(keys)
        hash_index = tf.broadcast_to(
            tf.reshape(
                tf.range(self.num_hashes, dtype=tf.int64),
                tf.concat([[-1], tf.ones([tf.rank(keys)], tf.int32)], 0),
            ),
            tf.shape(buckets),
        )
        gaps = tf.gather_nd(self.gap, tf.stack([hash_index, buckets], axis=-1))
        return 1.0 / tf.reduce_max(gaps, axis=0)

    def log_probability(self, keys: tf.Tensor) -> tf.Tensor:
        """log per-draw probability: log(occurrences per step / draws per step)."""
        per_step = self.expected_count_per_step(keys)
        draws = tf.maximum(self.draws_per_step, 1.0)
        return tf.math.log(per_step) - tf.math.log(draws)


def _scatter_nd_update(variable: tf.Variable, indices: tf.Tensor, updates: tf.Tensor) -> None:
    """``variable.scatter_nd_update``; mirrored (``tf.distribute``) variables lack it and get
    the whole updated array assigned instead."""
    if isinstance(variable, tf.distribute.DistributedValues):
        variable.assign(tf.tensor_scatter_nd_update(variable, indices, updates))
    else:
        variable.scatter_nd_update(indices, updates)
