"""Catalogue edits without retraining (``retrieval.bundle.catalogue``): offline, through the CLI and
live through ``POST /admin/catalogue``, against brute force over the in-training towers."""

import asyncio
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
import uvicorn
from feature_fixtures import ALL_KINDS, small_tables, stored_histories

import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow)
from retrieval.bundle.catalogue import CatalogueError, current_version, edit_catalogue, read_items
from retrieval.bundle.manifest import read_manifest
from retrieval.cli import main as cli_main
from retrieval.features.tables import catalogue_inputs
from retrieval.serving.batch import all_items, similar_to_file
from retrieval.serving.bundle import Bundle
from retrieval.serving.http import create_app, server_config
from retrieval.serving.request_checks import RequestError
from retrieval.training import embed_frame

# The fixtures build feature towers and write them as SavedModels (~10-30 s on 2 cores).
pytestmark = pytest.mark.slow
USERS = [f"u{i}" for i in range(6)]
ALL = 100  # k above any catalogue size here: every servable item, ranked


def _raw_items(seed: int, count: int, prefix: str) -> pd.DataFrame:
    """``count`` new items with raw doc features (the columns the doc model reads) and a title."""
    rng = np.random.default_rng(seed)
    genres = ["Drama", "Comedy", "Action", "War", "Horror", "Sci-Fi"]
    return pd.DataFrame({
        "item_id": [f"{prefix}{i}" for i in range(count)],
        "genres": [list(rng.choice(genres, rng.integers(1, 3), replace=False)) for _ in range(count)],
        "tags": ["|".join(rng.choice(list("abcdz"), 2)) for _ in range(count)],
        "price": rng.uniform(1, 100, count).round(2),
        "released": rng.integers(1970, 2020, count).astype(float),
        "title": [f"New thing {prefix}{i}" for i in range(count)],
    })


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A feature-tower bundle (seeded, untrained towers over ``small_tables(0)``) with seen items,
    histories, user features, display features and a topk model; the Keras towers for references."""
    from retrieval.bundle.seen_items import SeenItems
    from retrieval.bundle.writer import raw_query, write_bundle
    from retrieval.config import ModelConfig
    from retrieval.features import TowerStatistics, TowerTables
    from retrieval.index import ItemIndex
    from retrieval.towers import build_towers

    clicks, users, items = small_tables(0)
    tables = TowerTables(ALL_KINDS, clicks, users, items)
    stats = TowerStatistics.fit(ALL_KINDS, tables.examples(), tables.reference_time)
    tf.keras.utils.set_random_seed(1)
    query, doc = build_towers(ALL_KINDS, ModelConfig(embedding_dim=8), stats)
    catalogue = tables.catalogue()
    embeddings = embed_frame(doc, catalogue)
    index = ItemIndex.build(catalogue["item_id"].tolist(), embeddings)
    root = tmp_path_factory.mktemp("catalogue") / "shop"
    write_bundle(root, query_tower=query, doc_tower=doc, index=index,
                 manifest={"run": "shop", "popular_item_ids": ["i0", "i1", "i2"],
                           "config": {"towers": ALL_KINDS.model_dump(mode="json")}},
                 item_embeddings=embeddings, topk_k=3, user_features=tables.user_features(),
                 probe_query=tables.queries(["u2"]), item_features=items.assign(brand=[f"b{i % 3}" for i in range(8)]),
                 user_histories=stored_histories(clicks, index.item_ids, 3),
                 seen_items=SeenItems.from_pairs(clicks["user_id"], pd.Index(index.item_ids, dtype=object)
                                                 .get_indexer(clicks["item_id"])))
    # Full raw queries (every input, as a client sends them) and their in-training embeddings.
    frames = tables.queries(USERS)
    queries = [raw_query(frames.iloc[[i]], query.input_names) for i in range(len(USERS))]
    candidates = _raw_items(7, 40, "new")
    return {"root": root, "query": query, "doc": doc, "items": items, "catalogue": catalogue,
            "queries": queries, "query_vectors": embed_frame(query, frames), "candidates": candidates,
            "candidate_vectors": embed_frame(doc, catalogue_inputs(candidates, ALL_KINDS))}


def _brute_force(world, item_ids, vectors, removed=()):
    """Per user, every item not removed, best first: numpy over the in-training towers' embeddings."""
    scores = world["query_vectors"] @ vectors.T
    keep = [i for i, item in enumerate(item_ids) if item not in set(removed)]
    return [[item_ids[i] for i in sorted(keep, key=lambda i: -row[i])] for row in scores]


