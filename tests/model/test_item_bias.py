"""A learned item bias outside the dot product (``model.item_bias``).

The towers score ``(q . d + b_item) / temperature`` through one inner product (the query appends 1,
the doc its bias), the bias starts at the centred log training count times the temperature, the
loss sees those logits, and a trained bundle serves the same ranking as a brute-force numpy top-k.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

import retrieval  # noqa: F401
from retrieval.config import ConfigError, LossConfig, ModelConfig, load_config
from retrieval.features import FeatureStatistics
from retrieval.losses import LossInputs
from retrieval.model import build_model
from retrieval.towers import id_tower
from retrieval.towers.bias import log_popularity_bias, with_item_bias


def _clicks(seed: int = 0, users: int = 30, items: int = 20) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({"user_id": [f"u{u}" for u in rng.integers(users, size=300)],
                          "item_id": [f"i{i}" for i in rng.zipf(1.5, size=300) % items]})
    frame["weight"] = np.float32(1.0)
    return frame


def test_the_towers_dot_product_is_the_cosine_plus_the_items_bias():
    stats = FeatureStatistics.from_training_clicks(_clicks())
    tf.keras.utils.set_random_seed(0)
    query, doc = id_tower("user_id", stats.users, 8), id_tower("item_id", stats.items, 8)
    initial = np.linspace(-1.0, 1.0, len(stats.items) + 1).astype(np.float32)
    biased_query, biased_doc = with_item_bias(query, doc, stats.items.ids, initial)
    users = tf.constant(["u1", "u2", "nobody"])
    items = tf.constant([stats.items.ids[0], stats.items.ids[5], "unknown item"])
    got = biased_query({"user_id": users}).numpy() @ biased_doc({"item_id": items}).numpy().T
    cosines = query({"user_id": users}).numpy() @ doc({"item_id": items}).numpy().T
    bias = np.array([initial[1], initial[6], 0.0])  # tower index = vocabulary position + 1; unknown: 0
    known_user = np.array([1.0, 1.0, 0.0])[:, np.newaxis]  # an unknown user's query stays all zeros
    np.testing.assert_allclose(got, cosines + known_user * bias[np.newaxis, :], rtol=1e-5, atol=1e-6)
    assert not biased_query({"user_id": users}).numpy()[2].any()
    assert biased_query.output_shape[-1] == biased_doc.output_shape[-1] == 9


def test_the_bias_starts_at_the_centred_log_count_times_the_temperature():
    counts = np.array([0, 1, 9, 99, 0])
    logs = np.log([2.0, 10.0, 100.0, 1.0])
    np.testing.assert_allclose(log_popularity_bias(counts, 0.2), 0.2 * np.r_[0.0, logs - logs.mean()], rtol=1e-6)


@pytest.mark.parametrize("negatives", ["in_batch", "mixed"])
def test_the_loss_scores_the_biased_logits(negatives):
    clicks = _clicks(seed=1)
    stats = FeatureStatistics.from_training_clicks(clicks)
    loss = LossConfig(log_q_source="static", negatives=negatives, num_negatives=16)
    config = ModelConfig(embedding_dim=8, temperature=0.25, loss=loss, item_bias=True)
    tf.keras.utils.set_random_seed(0)
    model = build_model(config, stats)
    bias = model.doc_tower.get_layer("item_bias").embeddings.numpy()[:, 0]
    expected_start = log_popularity_bias(stats.item_popularity.counts, 0.25)
    np.testing.assert_allclose(bias, expected_start, rtol=1e-6)
    # Ranking: every catalogue item's cosine + bias (the temperature scales, never reorders).
    users = tf.constant(["u0", "u3"])
    queries = model.query_tower({"user_id": users})
    catalogue = model.embed_catalogue().numpy()
    np.testing.assert_allclose(catalogue[:, -1], bias, rtol=1e-6)
    cosines = queries.numpy()[:, :-1] @ catalogue[:, :-1].T
    np.testing.assert_allclose(model.item_scores(queries).numpy(), cosines + bias, rtol=1e-4, atol=1e-5)
    # Training: each candidate column's logit is the unbiased one plus its item's bias / temperature.
    batch = {"user_id": tf.constant(clicks["user_id"][:64]), "item_id": tf.constant(clicks["item_id"][:64])}
    positive_ids = model.item_index(batch["item_id"])
    tf.keras.utils.set_random_seed(3)
    negatives = (model.sampler.sample(positive_ids, queries=None, embed_catalogue=model.embed_catalogue),)
    inputs = LossInputs(
        queries=model.query_tower({"user_id": batch["user_id"]}),
        positives=model.doc_tower({"item_id": batch["item_id"]}), positive_ids=positive_ids, negatives=negatives,
        negative_embeddings=tuple(model.embed_items(n.ids) for n in negatives),
        includes_batch_positives=model.sampler.includes_batch_positives, sample_weight=None, own_items=None,
    )
    unbiased = inputs._replace(queries=inputs.queries[:, :-1], positives=inputs.positives[:, :-1],
                               negative_embeddings=tuple(e[..., :-1] for e in inputs.negative_embeddings))
    biased_logits, _, kept = (t.numpy() for t in model.objective.candidate_columns(inputs))
    plain_logits, _, _ = (t.numpy() for t in model.objective.candidate_columns(unbiased))
    columns = np.concatenate([positive_ids.numpy()] + [np.ravel(n.ids.numpy()) for n in negatives
                                                       if n.ids.shape.num_elements()])
    expected = np.broadcast_to(plain_logits + bias[columns][np.newaxis, :] / 0.25, plain_logits.shape)
    np.testing.assert_allclose(biased_logits[kept], expected[kept], rtol=1e-4, atol=1e-4)
    # The bias is a trained variable of the doc tower.
    with tf.GradientTape() as tape:
        value = model.compute_loss(batch, training=True)
    gradient = tape.gradient(value, model.doc_tower.get_layer("item_bias").embeddings)
    assert np.isfinite(float(value)) and np.abs(tf.convert_to_tensor(gradient).numpy()).sum() > 0


def test_item_bias_settings_are_checked():
    with pytest.raises(ConfigError, match="model.item_bias.*ensemble_members"):
        load_config(None, ["model.item_bias=true", "model.ensemble_members=2"])
    with pytest.raises(ConfigError, match="model.item_bias.*'bsl'"):
        load_config(None, ["model.item_bias=true", "model.loss.kind=bsl", "model.log_q_correction=false"])
    stats = FeatureStatistics.from_training_clicks(_clicks())
    doc_of_categories = id_tower("category", stats.items, 8)  # a doc tower that never reads item_id
    with pytest.raises(ValueError, match="model.item_bias needs a doc tower that reads 'item_id'"):
        with_item_bias(id_tower("user_id", stats.users, 8), doc_of_categories, stats.items.ids,
                       np.zeros(len(stats.items) + 1))


@pytest.mark.slow
def test_a_trained_bundle_with_an_item_bias_serves_the_brute_force_top_k(tmp_path):
    from retrieval.jobs import train_evaluate_export
    from retrieval.serving import Bundle

    config = load_config(None, [
        "data.synthetic.n_users=120", "data.synthetic.n_items=60", "model.embedding_dim=8",
        "model.item_bias=true", "train.epochs=2", "train.batch_size=128", "train.validation_fraction=0",
        "train.verbose=0", "evaluation.baselines.rankers=[popularity]", "evaluation.plots=false",
        f"run.output_dir={tmp_path / 'runs'}", "run.name=bias",
    ])
    result = train_evaluate_export(config)
    bundle = Bundle.load(result.directory)  # reruns the probe: the exported towers carry the bias
    assert bundle.index.dim == 9
    user = "u0001"
    served = bundle.recommend({"user_id": user}, k=10, exclude_seen=False)
    query = bundle.embed([{"user_id": user}])[0]
    assert query[-1] == pytest.approx(1.0)
    vectors, ids = bundle.index.flat_vectors(), np.asarray(bundle.index.item_ids)
    assert not np.allclose(vectors[:, -1], vectors[0, -1])  # a bias an item, not one constant
    expected = ids[np.argsort(-(vectors @ query), kind="stable")[:10]].tolist()
    assert served.item_ids == expected
    assert bundle.recommend({"user_id": "never seen"}, k=5).fallback == "popular"
