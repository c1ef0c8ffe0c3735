"""One set of request rules for every entry point (``retrieval.serving.request_checks``): the Python API, the
command line and HTTP read ids, id lists, k and query keys alike; a query embedding that a feature
value breaks is an error naming that feature, not a fallback.

Answers are checked against a numpy ranking of the towers' own vectors (``exact``)."""

import json
import re

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
from feature_fixtures import write_feature_bundle
from test_service import _fixed_id_tower, call

import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow)
from retrieval.bundle.writer import write_bundle
from retrieval.config import MAX_EVALUATION_K, ConfigError, load_config
from retrieval.index import ItemIndex
from retrieval.serving import Bundle
from retrieval.serving import bundle as serving
from retrieval.serving.batch import IdList, recommend_to_file
from retrieval.serving.http import create_app
from retrieval.serving.queries import input_tensor
from retrieval.serving.request_checks import RequestError, check_query_keys, checked_id, checked_ids, checked_k

NUM_ITEMS, DIM = 40, 8
ITEM_IDS = [str(100 + i) for i in range(NUM_ITEMS)]  # numeric ids, as MovieLens has
USER_IDS = [str(u) for u in range(1, 10)]


# --- the rules themselves --------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [("i1", "i1"), (494, "494"), (np.int64(7), "7"), ("", "")])
def test_an_id_is_a_string_or_an_int_read_as_its_decimal_string(value, expected):
    assert checked_id(value, "item_id") == expected


@pytest.mark.parametrize("value", [True, 4.0, None, ["a"], b"a", {"a": 1}])
def test_anything_else_is_no_id(value):
    with pytest.raises(RequestError, match=r"^item_id must be an id \(a string or an integer\), got "):
        checked_id(value, "item_id")


def test_id_lists():
    assert checked_ids(None, "exclude_item_ids") == []
    assert checked_ids([494, "i2"], "exclude_item_ids") == ["494", "i2"]
    assert checked_ids(("a",), "exclude_item_ids") == ["a"] and checked_ids(np.array([3, 4]), "x") == ["3", "4"]
    with pytest.raises(RequestError, match=r"exclude_item_ids must be a list of ids .*got a single string; wrap"):
        checked_ids("i0613", "exclude_item_ids")
    with pytest.raises(RequestError, match=r"exclude_item_ids\[1\] must be an id"):
        checked_ids(["a", 1.5], "exclude_item_ids")
    for bad in (7, {"a": 1}, b"ab"):
        with pytest.raises(RequestError, match="exclude_item_ids must be a list of ids"):
            checked_ids(bad, "exclude_item_ids")


@pytest.mark.parametrize("k, message", [("10", "must be an integer"), (True, "must be an integer"),
                                        (2.5, "must be an integer"), (None, "must be an integer"),
                                        (0, "must be at least 1, got 0"), (-3, "must be at least 1, got -3")])
def test_k_is_an_int_of_at_least_one(k, message):
    with pytest.raises(RequestError, match=f"^k {message}"):
        checked_k(k, 100)


def test_k_is_capped_at_the_catalogue():
    assert checked_k(10**9, 1000) == 1000 and checked_k(5, 1000) == 5 and checked_k(np.int32(3), 2) == 2


def test_an_unknown_query_key_is_refused_with_a_near_miss():
    check_query_keys({"user_id": "u", "color": "red"}, ["user_id", "color"], 0, {})
    with pytest.raises(RequestError, match=r"query 2 has the key 'colour', .* reads \['user_id', 'color'\]\); "
                                           r"did you mean 'color'\?"):
        check_query_keys({"user_id": "u", "colour": "red"}, ["user_id", "color"], 2, {})
    with pytest.raises(RequestError, match=r"'zzz'.*\]\)$"):  # nothing near: no guess
        check_query_keys({"zzz": 1}, ["user_id"], 0, {})