def _served(bundle, world):
    return [result.item_ids for result in bundle.recommend_batch(world["queries"], ALL, exclude_seen=False)]


def _same_up_to_ties(served, expected, scores_of):
    """Equal rankings, items of equal score (1e-5) in either order."""
    assert len(served) == len(expected)
    for got, want in zip(served, expected):
        assert sorted(got) == sorted(want)
        np.testing.assert_allclose([scores_of(item) for item in got], [scores_of(item) for item in want], atol=1e-5)


@pytest.fixture(scope="module")
def added(world, tmp_path_factory):
    """The bundle with three new items, one of them some user's brute-force top-1 over the new catalogue."""
    old_ids, old_vectors = world["catalogue"]["item_id"].tolist(), embed_frame(world["doc"], world["catalogue"])
    best_old = (world["query_vectors"] @ old_vectors.T).max(axis=1)
    wins = world["query_vectors"] @ world["candidate_vectors"].T > best_old[:, None]  # [users, candidates]
    winner = int(np.flatnonzero(wins.any(axis=0))[0])  # a candidate that beats every item for some user
    chosen = [winner, *[c for c in range(len(world["candidates"])) if not wins[:, c].any()][:2]]
    new = world["candidates"].iloc[chosen].reset_index(drop=True)
    out = tmp_path_factory.mktemp("edits") / "added"
    manifest = edit_catalogue(world["root"], "add", new, out)
    ids = old_ids + new["item_id"].tolist()
    vectors = np.vstack([old_vectors, world["candidate_vectors"][chosen]])
    return {"dir": out, "manifest": manifest, "new": new, "ids": ids, "vectors": vectors,
            "winner": new["item_id"][0], "winner_user": int(np.flatnonzero(wins[:, winner])[0])}


def test_an_added_item_is_served_where_brute_force_ranks_it(world, added):
    bundle = Bundle.load(added["dir"])  # a restart: the new version from disk, every check of a load
    expected = _brute_force(world, added["ids"], added["vectors"])
    assert expected[added["winner_user"]][0] == added["winner"]  # the reference puts the new item first
    served = _served(bundle, world)
    assert served[added["winner_user"]][0] == added["winner"]
    user_scores = world["query_vectors"] @ added["vectors"].T
    for user, (got, want) in enumerate(zip(served, expected)):
        _same_up_to_ties([got], [want], lambda item, u=user: user_scores[u, added["ids"].index(item)])
    # Rows of the source keep their items (seen items and histories name rows); new ones at the end.
    assert list(bundle.index.item_ids) == added["ids"]
    # The new items are shown with their display features; the old ones keep theirs.
    shown = bundle.item_features([added["winner"], "i2"])
    assert shown[0]["title"] == added["new"]["title"][0] and shown[0]["genres"] == list(added["new"]["genres"][0])
    assert shown[1]["title"] == "Café au lait"


def test_an_edited_bundle_records_its_parent_and_drops_the_topk_model(world, added):
    manifest = read_manifest(added["dir"])
    source = read_manifest(world["root"])
    assert manifest.parent is not None and manifest.parent.change == "catalogue_add"
    assert manifest.parent.directory == str(world["root"].resolve()) and manifest.parent.run == "shop"
    assert manifest.parent.created_at == source.created_at
    assert "topk_model" not in manifest.files and "topk" not in (added["dir"] / "models/models.config").read_text()
    assert manifest.files["query_model"] == source.files["query_model"]  # the same models, same version
    assert manifest.num_items == source.num_items + 3 and manifest.probe["item_ids"]
    assert manifest.fingerprints != source.fingerprints


