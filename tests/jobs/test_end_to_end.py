"""The whole path on a small synthetic log: train -> index -> evaluate -> export -> serve.

The run is the shared ``trained_bundle`` (tests/conftest.py): the small synthetic job, trained once per
test process.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

import retrieval  # noqa: F401
from retrieval.bundle.run_directory import RunExistsError
from retrieval.bundle.saved_models import model_path
from retrieval.data import ITEM, load_dataset
from retrieval.jobs import evaluate_bundle, train_evaluate_export
from retrieval.serving import Bundle

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(trained_bundle):
    return trained_bundle.config, trained_bundle.result


def test_model_clearly_beats_popularity_on_held_back_data(run):
    _, result = run
    model, popular = result.metrics["model"], result.metrics["popularity"]
    assert model["users"] == popular["users"] > 100
    assert model["recall@20"] > 1.3 * popular["recall@20"], (model["recall@20"], popular["recall@20"])
    assert model["ndcg@20"] > popular["ndcg@20"]


def test_bundle_layout_and_no_partial_directories(run):
    config, result = run
    names = {p.name for p in result.directory.iterdir()}
    assert {"manifest.json", "models", "index.faiss", "item_ids.parquet", "config.yaml",
            "train_log.csv", "metrics.json"} <= names
    manifest = json.loads((result.directory / "manifest.json").read_text())
    assert manifest["embedding_dim"] == config.model.embedding_dim
    assert manifest["metric"] == "inner_product"
    assert manifest["num_items"] == result.metrics["data"]["catalogue_items"]
    assert not [p for p in result.directory.parent.iterdir() if p.name.startswith(".")]
    # The job records a training user's query and its top 10, which serving reproduces at load.
    probe = manifest["probe"]
    assert list(probe["query"]) == ["user_id"] and len(probe["item_ids"]) == len(probe["scores"]) == 10
    served = Bundle.load(result.directory).recommend(probe["query"], k=10, exclude_seen=False)  # as the probe ran
    assert served.item_ids == probe["item_ids"]
    version = manifest["model_version"]
    assert {"index.faiss", "item_ids.parquet", "index.json", f"models/query/{version}/saved_model.pb",
            f"models/doc/{version}/saved_model.pb"} <= set(manifest["fingerprints"]["files"])


def test_the_bundle_ships_the_catalogues_display_features(run):
    # The synthetic source brings an item table (category, price, title): the web page's features.
    from retrieval.bundle.display_features import DISPLAY_FEATURES_FILE
    from retrieval.data.synthetic import generate_clicks

    config, result = run
    _, items, _ = generate_clicks(config.data.synthetic)
    bundle = Bundle.load(result.directory)
    assert bundle.manifest["files"]["item_features"] == DISPLAY_FEATURES_FILE
    assert bundle.manifest["item_features"]["features"] == ["category", "price", "title"]
    ids = list(bundle.index.item_ids)
    assert bundle.manifest["item_features"]["num_items"] == int(items["item_id"].astype(str).isin(ids).sum())
    rows = items.assign(item_id=items["item_id"].astype(str)).set_index("item_id")
    for item, features in zip(ids[:50], bundle.item_features(ids[:50])):
        row = rows.loc[item]
        price = None if pd.isna(row["price"]) else float(row["price"])
        assert features == {"category": row["category"], "price": price, "title": row["title"]}, item


def test_index_covers_items_without_training_clicks(run):
    config, result = run
    dataset = load_dataset(config.data, config.split)
    catalogue = set(dataset.items[ITEM].astype(str))
    cold = catalogue - set(dataset.train[ITEM].astype(str))
    assert len(cold) >= 5  # the synthetic log has never-clicked items, and the split leaves more
    index = Bundle.load(result.directory).index
    assert index.index.ntotal == len(index.item_ids) == len(catalogue)
    assert set(index.item_ids) == catalogue  # every cold item is searchable, not only the trained ones


def test_run_directory_is_never_silently_overwritten(run):
    config, _ = run
    with pytest.raises(RunExistsError, match="already exists"):
        train_evaluate_export(config)


def test_served_top_k_equals_brute_force_over_exported_towers(run):
    _, result = run
    bundle = Bundle.load(result.directory)
    users = ["u0001", "u0002", "u0003"]
    # The towers and the index, without the exclusion of training items (tests/serving/test_seen_items.py).
    served = bundle.recommend_batch([{"user_id": u} for u in users], k=10, exclude_seen=False)
    query_model = tf.saved_model.load(str(model_path(result.directory, "query_model"))).signatures["serving_default"]
    doc_model = tf.saved_model.load(str(model_path(result.directory, "doc_model"))).signatures["serving_default"]
    items = np.asarray(bundle.index.item_ids, dtype=object)
    doc = doc_model(item_id=tf.constant(items))["embedding"].numpy()
    query = query_model(user_id=tf.constant(users))["embedding"].numpy()
    expected = np.argsort(-(query @ doc.T), axis=1, kind="stable")[:, :10]
    for result_row, expected_rows in zip(served, expected):
        assert result_row.fallback is None
        assert result_row.item_ids == [str(items[r]) for r in expected_rows]


def test_exclusions_and_unknown_users(run):
    _, result = run
    bundle = Bundle.load(result.directory)
    first = bundle.recommend({"user_id": "u0001"}, k=5)
    again = bundle.recommend({"user_id": "u0001"}, k=5, exclude_item_ids=first.item_ids[:2])
    assert again.item_ids[:3] == first.item_ids[2:]
    assert not set(first.item_ids[:2]) & set(again.item_ids)
    unknown = bundle.recommend({"user_id": "nobody"}, k=5)
    assert unknown.fallback == "popular"
    assert unknown.item_ids == bundle.manifest["popular_item_ids"][:5]


def test_fresh_process_serves_the_same_top_k(run):
    _, result = run
    in_process = Bundle.load(result.directory).recommend({"user_id": "u0007"}, k=10)
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "retrieval.serving",
            "--bundle",
            str(result.directory),
            "--user-id",
            "u0007",
            "-k",
            "10",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=True,
    )
    served = json.loads(completed.stdout.strip().splitlines()[-1])
    assert served["item_ids"] == in_process.item_ids
    np.testing.assert_allclose(served["scores"], in_process.scores, rtol=1e-5)


def test_re_evaluating_the_bundle_reproduces_the_metrics(run):
    _, result = run
    again = evaluate_bundle(result.directory)
    for key in ("recall@20", "ndcg@20", "mrr@100"):
        assert again["model"][key] == pytest.approx(result.metrics["model"][key], abs=1e-9)
        assert again["popularity"][key] == pytest.approx(result.metrics["popularity"][key], abs=1e-9)
