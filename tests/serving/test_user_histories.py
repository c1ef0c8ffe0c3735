"""A bundle whose query tower reads a click history answers a known user's id alone: it stores each
training user's recent clicks (user_histories/, newest first) and fills the history a query lacks.
A sent history's order is stated (history_order), and a query the towers know nothing about gets
the popular fallback, never a 422 for a merely missing feature."""

import json
import shutil

import numpy as np
import pandas as pd
import pytest
from feature_fixtures import ALL_KINDS, small_tables, stored_histories, write_feature_bundle
from test_service import call

import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow)
from retrieval import serving
from retrieval.bundle.manifest import MANIFEST_FILE
from retrieval.bundle.user_histories import USER_HISTORIES_DIR, UserHistories
from retrieval.bundle.writer import raw_query
from retrieval.config import TowersConfig
from retrieval.features.histories import ClickHistories
from retrieval.features.tables import latest_history
from retrieval.serving import Bundle, BundleError, RequestError
from retrieval.serving.http import create_app

KNOWN = ["u0", "u1", "u2", "u3", "u4", "u5"]
LIMIT = 5  # above the towers' history length (3): the tower reads the first 3 of the stored 5
# A sequence tower: the click history alone, as configs/beauty-sasrec.yaml's (mean pooling, smaller).
SEQUENCE = TowersConfig.model_validate({
    "query": {"features": [], "history": {"length": 3, "pooling": "mean", "share_item_embedding": True}},
    "doc": {"features": [{"name": "item_id", "kind": "id", "embedding_dim": 5}]},
})

# The fixtures build feature towers and write them as SavedModels (~10-30 s each on 2 cores).
pytestmark = pytest.mark.slow


def _reference_recent(clicks: pd.DataFrame, limit: int) -> dict[str, list[str]]:
    """Each user's last ``limit`` clicks newest first, by a plain sort (time, then log order)."""
    ordered = clicks.assign(position=np.arange(len(clicks))).sort_values(["user_id", "timestamp", "position"])
    return {user: group["item_id"].tolist()[::-1][:limit] for user, group in ordered.groupby("user_id")}


def test_recent_clicks_are_each_users_last_ones_newest_first():
    clicks, _, _ = small_tables(0, n_clicks=200)
    user_rows, user_ids = pd.factorize(clicks["user_id"])
    item_rows, item_ids = pd.factorize(clicks["item_id"])
    histories = ClickHistories(user_rows, item_rows, clicks["timestamp"].to_numpy(), user_ids, item_ids)
    for limit in (1, 3, 40, 1000):
        users, indptr, rows = histories.recent(limit)
        got = {user: histories.item_ids[rows[indptr[u]:indptr[u + 1]]].tolist() for u, user in enumerate(users)}
        assert got == _reference_recent(clicks, limit)
        # The tower's serving history is the first `length` of them ("" padded).
        latest = latest_history(clicks, users, 3)
        assert limit < 3 or [[i for i in row if i] for row in latest.tolist()] == [got[user][:3] for user in users]


def test_the_table_round_trips_sorted_read_only_and_in_memory(tmp_path):
    clicks, _, _ = small_tables(0, n_clicks=80)
    catalogue = [f"i{i}" for i in range(8)][::-1]  # index rows are not the click order's
    table = stored_histories(clicks, catalogue, LIMIT)
    table.save(tmp_path / "h")
    loaded = UserHistories.load(tmp_path / "h", LIMIT)
    assert loaded.info() == table.info() == {"num_users": 6, "num_clicks": int(loaded.indptr[-1]),
                                             "limit": LIMIT, "order": "newest first"}
    for array in (loaded.user_ids, loaded.indptr, loaded.item_rows):
        assert not isinstance(array, np.memmap) and not array.flags.writeable
    expected = _reference_recent(clicks, LIMIT)
    found = loaded.rows_of_many([*KNOWN, "nobody", None])
    assert [[catalogue[r] for r in rows] for rows in found[:6]] == [expected[u] for u in KNOWN]
    assert found[6:] == [None, None]
    with pytest.raises(ValueError, match="more than the limit 2"):
        UserHistories(loaded.user_ids, loaded.indptr, loaded.item_rows, 2)