def test_evaluation_ks_are_bounded_at_config_load():
    with pytest.raises(ConfigError, match=r"evaluation\.ks must be at most 10,000 .*got 1,000,000,000"):
        load_config(None, ["evaluation.ks=[10,1000000000]"])
    assert load_config(None, [f"evaluation.ks=[10,{MAX_EVALUATION_K}]"]).evaluation.ks[-1] == MAX_EVALUATION_K


# --- every entry point applies them ------------------------------------------------------------------


@pytest.fixture(scope="module")
def numeric(tmp_path_factory):
    """An ID-tower bundle whose user and item ids are numbers written as strings (Flat index)."""
    rng = np.random.default_rng(3)
    users = rng.normal(size=(len(USER_IDS), DIM)).astype(np.float32)
    items = rng.normal(size=(NUM_ITEMS, DIM)).astype(np.float32)
    directory = tmp_path_factory.mktemp("numeric")
    write_bundle(directory, query_tower=_fixed_id_tower("user_id", USER_IDS, users),
                 doc_tower=_fixed_id_tower("item_id", ITEM_IDS, items), index=ItemIndex.build(ITEM_IDS, items),
                 manifest={"run": "numeric", "popular_item_ids": ITEM_IDS[:5]})
    return {"dir": directory, "bundle": Bundle.load(directory), "users": users, "items": items}


def exact(numeric, user, k, exclude=()):
    """The k items of highest inner product with ``user``'s vector, ``exclude`` (strings) left out: numpy."""
    scores = numeric["items"] @ numeric["users"][USER_IDS.index(str(user))]
    order = [ITEM_IDS[r] for r in np.argsort(-scores, kind="stable") if ITEM_IDS[r] not in set(exclude)]
    return order[:k]


def test_int_item_ids_are_excluded_like_int_user_ids_are_read(numeric):
    bundle = numeric["bundle"]
    top = exact(numeric, 3, 5)
    assert bundle.recommend({"user_id": 3}, k=5).item_ids == top  # an int user id is "3"
    served = bundle.recommend({"user_id": 3}, k=5, exclude_item_ids=[int(top[0]), top[1]])
    assert served.item_ids == exact(numeric, 3, 5, exclude=top[:2]) and top[0] not in served.item_ids
    similar = bundle.similar_items(int(top[0]), k=3, exclude_item_ids=[int(top[1])])
    assert similar.item_ids == bundle.similar_items(top[0], k=3, exclude_item_ids=[top[1]]).item_ids
    assert top[1] not in similar.item_ids
    app = create_app(bundle)
    reply = call(app, "POST", "/recommend", json={"query": {"user_id": 3}, "k": 5,
                                                  "exclude_item_ids": [int(top[0]), top[1]]})
    assert reply.status_code == 200 and reply.json()["item_ids"] == served.item_ids, reply.text
    reply = call(app, "POST", "/similar", json={"item_id": int(top[0]), "k": 3, "exclude_item_ids": [int(top[1])]})
    assert reply.status_code == 200 and reply.json()["item_ids"] == similar.item_ids, reply.text


def test_a_bare_string_of_ids_is_refused_and_none_is_no_exclusion(numeric):
    bundle = numeric["bundle"]
    first = exact(numeric, 4, 1)[0]
    for call_with in (lambda excluded: bundle.recommend({"user_id": "4"}, 5, excluded),
                      lambda excluded: bundle.similar_items(first, 5, exclude_item_ids=excluded)):
        with pytest.raises(RequestError, match=rf"exclude_item_ids must be a list of ids .*\['{first}'\]"):
            call_with(first)
        assert call_with(None).item_ids == call_with(()).item_ids
    assert bundle.recommend({"user_id": "4"}, 5, None).item_ids == exact(numeric, 4, 5)
    with pytest.raises(RequestError, match=r"exclude_item_ids\[0\] must be a list of ids"):
        bundle.recommend_batch([{"user_id": "4"}], 5, [first])
    reply = call(create_app(bundle), "POST", "/recommend", json={"query": {"user_id": "4"}, "exclude_item_ids": first})
    assert reply.status_code == 422 and "exclude_item_ids must be a list of ids" in reply.json()["error"]


