"""Config -> sampler + loss wiring, mined hard negatives, and the model's full softmax."""

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

import retrieval  # noqa: F401
from retrieval.config import ConfigError, LossConfig, ModelConfig, load_config
from retrieval.features import FeatureStatistics
from retrieval.losses import LossInputs, SampledSoftmax
from retrieval.model import build_model
from retrieval.model.parts import build_objective, build_sampler
from retrieval.samplers import MASKED_LOG_Q, FaissHardNegativeMiner, Negatives, UserHistory


def _train(seed=0, users=30, items=25, clicks=300):
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "user_id": [f"u{u}" for u in rng.integers(0, users, clicks)],
            "item_id": [f"i{i}" for i in np.minimum(rng.zipf(1.3, clicks), items)],
            "weight": np.ones(clicks, np.float32),
        }
    )


def _batch(train, size=16):
    rows = train.iloc[:size]
    return {
        "user_id": tf.constant(rows["user_id"].tolist()),
        "item_id": tf.constant(rows["item_id"].tolist()),
    }


LOSSES = [
    {},
    {"negatives": "uniform", "num_negatives": 8},
    {"negatives": "unigram", "num_negatives": 8, "unique": True},
    {"negatives": "log_uniform", "num_negatives": 8},
    {"negatives": "mixed", "num_negatives": 8, "mixed_corpus": "unigram"},
    {"kind": "full_softmax"},
    {"kind": "sgns", "negatives": "unigram", "num_negatives": 5},
    {"kind": "hierarchical_softmax"},
    {"hard_negatives": "in_batch_top_k", "num_hard_negatives": 3},
    {"hard_negatives": "mined", "num_hard_negatives": 3, "mining_refresh_steps": 2},
    {"log_q_source": "streaming"},
]


@pytest.mark.parametrize(
    "loss", LOSSES, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "default"
)
def test_every_loss_trains_the_same_towers(loss):
    """The towers are built the same way whatever the loss; each loss gives a finite
    value and a gradient to the query tower (to the tree's node vectors for the
    hierarchical softmax, whose nodes start at zero as in word2vec)."""
    train = _train()
    stats = FeatureStatistics.from_training_clicks(train)
    tf.keras.utils.set_random_seed(0)
    model = build_model(ModelConfig(embedding_dim=8, loss=LossConfig(**loss)), stats, train_clicks=train)
    assert [layer.name for layer in model.query_tower.layers] == [
        "user_id",
        "user_id_lookup",
        "user_id_embedding",
        "l2_normalize",
    ]
    with tf.GradientTape() as tape:
        value = model.compute_loss(_batch(train), training=True)
    assert np.isfinite(float(value))
    trained = model.query_tower.trainable_variables + model.objective.trainable_variables
    gradients = [tf.convert_to_tensor(g) for g in tape.gradient(value, trained) if g is not None]
    assert sum(float(tf.reduce_sum(tf.abs(g))) for g in gradients) > 0
    scores = model.item_scores(model.query_tower({"user_id": tf.constant(["u1", "u2"])}))
    assert scores.shape == (2, len(stats.items) + 1)


def test_model_full_softmax_equals_numpy_over_the_vocabulary():
    train = _train(1)
    stats = FeatureStatistics.from_training_clicks(train)
    tf.keras.utils.set_random_seed(1)
    config = ModelConfig(embedding_dim=6, temperature=0.25, loss=LossConfig(kind="full_softmax"))
    model = build_model(config, stats)
    batch = _batch(train, 10)
    loss = float(model.compute_loss(batch))
    q = model.query_tower({"user_id": batch["user_id"]}).numpy()
    items = model.doc_tower({"item_id": tf.constant(list(stats.items.ids))}).numpy()
    logits = q @ items.T / 0.25
    labels = stats.items.lookup(batch["item_id"].numpy().astype(str)) - 1
    expected = np.mean(np.logaddexp.reduce(logits, axis=1) - logits[np.arange(10), labels])
    assert loss == pytest.approx(expected, rel=1e-5)