@pytest.fixture(scope="module")
def history_bundle(tmp_path_factory):
    """Feature towers with user features and a click history, its histories stored."""
    directory, tables, query, *_ = write_feature_bundle(
        tmp_path_factory.mktemp("bundle") / "history", ALL_KINDS, topk=False, history_clicks=LIMIT,
        manifest={"run": "history", "popular_item_ids": ["i0", "i1", "i2"], "config": {
            "towers": ALL_KINDS.model_dump(mode="json")}},
    )
    return directory, tables, list(query.input_names), Bundle.load(directory)


@pytest.fixture(scope="module")
def sequence_bundle(tmp_path_factory):
    directory, tables, query, *_ = write_feature_bundle(
        tmp_path_factory.mktemp("bundle") / "sequence", SEQUENCE, topk=False, history_clicks=LIMIT,
        manifest={"run": "sequence", "popular_item_ids": ["i0", "i1", "i2"], "config": {
            "towers": SEQUENCE.model_dump(mode="json")}},
    )
    return directory, tables, list(query.input_names), Bundle.load(directory)


def _full(built, user):
    """The user's whole raw query as the training tables give it (history: its last 3 clicks)."""
    _, tables, names, _ = built
    return raw_query(tables.queries([user]), names)


@pytest.mark.parametrize("which", ["history_bundle", "sequence_bundle"])
def test_a_known_user_id_alone_is_answered_from_its_stored_history(which, request):
    built = request.getfixturevalue(which)
    directory, _, names, served = built
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    assert manifest["files"]["user_histories"] == USER_HISTORIES_DIR
    assert {f"{USER_HISTORIES_DIR}/{name}" for name in ("user_ids.npy", "indptr.npy", "item_rows.npy")} <= set(
        manifest["fingerprints"]["files"])
    assert manifest["user_histories"]["order"] == "newest first" and manifest["user_histories"]["limit"] == LIMIT
    for user in KNOWN:
        full = _full(built, user)
        assert any(full["history"])  # every fixture user has clicks: the history matters
        alone = served.recommend({"user_id": user}, k=5, exclude_seen=False)
        expected = served.recommend(full, k=5, exclude_seen=False)
        assert alone.item_ids == expected.item_ids and alone.fallback is None
        np.testing.assert_allclose(alone.scores, expected.scores, rtol=1e-6, atol=1e-7)
    # Over HTTP, the same.
    app = create_app(served)
    response = call(app, "POST", "/recommend", json={"query": {"user_id": "u2"}, "k": 4})
    assert response.status_code == 200, response.text
    assert response.json()["item_ids"] == served.recommend({"user_id": "u2", **_full(built, "u2")}, k=4).item_ids
    assert response.json()["fallback"] is None


def test_batch_scoring_of_every_user_reads_the_stored_histories(history_bundle, tmp_path):
    directory, _, _, served = history_bundle
    out = tmp_path / "recs.parquet"
    assert serving.main(["--bundle", str(directory), "--users", "all", "-k", "3", "--out", str(out)]) == 0
    frame = pd.read_parquet(out)
    user_column = "user_id" if "user_id" in frame else "user"
    item_column = "item_id" if "item_id" in frame else "item"
    for user, group in frame.groupby(user_column):
        assert group.sort_values("rank")[item_column].tolist() == served.recommend(
            _full(history_bundle, user), k=3).item_ids


def test_the_page_lists_a_users_stored_clicks_newest_first(history_bundle):
    _, tables, _, served = history_bundle
    reply = call(create_app(served), "GET", "/users/u3/items").json()
    clicks = tables.train
    assert reply["recent_item_ids"] == _reference_recent(clicks, LIMIT)["u3"]
    assert call(create_app(served), "GET", "/metadata").json()["user_histories"]["num_users"] == 6