def test_a_removed_item_is_never_served(world, added, tmp_path):
    top = _brute_force(world, added["ids"], added["vectors"])
    removed = sorted({top[0][0], "i0", added["winner"]})  # a top-1, a popular item, a new item
    out = tmp_path / "removed"
    edit_catalogue(added["dir"], "remove", pd.DataFrame({"item_id": removed}), out)
    bundle = Bundle.load(out)
    expected = _brute_force(world, added["ids"], added["vectors"], removed)
    served = _served(bundle, world)
    assert [sorted(items) for items in served] == [sorted(items) for items in expected]
    assert all(items[:1] == want[:1] for items, want in zip(served, expected))
    # Nor as a similar item, nor in the popular fallback of a query the towers know nothing of.
    for item in added["ids"]:
        if item not in removed:
            assert not set(removed) & set(bundle.similar_items(item, ALL).item_ids)
    fallback = bundle.recommend({"user_id": "stranger"}, k=3)
    assert fallback.fallback == "popular" and fallback.item_ids == [i for i in ("i0", "i1", "i2") if i not in removed]
    with pytest.raises(RequestError, match=f"item id '{removed[0]}' was removed"):
        bundle.similar_items(removed[0])
    # Nor under a filter whose allow-list names them (the filtered search takes the same exclusions).
    allowed = {"item_id": {"in": [*removed, "i4", "i5"]}}
    for result in bundle.recommend_batch(world["queries"], ALL, exclude_seen=False, filters=allowed):
        assert sorted(result.item_ids) == [item for item in ("i4", "i5") if item not in removed]
    # Nor found by the page's item search.
    assert set(bundle.search_items("thing new", 20)) == set(added["new"]["item_id"]) - set(removed)
    assert Bundle.load(added["dir"]).search_items("Toy Story", 5) == ["i0"]
    assert bundle.search_items("Toy Story", 5) == []
    # Nor in a batch of every item's similar items (retrieval recommend --similar all).
    written = similar_to_file(bundle, all_items(bundle), ALL, tmp_path / "similar.parquet", block_size=4)
    similar = pd.read_parquet(tmp_path / "similar.parquet")
    assert written.queries == len(added["ids"]) - 3
    assert not set(removed) & (set(similar["item_id"]) | set(similar["similar_item_id"]))
    # The rows stay: seen items and histories still name them; the manifest lists the removed ones.
    assert list(bundle.index.item_ids) == added["ids"] and bundle.metadata()["disabled_items"] == 3
    assert read_manifest(out).disabled_item_ids == removed
    # Adding a removed item back serves it again, under its old row.
    back = tmp_path / "back"
    edit_catalogue(out, "add", added["new"].iloc[[0]], back)
    again = Bundle.load(back)
    assert list(again.index.item_ids) == added["ids"]
    assert again.recommend_batch(world["queries"], 1, exclude_seen=False)[added["winner_user"]].item_ids == \
        [added["winner"]]


def test_update_re_embeds_an_item_and_changes_its_display(world, added, tmp_path):
    changed = added["new"].iloc[[1]].copy()
    changed["genres"] = [["War", "Horror"]]
    changed["price"] = 55.0
    changed["title"] = "Renamed"
    out = tmp_path / "updated"
    edit_catalogue(added["dir"], "update", changed, out)
    bundle = Bundle.load(out)
    row = added["ids"].index(changed["item_id"].iloc[0])
    reference = embed_frame(world["doc"], catalogue_inputs(changed, ALL_KINDS))
    np.testing.assert_allclose(bundle.index.vectors([row]), reference, atol=1e-5)
    assert not np.allclose(reference, added["vectors"][row], atol=1e-3)
    others = np.delete(np.arange(len(added["ids"])), row)
    np.testing.assert_allclose(bundle.index.vectors(others), added["vectors"][others], atol=1e-5)
    assert bundle.item_features([changed["item_id"].iloc[0]])[0]["title"] == "Renamed"
    # A display feature the doc model does not read: the vectors stay, the brand changes.
    brand_only = tmp_path / "brand"
    edit_catalogue(out, "update", pd.DataFrame({"item_id": ["i3"], "brand": ["Acme"]}), brand_only)
    retitled = Bundle.load(brand_only)
    assert retitled.item_features(["i3"])[0]["brand"] == "Acme"
    assert retitled.item_features(["i4"])[0]["brand"] == "b1"
    np.testing.assert_array_equal(retitled.index.vectors(np.arange(len(added["ids"]))),
                                  bundle.index.vectors(np.arange(len(added["ids"]))))