def test_unknown_names_are_rejected_with_the_valid_ones():
    counts = np.r_[0.0, np.ones(5)]
    bad = LossConfig.model_construct(**{**LossConfig().model_dump(), "negatives": "magic"})
    with pytest.raises(ValueError, match=r"unknown model.loss.negatives 'magic'; valid: in_batch, uniform"):
        build_sampler(bad, counts)
    bad = LossConfig.model_construct(**{**LossConfig().model_dump(), "kind": "nce"})
    config = ModelConfig.model_construct(**{**ModelConfig(temperature=0.2).model_dump(), "loss": bad})
    with pytest.raises(ValueError, match=r"unknown model.loss.kind 'nce'; valid: softmax, full_softmax"):
        build_objective(config, counts, 4)
    with pytest.raises(ConfigError, match=r"model.loss.kind"):
        load_config(None, ["model.loss.kind=nce"])
    with pytest.raises(ConfigError, match=r"hierarchical_softmax has none"):
        load_config(None, ["model.loss.kind=hierarchical_softmax", "model.loss.hard_negatives=mined"])


def test_mined_negatives_need_the_training_clicks():
    train = _train()
    stats = FeatureStatistics.from_training_clicks(train)
    with pytest.raises(ValueError, match="pass train_clicks"):
        build_model(ModelConfig(loss=LossConfig(hard_negatives="mined")), stats)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_miner_returns_brute_force_top_k_minus_positive_and_clicks(seed):
    rng = np.random.default_rng(seed)
    num_items, dim, k = 40, 6, 5
    items = rng.normal(size=(num_items + 1, dim)).astype(np.float32)
    queries = rng.normal(size=(8, dim)).astype(np.float32)
    users = rng.integers(0, 4, 60)
    clicked = rng.integers(1, num_items + 1, 60)
    history = UserHistory(users, clicked, 4)
    miner = FaissHardNegativeMiner(k, refresh_every=10, history=history)
    miner.rebuild(items)
    positives = rng.integers(1, num_items + 1, 8)
    user_rows = np.r_[rng.integers(0, 4, 7), -1]  # the last user is unknown
    mined = miner.mine(queries, positives, user_rows)
    for row in range(8):
        excluded = {positives[row]} | (
            set(clicked[users == user_rows[row]]) if user_rows[row] >= 0 else set()
        )
        order = [
            i + 1 for i in np.argsort(-(queries[row] @ items[1:].T), kind="stable") if i + 1 not in excluded
        ]
        assert mined[row].tolist() == order[:k]


def test_slots_the_miner_cannot_fill_are_masked_out_of_the_loss():
    # Fewer items than num_negatives: each row gets its 3 items other than the positive, then
    # id 0 (OOV) padding, which must carry MASKED_LOG_Q so the loss never sees it.
    rng = np.random.default_rng(0)
    items = rng.normal(size=(5, 3)).astype(np.float32)  # tower indices 1..4
    queries = rng.normal(size=(2, 3)).astype(np.float32)
    positives = np.array([1, 2])
    miner = FaissHardNegativeMiner(6, refresh_every=100)
    negatives = miner.sample(
        tf.constant(positives, tf.int64), tf.constant(queries), tf.constant([-1, -1], tf.int64), lambda: items
    )
    ids, log_q = negatives.ids.numpy(), negatives.log_q.numpy()
    assert (ids[:, :3] > 0).all() and (ids[:, 3:] == 0).all()
    np.testing.assert_array_equal(log_q, np.where(ids > 0, 0.0, np.float32(MASKED_LOG_Q)))
    loss = SampledSoftmax(temperature=1.0, log_q_weight=1.0)

    def per_example(columns):
        inputs = LossInputs(
            tf.constant(queries),
            tf.constant(items[positives]),
            tf.constant(positives, tf.int64),
            (Negatives(tf.constant(ids[:, columns]), tf.constant(log_q[:, columns]), tf.zeros([2])),),
            (tf.constant(items[ids[:, columns]]),),
            False,
        )
        return loss.per_example(inputs).numpy()

    np.testing.assert_allclose(per_example(slice(None)), per_example(slice(0, 3)), rtol=1e-6)


@pytest.mark.slow
def test_miner_rebuilds_every_n_steps_inside_training():
    train = _train(2)
    stats = FeatureStatistics.from_training_clicks(train)
    config = ModelConfig(
        embedding_dim=8, loss=LossConfig(hard_negatives="mined", num_hard_negatives=3, mining_refresh_steps=3)
    )
    model = build_model(config, stats, train_clicks=train)
    step = tf.function(lambda batch: model.compute_loss(batch, training=True))
    for _ in range(7):
        step(_batch(train))
    assert model.miner.rebuilds == 3  # steps 0, 3 and 6
    assert int(model.miner.step) == 7