@pytest.mark.parametrize("k", ["10", True, 2.5, 0])
def test_a_bad_k_is_the_same_error_from_python_and_http(numeric, k):
    bundle = numeric["bundle"]
    with pytest.raises(RequestError) as python:
        bundle.recommend({"user_id": "4"}, k)
    for attempt in (lambda: bundle.recommend_batch([{"user_id": "4"}], k), lambda: bundle.similar_items("100", k)):
        with pytest.raises(RequestError, match=re.escape(str(python.value))):
            attempt()
    for path, body in (("/recommend", {"query": {"user_id": "4"}}), ("/similar", {"item_id": "100"})):
        reply = call(create_app(bundle), "POST", path, json={**body, "k": k})
        assert reply.status_code == 422 and reply.json()["error"] == f"k: {python.value}"


@pytest.fixture()
def search_depths(monkeypatch):
    """The k of every ItemIndex.search call."""
    depths = []
    search = ItemIndex.search

    def spy(self, queries, k, *args, **kwargs):
        depths.append(k)
        return search(self, queries, k, *args, **kwargs)

    monkeypatch.setattr(ItemIndex, "search", spy)
    return depths


def test_a_k_above_the_catalogue_is_capped_everywhere(numeric, search_depths, capsys, tmp_path):
    # 10**7, not the 10**9 that took 16 GB: were the cap lost, this test would fail, not exhaust the machine.
    bundle, huge = numeric["bundle"], 10**7
    served = bundle.recommend({"user_id": "5"}, k=huge, exclude_item_ids=["100"])
    assert served.item_ids == exact(numeric, 5, NUM_ITEMS, exclude=["100"])  # every other item, in order
    assert bundle.similar_items("100", k=huge).item_ids[0] != "100"
    assert serving.main(["--bundle", str(numeric["dir"]), "--user-id", "5", "-k", str(huge)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["item_ids"] == exact(numeric, 5, NUM_ITEMS)
    out = tmp_path / "recs.parquet"
    recommend_to_file(bundle, IdList(["5", "6"]), huge, out)
    assert len(pd.read_parquet(out)) == 2 * NUM_ITEMS
    # No search was asked for more ranks than the catalogue holds (FAISS allocates [queries, k]).
    assert search_depths and max(search_depths) <= NUM_ITEMS


def test_the_cli_refuses_a_bad_k_in_one_line(numeric, capsys):
    assert serving.main(["--bundle", str(numeric["dir"]), "--user-id", "5", "-k", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: -k must be at least 1, got 0"


def test_a_history_sent_to_a_bundle_that_reads_none_is_refused(numeric):
    bundle = numeric["bundle"]
    with pytest.raises(RequestError, match=r"query 0 has the key 'history', which this bundle does not read "
                                           r".*reads no click history.*exclude_item_ids"):
        bundle.recommend({"user_id": "3", "history": [exact(numeric, 3, 1)[0]]}, k=5)
    reply = call(create_app(bundle), "POST", "/recommend", json={"query": {"user_id": "3", "history": ["100"]}})
    assert reply.status_code == 422 and "'history'" in reply.json()["error"], reply.text
    with pytest.raises(RequestError, match=r"'usr_id'.*did you mean 'user_id'\?"):
        bundle.recommend({"user_id": "3", "usr_id": "3"})


# --- embeddings a feature value breaks ----------------------------------------------------------------


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    """The feature-tower bundle of every feature kind (untrained, seeded; no recorded norm range)."""
    directory = write_feature_bundle(tmp_path_factory.mktemp("features"), topk=False)[0]
    return Bundle.load(directory)


def test_a_feature_value_that_zeroes_the_embedding_is_named(features):
    known = {"user_id": "u0", "history": ["i1"]}  # the user table fills age, zip, country, signup
    assert features.recommend(known, k=3).fallback is None
    # Finite, so the float32 check passes; the tower's L2 normalisation of its overflowing output gives 0
    # (a trained tower does so from about 1e20, these untrained seeded weights from about 1e30).
    huge = {**known, "age": 1e30}
    assert not np.any(features._embed(**{feature: input_tensor([features.complete_query(huge)[feature]],
                                                               features._input_specs[feature])
                                         for feature in features.query_features})["embedding"].numpy())
    with pytest.raises(RequestError, match=r"query 0: its embedding's norm is 0, all zero, .* the "
                                           r"feature 'age' \(1e\+30\) causes it"):
        features.recommend(huge, k=3)
    reply = call(create_app(features), "POST", "/recommend", json={"query": huge})
    assert reply.status_code == 422 and "the feature 'age'" in reply.json()["error"], reply.text
    with pytest.raises(RequestError, match=r"'contry'.*did you mean 'country'\?"):
        features.recommend({**known, "contry": "US"})


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    """A bundle whose query embedding is the user's vector times a numeric feature ``scale`` (missing: 1),
    exported with the norms of its training users' queries (``scale`` 1 and 2)."""
    rng = np.random.default_rng(5)
    users = rng.normal(size=(len(USER_IDS), DIM)).astype(np.float32)
    items = rng.normal(size=(NUM_ITEMS, DIM)).astype(np.float32)
    ids = _fixed_id_tower("user_id", USER_IDS, users)
    inputs = {"user_id": tf.keras.Input(shape=(), dtype=tf.string, name="user_id"),
              "scale": tf.keras.Input(shape=(), dtype=tf.float32, name="scale")}
    factor = tf.keras.layers.Lambda(lambda x: tf.where(tf.math.is_nan(x), tf.ones_like(x), x)[:, None])
    query_tower = tf.keras.Model(inputs, ids(inputs["user_id"]) * factor(inputs["scale"]))
    training = pd.DataFrame({"user_id": USER_IDS, "scale": np.where(np.arange(len(USER_IDS)) % 2, 2.0, 1.0)})
    directory = tmp_path_factory.mktemp("scaled")
    written = write_bundle(directory, query_tower=query_tower, doc_tower=_fixed_id_tower("item_id", ITEM_IDS, items),
                           index=ItemIndex.build(ITEM_IDS, items), training_queries=training,
                           manifest={"run": "scaled", "popular_item_ids": ITEM_IDS[:5]})
    norms = np.linalg.norm(users, axis=1) * training["scale"].to_numpy()
    return {"bundle": Bundle.load(directory), "manifest": written.to_dict(), "norms": norms}


def test_the_manifest_records_the_training_queries_norm_range(scaled):
    record = scaled["manifest"]["query_norms"]
    assert record["queries"] == len(USER_IDS)
    np.testing.assert_allclose([record["min"], record["max"]], [scaled["norms"].min(), scaled["norms"].max()],
                               rtol=1e-5)
    assert scaled["bundle"].manifest["query_norms"] == record


def test_a_norm_outside_the_training_range_is_an_error_naming_the_feature(scaled):
    bundle = scaled["bundle"]
    assert bundle.recommend({"user_id": "2", "scale": 3.0}, k=3).fallback is None  # within the margin
    for scale in (1e4, 1e-4, 0.0):
        with pytest.raises(RequestError, match=r"query 0: its embedding's norm is .*, (outside \[.*\] \(the "
                                               r"training users' query norms at export|all zero).*the feature "
                                               r"'scale' \(.*\) causes it"):
            bundle.recommend({"user_id": "2", "scale": scale}, k=3)
    # An id the towers do not know still embeds to zero with nothing to blame: the popular items.
    assert bundle.recommend({"user_id": "stranger", "scale": 1.0}, k=3).fallback == "popular"
