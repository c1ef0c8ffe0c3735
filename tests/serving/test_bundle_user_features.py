"""A feature-tower bundle answers a request by user id alone: it ships each known user's raw query
features (user_features.parquet) and fills those a request lacks, what the request sends winning."""

import json
import shutil

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from feature_fixtures import ALL_KINDS, small_tables, write_feature_bundle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_service import _fixed_id_tower, call

import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow)
from retrieval import serving
from retrieval.bundle.manifest import MANIFEST_FILE
from retrieval.bundle.user_features import USER_FEATURES_FILE, UserFeatures
from retrieval.bundle.writer import raw_query, write_bundle
from retrieval.features import TowerTables, feature_arrays
from retrieval.index import ItemIndex
from retrieval.jobs import reevaluate_reindex
from retrieval.serving import Bundle, BundleError
from retrieval.serving.http import create_app

# ALL_KINDS without the click history: every query input but the id comes from the user table.
NO_HISTORY = ALL_KINDS.model_copy(update={"query": ALL_KINDS.query.model_copy(update={"history": None})})
TABLE_FEATURES = ["age", "zip", "country", "signup"]
KNOWN = ["u0", "u1", "u2", "u3", "u4", "u5"]  # u1 lacks its age, u4 its country, u5 its zip
EXAMPLES = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# The fixture builds feature towers and writes them as SavedModels (~10-30 s on 2 cores).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    directory, tables, query, *_ = write_feature_bundle(
        tmp_path_factory.mktemp("bundle") / "features", NO_HISTORY, topk=False,
        manifest={"run": "features", "popular_item_ids": ["i0", "i1"], "config": {}},
    )
    return directory, tables, list(query.input_names)


@pytest.fixture(scope="module")
def served(built):
    return Bundle.load(built[0])


def _full(built, user):
    """The user's raw query with every feature, as a client that has them all sends it."""
    _, tables, names = built
    return raw_query(tables.queries([user]), names)


def test_the_bundle_ships_every_users_raw_features_fingerprinted_and_described(built, served):
    directory, tables, _ = built
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    assert manifest["files"]["user_features"] == USER_FEATURES_FILE
    assert manifest["user_features"] == {"file": USER_FEATURES_FILE, "id_column": "user_id",
                                         "features": TABLE_FEATURES, "num_users": 6}
    assert USER_FEATURES_FILE in manifest["fingerprints"]["files"]
    frame = pd.read_parquet(directory / USER_FEATURES_FILE)
    assert list(frame.columns) == ["user_id", *TABLE_FEATURES] and frame["user_id"].tolist() == KNOWN
    expected = tables.user_features(KNOWN)
    pd.testing.assert_frame_equal(frame, expected, check_dtype=False)
    assert served.metadata()["user_features"] == {"features": TABLE_FEATURES, "num_users": 6, "user_input": "user_id"}
    assert served.metadata()["fallbacks"] == ["popular", "features"]


def test_a_known_user_id_alone_gets_the_answer_of_its_full_query(built, served):
    for user in KNOWN:
        alone = served.recommend({"user_id": user}, k=5, exclude_seen=False)
        full = served.recommend(_full(built, user), k=5, exclude_seen=False)
        assert alone.item_ids == full.item_ids and alone.fallback == full.fallback is None
        np.testing.assert_allclose(alone.scores, full.scores, rtol=1e-6, atol=1e-7)
    # A batch mixing both forms, and the embeddings themselves.
    queries = [{"user_id": "u0"}, _full(built, "u1"), {"user_id": "u4", "zip": None}]
    batch = served.recommend_batch(queries, k=5, exclude_seen=False)
    assert [r.item_ids for r in batch] == [served.recommend(q, k=5, exclude_seen=False).item_ids for q in queries]
    np.testing.assert_allclose(served.embed([{"user_id": u} for u in KNOWN]),
                               served.embed([_full(built, u) for u in KNOWN]), rtol=1e-6, atol=1e-7)


