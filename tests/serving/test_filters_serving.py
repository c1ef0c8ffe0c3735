"""Filters at every entry point: ``Bundle.recommend*`` / ``similar_items*``, ``Run``, HTTP, ``retrieval recommend``.

Over the web page's bundles (``tests/serving/test_web_page.py``'s ``world``, written once a session:
"shop" has an item table with string, number and list-of-strings columns; "plain" has none), each
answer equals a brute-force top-k over the items a pandas filter of the raw item table passes, the
user's training items left out; the popular fallback keeps only popular items that pass; bad filters
are a RequestError, a 422 and a one-line command error, each naming the column or operator.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
from test_service import call
from test_web_page import world  # noqa: F401  (the module-scoped fixture)

from retrieval import serving
from retrieval.api import open_run
from retrieval.serving import Bundle
from retrieval.serving.http import create_app
from retrieval.serving.request_checks import RequestError

K = 8
FILTERS = {"category": {"in": ["c1", "c3"]}, "year": {"min": 2000}}


def _passing(table: pd.DataFrame, item_ids: list[str], filters=FILTERS) -> set[str]:
    """The indexed items of the raw item table that pass ``FILTERS``, by pandas."""
    rows = table[table["item_id"].isin(item_ids)]
    keep = rows["category"].isin(filters["category"]["in"]) & (rows["year"] >= filters["year"]["min"])
    return set(rows.loc[keep, "item_id"])


def _brute_force(vector: np.ndarray, world, allowed: set[str], exclude=(), k=K) -> list[str]:  # noqa: F811
    scores = world["items"] @ vector
    order = np.argsort(-scores, kind="stable")
    ids = world["item_ids"]
    return [ids[r] for r in order if ids[r] in allowed and ids[r] not in set(exclude)][:k]


@pytest.fixture(scope="module")
def shop_bundle(world):  # noqa: F811
    return Bundle.load(world["shop"])


def test_recommend_equals_brute_force_over_the_pandas_filtered_items(world, shop_bundle):  # noqa: F811
    allowed = _passing(world["table"], world["item_ids"])
    assert 2 * K < len(allowed) < len(world["item_ids"]) / 2
    users = ["user00", "user05", "team/7"]
    embeddings, _ = shop_bundle.embed_with_known([{"user_id": user} for user in users])
    answers = shop_bundle.recommend_batch([{"user_id": user} for user in users], K, filters=FILTERS)
    for user, vector, answer in zip(users, embeddings, answers):
        expected = _brute_force(vector, world, allowed, exclude=world["seen"][user])
        assert answer.item_ids == expected, user
        single = shop_bundle.recommend({"user_id": user}, K, filters=FILTERS)
        assert single.item_ids == expected
    # Exclusions on top of the filter, and the unfiltered answer differs (the filter did something).
    drop = answers[0].item_ids[:2]
    again = shop_bundle.recommend({"user_id": "user00"}, K, exclude_item_ids=drop, filters=FILTERS)
    assert again.item_ids == _brute_force(embeddings[0], world, allowed - set(drop), exclude=world["seen"]["user00"])
    assert shop_bundle.recommend({"user_id": "user00"}, K).item_ids != answers[0].item_ids


def test_similar_items_and_the_python_api_take_filters(world, shop_bundle):  # noqa: F811
    allowed = _passing(world["table"], world["item_ids"])
    item = "item010"
    vector = world["items"][world["item_ids"].index(item)]
    expected = _brute_force(vector, world, allowed - {item})
    assert shop_bundle.similar_items(item, K, filters=FILTERS).item_ids == expected
    assert shop_bundle.similar_items_batch([item, item], K, filters=FILTERS)[1].item_ids == expected
    run = open_run(world["shop"])
    assert run.similar_items(item, K, filters=FILTERS).item_ids == expected
    assert run.recommend("user05", K, filters=FILTERS).item_ids == shop_bundle.recommend(
        {"user_id": "user05"}, K, filters=FILTERS).item_ids


def test_fewer_passing_items_than_k_come_back_whole(world, shop_bundle):  # noqa: F811
    few = {"item_id": {"in": ["item003", "item050", "item051", "nowhere"]}, "year": {"max": 2050}}
    answer = shop_bundle.recommend({"user_id": "user26"}, 20, filters=few, exclude_item_ids=["item051"])
    assert sorted(answer.item_ids) == ["item003", "item050"]


def test_the_popular_fallback_keeps_only_items_that_pass(world):  # noqa: F811
    plain = Bundle.load(world["plain"])
    popular = world["item_ids"][:20]
    allow = popular[3:20:4] + ["item100"]  # item100 passes but is not popular
    answer = plain.recommend({"user_id": "never-seen"}, K, filters={"item_id": {"in": allow}})
    assert answer.fallback == "popular" and answer.item_ids == popular[3:20:4]
    with pytest.raises(RequestError, match=r"filters\.category: this bundle has no item table"):
        plain.recommend({"user_id": "never-seen"}, K, filters={"category": "c1"})


@pytest.mark.parametrize("filters, message", [
    ({"categry": "c1"}, r"filters\.categry: the item table has no column 'categry' .*did you mean 'category'\?"),
    ({"year": {"over": 3}}, r"filters\.year has the operator 'over', which is not one of"),
    ({"year": {"min": "2000"}}, r"filters\.year\.min must be a number, got '2000'"),
    ({"category": {"in": [3]}}, r"'category' is a string column, so it compares with strings, not 3"),
])
def test_a_bad_filter_is_a_request_error_and_a_422_naming_it(world, shop_bundle, filters, message):  # noqa: F811
    with pytest.raises(RequestError, match=message):
        shop_bundle.recommend({"user_id": "user00"}, K, filters=filters)
    app = create_app(shop_bundle)
    for path, body in (("/recommend", {"query": {"user_id": "user00"}}), ("/similar", {"item_id": "item001"}),
                       ("/recommend", {"queries": [{"user_id": "user00"}, {"user_id": "user01"}]})):
        reply = call(app, "POST", path, json={**body, "k": K, "filters": filters})
        assert reply.status_code == 422, (path, reply.text)
        assert re.search(message, reply.json()["error"]), reply.json()


def test_http_answers_equal_the_bundle(world, shop_bundle):  # noqa: F811
    app = create_app(shop_bundle)
    reply = call(app, "POST", "/recommend", json={"query": {"user_id": "user05"}, "k": K, "filters": FILTERS})
    assert reply.status_code == 200, reply.text
    assert reply.json()["item_ids"] == shop_bundle.recommend({"user_id": "user05"}, K, filters=FILTERS).item_ids
    batch = call(app, "POST", "/recommend", json={"queries": [{"user_id": "user05"}, {"user_id": "user00"}],
                                                 "k": K, "filters": FILTERS}).json()["results"]
    assert [result["item_ids"] for result in batch] == [
        answer.item_ids for answer in shop_bundle.recommend_batch([{"user_id": "user05"}, {"user_id": "user00"}],
                                                                  K, filters=FILTERS)]
    similar = call(app, "POST", "/similar", json={"item_id": "item010", "k": K, "filters": FILTERS}).json()
    assert similar["item_ids"] == shop_bundle.similar_items("item010", K, filters=FILTERS).item_ids
    assert set(similar["item_ids"]) <= _passing(world["table"], world["item_ids"])


def test_the_command_line_filters_every_query(world, shop_bundle, tmp_path, capsys):  # noqa: F811
    users = tmp_path / "users.txt"
    users.write_text("user00\nuser05\nnever-seen\n")
    out = tmp_path / "recs.parquet"
    argv = ["--bundle", str(world["shop"]), "--users", str(users), "-k", str(K), "--out", str(out),
            "--filters", json.dumps(FILTERS)]
    assert serving.main(argv) == 0
    rows = pd.read_parquet(out)
    allowed = _passing(world["table"], world["item_ids"])
    assert set(rows["item_id"]) <= allowed
    for user in ("user00", "user05", "never-seen"):
        expected = shop_bundle.recommend({"user_id": user}, K, filters=FILTERS).item_ids
        assert rows.loc[rows["user_id"] == user, "item_id"].tolist() == expected, user
    capsys.readouterr()
    assert serving.main(["--bundle", str(world["shop"]), "--user-id", "user05", "-k", str(K),
                         "--filters", json.dumps(FILTERS)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["item_ids"] == shop_bundle.recommend({"user_id": "user05"}, K, filters=FILTERS).item_ids


@pytest.mark.parametrize("text, message", [
    ('{"categry": "c1"}', "filters.categry: the item table has no column 'categry'"),
    ("{year: 1}", "--filters: not valid JSON"),
    ('{"year": {"min": true}}', "filters.year.min must be a number, got True"),
])
def test_a_bad_filters_flag_is_a_one_line_error(world, tmp_path, capsys, text, message):  # noqa: F811
    argv = ["--bundle", str(world["shop"]), "--user-id", "user05", "--filters", text]
    try:
        status = serving.main(argv)
    except SystemExit as error:  # argparse: a flag whose value it cannot read
        status = error.code
    assert status == 2
    assert message in capsys.readouterr().err
