"""Independent references for the losses, used only by the tests.

- ``numpy_in_batch_loss``: in-batch softmax with log-Q correction and accidental-hit
  removal, written with numpy from the formula;
- ``in_batch_softmax_task``: ``tfrs.tasks.Retrieval`` set up to compute the same mean loss;
- ``relative_sampling_probability``: Q scaled so that TFRS's clip at 1e-6 does not bite;
- ``row_candidates``: each row's positive and kept negatives, by loops; with it
  ``numpy_cosine_contrastive`` (SimpleX's CCL), ``numpy_bilateral_softmax`` (BSL) and
  ``numpy_gbce`` (gSASRec's gBCE).

None of this is project code: the project's losses are ``retrieval.losses``. (``tests/conftest.py``
imports ``retrieval`` first, which sets ``TF_USE_LEGACY_KERAS`` before TFRS is imported.)
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import tensorflow_recommenders as tfrs


def numpy_in_batch_loss(q, d, log_q, ids, temperature, weights=None, remove_hits=True, removed=None):
    """``sum_i w_i * -log softmax_i(q_i . d / T - log Q)[i] / batch_size``.

    Args:
      q, d: [batch_size, dim] query and positive-item embeddings.
      log_q: [batch_size] log Q of each row's positive.
      ids: [batch_size] positive ids; a column with row i's id (other than i) is removed.
      removed: [batch_size, batch_size] bool, more columns to remove from each row (not its own).
    """
    logits = q @ d.T / temperature - log_q[None, :]
    if remove_hits:
        same = ids[:, None] == ids[None, :]
        if removed is not None:
            same = same | removed
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


def row_candidates(q, d, positive_ids, positive_log_q, blocks=(), in_batch=True, remove_hits=True):
    """Each row's positive and kept negatives, by loops over rows and columns.

    Args:
      q, d: [batch_size, dim] query and positive-item embeddings.
      positive_ids, positive_log_q: [batch_size].
      blocks: ``(embeddings, ids, log_q)`` of sampled negatives: [num, dim], [num], [num] shared
        or [batch, num, dim], [batch, num], [batch, num] per row; log_q >= 1e29 marks padding.
      in_batch: the other rows' positives are negatives too.

    Returns:
      one ``(score, log_q, negative_scores, negative_log_q)`` per row, the last two 1-d arrays.
    """
    rows = []
    for i in range(len(q)):
        scores, log_qs = [], []
        if in_batch:
            for j in range(len(q)):
                if j == i or (remove_hits and positive_ids[j] == positive_ids[i]):
                    continue
                scores.append(float(q[i] @ d[j]))
                log_qs.append(float(positive_log_q[j]))
        for embeddings, ids, log_q in blocks:
            row_embeddings = embeddings if embeddings.ndim == 2 else embeddings[i]
            row_ids = ids if ids.ndim == 1 else ids[i]
            row_log_q = log_q if log_q.ndim == 1 else log_q[i]
            for c in range(len(row_ids)):
                if row_log_q[c] >= 1e29 or (remove_hits and row_ids[c] == positive_ids[i]):
                    continue
                scores.append(float(q[i] @ row_embeddings[c]))
                log_qs.append(float(row_log_q[c]))
        rows.append((float(q[i] @ d[i]), float(positive_log_q[i]), np.array(scores), np.array(log_qs)))
    return rows


def numpy_cosine_contrastive(rows, margin, negative_weight, weights=None):
    """SimpleX's CCL, ``mean_i w_i [relu(1 - s+) + negative_weight * mean_j relu(s_j - margin)]``.

    ``rows`` from ``row_candidates``; a row without negatives has its positive term only.
    """
    per_row = []
    for positive, _, negatives, _ in rows:
        pushed = np.mean(np.maximum(negatives - margin, 0.0)) if len(negatives) else 0.0
        per_row.append(max(1.0 - positive, 0.0) + negative_weight * pushed)
    weights = np.ones(len(rows)) if weights is None else np.asarray(weights)
    return float(np.sum(np.array(per_row) * weights) / len(rows))


def numpy_bilateral_softmax(rows, temperature, negative_temperature, log_q_weight=0.0, weights=None):
    """BSL (junkangwu/BSL ``mode="reweight"``): ``-log(exp(l+) / (sum_j exp(l_j)) ** tau2)``, averaged.

    ``l = s / temperature - log_q_weight * log Q``; ``rows`` from ``row_candidates``; a row
    without negatives counts 0. Written with ``exp`` and ``log`` of the sum, not log-sum-exp.
    """
    per_row = []
    for positive, positive_log_q, negatives, negative_log_q in rows:
        if not len(negatives):
            per_row.append(0.0)
            continue
        positive_logit = positive / temperature - log_q_weight * positive_log_q
        negative_logits = negatives / temperature - log_q_weight * negative_log_q
        ratio = np.exp(positive_logit) / np.sum(np.exp(negative_logits)) ** negative_temperature
        per_row.append(-np.log(ratio))
    weights = np.ones(len(rows)) if weights is None else np.asarray(weights)
    return float(np.sum(np.array(per_row) * weights) / len(rows))


def numpy_gbce(rows, beta, temperature=1.0, weights=None):
    """gBCE (Petrov & Macdonald 2023), from its equation, ``rows`` from ``row_candidates``:

    ``-(1 / (|N| + 1)) * (log(sigmoid(s+) ** beta) + sum_{j in N} log(1 - sigmoid(s_j)))`` with
    ``s = score / temperature``, averaged over the rows (weighted). Written with ``sigmoid`` and
    ``log`` in float64, not softplus.
    """
    def sigmoid(x):
        return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))

    per_row = []
    for positive, _, negatives, _ in rows:
        total = np.log(sigmoid(positive / temperature) ** beta) + np.sum(np.log(1.0 - sigmoid(negatives / temperature)))
        per_row.append(-total / (len(negatives) + 1))
    weights = np.ones(len(rows)) if weights is None else np.asarray(weights)
    return float(np.sum(np.array(per_row) * weights) / len(rows))
