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
    times in one batch gets ``c`` updates that share the batch's gap evenly, each
    with gap ``(t - A) / c``, which in closed form is
    ``B <- (1 - lr)^c B + (1 - (1 - lr)^c) (t - A) / c``; with ``c = 1`` that
    is the rule above, and at the fixed point of ``c`` occurrences a step
    ``B = 1 / c`` exactly. (Ordering them as one update with gap ``t - A`` then
    ``c - 1`` with gap 0 ends each batch on ``c - 1`` zeros, so ``1 / B``
    overestimates by a factor that grows like ``(1 - lr)^-c``: at lr 0.05, 1.27
    at 10 a step, 2.8 at 36, as often as a 1,024-click batch of the synthetic
    log holds its most clicked item.) On an item's first occurrence B is set to
    the steps since the start (there is no earlier gap to average), divided by c.
    Collisions only shrink a bucket's gap, so the estimate over several hashings
    takes the largest gap (Yi et al., Alg. 3).
    The per-draw probability is ``1 / (B * draws per step)``, the draws per
    step being a running mean of the batch size.

    All state is in ``tf.Variable`` s, so it is saved with a checkpoint. Each hash's two arrays are
    ``num_shards`` variables (bucket ``b`` in shard ``b % num_shards`` at ``b // num_shards``), which
    ``ParameterServerStrategy`` places on its ps tasks in turn: the estimator is sharded like the
    ID tables (whose partitioner cannot take it: its arrays are scatter-updated).
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
      num_shards: variables each hash array is split into.
    """

    def __init__(
        self,
        num_buckets: int = 1 << 18,
        num_hashes: int = 2,
        learning_rate: float = 0.05,
        initial_gap: float = 1e4,
        name: str = "streaming_frequency",
        num_shards: int = 1,
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
        if not 1 <= num_shards <= num_buckets:
            raise ValueError(f"num_shards must be in 1..num_buckets ({num_buckets}), got {num_shards}")
        self.num_buckets = int(num_buckets)
        self.num_hashes = int(num_hashes)
        self.num_shards = int(num_shards)
        self.learning_rate = float(learning_rate)
        self.initial_gap = float(initial_gap)
        # Every replica computes the same update (see above): keep the first one's.
        first = dict(trainable=False, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self.step = tf.Variable(0, dtype=tf.int64, name="step", **first)
        rows = -(-self.num_buckets // self.num_shards)  # the last shards may hold one unused slot
        # [hash][shard] -> [rows]
        self.last_steps = [[tf.Variable(tf.fill([rows], tf.constant(-1, tf.int64)), name=f"last_step_{h}_{s}",
                                        **first) for s in range(self.num_shards)] for h in range(num_hashes)]
        self.gaps = [[tf.Variable(tf.fill([rows], tf.constant(initial_gap, tf.float32)), name=f"gap_{h}_{s}",
                                  **first) for s in range(self.num_shards)] for h in range(num_hashes)]
        self.draws_per_step = tf.Variable(0.0, dtype=tf.float32, name="draws_per_step", **first)
        self._multipliers = tf.constant(
            [np.uint64(m).astype(np.int64) for m in _HASH_MULTIPLIERS[:num_hashes]], tf.int64
        )

    @property
    def gap(self) -> tf.Tensor:
        """Every gap, float32 ``[num_hashes, num_buckets]`` (read from the shards)."""
        return tf.stack([self._whole(shards) for shards in self.gaps])

    @property
    def last_step(self) -> tf.Tensor:
        """Every bucket's last step, int64 ``[num_hashes, num_buckets]`` (-1: never seen)."""
        return tf.stack([self._whole(shards) for shards in self.last_steps])

    def _whole(self, shards: list[tf.Variable]) -> tf.Tensor:
        """One hash's array from its shards: bucket ``b`` is shard ``b % S``'s row ``b // S``."""
        return tf.reshape(tf.stack([tf.convert_to_tensor(shard) for shard in shards], axis=1), [-1])[
            : self.num_buckets]

    def assign_arrays(self, hash_index: int, gap: np.ndarray, last_step: np.ndarray) -> None:
        """Set hash ``hash_index``'s whole arrays (``gap`` float32 and ``last_step`` int64, [num_buckets])
        across its shards (a warm start moves an estimate to new keys: ``retrieval.training.warm_start``)."""
        rows = -(-self.num_buckets // self.num_shards)
        for values, shards in ((gap, self.gaps[hash_index]), (last_step, self.last_steps[hash_index])):
            padded = np.resize(values, rows * self.num_shards).reshape(rows, self.num_shards)
            for s, shard in enumerate(shards):
                shard.assign(padded[:, s])

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
        all_buckets = self.buckets(keys)
        for h in range(self.num_hashes):
            unique, position = tf.unique(all_buckets[h])
            count = tf.cast(
                tf.math.unsorted_segment_sum(tf.ones_like(position), position, tf.size(unique)), tf.float32
            )
            shard_of = tf.cast(tf.math.floormod(unique, self.num_shards), tf.int32)
            rows = tf.math.floordiv(unique, self.num_shards)
            row_parts = tf.dynamic_partition(rows, shard_of, self.num_shards)
            count_parts = tf.dynamic_partition(count, shard_of, self.num_shards)
            for s in range(self.num_shards):
                at, seen = row_parts[s], count_parts[s]
                last = tf.gather(self.last_steps[h][s], at)
                old = tf.gather(self.gaps[h][s], at)
                # Never negative: under ParameterServerStrategy workers update asynchronously, and a step can
                # read a last_step a later step already wrote (a negative gap would make log-Q NaN).
                elapsed = tf.cast(tf.maximum(step - last, 0), tf.float32)
                # c updates, each with the mean gap elapsed / c of the batch's c occurrences.
                decayed = tf.pow(1.0 - rate, seen)
                updated = decayed * old + (1.0 - decayed) * elapsed / seen
                # First sight (last == -1): the steps since the start are the only gap there is.
                first_sight = tf.cast(step, tf.float32) / seen
                _scatter_update(self.gaps[h][s], at, tf.where(last < 0, first_sight, updated))
                _scatter_update(self.last_steps[h][s], at, tf.fill(tf.shape(at), step))

    def expected_count_per_step(self, keys: tf.Tensor) -> tf.Tensor:
        """Estimated occurrences per step, ``1 / max_h B[h(key)]``, same shape as ``keys``."""
        keys = tf.convert_to_tensor(keys)
        flat = tf.reshape(self.buckets(keys), [self.num_hashes, -1])
        gaps = []
        for h in range(self.num_hashes):
            shard_of = tf.cast(tf.math.floormod(flat[h], self.num_shards), tf.int32)
            rows = tf.dynamic_partition(tf.math.floordiv(flat[h], self.num_shards), shard_of, self.num_shards)
            places = tf.dynamic_partition(tf.range(tf.size(flat[h])), shard_of, self.num_shards)
            gaps.append(tf.dynamic_stitch(places, [tf.gather(self.gaps[h][s], rows[s])
                                                   for s in range(self.num_shards)]))
        return tf.reshape(1.0 / tf.reduce_max(tf.stack(gaps), axis=0), tf.shape(keys))

    def log_probability(self, keys: tf.Tensor) -> tf.Tensor:
        """log per-draw probability: log(occurrences per step / draws per step)."""
        per_step = self.expected_count_per_step(keys)
        draws = tf.maximum(self.draws_per_step, 1.0)
        return tf.math.log(per_step) - tf.math.log(draws)


def _scatter_update(variable: tf.Variable, rows: tf.Tensor, updates: tf.Tensor) -> None:
    """``variable[rows] = updates``; mirrored (``tf.distribute``) variables lack scatter updates and get
    the whole updated array assigned instead."""
    if isinstance(variable, tf.distribute.DistributedValues):
        variable.assign(tf.tensor_scatter_nd_update(variable, rows[:, tf.newaxis], updates))
    else:
        variable.scatter_nd_update(rows[:, tf.newaxis], updates)
