"""Feature towers through the whole job on a small synthetic log, with cold items held out of training."""

import numpy as np
import pytest
import tensorflow as tf

import retrieval  # noqa: F401
from retrieval.bundle.saved_models import model_path
from retrieval.data import ITEM, USER, load_dataset
from retrieval.features import TowerTables, feature_arrays
from retrieval.jobs import evaluate_bundle
from retrieval.serving import Bundle

SMALL = [
    "data.synthetic.n_users=500",
    "data.synthetic.n_items=250",
    "data.synthetic.mean_clicks_per_user=30",
    "split.hold_out_items=0.1",
    "train.epochs=4",
    "train.batch_size=512",
    "evaluation.plots=false",
    "evaluation.baselines.rankers=[popularity]",
    "export.topk_model=false",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(train_run):
    config, result = train_run("synthetic_features.yaml", SMALL, "features")
    return config, load_dataset(config.data, config.split), result


def test_feature_model_beats_popularity(run):
    _, _, result = run
    model, popular = result.metrics["model"], result.metrics["popularity"]
    assert model["recall@20"] > 1.3 * popular["recall@20"], (model["recall@20"], popular["recall@20"])


def test_the_probe_query_holds_every_raw_query_feature_and_loads(run):
    """A feature tower's probe: every query feature as plain JSON (lists of ids, null for missing)."""
    config, dataset, result = run
    bundle = Bundle.load(result.directory)
    probe = bundle.manifest["probe"]
    assert list(probe["query"]) == bundle.query_features and len(bundle.query_features) > 1
    assert probe["query"][USER] in set(dataset.train[USER].astype(str))
    assert bundle.recommend(probe["query"], k=10, exclude_seen=False).item_ids == probe["item_ids"]


def test_items_held_out_of_training_are_indexed_from_their_features(run):
    config, dataset, result = run
    held = set(dataset.held_out_items)
    assert 20 <= len(held) <= 25 and not held & set(dataset.train[ITEM])  # 10% of the ~240 clicked items
    catalogue = TowerTables.from_dataset(dataset, config.towers).catalogue()
    doc = tf.saved_model.load(str(model_path(result.directory, "doc_model"))).signatures["serving_default"]
    inputs = feature_arrays(catalogue, list(doc.structured_input_signature[1]))
    embeddings = doc(**{name: tf.constant(values) for name, values in inputs.items()})["embedding"].numpy()
    cold = embeddings[catalogue[ITEM].isin(held).to_numpy()]
    assert np.linalg.norm(cold, axis=1).min() > 0.5  # unit vectors from features, not the zero OOV row
    assert len(np.unique(cold.round(4), axis=0)) == len(cold)  # distinct: their features differ
    # They are retrieved: some user's served top-20 holds a held-out item.
    bundle = Bundle.load(result.directory)
    users = sorted(set(dataset.test[USER]))[:200]
    queries = TowerTables.from_dataset(dataset, config.towers).queries(users).to_dict("records")
    served = {item for r in bundle.recommend_batch(queries, k=20) for item in r.item_ids}
    assert served & held


def test_users_unseen_in_training_are_served_from_their_features(run):
    config, dataset, result = run
    unseen = sorted(set(dataset.test[USER]) - set(dataset.train[USER]))
    assert result.metrics["counts"]["test_users_unseen_in_training"] == len(unseen) > 0
    queries = TowerTables.from_dataset(dataset, config.towers).queries(unseen).to_dict("records")
    assert all(q["history"] == ("",) * 20 for q in queries)
    served = Bundle.load(result.directory).recommend_batch(queries, k=10)
    # Unseen ids, embedded from their features: the reply says so and keeps the scores.
    assert all(r.fallback == "features" and len(r.item_ids) == 10 and None not in r.scores for r in served)


def test_re_evaluating_the_bundle_reproduces_the_metrics(run):
    # Query and doc SavedModels fed raw features give the in-training ranking.
    _, _, result = run
    again = evaluate_bundle(result.directory)
    for key in ("recall@20", "ndcg@20", "mrr@100"):
        assert again["model"][key] == pytest.approx(result.metrics["model"][key], abs=1e-6)