@EXAMPLES
@given(user=st.sampled_from(KNOWN), donor=st.sampled_from(KNOWN),
       sent=st.lists(st.sampled_from(TABLE_FEATURES), unique=True))
def test_what_the_request_sends_wins_feature_by_feature(built, served, user, donor, sent):
    """Any subset of the features, taken from another user: the answer of the user's query with exactly those."""
    own, other = _full(built, user), _full(built, donor)
    request = {"user_id": user, **{feature: other[feature] for feature in sent}}
    merged = {**own, **{feature: other[feature] for feature in sent}}
    np.testing.assert_allclose(served.embed([request]), served.embed([merged]), rtol=1e-6, atol=1e-7)


def test_an_override_changes_the_answer_and_null_is_a_missing_value(built, served):
    own = _full(built, "u0")
    for override in ({"country": "DE"}, {"age": 80.0}, {"age": None}, {"zip": None}):
        request, merged = {"user_id": "u0", **override}, {**own, **override}
        got = served.recommend(request, k=8, exclude_seen=False)
        assert got.item_ids == served.recommend(merged, k=8, exclude_seen=False).item_ids
        # ... not the stored row's answer: the table did not overwrite what the request sent.
        assert not np.allclose(served.embed([request]), served.embed([own]), atol=1e-6), override


def test_an_unknown_user_is_embedded_from_what_it_sends_else_gets_popular_items(built, served):
    # Unknown ids are still embedded from the features they send (the "features" fallback).
    stranger = {"user_id": "new", "age": 30, "zip": "99999", "country": "BR", "signup": None}
    assert served.recommend(stranger, k=3).fallback == "features"
    # A feature it leaves out is a missing value, as null is.
    partial = {k: v for k, v in stranger.items() if k != "signup"}
    np.testing.assert_allclose(served.embed([partial]), served.embed([stranger]))
    batch = served.recommend_batch([{"user_id": "u0"}, {**partial, "user_id": "nobody"}], k=3)
    assert [r.fallback for r in batch] == [None, "features"]
    # Nothing to go on (an unknown id and no feature value): the popular items, as an ID bundle answers.
    for nothing in ({"user_id": "new"}, {"user_id": "new", "age": None, "country": ""}):
        answer = served.recommend(nothing, k=3)
        assert (answer.item_ids, answer.scores, answer.fallback) == (["i0", "i1"], [None, None], "popular")
    # Features alone, no id: embedded from them.
    assert served.recommend({"country": "US"}, k=3).fallback == "features"


def test_http_recommend_takes_a_user_id_alone(built, served):
    app = create_app(built[0])
    response = call(app, "POST", "/recommend", json={"query": {"user_id": "u3"}, "k": 4})
    assert response.status_code == 200, response.text
    direct = served.recommend(_full(built, "u3"), k=4)
    assert response.json()["item_ids"] == direct.item_ids
    assert response.json()["scores"] == pytest.approx(direct.scores, rel=1e-6, abs=1e-7)
    batch = call(app, "POST", "/recommend", json={"queries": [{"user_id": "u0"}, {"user_id": "u5"}], "k": 4})
    assert [r["item_ids"] for r in batch.json()["results"]] == [
        served.recommend(_full(built, u), k=4).item_ids for u in ("u0", "u5")]
    stranger = call(app, "POST", "/recommend", json={"query": {"user_id": "new"}, "k": 4})
    assert stranger.status_code == 200 and stranger.json()["fallback"] == "popular"
    assert call(app, "GET", "/metadata").json()["user_features"]["features"] == TABLE_FEATURES