def test_a_tampered_history_table_is_refused_naming_it(history_bundle, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(history_bundle[0], copy)
    rows = np.load(copy / USER_HISTORIES_DIR / "item_rows.npy")
    np.save(copy / USER_HISTORIES_DIR / "item_rows.npy", rows[::-1].copy())  # valid file, other order
    with pytest.raises(BundleError, match="user_histories/item_rows.npy: content differs from the manifest"):
        Bundle.load(copy)


def test_an_export_history_bound_below_the_towers_length_is_refused():
    from conftest import ROOT

    from retrieval.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"export.history_clicks \(5\) is below towers.query.history.length"):
        load_config(ROOT / "configs" / "ml100k_features_history.yaml", ["export.history_clicks=5"])


# --- the order of a sent history ---


def test_a_sent_history_is_read_in_the_order_the_request_states(history_bundle):
    _, _, _, served = history_bundle
    base = {"user_id": "u0", "age": 30, "zip": "10001", "country": "US", "signup": None}
    newest_first = ["i5", "i1", "i3", "i6", "i0"]  # the tower reads the first 3: the order picks which
    expected = served.embed([{**base, "history": newest_first}])
    # Python: the default reads newest first; oldest_first reverses a history given in time order.
    np.testing.assert_allclose(
        served.embed([{**base, "history": newest_first[::-1]}], history_order="oldest_first"), expected)
    assert not np.allclose(served.embed([{**base, "history": newest_first[::-1]}]), expected, atol=1e-6)
    with pytest.raises(RequestError, match=r"history_order must be one of \['newest_first', 'oldest_first'\]"):
        served.embed([{**base, "history": newest_first}], history_order="latest")  # type: ignore[arg-type]
    # HTTP: a body whose queries send a non-empty history must say its order.
    app = create_app(served)
    refused = call(app, "POST", "/recommend", json={"query": {**base, "history": newest_first}, "k": 3})
    assert refused.status_code == 422 and "history_order 'newest_first'" in refused.json()["error"]
    answers = [call(app, "POST", "/recommend", json={"query": {**base, "history": history}, "k": 3,
                                                      "history_order": order}).json()
               for history, order in ((newest_first, "newest_first"), (newest_first[::-1], "oldest_first"))]
    assert answers[0]["item_ids"] == answers[1]["item_ids"] == served.recommend(
        {**base, "history": newest_first}, k=3).item_ids
    # No history, or an empty one, needs no order.
    for query in ({"user_id": "u0"}, {**base, "history": []}):
        assert call(app, "POST", "/recommend", json={"query": query, "k": 3}).status_code == 200
    bad = call(app, "POST", "/recommend", json={"query": base, "k": 3, "history_order": "time"})
    assert bad.status_code == 422 and "history_order" in bad.json()["error"]


# --- a query the towers know nothing about, or one that leaves features out ---


def test_an_unknown_user_alone_gets_the_popular_fallback(history_bundle, sequence_bundle):
    for _, _, _, served in (history_bundle, sequence_bundle):
        answer = served.recommend({"user_id": "new"}, k=5)
        assert answer.fallback == "popular" and answer.item_ids == ["i0", "i1", "i2"]
        assert answer.scores == [None, None, None]
        http = call(create_app(served), "POST", "/recommend", json={"query": {"user_id": "new"}, "k": 2})
        assert http.status_code == 200, http.text
        assert http.json()["item_ids"] == ["i0", "i1"] and http.json()["fallback"] == "popular"


def test_features_a_query_leaves_out_are_missing_values(history_bundle):
    """An unknown user who sends some features, or a history alone, is embedded from them."""
    _, _, _, served = history_bundle
    explicit = {"user_id": "new", "age": None, "zip": None, "country": "DE", "signup": None, "history": []}
    for sent in ({"user_id": "new", "country": "DE"}, {"country": "DE"}):
        np.testing.assert_allclose(served.embed([sent]), served.embed([{**explicit, "user_id": sent.get("user_id")}]))
        assert served.recommend(sent, k=3).fallback == "features"
    history_only = {"history": ["i1", "i2"]}
    np.testing.assert_allclose(served.embed([history_only]), served.embed([{
        "user_id": None, "age": None, "zip": None, "country": None, "signup": None, "history": ["i1", "i2"]}]))
    answer = served.recommend(history_only, k=3)
    assert answer.fallback == "features" and not {"i1", "i2"} & set(answer.item_ids)
    with pytest.raises(RequestError, match="query 0 sends none of this bundle's inputs"):
        served.recommend({})