@pytest.mark.parametrize(("change", "items", "message"), [
    ("remove", {"item_id": ["i1", "nope"]}, r"cannot remove item 'nope': not in the catalogue"),
    ("add", {"item_id": ["i4"]}, r"cannot add item 'i4': already in the catalogue"),
    ("add", {"item_id": ["x", "x"]}, r"the items repeat item 'x'"),
    ("add", {"item_id": ["x"], "genres": [["Drama"]], "tags": ["a"], "price": [1.0], "title": ["t"]},
     r"lack the doc model's inputs \['released'\]"),
    ("add", {"item_id": ["x"], "colour": ["red"]}, r"columns \['colour'\] this bundle does not read"),
    ("update", {"item_id": ["zz"], "brand": ["t"]}, r"cannot update item 'zz': not in the catalogue"),
    ("update", {"item_id": ["i1"], "price": [3.0]}, r"lack the doc model's inputs"),
    ("add", {"item_id": ["x"], "genres": [["Drama"]], "tags": ["a"], "price": ["cheap"], "released": [1990.0],
             "title": ["t"]}, r"item 'x': 'price' must be a number, got 'cheap'"),
    ("remove", {"item_id": ["i1"], "title": ["t"]}, r"remove reads only 'item_id'"),
])
def test_bad_edits_are_refused_naming_the_problem(world, tmp_path, change, items, message):
    with pytest.raises(CatalogueError, match=message):
        edit_catalogue(world["root"], change, pd.DataFrame(items), tmp_path / "never")
    assert not (tmp_path / "never").exists()


def _id_only_bundle(directory, factory="Flat", num_items=20):
    """An ID-only bundle: fixed unit vectors for ``num_items`` items and 4 users; unknown ids -> the zero row."""
    from retrieval.bundle.writer import write_bundle
    from retrieval.index import ItemIndex

    rng = np.random.default_rng(3)
    items = rng.normal(size=(num_items, 8)).astype(np.float32)
    items /= np.linalg.norm(items, axis=1, keepdims=True)
    users = rng.normal(size=(4, 8)).astype(np.float32)
    item_ids, user_ids = [f"item{i}" for i in range(num_items)], [f"user{i}" for i in range(4)]

    def tower(feature, ids, vectors):
        inputs = {feature: tf.keras.Input(shape=(), dtype=tf.string, name=feature)}
        lookup = tf.keras.layers.StringLookup(vocabulary=ids, mask_token=None, num_oov_indices=1)
        embedding = tf.keras.layers.Embedding(len(ids) + 1, 8)
        model = tf.keras.Model(inputs, embedding(lookup(inputs[feature])))
        embedding.set_weights([np.vstack([np.zeros((1, 8), np.float32), vectors])])
        return model

    write_bundle(directory, query_tower=tower("user_id", user_ids, users), doc_tower=tower("item_id", item_ids, items),
                 index=ItemIndex.build(item_ids, items, factory), manifest={"popular_item_ids": item_ids[:5]})
    return item_ids, items, users


def test_an_id_only_bundle_takes_a_new_item_only_with_its_embedding(tmp_path):
    item_ids, items, users = _id_only_bundle(tmp_path / "ids")
    with pytest.raises(CatalogueError, match=r"cannot add item 'fresh': this bundle's doc model reads only "
                                             r"'item_id'.*out-of-vocabulary row.*'embedding' column \(8 numbers\)"):
        edit_catalogue(tmp_path / "ids", "add", pd.DataFrame({"item_id": ["fresh"]}), tmp_path / "never")
    with pytest.raises(CatalogueError, match=r"item 'fresh': embedding must be a list of 8 numbers"):
        edit_catalogue(tmp_path / "ids", "add", pd.DataFrame({"item_id": ["fresh"], "embedding": [[1.0, 2.0]]}),
                       tmp_path / "never")
    # The new vector: 3 x user0's direction (normalised, as the index's vectors are): user0's top-1.
    supplied = (3 * users[0]).tolist()
    edit_catalogue(tmp_path / "ids", "add", pd.DataFrame({"item_id": ["fresh"], "embedding": [supplied]}),
                   tmp_path / "out")
    bundle = Bundle.load(tmp_path / "out")
    vectors = np.vstack([items, users[0] / np.linalg.norm(users[0])])
    ids = [*item_ids, "fresh"]
    for user in range(4):
        expected = [ids[i] for i in np.argsort(-(vectors @ users[user]), kind="stable")[:5]]
        assert bundle.recommend({"user_id": f"user{user}"}, k=5).item_ids == expected
        if user == 0:
            assert expected[0] == "fresh"


