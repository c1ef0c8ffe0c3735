"""The HTTP service end to end: in-process (ASGI) and over loopback (uvicorn), bad requests,
bundle reload under load, and the pure-TensorFlow top-k SavedModel against FAISS."""

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import tensorflow as tf
import uvicorn

import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow)
from retrieval.bundle.saved_models import model_path
from retrieval.bundle.writer import write_bundle
from retrieval.config import IndexConfig
from retrieval.index import build_index
from retrieval.serving import Bundle
from retrieval.serving.http import ServiceLimits, create_app, server_config

ROOT = Path(__file__).resolve().parents[2]
DIM, NUM_ITEMS, NUM_USERS, K = 16, 300, 60, 10


def _unit(rng, n, centres):
    points = centres[rng.integers(0, len(centres), n)] + 0.4 * rng.normal(size=(n, centres.shape[1]))
    return (points / np.linalg.norm(points, axis=1, keepdims=True)).astype(np.float32)


def _fixed_id_tower(feature, ids, vectors):
    """An ID tower with given embeddings; unknown ids map to the zero (out-of-vocabulary) row."""
    inputs = {feature: tf.keras.Input(shape=(), dtype=tf.string, name=feature)}
    lookup = tf.keras.layers.StringLookup(vocabulary=list(ids), mask_token=None, num_oov_indices=1)
    table = np.vstack([np.zeros((1, vectors.shape[1]), np.float32), vectors])
    embedding = tf.keras.layers.Embedding(len(table), vectors.shape[1])
    model = tf.keras.Model(inputs, embedding(lookup(inputs[feature])))
    embedding.set_weights([table])
    return model


