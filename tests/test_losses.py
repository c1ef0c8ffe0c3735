"""In-batch softmax with log-Q correction against a numpy hand computation."""

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

import retrieval  # noqa: F401
from retrieval.config import ModelConfig
from retrieval.features import FeatureStatistics
from retrieval.losses import in_batch_softmax_task, relative_sampling_probability
from retrieval.model import build_model


def _numpy_in_batch_loss(q, d, log_q, ids, temperature, weights=None, remove_hits=True):
    logits = q @ d.T / temperature - log_q[None, :]
    if remove_hits:
        same = ids[:, None] == ids[None, :]
        logits = np.where(same & ~np.eye(len(ids), dtype=bool), -np.inf, logits)
    log_softmax = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    per_row = -np.diag(log_softmax)
    weights = np.ones(len(ids)) if weights is None else weights
    return float(np.sum(per_row * weights) / len(ids))


def test_relative_probability_is_probability_over_its_max():
    q = np.array([0.5, 0.25, 0.125, 0.125])
    np.testing.assert_allclose(relative_sampling_probability(q), [1.0, 0.5, 0.25, 0.25])
    # log(Q / max Q) differs from log Q by one constant, so softmax is unchanged.
    shift = np.log(q) - np.log(relative_sampling_probability(q))
    np.testing.assert_allclose(shift, shift[0])


@pytest.mark.parametrize("bad", [np.array([]), np.array([0.0, 0.0]), np.array([0.5, -0.1]), np.array([np.nan])])
def test_relative_probability_rejects_bad_input(bad):
    with pytest.raises(ValueError, match="probability"):
        relative_sampling_probability(bad)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tfrs_task_with_correction_equals_numpy(seed):
    rng = np.random.default_rng(seed)
    batch, dim, temperature = 8, 4, 0.2
    q = rng.normal(size=(batch, dim)).astype(np.float32)
    d = rng.normal(size=(batch, dim)).astype(np.float32)
    ids = np.array([0, 1, 2, 1, 3, 4, 0, 5])  # rows 1/3 and 0/6 share a positive: accidental hits
    prob = rng.uniform(0.01, 1.0, size=batch).astype(np.float32)
    weights = rng.uniform(0.5, 2.0, size=batch).astype(np.float32)
    task = in_batch_softmax_task(temperature=temperature, remove_accidental_hits=True)
    loss = task(
        tf.constant(q),
        tf.constant(d),
        sample_weight=tf.constant(weights),
        candidate_sampling_probability=tf.constant(prob),
        candidate_ids=tf.constant(ids),
        compute_metrics=False,
    )
    expected = _numpy_in_batch_loss(q, d, np.log(prob), ids, temperature, weights)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    # The correction matters: without it the loss is different.
    assert expected != pytest.approx(_numpy_in_batch_loss(q, d, np.zeros(batch), ids, temperature, weights))


def test_model_loss_uses_training_popularity_as_q():
    train = pd.DataFrame(
        {
            "user_id": ["u1", "u2", "u3", "u1", "u2", "u4"],
            "item_id": ["a", "a", "a", "b", "c", "b"],
            "weight": np.ones(6, np.float32),
        }
    )
    stats = FeatureStatistics.from_training_clicks(train)
    config = ModelConfig(embedding_dim=6, temperature=0.1)
    tf.keras.utils.set_random_seed(0)
    model = build_model(config, stats)
    batch = {"user_id": tf.constant(["u1", "u2", "u3", "u4"]), "item_id": tf.constant(["a", "c", "b", "b"])}
    loss = float(model.compute_loss(batch))

    q = model.query_tower({"user_id": batch["user_id"]}).numpy()
    d = model.doc_tower({"item_id": batch["item_id"]}).numpy()
    counts = {"a": 3, "b": 2, "c": 1}  # training clicks per item
    log_q = np.log([counts[i] / 6 for i in ["a", "c", "b", "b"]])
    ids = np.array([0, 1, 2, 2])
    assert loss == pytest.approx(_numpy_in_batch_loss(q, d, log_q, ids, 0.1), rel=1e-5)


def test_unknown_ids_embed_to_zero():
    train = pd.DataFrame({"user_id": ["u1", "u2"], "item_id": ["a", "b"], "weight": [1.0, 1.0]})
    model = build_model(ModelConfig(embedding_dim=4), FeatureStatistics.from_training_clicks(train))
    out = model.query_tower({"user_id": tf.constant(["never-seen", "u1"])}).numpy()
    np.testing.assert_array_equal(out[0], np.zeros(4))
    assert np.linalg.norm(out[1]) == pytest.approx(1.0, rel=1e-5)
