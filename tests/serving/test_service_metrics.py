"""``GET /metrics``: request counts and latency by route and status, the served bundle across a
hot swap, one registry per app; parsed with prometheus_client's own text parser."""

import json
import time
from collections import Counter

import prometheus_client
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from test_service import call, world  # noqa: F401  (the module fixture: two small bundles)

import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow)
from retrieval.serving import Bundle
from retrieval.serving.http import ServiceLimits, create_app

LIMITS = ServiceLimits(max_body_bytes=1024, max_headers=20)
GOOD = {"query": {"user_id": "user07"}, "k": 5}


@pytest.fixture(scope="module")
def bundle_a(world):  # noqa: F811
    """bundle-a loaded once: apps made from it start without loading anything."""
    return Bundle.load(world["bundle-a"])


def scrape(app):
    """Every sample of the app's /metrics as (name, labels, value), parsed as Prometheus parses it."""
    response = call(app, "GET", "/metrics")
    assert response.status_code == 200, response.text
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(response.text)
            for s in family.samples]


def requests_by_route_and_status(samples):
    return {(labels["route"], labels["status"]): value for name, labels, value in samples
            if name == "retrieval_requests_total"}


def latency(samples, route, suffix):
    return [(labels, value) for name, labels, value in samples
            if name == f"retrieval_request_seconds{suffix}" and labels["route"] == route]


def only(samples, name):
    """The labels and value of the one sample called ``name``."""
    found = [(labels, value) for sample_name, labels, value in samples if sample_name == name]
    assert len(found) == 1, found
    return found[0]


def test_good_and_bad_requests_are_counted_by_route_and_status(bundle_a):
    app = create_app(bundle_a, limits=LIMITS)
    good = 3
    for _ in range(good):
        assert call(app, "POST", "/recommend", json=GOOD).status_code == 200
    bad = [
        ({"content": b"{not json"}, 400),
        ({"json": {"k": 3}}, 422),
        ({"json": {"query": {"user_id": "u"}, "k": 0}}, 422),
        ({"content": json.dumps({"query": {"user_id": "u" * 2000}}).encode()}, 413),
        ({"json": GOOD, "headers": {f"x-extra-{n}": "1" for n in range(30)}}, 431),
    ]
    for kwargs, status in bad:
        assert call(app, "POST", "/recommend", **kwargs).status_code == status
    assert call(app, "GET", "/recommend").status_code == 405
    assert call(app, "GET", "/nowhere").status_code == 404
    assert call(app, "GET", "/healthz").status_code == 200

    samples = scrape(app)
    assert requests_by_route_and_status(samples) == {
        ("/recommend", "200"): good, ("/recommend", "400"): 1, ("/recommend", "422"): 2,
        ("/recommend", "413"): 1, ("/recommend", "431"): 1, ("/recommend", "405"): 1,
        ("other", "404"): 1, ("/healthz", "200"): 1,
    }
    [(_, count)] = latency(samples, "/recommend", "_count")
    assert count == good + len(bad) + 1
    buckets = sorted((float(labels["le"]), value) for labels, value in latency(samples, "/recommend", "_bucket"))
    assert [le for le, _ in buckets] == [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                                         float("inf")]
    assert buckets[-1][1] == count and all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:]))
    [(_, seconds)] = latency(samples, "/recommend", "_sum")
    assert 0 < seconds < 60
    # Scrapes are not counted, under any method.
    assert call(app, "DELETE", "/metrics").status_code == 405
    assert requests_by_route_and_status(scrape(app)) == requests_by_route_and_status(samples)


def test_an_unhandled_error_is_counted_as_500(bundle_a):
    class ExplodingBundle:
        version = "exploding"

        def changed_files(self):
            return []

        def probe_problem(self):
            raise RuntimeError("probe exploded")

    app = create_app(bundle_a)
    app.state.holder.current = ExplodingBundle()
    with pytest.raises(RuntimeError, match="probe exploded"):  # the ASGI transport re-raises after the 500
        call(app, "GET", "/healthz")
    app.state.holder.current = bundle_a
    samples = scrape(app)
    assert requests_by_route_and_status(samples) == {("/healthz", "500"): 1}
    assert latency(samples, "/healthz", "_count")[0][1] == 1


