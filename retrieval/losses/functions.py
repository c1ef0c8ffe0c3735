"""Pure functions on logits (logits first, as ``tf.nn``): the building blocks every loss uses.

``correct_log_q`` (the sampled-softmax correction), ``remove_accidental_hits``
(and ``accidental_hits``, its mask), ``mine_hard_negatives`` (and
``hard_negative_columns``, the columns it keeps), ``candidate_scores``,
``softmax_cross_entropy``, ``weighted_mean`` (the reduction) and ``gbce_beta`` (gBCE's exponent), with the
``MIN_FLOAT`` / ``MAX_FLOAT`` constants that mask or force a column.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

# As TFRS: large enough to remove a column from a softmax, small enough that
# adding a logit to it stays finite.
MIN_FLOAT = float(np.finfo(np.float32).min / 100.0)
MAX_FLOAT = float(np.finfo(np.float32).max / 100.0)


def correct_log_q(logits: tf.Tensor, log_q: tf.Tensor) -> tf.Tensor:
    """``logits - log_q``: the sampled-softmax correction.

    Args:
      logits: ``[batch_size, num_candidates]``.
      log_q: log expected count of each candidate, broadcastable to ``logits``
        (``[num_candidates]`` shared or ``[batch_size, num_candidates]``).
    """
    return logits - tf.cast(log_q, logits.dtype)


def remove_accidental_hits(
    logits: tf.Tensor, labels: tf.Tensor, candidate_ids: tf.Tensor, positive_ids: tf.Tensor | None = None
) -> tf.Tensor:
    """Push negatives that are the row's own positive item out of the softmax.

    A candidate column whose id equals the row's positive id, and which is not
    the label column itself, gets ``MIN_FLOAT`` added (as TFRS and
    ``tf.nn.sampled_softmax_loss`` do), so it carries no probability and no gradient.

    Args:
      logits: ``[batch_size, num_candidates]``.
      labels: ``[batch_size, num_candidates]`` one-hot (all zero for a block of
        negatives only; then ``positive_ids`` is required).
      candidate_ids: ``[num_candidates]`` shared or ``[batch_size, num_candidates]``.
      positive_ids: ``[batch_size]``; None = the id at each row's label column.
    """
    labels = tf.cast(labels, logits.dtype)
    candidate_ids = tf.cast(candidate_ids, tf.int64)
    if positive_ids is None:
        label_column = tf.math.argmax(labels, axis=1)
        if candidate_ids.shape.rank == 1:
            positive_ids = tf.gather(candidate_ids, label_column)
        else:
            positive_ids = tf.gather(candidate_ids, label_column, batch_dims=1)
    return logits + tf.cast(accidental_hits(labels, candidate_ids, positive_ids), logits.dtype) * MIN_FLOAT


def accidental_hits(labels: tf.Tensor, candidate_ids: tf.Tensor, positive_ids: tf.Tensor) -> tf.Tensor:
    """Bool ``[batch_size, num_candidates]``: columns whose id is the row's positive id, label column excepted.

    Args:
      labels: ``[batch_size, num_candidates]`` one-hot (all zero for a block of negatives only).
      candidate_ids: ``[num_candidates]`` shared or ``[batch_size, num_candidates]``.
      positive_ids: ``[batch_size]``.
    """
    same = tf.equal(tf.cast(candidate_ids, tf.int64), tf.cast(positive_ids, tf.int64)[:, tf.newaxis])
    return tf.logical_and(same, tf.logical_not(tf.cast(labels, tf.bool)))


def mine_hard_negatives(logits: tf.Tensor, labels: tf.Tensor, k: int) -> tuple[tf.Tensor, tf.Tensor]:
    """Keep each row's positive and its ``k`` highest-scoring negatives (TFRS ``num_hard_negatives``).

    Args:
      logits: ``[batch_size, num_candidates]`` (already corrected and hit-removed).
      labels: ``[batch_size, num_candidates]`` one-hot.
      k: negatives kept per row; all are kept when there are fewer.

    Returns:
      ``(logits, labels)``, each ``[batch_size, min(k + 1, num_candidates)]``.
    """
    labels = tf.cast(labels, logits.dtype)
    columns = hard_negative_columns(logits, labels, k)
    return tf.gather(logits, columns, batch_dims=1), tf.gather(labels, columns, batch_dims=1)


def hard_negative_columns(logits: tf.Tensor, labels: tf.Tensor, k: int) -> tf.Tensor:
    """The columns ``mine_hard_negatives`` keeps: int32 ``[batch_size, min(k + 1, num_candidates)]``.

    Gather any other per-column tensor of the same candidates (a mask) with
    ``tf.gather(x, columns, batch_dims=1)``.
    """
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    keep = tf.minimum(k + 1, tf.shape(logits)[1])
    _, columns = tf.math.top_k(logits + tf.cast(labels, logits.dtype) * MAX_FLOAT, k=keep, sorted=False)
    return columns


SCORE_DTYPES = ("float32", "bfloat16")


def candidate_scores(queries: tf.Tensor, candidates: tf.Tensor, dtype: str = "float32") -> tf.Tensor:
    """Dot products ``[batch_size, num_candidates]``, float32.

    Args:
      queries: ``[batch_size, dim]``.
      candidates: ``[num_candidates, dim]`` shared or ``[batch_size, num_candidates, dim]`` per query.
      dtype: the precision of the product: "bfloat16" rounds both sides to bfloat16 (8 bits of
        significand) before multiplying, where the CPU's bfloat16 instructions make the product
        cheaper; the sums are accumulated in float32 but come back rounded to bfloat16 (TensorFlow's
        CPU kernels have no float32 output for bfloat16 inputs), then cast to float32, which log-Q,
        the masks and the softmax read.
    """
    if dtype not in SCORE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(SCORE_DTYPES)}, got {dtype!r}")
    if candidates.shape.rank not in (2, 3):
        raise ValueError(f"candidates must be [num, dim] or [batch, num, dim], got shape {candidates.shape}")
    out_dtype = queries.dtype
    if dtype != "float32":
        queries, candidates = tf.cast(queries, dtype), tf.cast(candidates, dtype)
    if candidates.shape.rank == 2:
        scores = tf.linalg.matmul(queries, candidates, transpose_b=True)
    else:
        scores = tf.einsum("bd,bcd->bc", queries, candidates)
    return tf.cast(scores, out_dtype)


def softmax_cross_entropy(logits: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    """Per-example cross-entropy ``[batch_size]`` of one-hot ``labels`` under ``softmax(logits)``."""
    return tf.nn.softmax_cross_entropy_with_logits(labels=tf.cast(labels, logits.dtype), logits=logits)


def weighted_mean(
    per_example: tf.Tensor, sample_weight: tf.Tensor | None = None, global_batch_size=None
) -> tf.Tensor:
    """``sum(w * loss) / batch_size`` (Keras ``SUM_OVER_BATCH_SIZE``), so the
    learning rate does not depend on the batch size.

    With ``global_batch_size`` (rows over every replica of a ``tf.distribute``
    strategy) it is this replica's share of the global mean,
    ``tf.nn.compute_average_loss``: the replicas' shares, and their gradients
    (which tf-keras optimizers sum), add up to the single-device values.
    """
    if sample_weight is not None:
        per_example = per_example * tf.cast(sample_weight, per_example.dtype)
    if global_batch_size is None:
        global_batch_size = tf.shape(per_example)[0]
    return tf.reduce_sum(per_example) / tf.cast(global_batch_size, per_example.dtype)


def gbce_beta(num_negatives: int, num_items: int, calibration: float) -> float:
    """gBCE's exponent ``beta = alpha * (t * (1 - 1/alpha) + 1/alpha)`` (Petrov & Macdonald, RecSys 2023).

    ``alpha = num_negatives / (num_items - 1)`` is the negative sampling rate (the share of the
    catalogue's other items a positive meets as negatives) and ``t = calibration`` in [0, 1]:
    ``t = 0`` gives ``beta = 1`` (plain binary cross-entropy), ``t = 1`` gives ``beta = alpha``, the
    exponent under which the loss's optimum is the calibrated probability of the full catalogue.
    """
    if num_items < 2:
        raise ValueError(f"gBCE needs a catalogue of at least 2 items, got {num_items}")
    if num_negatives <= 0:
        raise ValueError(f"num_negatives must be positive, got {num_negatives}")
    if not 0.0 <= calibration <= 1.0:
        raise ValueError(f"calibration (gBCE's t) must be in [0, 1], got {calibration}")
    alpha = num_negatives / (num_items - 1)
    return alpha * (calibration * (1.0 - 1.0 / alpha) + 1.0 / alpha)
