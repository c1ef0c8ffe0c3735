"""Independent references for the losses, used only by the tests.

- ``numpy_in_batch_loss``: in-batch softmax with log-Q correction and accidental-hit
  removal, written with numpy from the formula;
- ``in_batch_softmax_task``: ``tfrs.tasks.Retrieval`` set up to compute the same mean loss;
- ``relative_sampling_probability``: Q scaled so that TFRS's clip at 1e-6 does not bite.

None of this is project code: the project's losses are ``retrieval.losses``. (``tests/conftest.py``
imports ``retrieval`` first, which sets ``TF_USE_LEGACY_KERAS`` before TFRS is imported.)
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import tensorflow_recommenders as tfrs


def numpy_in_batch_loss(q, d, log_q, ids, temperature, weights=None, remove_hits=True):
    """``sum_i w_i * -log softmax_i(q_i . d / T - log Q)[i] / batch_size``.

    Args:
      q, d: [batch_size, dim] query and positive-item embeddings.
      log_q: [batch_size] log Q of each row's positive.
      ids: [batch_size] positive ids; a column with row i's id (other than i) is removed.
    """
    logits = q @ d.T / temperature - log_q[None, :]
    if remove_hits:
        same = ids[:, None] == ids[None, :]
        logits = np.where(same & ~np.eye(len(ids), dtype=bool), -np.inf, logits)
    log_softmax = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    per_row = -np.diag(log_softmax)
    weights = np.ones(len(ids)) if weights is None else weights
    return float(np.sum(per_row * weights) / len(ids))


def relative_sampling_probability(probability) -> np.ndarray:
    """Q / max Q, float32.

    Softmax is unchanged by adding a constant to every logit of a row, so
    ``log(Q / max Q)`` corrects exactly as ``log Q`` does; TFRS clips the
    probability it is given at 1e-6 before taking the log, which raw Q of a
    large corpus's tail falls under.
    """
    probability = np.asarray(probability, dtype=np.float64)
    return (probability / probability.max()).astype(np.float32)


def in_batch_softmax_task(
    *, temperature: float | None, remove_accidental_hits: bool, num_hard_negatives: int | None = None
) -> tfrs.tasks.Retrieval:
    """TFRS in-batch softmax with a mean (not TFRS's default sum) reduction."""
    loss = tf.keras.losses.CategoricalCrossentropy(
        from_logits=True, reduction=tf.keras.losses.Reduction.SUM_OVER_BATCH_SIZE
    )
    return tfrs.tasks.Retrieval(
        loss=loss,
        temperature=temperature,
        remove_accidental_hits=remove_accidental_hits,
        num_hard_negatives=num_hard_negatives,
        name="in_batch_softmax",
    )