def test_cli_answers_a_user_id_and_says_in_one_line_what_it_cannot(built, served, capsys, tmp_path):
    directory = str(built[0])
    assert serving.main(["--bundle", directory, "--user-id", "u2", "-k", "3"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["item_ids"] == served.recommend(_full(built, "u2"), k=3).item_ids
    broken = tmp_path / "broken"
    shutil.copytree(directory, broken)
    (broken / USER_FEATURES_FILE).write_bytes(b"not parquet")
    for bundle, user, message in [
        (str(tmp_path / "absent"), "u2", f"error: {tmp_path / 'absent'}: manifest.json cannot be loaded"),
        (str(broken), "u2", f"error: {broken}: user_features.parquet: content differs from the manifest's"),
    ]:
        assert serving.main(["--bundle", bundle, "--user-id", user]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith(message), captured.err
        assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


def test_a_tampered_user_table_is_refused_naming_it(built, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(built[0], copy)
    Bundle.load(copy, verify="full")
    table = pq.read_table(copy / USER_FEATURES_FILE).to_pandas()
    table.loc[0, "country"] = "FR"  # a valid file, another value
    table.to_parquet(copy / USER_FEATURES_FILE, index=False)
    with pytest.raises(BundleError, match="user_features.parquet: content differs from the manifest's fingerprint"):
        Bundle.load(copy, verify="full")


def test_reindexing_carries_the_user_table(built, tmp_path, monkeypatch):
    directory, tables, _ = built
    catalogue = tables.catalogue()
    # The catalogue the bundle's doc tower read, not re-read from data.
    monkeypatch.setattr(reevaluate_reindex, "_doc_inputs",
                        lambda manifest, ids: feature_arrays(catalogue.set_index("item_id").loc[list(ids)]
                                                             .reset_index(), manifest.doc_features))
    out = reevaluate_reindex.reindex_bundle(directory, tmp_path / "reindexed", "HNSW8")
    copied = Bundle.load(out, verify="full")
    assert (out / USER_FEATURES_FILE).read_bytes() == (directory / USER_FEATURES_FILE).read_bytes()
    assert copied.manifest["user_features"] == Bundle.load(directory).manifest["user_features"]
    assert copied.recommend({"user_id": "u1"}, k=3).item_ids == copied.recommend(_full(built, "u1"), k=3).item_ids


def test_an_id_only_bundle_has_no_user_table(tmp_path):
    clicks, users, items = small_tables(0)
    id_only = ALL_KINDS.model_copy(update={"query": ALL_KINDS.query.model_copy(
        update={"features": ALL_KINDS.query.features[:1], "history": None})})
    assert TowerTables(id_only, clicks, users, items).user_features() is None  # a user table it does not read
    ids = sorted(set(clicks["user_id"]))
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(8, 4)).astype(np.float32)
    write_bundle(tmp_path, query_tower=_fixed_id_tower("user_id", ids, rng.normal(size=(6, 4)).astype(np.float32)),
                 doc_tower=_fixed_id_tower("item_id", items["item_id"], vectors),
                 index=ItemIndex.build(items["item_id"].tolist(), vectors), manifest={"popular_item_ids": ["i0"]})
    served = Bundle.load(tmp_path)
    assert not (tmp_path / USER_FEATURES_FILE).exists() and "user_features" not in served.manifest["files"]
    assert served.metadata()["user_features"] is None
    assert served.recommend({"user_id": "nobody"}, k=2).fallback == "popular"


def test_the_table_round_trips_every_raw_format(tmp_path):
    frame = pd.DataFrame({"user_id": ["b", "a", "é"], "age": np.array([1.5, np.nan, 3.0], np.float32),
                          "tags": [("x", "y", ""), ("", "", ""), ("z", "", "")], "city": ["Oslo", "", "Köln"]})
    UserFeatures.from_frame(frame).save(tmp_path / USER_FEATURES_FILE)
    table = UserFeatures.load(tmp_path / USER_FEATURES_FILE)
    rows = table.rows_of(["a", "é", "b", "c", None])
    assert rows[-2:].tolist() == [-1, -1]
    assert [table.values(int(r), ["age", "tags", "city"]) for r in rows[:3]] == [
        {"age": None, "tags": [], "city": ""}, {"age": 3.0, "tags": ["z"], "city": "Köln"},
        {"age": 1.5, "tags": ["x", "y"], "city": "Oslo"}]
    with pytest.raises(ValueError, match="holds an id twice"):
        UserFeatures.from_frame(pd.concat([frame, frame]))