def test_bundle_info_names_the_served_bundle_and_only_the_new_one_after_a_reload(world, tmp_path):  # noqa: F811
    before = time.time()
    app = create_app(world["bundle-a"])
    samples = scrape(app)
    labels, value = only(samples, "retrieval_bundle_info")
    assert value == 1
    assert labels == {"bundle": "bundle-a", "format_version": "2", "created_at": labels["created_at"],
                      "embedding_dim": "16", "num_items": "300", "index_factory": "Flat"}
    assert labels["created_at"] == Bundle.load(world["bundle-a"]).manifest["created_at"]
    first_load = only(samples, "retrieval_bundle_load_seconds")[1]
    first_swap = only(samples, "retrieval_bundle_loaded_timestamp_seconds")[1]
    assert 0 < first_load < 120 and before <= first_swap <= time.time()

    swapping = time.time()
    assert call(app, "POST", "/admin/reload", json={"bundle": str(world["bundle-b"])}).status_code == 200
    samples = scrape(app)
    labels, value = only(samples, "retrieval_bundle_info")  # bundle-a's series is gone
    assert value == 1 and labels["bundle"] == "bundle-b" and labels["index_factory"] == "HNSW16"
    assert 0 < only(samples, "retrieval_bundle_load_seconds")[1] < 120
    assert swapping <= only(samples, "retrieval_bundle_loaded_timestamp_seconds")[1] <= time.time()

    # A failed reload changes nothing but the count of /admin/reload answers.
    assert call(app, "POST", "/admin/reload", json={"bundle": str(tmp_path / "missing")}).status_code == 422
    after = scrape(app)
    assert only(after, "retrieval_bundle_info")[0]["bundle"] == "bundle-b"
    assert requests_by_route_and_status(after) == {("/admin/reload", "200"): 1, ("/admin/reload", "422"): 1}


def test_a_bundle_loaded_elsewhere_has_no_load_time(bundle_a):
    samples = scrape(create_app(bundle_a))
    assert only(samples, "retrieval_bundle_info")[0]["bundle"] == "bundle-a"
    assert not [name for name, _, _ in samples if name == "retrieval_bundle_load_seconds"]
    assert only(samples, "retrieval_bundle_loaded_timestamp_seconds")[1] > 0


def test_two_apps_in_one_process_count_apart(bundle_a):
    first, second = create_app(bundle_a), create_app(bundle_a)
    for _ in range(2):
        call(first, "POST", "/recommend", json=GOOD)
    call(second, "POST", "/recommend", json={"k": 3})
    assert requests_by_route_and_status(scrape(first)) == {("/recommend", "200"): 2}
    assert requests_by_route_and_status(scrape(second)) == {("/recommend", "422"): 1}
    assert prometheus_client.REGISTRY.get_sample_value("retrieval_requests_total",
                                                       {"route": "/recommend", "status": "200"}) is None


def test_the_content_type_is_prometheus_text(bundle_a):
    response = call(create_app(bundle_a), "GET", "/metrics")
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "# TYPE retrieval_requests_total counter" in response.text


# (method, path, kwargs) -> the (route, status) it is counted under; None: not counted.
REQUESTS = {
    "good recommend": (("POST", "/recommend", {"json": GOOD}), ("/recommend", "200")),
    "not json": (("POST", "/recommend", {"content": b"[1,"}), ("/recommend", "400")),
    "no query": (("POST", "/recommend", {"json": {"k": 3}}), ("/recommend", "422")),
    "wrong method": (("PUT", "/recommend", {}), ("/recommend", "405")),
    "good similar": (("POST", "/similar", {"json": {"item_id": "item001", "k": 3}}), ("/similar", "200")),
    "unknown item": (("POST", "/similar", {"json": {"item_id": "nope"}}), ("/similar", "422")),
    "metadata": (("GET", "/metadata", {}), ("/metadata", "200")),
    "scrape": (("GET", "/metrics", {}), None),
}


@settings(max_examples=12, deadline=None)
@given(
    st.lists(st.one_of(st.sampled_from(sorted(REQUESTS)), st.text("abc/%-_", min_size=1, max_size=12)), max_size=8)
)
def test_counts_equal_the_requests_sent_and_unknown_paths_share_one_label(bundle_a, plan):
    app = create_app(bundle_a, limits=LIMITS)
    expected = Counter()
    for step in plan:
        if step in REQUESTS:
            (method, path, kwargs), counted = REQUESTS[step]
        else:  # a path no route has, whatever it is
            (method, path, kwargs), counted = ("GET", f"/x/{step}", {}), ("other", "404")
        response = call(app, method, path, **kwargs)
        if counted:
            assert response.status_code == int(counted[1]), (step, response.text)
            expected[counted] += 1
    samples = scrape(app)
    assert requests_by_route_and_status(samples) == expected
    for route in {route for route, _ in expected}:
        assert latency(samples, route, "_count")[0][1] == sum(n for (r, _), n in expected.items() if r == route)
