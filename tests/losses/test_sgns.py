"""SGNS (``NegativeSampling``) against an independent numpy SGNS, values and gradients.

The per-example values of shared negatives are in ``test_sampled_losses.py``. Here: negatives drawn
per row (``[batch, k]`` ids, word2vec's own form, which the loss supports and which
``benchmarks/results/sgns.md`` shows is what SGNS needs to learn), and the gradients the optimizer
gets, for shared and per-row negatives, against the closed form ``d/ds softplus(-s) = -(1 - σ(s))``,
``d/ds softplus(s) = σ(s)`` that the numpy SGNS of ``sgns.md`` applies.
"""

import numpy as np
import pytest
import tensorflow as tf

import retrieval  # noqa: F401
from retrieval.losses import LossInputs, NegativeSampling
from retrieval.samplers import Negatives

BATCH, DIM, NUM_ITEMS, K, T = 6, 5, 30, 4, 0.5


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _draw(seed, per_row):
    rng = np.random.default_rng(seed)
    queries = rng.normal(size=(BATCH, DIM))
    items = rng.normal(size=(NUM_ITEMS + 1, DIM))
    items[0] = 0.0
    positive_ids = rng.integers(1, NUM_ITEMS + 1, BATCH)
    ids = rng.integers(1, NUM_ITEMS + 1, (BATCH, K) if per_row else (K,))
    if per_row:
        ids[0, 2] = positive_ids[0]  # accidental hits: one in row 0 ...
    else:
        ids[1] = positive_ids[3]  # ... or the shared column 1 for row 3
    log_q = np.log(rng.uniform(0.05, 2.0, ids.shape))
    positive_log_q = np.log(rng.uniform(0.05, 2.0, BATCH))
    return queries, items, positive_ids, ids, log_q, positive_log_q


def _numpy_sgns(queries, items, positive_ids, ids, log_q, positive_log_q, weight):
    """Per-example loss and the gradients of the mean loss w.r.t. queries and every item row."""
    ids = np.broadcast_to(ids, (BATCH, K))
    log_q = np.broadcast_to(log_q, (BATCH, K))
    negatives = items[ids]  # [B, K, D]
    s_pos = np.sum(queries * items[positive_ids], axis=1) / T - weight * positive_log_q
    s_neg = np.einsum("bd,bkd->bk", queries, negatives) / T - weight * log_q
    keep = ids != positive_ids[:, None]
    loss = np.logaddexp(0, -s_pos) + np.sum(np.where(keep, np.logaddexp(0, s_neg), 0.0), axis=1)
    g_pos = -(1 - _sigmoid(s_pos)) / T / BATCH  # d mean loss / d (q . v)
    g_neg = np.where(keep, _sigmoid(s_neg), 0.0) / T / BATCH
    d_queries = g_pos[:, None] * items[positive_ids] + np.einsum("bk,bkd->bd", g_neg, negatives)
    d_items = np.zeros_like(items)
    np.add.at(d_items, positive_ids, g_pos[:, None] * queries)
    np.add.at(d_items, ids.reshape(-1), (g_neg[:, :, None] * queries[:, None, :]).reshape(-1, DIM))
    return loss, d_queries, d_items


def _ours(queries, items, positive_ids, ids, log_q, positive_log_q, weight):
    q = tf.Variable(queries, dtype=tf.float64)
    table = tf.Variable(items, dtype=tf.float64)
    loss = NegativeSampling(temperature=T, log_q_weight=weight)
    with tf.GradientTape() as tape:
        inputs = LossInputs(
            queries=q,
            positives=tf.gather(table, positive_ids),
            positive_ids=tf.constant(positive_ids, tf.int64),
            negatives=(Negatives(tf.constant(ids, tf.int64), tf.constant(log_q), tf.constant(positive_log_q)),),
            negative_embeddings=(tf.gather(table, ids),),
            includes_batch_positives=False,
        )
        per_example = loss.per_example(inputs)
        mean = loss.compute(inputs)
    d_queries, d_items = tape.gradient(mean, [q, table])
    return per_example.numpy(), d_queries.numpy(), tf.convert_to_tensor(d_items).numpy()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "shared"])
@pytest.mark.parametrize("log_q_weight", [0.0, 1.0], ids=["word2vec", "nce"])
def test_sgns_values_and_gradients_equal_numpy(seed, per_row, log_q_weight):
    drawn = _draw(seed, per_row)
    loss, d_queries, d_items = _ours(*drawn, log_q_weight)
    expected_loss, expected_d_queries, expected_d_items = _numpy_sgns(*drawn, log_q_weight)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-10)
    np.testing.assert_allclose(d_queries, expected_d_queries, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(d_items, expected_d_items, rtol=1e-9, atol=1e-12)

