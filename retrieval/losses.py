"""Losses and logit transforms.

Every loss here scores a batch of queries against candidates and corrects the
logits for how the candidates were sampled: ``logit / temperature - log Q``.
That correction (Yi et al., RecSys 2019; Bengio & Senecal 2008) removes the
popularity bias that in-batch or sampled negatives would otherwise bake into
the model: popular items appear as negatives more often, so without it they
are pushed down too hard.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import tensorflow_recommenders as tfrs


def relative_sampling_probability(probability: np.ndarray) -> np.ndarray:
    """Scale Q so its largest value is 1.

    Softmax is unchanged by adding a constant to every logit of a row, so
    ``log(Q / max Q)`` corrects exactly as ``log Q`` does. TFRS clips the
    probability it is given at 1e-6 before taking the log; on a large corpus
    raw Q falls below that for most of the tail, and the clip would silently
    under-correct exactly the items the correction is for. Relative to the head
    item, a tail item clicked once stays above 1e-6 unless the head has a
    million times more clicks.

    Args:
      probability: [num_items] non-negative.

    Returns:
      [num_items] float32 in [0, 1].
    """
    probability = np.asarray(probability, dtype=np.float64)
    if probability.ndim != 1 or probability.size == 0:
        raise ValueError(f"probability must be a non-empty vector, got shape {probability.shape}")
    if np.any(probability < 0) or not np.all(np.isfinite(probability)):
        raise ValueError("probability must be finite and non-negative")
    peak = probability.max()
    if peak <= 0:
        raise ValueError("probability must have at least one positive entry")
    return (probability / peak).astype(np.float32)


def in_batch_softmax_task(
    *, temperature: float | None, remove_accidental_hits: bool
) -> tfrs.tasks.Retrieval:
    """TFRS in-batch softmax with a mean (not TFRS's default sum) reduction.

    The mean keeps the learning rate independent of the batch size.
    """
    loss = tf.keras.losses.CategoricalCrossentropy(
        from_logits=True, reduction=tf.keras.losses.Reduction.SUM_OVER_BATCH_SIZE
    )
    return tfrs.tasks.Retrieval(
        loss=loss,
        temperature=temperature,
        remove_accidental_hits=remove_accidental_hits,
        name="in_batch_softmax",
    )