def write_fixed_tower_bundles(root: Path) -> dict:
    """Two bundles over the same fixed ID towers in ``root``: "bundle-a" (exact Flat) and "bundle-b" (tuned
    HNSW), with the vectors they were written from (tests/conftest.py's ``fixed_tower_bundles``)."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(8, DIM))
    item_ids = [f"item{i:03d}" for i in range(NUM_ITEMS)]
    user_ids = [f"user{u:02d}" for u in range(NUM_USERS)]
    items, users = _unit(rng, NUM_ITEMS, centres), _unit(rng, NUM_USERS, centres)
    query_tower = _fixed_id_tower("user_id", user_ids, users)
    doc_tower = _fixed_id_tower("item_id", item_ids, items)
    popular = [item_ids[i] for i in rng.permutation(NUM_ITEMS)[:50]]
    directories = {}
    for name, factory in [("bundle-a", "Flat"), ("bundle-b", "HNSW16")]:
        index = build_index(item_ids, items, IndexConfig(factory=factory, tune_k=K), users, "test users")
        directories[name] = root / name
        directories[name].mkdir()
        write_bundle(
            directories[name],
            query_tower=query_tower,
            doc_tower=doc_tower,
            index=index,
            manifest={"run": name, "popular_item_ids": popular},
            item_embeddings=items,
            topk_k=K,
        )
    return {"items": items, "users": users, "item_ids": item_ids, "user_ids": user_ids, "popular": popular,
            **directories}


@pytest.fixture(scope="module")
def world(fixed_tower_bundles):
    """The session's two fixed-tower bundles (tests/conftest.py), shared with every module that imports this
    fixture: "bundle-a" (exact Flat), "bundle-b" (tuned HNSW), and the ids and vectors they hold."""
    return fixed_tower_bundles


@pytest.fixture(scope="module")
def app(world):
    return create_app(world["bundle-a"], limits=ServiceLimits(max_body_bytes=64 * 1024))


def call(app, method, path, **kwargs):
    """One request to the ASGI app in-process (httpx's ASGI transport, no socket)."""

    async def go():
        transport = httpx.ASGITransport(app=app)
        # The address create_app assumes it is bound to by default: admin routes check the Host header.
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def exact_top(world, user, k=K, exclude=()):
    scores = world["items"] @ world["users"][world["user_ids"].index(user)]
    order = np.argsort(-scores, kind="stable")
    return [world["item_ids"][r] for r in order if world["item_ids"][r] not in set(exclude)][:k]


def test_single_query_equals_exact_search_and_the_bundle(world, app):
    response = call(app, "POST", "/recommend", json={"query": {"user_id": "user07"}, "k": K})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["bundle"] == "bundle-a" and body["fallback"] is None
    assert body["item_ids"] == exact_top(world, "user07")
    direct = Bundle.load(world["bundle-a"]).recommend({"user_id": "user07"}, k=K)
    np.testing.assert_allclose(body["scores"], direct.scores, rtol=1e-6)


def test_batch_with_exclusions_and_an_unknown_user(world, app):
    seen = exact_top(world, "user03")[:3]
    response = call(app, "POST", "/recommend", json={
        "queries": [{"user_id": "user03"}, {"user_id": "never-seen"}, {"user_id": "user04"}],
        "k": 5,
        "exclude_item_ids": [seen + ["not-in-catalogue"], world["popular"][:2], []],
    })
    assert response.status_code == 200, response.text
    first, unknown, third = response.json()["results"]
    assert first["item_ids"] == exact_top(world, "user03", 5, exclude=seen) and not set(seen) & set(first["item_ids"])
    assert unknown["fallback"] == "popular" and unknown["scores"] == [None] * 5
    assert unknown["item_ids"] == world["popular"][2:7]
    assert third["item_ids"] == exact_top(world, "user04", 5) and third["fallback"] is None


def test_health_and_metadata(app):
    assert call(app, "GET", "/healthz").json() == {"status": "ok", "bundle": "bundle-a", "num_items": NUM_ITEMS}
    meta = call(app, "GET", "/metadata").json()
    assert meta["bundle"] == "bundle-a" and meta["query_features"] == ["user_id"]
    assert meta["metric"] == "inner_product" and meta["normalized"] is True
    assert meta["index"]["factory"] == "Flat" and meta["index"]["exact"] is True


@pytest.mark.parametrize(
    "method, path, kwargs, status, reason",
    [
        ("POST", "/recommend", {"content": b"{not json"}, 400, "not valid JSON"),
        ("POST", "/recommend", {"json": [1, 2]}, 400, "must be a JSON object"),
        ("POST", "/recommend", {"json": {"k": 3}}, 422, "exactly one of 'query'"),
        ("POST", "/recommend", {"json": {"query": {"user_id": "u"}, "queries": [{"user_id": "u"}]}}, 422,
         "exactly one of"),
        ("POST", "/recommend", {"json": {"query": {"item_id": "x"}}}, 422,
         "query 0 has the key 'item_id', which this bundle does not read"),
        ("POST", "/recommend", {"json": {"query": {}}}, 422, "lacks the feature 'user_id'"),
        ("POST", "/recommend", {"json": {"query": {"user_id": ["a"]}}}, 422, "must be a string or integer"),
        ("POST", "/recommend", {"json": {"query": {"user_id": "u"}, "k": 0}}, 422, "k: k must be at least 1"),
        ("POST", "/recommend", {"json": {"query": {"user_id": "u"}, "k": "ten"}}, 422, "k: k must be an integer"),
        ("POST", "/recommend", {"json": {"query": {"user_id": "u"}, "top": 3}}, 422, "top: unknown field"),
        ("POST", "/recommend", {"json": {"query": {"user_id": "u"}, "exclude_item_ids": "item001"}}, 422,
         "exclude_item_ids"),
        ("POST", "/recommend", {"json": {"queries": [{"user_id": "u"}], "exclude_item_ids": [["a"], ["b"]]}}, 422,
         "exclude_item_ids has 2 lists for 1 queries"),
        ("POST", "/recommend", {"json": {"queries": []}}, 422, "queries"),
        ("GET", "/recommend", {}, 405, "Method Not Allowed"),
        ("GET", "/nowhere", {}, 404, "Not Found"),
        ("POST", "/admin/reload", {"json": {}}, 422, "bundle: Field required"),
    ],
)
def test_bad_requests_get_4xx_with_a_reason(app, method, path, kwargs, status, reason):
    response = call(app, method, path, **kwargs)
    assert response.status_code == status, response.text
    assert reason in response.json()["error"]


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_oversized_body_is_refused_in_json(app, declared):
    body = json.dumps({"query": {"user_id": "u" * 100_000}}).encode()
    # Without Content-Length (a generator body is sent chunked) the limit trips while reading.
    async def chunks():
        yield body[:50_000]
        yield body[50_000:]

    content = body if declared else chunks()
    response = call(app, "POST", "/recommend", content=content)
    assert response.status_code == 413
    assert response.json() == {"error": f"request body over {64 * 1024} bytes"}
    assert response.headers["connection"] == "close"


def test_failed_reload_keeps_serving_the_old_bundle(app, tmp_path):
    response = call(app, "POST", "/admin/reload", json={"bundle": str(tmp_path / "missing")})
    assert response.status_code == 422
    assert (
        "still serving 'bundle-a'" in response.json()["error"]
        and "manifest.json is missing" in response.json()["error"]
    )
    assert call(app, "GET", "/healthz").json()["bundle"] == "bundle-a"


def test_admin_can_be_switched_off(world):
    app = create_app(Bundle.load(world["bundle-a"]), admin=False)
    assert call(app, "POST", "/admin/reload", json={"bundle": str(world["bundle-b"])}).status_code == 404


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve_in_thread(app, limits: ServiceLimits | None = None, http: str = "auto"):
    """(server, thread, port): a uvicorn server on 127.0.0.1 in a thread, ``limits`` at the connection level too."""
    port = free_port()
    server = uvicorn.Server(server_config(app, limits, http=http, host="127.0.0.1", port=port,
                                          log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    return server, thread, port


@pytest.fixture
def loopback(world):
    """A uvicorn server on 127.0.0.1 in a thread, serving bundle-a."""
    server, thread, port = serve_in_thread(create_app(world["bundle-a"]))
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_reload_under_loopback_load_drops_nothing(world, loopback):
    stop = threading.Event()

    def hammer(worker):
        seen = []
        with httpx.Client(base_url=loopback, timeout=30) as client:
            while not stop.is_set():
                user = f"user{(worker * 7 + len(seen)) % NUM_USERS:02d}"
                response = client.post("/recommend", json={"query": {"user_id": user}, "k": K})
                assert response.status_code == 200, response.text
                body = response.json()
                assert len(body["item_ids"]) == K and body["fallback"] is None
                seen.append(body["bundle"])
        return seen

    with ThreadPoolExecutor(4) as pool, httpx.Client(base_url=loopback, timeout=60) as admin:
        workers = [pool.submit(hammer, w) for w in range(4)]
        time.sleep(0.3)
        for target in ("bundle-b", "bundle-a", "bundle-b"):
            reply = admin.post("/admin/reload", json={"bundle": str(world[target])})
            assert reply.status_code == 200, reply.text
            assert reply.json()["bundle"] == target
            time.sleep(0.3)
        stop.set()
        served = [bundle for worker in workers for bundle in worker.result()]  # re-raises worker failures
        assert admin.get("/healthz").json()["bundle"] == "bundle-b"
        meta = admin.get("/metadata").json()
    assert {"bundle-a", "bundle-b"} <= set(served) and len(served) > 20
    assert meta["index"]["factory"] == "HNSW16" and meta["index"]["tuning"]["recall"] >= 0.95


def test_loopback_answers_equal_in_process_answers(world, app, loopback):
    request = {"queries": [{"user_id": "user11"}, {"user_id": "stranger"}], "k": 7}
    over_http = httpx.post(f"{loopback}/recommend", json=request, timeout=30).json()
    assert over_http == call(app, "POST", "/recommend", json=request).json()


def test_topk_savedmodel_equals_faiss_top_k(world):
    bundle = Bundle.load(world["bundle-a"])
    serve = tf.saved_model.load(str(model_path(world["bundle-a"], "topk_model"))).signatures["serving_default"]
    users = ["user00", "user01", "user02", "user59", "stranger"]
    out = serve(user_id=tf.constant(users), exclude_item_ids=tf.constant([[""]] * len(users)))
    ids = out["item_ids"].numpy().astype(str)
    assert ids.shape == (len(users), K)
    faiss_results = bundle.recommend_batch([{"user_id": u} for u in users], k=K)
    for row, result in enumerate(faiss_results[:-1]):
        assert list(ids[row]) == result.item_ids
        np.testing.assert_allclose(out["scores"].numpy()[row], result.scores, rtol=1e-5)
    assert out["fallback"].numpy().tolist() == [False] * 4 + [True]
    assert list(ids[-1]) == world["popular"][:K] == faiss_results[-1].item_ids
    assert np.all(np.isnan(out["scores"].numpy()[-1]))


def test_console_script_serves_and_reloads(world):
    port = free_port()
    command = [sys.executable, "-m", "retrieval.cli"]
    server = subprocess.Popen(command + ["serve", "--bundle", str(world["bundle-a"]), "--port", str(port)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stdout.read()
            assert time.monotonic() < deadline, "retrieval serve did not come up"
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        reply = httpx.post(f"{url}/recommend", json={"query": {"user_id": "user05"}, "k": 3}, timeout=30).json()
        assert reply["item_ids"] == exact_top(world, "user05", 3)
        reload = subprocess.run(command + ["reload", "--url", url, "--bundle", str(world["bundle-b"])],
                                cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert reload.returncode == 0, reload.stderr
        assert json.loads(reload.stdout)["bundle"] == "bundle-b"
        assert httpx.get(f"{url}/healthz", timeout=5).json()["bundle"] == "bundle-b"
    finally:
        server.terminate()
        server.wait(timeout=30)
