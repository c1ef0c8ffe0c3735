"""Ensembles of towers (``model.ensemble_members``): K members served as one pair of towers.

The joined towers score the mean of the members' scores; the training loss is the sum of each
member's own loss, as the member alone would compute it; a sequence job with two members exports a
bundle that serves a raw history by that mean.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

import retrieval  # noqa: F401
from retrieval.config import ConfigError, LossConfig, ModelConfig, load_config
from retrieval.features import FeatureStatistics
from retrieval.model import TwoTowerModel, build_model
from retrieval.model.parts import build_objective, build_sampler, resolved
from retrieval.towers import ensemble_towers, id_tower, member_embeddings


def _clicks(seed: int = 0, users: int = 30, items: int = 20) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({"user_id": [f"u{u}" for u in rng.integers(users, size=200)],
                          "item_id": [f"i{i}" for i in rng.integers(items, size=200)]})
    frame["weight"] = np.float32(1.0)
    return frame


def test_the_joined_towers_score_the_mean_of_the_members_scores():
    stats = FeatureStatistics.from_training_clicks(_clicks())
    tf.keras.utils.set_random_seed(0)
    members = [(id_tower("user_id", stats.users, 8, name=f"query_tower_{k}"),
                id_tower("item_id", stats.items, 8, name=f"doc_tower_{k}")) for k in range(3)]
    query, doc = ensemble_towers(members)
    users, items = tf.constant(["u1", "u2", "nobody"]), tf.constant(["i0", "i3", "i5", "i9"])
    joined = query({"user_id": users}).numpy() @ doc({"item_id": items}).numpy().T
    alone = np.mean([q({"user_id": users}).numpy() @ d({"item_id": items}).numpy().T for q, d in members], axis=0)
    np.testing.assert_allclose(joined, alone, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(query({"user_id": users[:2]}).numpy(), axis=1), 1.0, rtol=1e-5)
    parts = member_embeddings(query({"user_id": users}), 3)
    for part, (q, _) in zip(parts, members, strict=True):
        np.testing.assert_allclose(part.numpy(), q({"user_id": users}).numpy(), rtol=1e-5, atol=1e-6)
    assert ensemble_towers(members[:1]) == members[0]


@pytest.mark.parametrize("negatives", ["in_batch", "mixed"])
def test_the_ensemble_loss_is_the_sum_of_each_members_loss_alone(negatives):
    clicks = _clicks(seed=1)
    stats = FeatureStatistics.from_training_clicks(clicks)
    loss = LossConfig(log_q_source="static", negatives=negatives, num_negatives=16)
    config = ModelConfig(embedding_dim=8, temperature=0.2, loss=loss, ensemble_members=2)
    tf.keras.utils.set_random_seed(0)
    model = build_model(config, stats)
    assert model.query_tower.output_shape[-1] == 16
    batch = {"user_id": tf.constant(clicks["user_id"][:32]), "item_id": tf.constant(clicks["item_id"][:32])}
    tf.keras.utils.set_random_seed(5)  # the mixed sampler's draws: the same for every model below
    ensemble_loss = float(model.compute_loss(batch))
    member_losses = []
    for k in range(2):
        single = TwoTowerModel(model.query_tower.get_layer(f"query_tower_{k}"),
                               model.doc_tower.get_layer(f"doc_tower_{k}"),
                               build_objective(resolved(config, stats), stats.item_popularity.counts, 8),
                               build_sampler(loss, stats.item_popularity.counts), item_ids=stats.items.ids)
        tf.keras.utils.set_random_seed(5)
        member_losses.append(float(single.compute_loss(batch)))
    assert member_losses[0] != pytest.approx(member_losses[1])  # two members, not one twice
    assert ensemble_loss == pytest.approx(sum(member_losses), rel=1e-5)


def test_ensemble_settings_are_checked():
    with pytest.raises(ConfigError, match="hierarchical_softmax' does not score by one"):
        load_config(None, ["model.ensemble_members=2", "model.loss.kind=hierarchical_softmax",
                           "model.log_q_correction=false"])
    with pytest.raises(ConfigError, match="model.ensemble_members"):
        load_config(None, ["model.ensemble_members=0"])


@pytest.mark.slow
def test_a_sequence_ensemble_job_serves_a_history_by_the_members_mean(tmp_path):
    from retrieval.jobs import train_evaluate_export
    from retrieval.serving import Bundle

    rng = np.random.default_rng(4)
    lines = [" ".join([f"u{u}", *(f"i{i}" for i in rng.integers(40, size=rng.integers(2, 10)))]) for u in range(80)]
    path = tmp_path / "sequences.txt"
    path.write_text("\n".join(lines) + "\n")
    config = load_config(None, [
        "data.source=files", f"data.clicks.path={path}", "data.clicks.format=sequences",
        "split.kind=leave_last_k", "split.k=1", "towers.query.features=[]",
        "towers.query.history={length: 6, pooling: transformer}",
        "towers.doc.features=[{name: item_id, kind: id}]", "model.embedding_dim=8", "model.ensemble_members=2",
        "model.remove_sequence_items=true",
        "train.examples=sequences", "train.epochs=2", "train.batch_size=16", "train.validation_fraction=0.1",
        "train.verbose=0", "evaluation.baselines.rankers=[popularity]", "evaluation.plots=false",
        f"run.output_dir={tmp_path / 'runs'}", "run.name=ensemble",
    ])
    result = train_evaluate_export(config)
    bundle = Bundle.load(result.directory)  # reruns the probe: the SavedModel is the trained ensemble
    assert bundle.index.dim == 16
    history = ["i3", "i7", "i1"]
    served = bundle.recommend({"history": history}, k=10)
    assert len(served.item_ids) == 10 and not set(history) & set(served.item_ids) and served.fallback is None
    query = bundle.embed([{"history": history}])[0]
    np.testing.assert_allclose(np.linalg.norm(query.reshape(2, 8), axis=1), 2 ** -0.5, rtol=1e-4)  # two members
    vectors, ids = bundle.index.flat_vectors(), np.asarray(bundle.index.item_ids)
    scores = np.where(np.isin(ids, history), -np.inf, vectors @ query)  # the members' mean, history excluded
    assert served.item_ids == ids[np.argsort(-scores, kind="stable")[:10]].tolist()
    assert bundle.recommend({"history": []}, k=5).fallback == "popular"
