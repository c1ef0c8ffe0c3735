"""The HTTP service's answers called directly, with no HTTP: each ``answer_*`` function gives what the
bundle's own Python API gives, refuses a bad request with the status and reason the route replies with,
and produces exactly the bytes the route sends."""

import asyncio
import json

import numpy as np
import pytest
from starlette.exceptions import HTTPException
from test_service import K, call, exact_top, world  # noqa: F401  (the module fixture: two small bundles)

import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow)
from retrieval.serving import Bundle
from retrieval.serving.http import BundleHolder, ServiceLimits, create_app
from retrieval.serving.http.app import (
    answer_healthz,
    answer_recommend,
    answer_reload,
    answer_similar,
    answer_training_items,
    answer_users,
)
from retrieval.serving.http.inputs import ReloadRequest


@pytest.fixture(scope="module")
def bundle(world):  # noqa: F811
    return Bundle.load(world["bundle-a"])


@pytest.fixture(scope="module")
def app(world):  # noqa: F811
    return create_app(world["bundle-a"], limits=ServiceLimits(max_body_bytes=64 * 1024))


def test_recommend_answer_equals_the_bundle_api_and_the_exact_top_k(world, bundle):  # noqa: F811
    user = world["user_ids"][3]
    reply = json.loads(answer_recommend(bundle, {"query": {"user_id": user}, "k": K}))
    expected = bundle.recommend({"user_id": user}, K)
    assert reply["bundle"] == bundle.version
    assert reply["item_ids"] == expected.item_ids == exact_top(world, user)  # the Flat index is exact
    np.testing.assert_allclose(reply["scores"], expected.scores, rtol=1e-6)
    assert reply["fallback"] is None


def test_recommend_answer_is_the_bytes_the_route_sends_whatever_the_chunk(world, bundle, app):  # noqa: F811
    body = json.dumps({"queries": [{"user_id": user} for user in world["user_ids"][:7]], "k": 5}).encode()
    whole = answer_recommend(bundle, body)
    assert answer_recommend(bundle, body, chunk=2) == whole  # the bulk lane's slices join to the same reply
    response = call(app, "POST", "/recommend", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200 and response.content == whole
    assert [r["item_ids"] for r in json.loads(whole)["results"]] == [
        bundle.recommend({"user_id": user}, 5).item_ids for user in world["user_ids"][:7]]


@pytest.mark.parametrize("payload, reason", [
    ({"query": {"user_id": "user01"}, "k": 0}, "k:"),
    ({"query": {"user_id": "user01"}, "kk": 3}, "kk: unknown field"),
    ({"k": 3}, "give exactly one of 'query'"),
])
def test_a_bad_recommend_request_raises_the_422_the_route_replies_with(bundle, app, payload, reason):
    with pytest.raises(HTTPException) as raised:
        answer_recommend(bundle, payload)
    assert raised.value.status_code == 422 and reason in raised.value.detail
    response = call(app, "POST", "/recommend", json=payload)
    assert response.status_code == 422 and response.json() == {"error": raised.value.detail}


def test_similar_answer_names_an_unknown_item_with_a_422(world, bundle):  # noqa: F811
    seed = world["item_ids"][5]
    reply = json.loads(answer_similar(bundle, json.dumps({"item_id": seed, "k": 4}).encode()))
    assert reply["item_ids"] == bundle.similar_items(seed, 4).item_ids and seed not in reply["item_ids"]
    with pytest.raises(HTTPException) as raised:
        answer_similar(bundle, b'{"item_id": "no-such-item", "k": 4}')
    assert raised.value.status_code == 422 and "no-such-item" in raised.value.detail


def test_users_training_items_and_health_answers_match_the_routes(bundle, app):
    assert answer_users(bundle, 5) == call(app, "GET", "/users?limit=5").json()
    with pytest.raises(HTTPException) as raised:
        answer_training_items(bundle, "nobody")
    response = call(app, "GET", "/users/nobody/items")
    assert raised.value.status_code == response.status_code == 404
    assert response.json() == {"error": raised.value.detail} and "'nobody'" in raised.value.detail
    status, reply = asyncio.run(answer_healthz(bundle))
    assert (status, reply) == (200, {"status": "ok", "bundle": bundle.version, "num_items": len(bundle.index)})


def test_a_failed_reload_answer_keeps_the_served_bundle(bundle, tmp_path):
    holder = BundleHolder(bundle)
    missing = tmp_path / "no-bundle-here"
    status, reply = asyncio.run(answer_reload(holder, ReloadRequest(bundle=str(missing))))
    assert status == 422 and holder.current is bundle
    assert reply["error"].startswith(f"bundle {str(missing)!r} not loaded, still serving {bundle.version!r}: ")