@pytest.mark.parametrize("factory", ["IVF4,Flat", "HNSW8"])
def test_a_trained_or_graph_index_is_edited_in_place_of_a_rebuild(tmp_path, factory):
    item_ids, items, _ = _id_only_bundle(tmp_path / "ids", factory, num_items=200)
    rng = np.random.default_rng(5)
    new = rng.normal(size=(3, 8)).astype(np.float32)
    new /= np.linalg.norm(new, axis=1, keepdims=True)
    edit_catalogue(tmp_path / "ids", "add", pd.DataFrame({"item_id": ["a", "b", "c"], "embedding": list(new)}),
                   tmp_path / "added")
    moved = rng.normal(size=8).astype(np.float32)
    moved /= np.linalg.norm(moved)
    edit_catalogue(tmp_path / "added", "update", pd.DataFrame({"item_id": ["item7"], "embedding": [moved]}),
                   tmp_path / "updated")
    bundle = Bundle.load(tmp_path / "updated")
    expected = np.vstack([items, new])
    expected[7] = moved
    assert bundle.index.factory == factory and list(bundle.index.item_ids) == [*item_ids, "a", "b", "c"]
    np.testing.assert_allclose(bundle.index.vectors(np.arange(203)), expected, atol=1e-6)
    for row, item in ((200, "a"), (201, "b"), (202, "c"), (7, "item7")):  # each found from its own vector
        assert bundle.index.item_ids[bundle.index.search(expected[row : row + 1], 1).rows[0, 0]] == item


