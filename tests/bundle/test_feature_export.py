"""Exported feature towers: the SavedModels take raw values and give the in-training embeddings."""

import json

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
from feature_fixtures import write_feature_bundle

import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow)
from retrieval.bundle.saved_models import model_path
from retrieval.bundle.writer import raw_query
from retrieval.features import feature_arrays
from retrieval.serving import Bundle
from retrieval.training import embed_frame

# Known users, a user with missing features, and one never seen anywhere.
USERS = ["u0", "u1", "u5", "stranger"]

# The fixture builds feature towers and writes them as SavedModels (~10-30 s on 2 cores).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return write_feature_bundle(tmp_path_factory.mktemp("bundle"))


def _signature(path):
    return tf.saved_model.load(str(path)).signatures["serving_default"]


def test_signatures_take_exactly_the_declared_raw_inputs(bundle):
    directory, _, query, doc, _, _ = bundle
    manifest = json.loads((directory / "manifest.json").read_text())
    for name, tower in (("query", query), ("doc", doc)):
        specs = _signature(model_path(directory, f"{name}_model")).structured_input_signature[1]
        assert sorted(specs) == sorted(tower.input_names) == sorted(manifest[f"{name}_features"])
        described = {n: {"dtype": s.dtype.name, "shape": s.shape.as_list()} for n, s in specs.items()}
        assert described == manifest[f"{name}_inputs"]
    assert manifest["query_inputs"]["history"] == {"dtype": "string", "shape": [None, 3]}
    assert manifest["doc_inputs"]["tags"] == {"dtype": "string", "shape": [None]}  # split inside the model
    assert manifest["doc_inputs"]["released"] == {"dtype": "float64", "shape": [None]}


def test_saved_models_give_the_in_training_embeddings(bundle):
    directory, tables, query, doc, catalogue, item_embeddings = bundle
    serve_doc = _signature(model_path(directory, "doc_model"))
    raw = {name: tf.constant(values) for name, values in feature_arrays(catalogue, doc.input_names).items()}
    np.testing.assert_allclose(serve_doc(**raw)["embedding"].numpy(), item_embeddings, rtol=1e-5, atol=1e-6)

    queries = tables.queries(USERS)
    expected = embed_frame(query, queries)
    serve_query = _signature(model_path(directory, "query_model"))
    raw = {name: tf.constant(values) for name, values in feature_arrays(queries, query.input_names).items()}
    np.testing.assert_allclose(serve_query(**raw)["embedding"].numpy(), expected, rtol=1e-5, atol=1e-6)
    # The same through the serving API, from plain Python values as a client sends them (null, not NaN).
    plain = [raw_query(queries.iloc[[i]], query.input_names) for i in range(len(queries))]
    served = Bundle.load(directory).embed(plain)
    np.testing.assert_allclose(served[:3], expected[:3], rtol=1e-5, atol=1e-6)
    # The stranger sends nothing but an unknown id: zeros, which serving answers with popular items.
    assert USERS[3] == "stranger" and not served[3].any()


def test_unseen_items_and_users_get_real_embeddings(bundle):
    directory, tables, query, _, catalogue, item_embeddings = bundle
    never_clicked = ~catalogue["item_id"].isin(set(tables.train["item_id"]))
    assert never_clicked.sum() == 1  # i7: features only
    cold = item_embeddings[never_clicked.to_numpy()]
    assert np.all(np.isfinite(cold)) and np.linalg.norm(cold, axis=1).min() > 0.5  # unit norm, not the zero OOV row

    stranger = Bundle.load(directory).recommend(
        {"user_id": "new", "age": 30, "zip": "99999", "country": "BR", "signup": None, "history": ["i7", "i2"]}, k=3,
        exclude_seen=False,  # ranked over every item, as the brute force below
    )
    # An unseen id embedded from its features says so, and keeps its scores.
    assert stranger.fallback == "features" and len(stranger.item_ids) == 3
    # ... and they are the scores of the in-training query tower fed the same raw features.
    raw = {"user_id": "new", "age": 30.0, "zip": "99999", "country": "BR", "signup": np.nan}
    raw["history"] = ("i7", "i2", "")  # padded to the history length, as the bundle pads it
    scores = (embed_frame(query, pd.DataFrame([raw])) @ item_embeddings.T)[0]
    best = np.argsort(-scores, kind="stable")[:3]
    assert stranger.item_ids == catalogue["item_id"].to_numpy()[best].tolist()
    np.testing.assert_allclose(stranger.scores, scores[best], rtol=1e-5, atol=1e-6)
    known = Bundle.load(directory).recommend(raw_query(tables.queries(["u0"]), query.input_names), k=3)
    assert known.fallback is None
    assert "features" in Bundle.load(directory).metadata()["fallbacks"]
    no_history = embed_frame(query, tables.queries(["stranger"]))
    assert np.linalg.norm(no_history) > 0.5


def test_topk_model_serves_feature_queries(bundle):
    directory, tables, query, _, catalogue, item_embeddings = bundle
    queries = tables.queries(USERS)
    raw = {name: tf.constant(values) for name, values in feature_arrays(queries, query.input_names).items()}
    out = _signature(model_path(directory, "topk_model"))(**raw, exclude_item_ids=tf.zeros([len(USERS), 0], tf.string))
    scores = embed_frame(query, queries) @ item_embeddings.T
    expected = catalogue["item_id"].to_numpy()[np.argsort(-scores, axis=1, kind="stable")[:, :3]]
    assert [[v.decode() for v in row] for row in out["item_ids"].numpy()] == expected.tolist()


def test_bad_query_values_are_named(bundle):
    directory, *_ = bundle
    served = Bundle.load(directory)
    good = {"user_id": "u0", "age": 20, "zip": "1", "country": "US", "signup": 1.7e9, "history": []}
    with pytest.raises(ValueError, match="'age' must be a number"):
        served.embed([{**good, "age": "old"}])
    with pytest.raises(ValueError, match="'history' must be a list"):
        served.embed([{**good, "history": "i1"}])


def test_missing_values_may_be_null(bundle):
    directory, tables, query, *_ = bundle
    nothing = {"user_id": "stranger", "age": None, "zip": None, "country": None, "signup": None, "history": []}
    # One missing value beside others is embedded as the in-training tower embeds it ("" and NaN) ...
    expected = embed_frame(query, tables.queries(["stranger"]).assign(age=41.0))
    served = Bundle.load(directory)
    np.testing.assert_allclose(served.embed([{**nothing, "age": 41.0}]), expected, rtol=1e-5, atol=1e-6)
    # ... and a query with nothing but an unknown id embeds to zeros: the popular fallback.
    np.testing.assert_array_equal(served.embed([nothing]), np.zeros_like(expected))
    assert served.recommend(nothing, k=2).fallback == "popular"


def test_the_user_table_fills_a_known_users_features_but_not_the_history(bundle):
    directory, tables, query, *_ = bundle
    served = Bundle.load(directory)
    full = raw_query(tables.queries(["u1"]), query.input_names)  # u1: its age is missing (NaN)
    assert full["age"] is None and full["country"] == "US"
    np.testing.assert_allclose(served.embed([{"user_id": "u1", "history": full["history"]}]), served.embed([full]),
                               rtol=1e-6, atol=1e-7)
    # A bundle that stores no histories (this one, as bundles exported before them) reads a history
    # the query leaves out as empty.
    np.testing.assert_allclose(served.embed([{"user_id": "u1"}]), served.embed([{**full, "history": []}]),
                               rtol=1e-6, atol=1e-7)