def test_the_cli_publishes_versions_that_a_restart_serves(world, tmp_path, capsys):
    import shutil

    root = tmp_path / "shop"
    shutil.copytree(world["root"], root)
    new = world["candidates"].iloc[[5]]
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({**row, "genres": list(row["genres"])}) + "\n"
                             for row in new.to_dict("records")))
    assert cli_main(["catalogue", "add", "--bundle", str(root), "--items", str(items)]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["bundle"] == str(root.parent / "shop.catalogue" / "shop.v0001") and first["num_items"] == 9
    removal = tmp_path / "gone.csv"
    removal.write_text("item_id\ni5\n")
    assert cli_main(["catalogue", "remove", "--bundle", str(root), "--items", str(removal)]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["bundle"].endswith("shop.v0002") and second["num_items"] == 8 and second["disabled_items"] == 1
    assert current_version(root) == root.parent / "shop.catalogue" / "shop.v0002"
    assert read_manifest(current_version(root)).parent.directory.endswith("shop.v0001")
    # retrieval recommend opens the newest version too: the new item is in its catalogue, i5 is not.
    assert cli_main(["recommend", "--bundle", str(root), "--similar", new["item_id"].iloc[0], "-k", "20"]) == 0
    similar = json.loads(capsys.readouterr().out)["item_ids"]
    assert len(similar) == 7 and "i5" not in similar
    # A bad file is one line naming it.
    assert cli_main(["catalogue", "remove", "--bundle", str(root), "--items", str(tmp_path / "none.csv")]) == 2
    assert "none.csv: no such file" in capsys.readouterr().err
    # A service started on the bundle (a restart) serves its newest version.
    app = create_app(root)
    meta = _call(app, "GET", "/metadata").json()
    assert meta["bundle"] == "shop.v0002" and meta["num_items"] == 9 and meta["disabled_items"] == 1
    reply = _call(app, "POST", "/recommend", json={"query": world["queries"][0], "k": ALL, "exclude_seen": False,
                                                     "history_order": "newest_first"})
    assert "i5" not in reply.json()["item_ids"] and new["item_id"].iloc[0] in reply.json()["item_ids"]
    assert len(read_items(items)) == 1


def _call(app, method, path, headers=None, **kwargs):
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client:
            return await client.request(method, path, headers=headers, **kwargs)

    return asyncio.run(go())


def test_admin_catalogue_is_guarded_like_reload(world, tmp_path):
    import shutil

    root = tmp_path / "shop"
    shutil.copytree(world["root"], root)
    app = create_app(root, admin_token="a-long-enough-token")
    body = {"change": "remove", "item_ids": ["i1"]}
    assert _call(app, "POST", "/admin/catalogue", json=body).status_code == 401
    auth = {"Authorization": "Bearer a-long-enough-token"}
    foreign = _call(app, "POST", "/admin/catalogue", json=body, headers={**auth, "Host": "evil.example"})
    assert foreign.status_code == 403 and "Host header" in foreign.json()["error"]
    other_site = _call(app, "POST", "/admin/catalogue", json=body, headers={**auth, "Origin": "http://evil.example"})
    assert other_site.status_code == 403
    plain = _call(app, "POST", "/admin/catalogue", content=json.dumps(body),
                  headers={**auth, "Content-Type": "text/plain"})
    assert plain.status_code == 415
    unknown = _call(app, "POST", "/admin/catalogue", json={"change": "remove", "item_ids": ["zz"]}, headers=auth)
    assert unknown.status_code == 422 and "cannot remove item 'zz': not in the catalogue" in unknown.json()["error"]
    bad = _call(app, "POST", "/admin/catalogue", json={"change": "sell", "item_ids": ["i1"]}, headers=auth)
    assert bad.status_code == 422 and "change" in bad.json()["error"]
    assert not (tmp_path / "shop.catalogue" / "current").exists()  # nothing was published
    done = _call(app, "POST", "/admin/catalogue", json=body, headers=auth)
    assert done.status_code == 200 and done.json()["bundle"] == "shop.v0001" and done.json()["num_items"] == 7
    # The next edit copies the served files: one changed on disk since the load is refused, naming it.
    served = tmp_path / "shop.catalogue" / "shop.v0001" / "index.json"
    served.write_text(served.read_text() + "\n")
    changed = _call(app, "POST", "/admin/catalogue", json={"change": "remove", "item_ids": ["i2"]}, headers=auth)
    assert changed.status_code == 422
    assert "changed on disk since they were loaded (index.json)" in changed.json()["error"]
    assert current_version(root).name == "shop.v0001"


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_live_edits_under_load_fail_nothing_and_never_mix_catalogues(world, tmp_path):
    import shutil

    root = tmp_path / "shop"
    shutil.copytree(world["root"], root)
    port = _free_port()
    server = uvicorn.Server(server_config(create_app(root), None, host="127.0.0.1", port=port,
                                          log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    new = world["candidates"].iloc[[10, 11]]
    edits = [
        {"change": "add", "items": [{**row, "genres": list(row["genres"])} for row in new.to_dict("records")]},
        {"change": "remove", "item_ids": ["i0", "i3"]},
        {"change": "remove", "item_ids": [new["item_id"].iloc[0]]},
    ]
    catalogues = {"shop": {f"i{i}" for i in range(8)}}
    catalogues["shop.v0001"] = catalogues["shop"] | set(new["item_id"])
    catalogues["shop.v0002"] = catalogues["shop.v0001"] - {"i0", "i3"}
    catalogues["shop.v0003"] = catalogues["shop.v0002"] - {new["item_id"].iloc[0]}
    stop = threading.Event()

    def hammer(worker):
        answers = []
        with httpx.Client(base_url=url, timeout=30) as client:
            while not stop.is_set():
                query = world["queries"][(worker + len(answers)) % len(USERS)]
                reply = client.post("/recommend", json={"query": query, "k": ALL, "exclude_seen": False,
                                                            "history_order": "newest_first"})
                assert reply.status_code == 200, reply.text
                answers.append((reply.json()["bundle"], set(reply.json()["item_ids"])))
        return answers

    try:
        with ThreadPoolExecutor(3) as pool, httpx.Client(base_url=url, timeout=60) as admin:
            workers = [pool.submit(hammer, w) for w in range(3)]
            time.sleep(0.3)
            for edit in edits:
                reply = admin.post("/admin/catalogue", json=edit)
                assert reply.status_code == 200, reply.text
                time.sleep(0.3)
            stop.set()
            answers = [answer for worker in workers for answer in worker.result()]  # re-raises failures
    finally:
        stop.set()
        server.should_exit = True
        thread.join(timeout=10)
    assert {version for version, _ in answers} == set(catalogues)
    for version, items in answers:  # each answer is one whole catalogue: every item of it, nothing else
        assert items == catalogues[version], version
    assert current_version(root).name == "shop.v0003"


def _records(items):
    return [{**row, "genres": list(row["genres"])} for row in items.to_dict("records")]


class _HeldWrite:
    """``publish_prepared`` patched to wait for ``release`` (after setting ``reached``), or to fail."""

    def __init__(self, monkeypatch, fail=None):
        import retrieval.bundle.catalogue as catalogue

        self.reached, self.release, self.fail = threading.Event(), threading.Event(), fail
        self.written = []
        real = catalogue.publish_prepared

        def held(root, prepared):
            self.reached.set()
            assert self.release.wait(60), "the test never released the write"
            if self.fail is not None:
                raise self.fail
            self.written.append(prepared.changes["run"])
            return real(root, prepared)

        monkeypatch.setattr(catalogue, "publish_prepared", held)


def test_a_live_edit_is_served_before_its_version_is_written_and_a_restart_serves_it(world, added, tmp_path,
                                                                                       monkeypatch):
    import shutil

    root = tmp_path / "shop"
    shutil.copytree(world["root"], root)
    app = create_app(root)
    held = _HeldWrite(monkeypatch)
    user = added["winner_user"]
    expected = _brute_force(world, added["ids"], added["vectors"])
    user_scores = world["query_vectors"] @ added["vectors"].T

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000", timeout=60) as client:
            async def top(query):
                reply = await client.post("/recommend", json={"query": query, "k": ALL, "exclude_seen": False,
                                                             "history_order": "newest_first"})
                assert reply.status_code == 200, reply.text
                return reply.json()

            before = await top(world["queries"][user])
            edit = asyncio.create_task(client.post("/admin/catalogue", json={"change": "add",
                                                                               "items": _records(added["new"])}))
            assert await asyncio.to_thread(held.reached.wait, 60)
            during = await top(world["queries"][user])  # the write is held: served from memory only
            on_disk_during = current_version(root).name, (tmp_path / "shop.catalogue" / "shop.v0001").exists()
            held.release.set()
            reply = await edit
            after = await top(world["queries"][user])
            return before, during, on_disk_during, reply, after

    before, during, on_disk_during, reply, after = asyncio.run(go())
    assert before["bundle"] == "shop" and added["winner"] not in before["item_ids"]
    assert during["bundle"] == "shop.v0001" and on_disk_during == ("shop", False)
    assert during["item_ids"][0] == added["winner"]  # the brute-force top-1 of this user is the new item
    _same_up_to_ties([during["item_ids"]], [expected[user]], lambda item: user_scores[user, added["ids"].index(item)])
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["bundle"] == "shop.v0001" and 0 < body["served_seconds"] <= body["persisted_seconds"]
    assert after["item_ids"] == during["item_ids"] and current_version(root).name == "shop.v0001"
    # A restart reads the version written: every check of a load passes and it serves what the live edit did.
    restarted = Bundle.load(current_version(root), verify="full")
    assert list(restarted.index.item_ids) == added["ids"]
    assert _served(restarted, world)[user] == during["item_ids"]
    healthy = _call(app, "GET", "/healthz")  # the live bundle now watches the written files
    assert healthy.status_code == 200 and healthy.json()["bundle"] == "shop.v0001"


@pytest.mark.parametrize("failure", ["disk", "fingerprints"])
def test_a_live_edit_whose_version_cannot_be_written_is_rolled_back(world, added, tmp_path, monkeypatch, failure):
    import shutil

    import retrieval.bundle.catalogue as catalogue

    root = tmp_path / "shop"
    shutil.copytree(world["root"], root)
    app = create_app(root)
    if failure == "disk":
        held = _HeldWrite(monkeypatch, fail=OSError(28, "No space left on device"))
        held.release.set()
    else:  # the written files do not match the fingerprints recorded: current must not move to them
        def corrupt(directory, manifest, **kwargs):
            raise ValueError("index.faiss: 12 bytes, the manifest says 13")

        monkeypatch.setattr(catalogue, "check_fingerprints", corrupt)
    reply = _call(app, "POST", "/admin/catalogue", json={"change": "add", "items": _records(added["new"])})
    assert reply.status_code == 500
    message = reply.json()["error"]
    assert "served as 'shop.v0001' but writing that version failed" in message and "'shop'" in message
    assert ("No space left on device" if failure == "disk" else "does not match its fingerprints") in message
    # What is served is what a restart serves: the bundle before the edit, no version on disk.
    assert current_version(root) == root and not (tmp_path / "shop.catalogue" / "shop.v0001").exists()
    served = _call(app, "POST", "/recommend", json={"query": world["queries"][added["winner_user"]], "k": ALL,
                                                     "exclude_seen": False, "history_order": "newest_first"}).json()
    assert served["bundle"] == "shop" and sorted(served["item_ids"]) == sorted(f"i{i}" for i in range(8))
    assert _call(app, "GET", "/healthz").json()["status"] == "ok"
    monkeypatch.undo()  # the disk is back: the same edit goes through
    again = _call(app, "POST", "/admin/catalogue", json={"change": "add", "items": _records(added["new"])})
    assert again.status_code == 200 and again.json()["bundle"] == "shop.v0001"


def test_two_live_edits_are_served_and_written_in_order(world, added, tmp_path, monkeypatch):
    import shutil

    root = tmp_path / "shop"
    shutil.copytree(world["root"], root)
    app = create_app(root)
    held = _HeldWrite(monkeypatch)
    first, second = added["new"].iloc[[0]], added["new"].iloc[[1]]
    first_id, second_id = first["item_id"].iloc[0], second["item_id"].iloc[0]

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000", timeout=60) as client:
            one = asyncio.create_task(client.post("/admin/catalogue", json={"change": "add", "items": _records(first)}))
            assert await asyncio.to_thread(held.reached.wait, 60)
            two = asyncio.create_task(client.post("/admin/catalogue",
                                                  json={"change": "add", "items": _records(second)}))
            await asyncio.sleep(0.5)  # the second edit waits for the first one's write
            meta = (await client.get("/metadata")).json()
            held.release.set()
            return meta, await one, await two

    meta, one, two = asyncio.run(go())
    assert meta["bundle"] == "shop.v0001" and meta["num_items"] == 9  # the second not yet applied
    assert one.status_code == 200 and two.status_code == 200
    assert (one.json()["bundle"], two.json()["bundle"]) == ("shop.v0001", "shop.v0002") == tuple(held.written)
    versions = tmp_path / "shop.catalogue"
    v1, v2 = Bundle.load(versions / "shop.v0001"), Bundle.load(versions / "shop.v0002")
    assert list(v1.index.item_ids) == [*(f"i{i}" for i in range(8)), first_id]
    assert list(v2.index.item_ids) == [*(f"i{i}" for i in range(8)), first_id, second_id]
    assert v2.manifest["parent"]["run"] == "shop.v0001" and v1.manifest["parent"]["run"] == "shop"
    assert current_version(root).name == "shop.v0002"


def test_the_display_table_merge_sorts_as_a_full_sort_would():
    from retrieval.bundle.catalogue import _merged_order

    rng = np.random.default_rng(3)
    for n, m in [(0, 3), (5, 0), (50, 7), (200, 40)]:
        pool = np.array(sorted({f"x{rng.integers(0, 10 ** rng.integers(1, 7))}" for _ in range(3 * (n + m))}))
        chosen = rng.permutation(len(pool))[: n + m]
        old, new = np.sort(pool[chosen[:n]]).astype(bytes), pool[chosen[n:]].astype(bytes)
        both = np.concatenate([old, new])  # new ids longer than every old one included (wider dtype)
        order = _merged_order(both[:n], both[n:])
        np.testing.assert_array_equal(order, np.argsort(both, kind="stable"))
        assert sorted(both.tolist()) == both[order].tolist()
