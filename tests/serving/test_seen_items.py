"""Served recommendations never include what the user already has.

- ``SeenItems`` (the bundle's CSR of each training user's items) against a plain dict, saved and
  memory-mapped back, re-mapped to another row order;
- ``ItemIndex.search`` still returns k items when a query excludes most of the catalogue;
- bundles with fixed towers (exact scores known): every known user's served items (Python, HTTP,
  CLI) avoid their training items and equal a brute-force top-k over the rest; ``exclude_seen``
  off is the brute-force top-k over all items; caller exclusions and a query's click history are
  excluded too; a bundle exported without seen items serves as before;
- a trained bundle (the job writes the seen items from its training clicks; re-indexing keeps
  them) and MovieLens 100K users 196, 1 and 13 (slow).

The out-of-core job writes the in-memory job's seen items: ``tests/jobs/test_out_of_core.py::_job_both_ways``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from test_service import _fixed_id_tower, _unit, call

import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow)
from retrieval.bundle.seen_items import SEEN_ITEMS_DIR, SeenItems
from retrieval.bundle.writer import write_bundle
from retrieval.config import IndexConfig
from retrieval.index import ItemIndex, build_index
from retrieval.serving import Bundle, BundleError
from retrieval.serving import bundle as serving
from retrieval.serving.http import create_app

DIM, NUM_ITEMS, NUM_USERS, HISTORY = 16, 300, 40, 4
ALMOST_ALL = "user00"  # has seen every item but LEFT_OVER
LEFT_OVER = 5

# --- SeenItems against a dict -----------------------------------------------------------------------

user_ids = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=6)
pairs = st.lists(st.tuples(user_ids, st.integers(0, 49)), max_size=200)


def _as_dict(clicks):
    seen = defaultdict(set)
    for user, item in clicks:
        seen[user].add(item)
    return seen


@settings(max_examples=80, deadline=None)
@given(clicks=pairs, strangers=st.lists(user_ids, max_size=5))
def test_round_trip_equals_a_dict_of_sets(tmp_path_factory, clicks, strangers):
    seen = SeenItems.from_pairs([u for u, _ in clicks], np.array([i for _, i in clicks], dtype=np.int64))
    expected = _as_dict(clicks)
    folder = tmp_path_factory.mktemp("seen")
    seen.save(folder)
    loaded = SeenItems.load(folder)
    assert not isinstance(loaded.item_rows, np.memmap)  # read into memory: a file changed later changes nothing
    assert loaded.indptr.dtype == np.int64 and loaded.item_rows.dtype == np.int32
    assert len(loaded) == len(expected) and loaded.num_pairs == sum(len(v) for v in expected.values())
    for items in (seen, loaded):
        for user, rows in expected.items():
            np.testing.assert_array_equal(items.rows_of(user), sorted(rows))
        for user in strangers:
            for stranger in (user, user + "x"):
                if stranger not in expected:
                    assert items.rows_of(stranger).tolist() == []
    # One lookup for many ids equals the lookups one by one.
    users = list(expected) + strangers + [None]
    assert [r.tolist() for r in loaded.rows_of_many(users)] == [loaded.rows_of(u).tolist() if u is not None else []
                                                                for u in users]


@settings(max_examples=40, deadline=None)
@given(clicks=pairs, seed=st.integers(0, 2**16))
def test_coded_pairs_and_remapping_equal_the_dict(clicks, seed):
    vocabulary = sorted({u for u, _ in clicks}, reverse=True)  # any order
    rows = np.array([vocabulary.index(u) for u, _ in clicks], dtype=np.int32)
    items = np.array([i for _, i in clicks], dtype=np.int32)
    coded = SeenItems.from_coded_pairs(rows, items, vocabulary)
    permutation = np.random.default_rng(seed).permutation(50)
    remapped = coded.remapped(permutation)
    for user, expected in _as_dict(clicks).items():
        np.testing.assert_array_equal(coded.rows_of(user), sorted(expected))
        np.testing.assert_array_equal(remapped.rows_of(user), sorted(permutation[list(expected)]))


def test_bad_pairs_are_named():
    with pytest.raises(ValueError, match="non-negative index rows"):
        SeenItems.from_pairs(["a", "b"], np.array([0, -1]))  # get_indexer's -1: an item not in the index
    with pytest.raises(ValueError, match="holds an id twice"):
        SeenItems.from_coded_pairs(np.array([0]), np.array([0]), ["a", "a"])
    with pytest.raises(ValueError, match="rows of the 1-id vocabulary"):
        SeenItems.from_coded_pairs(np.array([1]), np.array([0]), ["a"])


# --- The index returns k items when most are excluded -------------------------------------------------


@pytest.mark.parametrize("factory", ["Flat", "HNSW16", "IVF8,Flat", "PCA6,IVF8,Flat"])
def test_search_returns_k_unexcluded_items_when_most_are_excluded(factory):
    rng = np.random.default_rng(1)
    items = rng.normal(size=(600, 8)).astype(np.float32)
    index = ItemIndex.build([f"i{n}" for n in range(600)], items, factory)
    index.set_search_params("nprobe=1" if "IVF" in factory else "")  # IVF reaches one list in eight
    queries = rng.normal(size=(4, 8)).astype(np.float32)
    # One query excludes 500 items, one 590 (10 left), one nothing, one a few: a batch of mixed depths.
    exclude = [rng.choice(600, 500, replace=False), rng.choice(600, 590, replace=False), np.zeros(0, np.int64),
               np.arange(3)]
    top = index.search(queries, 10, exclude=exclude)
    for query, rows, excluded in zip(queries, top.rows, exclude):
        assert len(rows) == 10 and (rows >= 0).all() and not set(rows) & set(excluded.tolist())
        if factory == "Flat":
            scores = items @ query
            scores[excluded] = -np.inf
            np.testing.assert_array_equal(rows, np.argsort(-scores, kind="stable")[:10])


# --- Bundles with fixed towers ------------------------------------------------------------------------


def _history_tower(user_ids, users, item_ids, items):
    """user embedding + mean of the history's item embeddings ("" and unknown ids: the zero row)."""
    user = tf.keras.Input(shape=(), dtype=tf.string, name="user_id")
    history = tf.keras.Input(shape=(HISTORY,), dtype=tf.string, name="history")
    user_lookup = tf.keras.layers.StringLookup(vocabulary=list(user_ids), mask_token=None, num_oov_indices=1)
    item_lookup = tf.keras.layers.StringLookup(vocabulary=list(item_ids), mask_token=None, num_oov_indices=1)
    user_table = tf.keras.layers.Embedding(len(users) + 1, DIM)
    item_table = tf.keras.layers.Embedding(len(items) + 1, DIM)
    pooled = tf.keras.layers.GlobalAveragePooling1D()(item_table(item_lookup(history)))
    model = tf.keras.Model({"user_id": user, "history": history}, user_table(user_lookup(user)) + pooled)
    user_table.set_weights([np.vstack([np.zeros((1, DIM), np.float32), users])])
    item_table.set_weights([np.vstack([np.zeros((1, DIM), np.float32), items])])
    return model


def write_seen_item_bundles(root: Path) -> dict:
    """Bundles over fixed towers in ``root``: "seen" (Flat), "seen-hnsw", "old" (exported without seen items)
    and "history" (a query tower reading a click history); tests/conftest.py's ``seen_item_bundles``."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(8, DIM))
    item_ids = [f"item{i:03d}" for i in range(NUM_ITEMS)]
    user_ids = [f"user{u:02d}" for u in range(NUM_USERS)]
    items, users = _unit(rng, NUM_ITEMS, centres), _unit(rng, NUM_USERS, centres)
    # Each user has seen the items they score highest among a random draw (as a trained model
    # would score them), user00 all but LEFT_OVER items; user39 nothing (no training clicks).
    seen = {ALMOST_ALL: rng.choice(NUM_ITEMS, NUM_ITEMS - LEFT_OVER, replace=False)}
    for u in range(1, NUM_USERS - 1):
        favourites = np.argsort(-(items @ users[u]))[:80]
        seen[user_ids[u]] = favourites[rng.choice(80, int(rng.integers(1, 60)), replace=False)]
    clicks = [(user, int(row)) for user, rows in seen.items() for row in rows]
    seen_items = SeenItems.from_pairs([u for u, _ in clicks], np.array([r for _, r in clicks]))
    popular = [item_ids[i] for i in rng.permutation(NUM_ITEMS)[:50]]
    doc_tower = _fixed_id_tower("item_id", item_ids, items)
    id_tower = _fixed_id_tower("user_id", user_ids, users)
    history_config = {"towers": {"query": {"features": [{"name": "user_id", "kind": "id"}],
                                           "history": {"name": "history", "length": HISTORY}}}}
    bundles = [
        ("seen", "Flat", id_tower, seen_items, {}),
        ("seen-hnsw", "HNSW16", id_tower, seen_items, {}),
        ("old", "Flat", id_tower, None, {}),
        ("history", "Flat", _history_tower(user_ids, users, item_ids, items), seen_items, {"config": history_config}),
    ]
    for name, factory, query_tower, stored, extra in bundles:
        index = build_index(item_ids, items, IndexConfig(factory=factory, tune_k=10), users, "test users")
        (root / name).mkdir()
        write_bundle(root / name, query_tower=query_tower, doc_tower=doc_tower, index=index,
                     manifest={"run": name, "popular_item_ids": popular, **extra}, seen_items=stored)
    return {"items": items, "users": users, "item_ids": item_ids, "user_ids": user_ids, "popular": popular,
            "had": {user: {item_ids[r] for r in rows} for user, rows in seen.items()},
            **{name: root / name for name, *_ in bundles}}


@pytest.fixture(scope="module")
def world(seen_item_bundles):
    """The session's fixed-tower bundles with seen items (tests/conftest.py), shared with the modules that
    import this fixture."""
    return seen_item_bundles


def exact_top(world, user, k, exclude=()):
    """Brute force: every item by score, best first, without ``exclude``."""
    scores = world["items"] @ world["users"][world["user_ids"].index(user)]
    return [world["item_ids"][r] for r in np.argsort(-scores, kind="stable") if world["item_ids"][r] not in exclude][:k]


def test_no_known_user_is_served_a_training_item(world):
    bundle = Bundle.load(world["seen"])
    queries = [{"user_id": user} for user in world["user_ids"]]
    served = bundle.recommend_batch(queries, k=10)
    app = create_app(bundle)
    over_http = call(app, "POST", "/recommend", json={"queries": queries, "k": 10}).json()["results"]
    for user, result, reply in zip(world["user_ids"], served, over_http):
        seen = world["had"].get(user, set())
        expected = exact_top(world, user, 10, exclude=seen)
        assert result.item_ids == reply["item_ids"] == expected, user
        assert not set(result.item_ids) & seen and len(result.item_ids) == min(10, NUM_ITEMS - len(seen))
    single = call(app, "POST", "/recommend", json={"query": {"user_id": "user05"}, "k": 10}).json()
    assert single["item_ids"] == exact_top(world, "user05", 10, exclude=world["had"]["user05"])


def test_exclude_seen_off_is_the_brute_force_top_k_over_all_items(world):
    bundle = Bundle.load(world["seen"])
    users = world["user_ids"][:6]
    off = bundle.recommend_batch([{"user_id": u} for u in users], k=10, exclude_seen=False)
    app = create_app(bundle)
    for user, result in zip(users, off):
        assert result.item_ids == exact_top(world, user, 10)
        assert bundle.recommend({"user_id": user}, k=10, exclude_seen=False).item_ids == result.item_ids
        reply = call(app, "POST", "/recommend", json={"query": {"user_id": user}, "k": 10, "exclude_seen": False})
        assert reply.json()["item_ids"] == result.item_ids
    # The towers rank training items first: that is why they are excluded by default.
    assert set(off[1].item_ids) & world["had"][users[1]]


def test_exclude_seen_must_be_a_json_boolean(world):
    app = create_app(world["seen"])
    for value in ["false", 0, None]:
        reply = call(app, "POST", "/recommend", json={"query": {"user_id": "user01"}, "exclude_seen": value})
        assert reply.status_code == 422 and "exclude_seen: Input should be a valid boolean" in reply.json()["error"]
    body = {"query": {"user_id": "user01"}, "exclude_seen": True}
    assert call(app, "POST", "/recommend", json=body).status_code == 200


def test_caller_exclusions_are_added_to_the_seen_items(world):
    bundle = Bundle.load(world["seen"])
    seen = world["had"]["user03"]
    caller = exact_top(world, "user03", 3, exclude=seen) + ["not-in-catalogue"]
    result = bundle.recommend({"user_id": "user03"}, k=5, exclude_item_ids=caller)
    assert result.item_ids == exact_top(world, "user03", 5, exclude=seen | set(caller))
    # An unknown user (popularity fallback) still gets the caller's exclusions.
    stranger = bundle.recommend({"user_id": "stranger"}, k=5, exclude_item_ids=world["popular"][:2])
    assert stranger.fallback == "popular" and stranger.item_ids == world["popular"][2:7]


@pytest.mark.parametrize("name", ["seen", "seen-hnsw"])
def test_a_user_who_has_seen_almost_everything_gets_the_rest(world, name):
    bundle = Bundle.load(world[name])
    left = set(world["item_ids"]) - world["had"][ALMOST_ALL]
    assert len(left) == LEFT_OVER
    result = bundle.recommend({"user_id": ALMOST_ALL}, k=10)
    assert set(result.item_ids) == left and len(result.item_ids) == LEFT_OVER
    three = bundle.recommend({"user_id": ALMOST_ALL}, k=3)
    assert three.item_ids == exact_top(world, ALMOST_ALL, 3, exclude=world["had"][ALMOST_ALL])
    # Users who have seen many: k unseen items come back from the approximate index too.
    for user in world["user_ids"][1:]:
        served = bundle.recommend({"user_id": user}, k=10).item_ids
        assert len(served) == 10 and not set(served) & world["had"].get(user, set())


def test_a_history_query_excludes_its_history(world):
    bundle = Bundle.load(world["history"])
    assert bundle.metadata()["excludes_history"] is True
    history = exact_top(world, "user04", 3) + [""]
    query = {"user_id": "user04", "history": history}
    result = bundle.recommend(query, k=10)
    scores = world["items"] @ bundle.embed([query])[0]
    excluded = world["had"]["user04"] | set(history)
    ranked = [world["item_ids"][r] for r in np.argsort(-scores, kind="stable")]
    assert result.item_ids == [item for item in ranked if item not in excluded][:10]
    # A user unknown to training: their history (and only it) is excluded.
    stranger = bundle.recommend({"user_id": "stranger", "history": history}, k=10)
    assert not set(stranger.item_ids) & set(history) and len(stranger.item_ids) == 10
    empty = bundle.recommend({"user_id": "stranger", "history": world["popular"][:2]}, k=5)
    assert not set(empty.item_ids) & set(world["popular"][:2])
    # Over HTTP too, and off with the flag.
    reply = call(create_app(bundle), "POST", "/recommend",
                 json={"query": query, "k": 10, "history_order": "newest_first"}).json()
    assert reply["item_ids"] == result.item_ids
    off = bundle.recommend(query, k=10, exclude_seen=False)
    assert off.item_ids == ranked[:10]


def test_a_bundle_exported_without_seen_items_serves_as_before(world):
    bundle = Bundle.load(world["old"])
    assert "seen_items" not in bundle.manifest["files"]
    assert bundle.metadata()["excludes_seen"] is False
    assert call(create_app(bundle), "GET", "/metadata").json()["excludes_seen"] is False
    for user in world["user_ids"][:5]:
        assert bundle.recommend({"user_id": user}, k=10).item_ids == exact_top(world, user, 10)


def test_metadata_and_manifest_describe_the_seen_items(world):
    bundle = Bundle.load(world["seen"])
    assert bundle.manifest["files"]["seen_items"] == SEEN_ITEMS_DIR
    assert bundle.manifest["seen_items"] == {"num_users": NUM_USERS - 1,
                                             "num_pairs": sum(len(s) for s in world["had"].values())}
    assert call(create_app(bundle), "GET", "/metadata").json()["excludes_seen"] is True
    embeddings, known = bundle.embed_with_known([{"user_id": "user01"}])
    with pytest.raises(ValueError, match="exclude_seen needs the raw queries"):
        bundle.recommend_embedded(embeddings, known, 5)


def test_seen_items_that_do_not_match_the_manifest_are_refused(world, tmp_path):
    import shutil

    from retrieval.bundle.fingerprints import fingerprint_files

    copy = tmp_path / "bundle"
    shutil.copytree(world["seen"], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["seen_items"]["num_pairs"] += 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="seen items hold"):
        Bundle.load(copy)
    manifest["seen_items"]["num_pairs"] -= 1
    (copy / SEEN_ITEMS_DIR / "indptr.npy").write_bytes(b"not numpy")
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="seen_items/indptr.npy: content differs from the manifest's fingerprint"):
        Bundle.load(copy)
    # Fingerprinted again (as if exported that way): the seen-items reader refuses the file itself.
    manifest["fingerprints"] = fingerprint_files(copy, manifest["files"])
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="seen items 'seen_items' cannot be loaded"):
        Bundle.load(copy)


# --- served files changed under a running server ------------------------------------------------------


def _serving_copy(world, tmp_path):
    """A copy of the "seen" bundle, an app serving it, and user01's answer and the brute-force reference."""
    import shutil

    copy = tmp_path / "served"
    shutil.copytree(world["seen"], copy)
    app = create_app(copy)
    expected = exact_top(world, "user01", 20, exclude=world["had"]["user01"])
    return copy, app, expected


def _answers(app, users=("user01", "user05", "user38")):
    replies = [call(app, "POST", "/recommend", json={"query": {"user_id": user}, "k": 20}) for user in users]
    assert all(reply.status_code == 200 for reply in replies), [reply.text for reply in replies]
    return [reply.json()["item_ids"] for reply in replies]


def test_seen_items_rewritten_in_place_change_no_answer_and_fail_healthz(world, tmp_path):
    """Same size, same inode, modification time put back: the answers stay those of the loaded files
    (user01's training items still excluded, the brute-force top-k over the rest) and /healthz names
    the changed file with a 503 while the old state serves on; a reload refuses the edited bundle."""
    import os

    copy, app, expected = _serving_copy(world, tmp_path)
    before = _answers(app)
    assert before[0] == expected and call(app, "GET", "/healthz").status_code == 200
    rows = copy / SEEN_ITEMS_DIR / "item_rows.npy"
    stat = rows.stat()
    stored = np.load(rows)
    with open(rows, "r+b") as handle:  # every user's items now point at the rows user01 scores lowest
        np.lib.format.write_array(handle, np.full_like(stored, np.argsort(world["items"] @ world["users"][1])[0]))
    os.utime(rows, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert rows.stat().st_size == stat.st_size and rows.stat().st_ino == stat.st_ino
    assert _answers(app) == before
    health = call(app, "GET", "/healthz")
    assert health.status_code == 503 and health.json()["status"] == "failing"
    assert "changed on disk since they were loaded: seen_items/item_rows.npy;" in health.json()["error"]
    assert str(tmp_path) not in health.text
    reload = call(app, "POST", "/admin/reload", json={"bundle": str(copy)})
    assert reload.status_code == 422 and "item_rows.npy: content differs" in reload.json()["error"]
    assert _answers(app) == before and call(app, "GET", "/healthz").status_code == 503


def test_a_smaller_bundles_seen_items_copied_over_crash_nothing(world, tmp_path):
    """The files of a bundle with one user and one pair written over the served ones (truncated, as
    cp does): no crash (the files are not mapped), the same answers, and /healthz names all three."""
    copy, app, expected = _serving_copy(world, tmp_path)
    before = _answers(app)
    SeenItems.from_pairs(["user01"], np.array([0])).save(copy / SEEN_ITEMS_DIR)
    assert (copy / SEEN_ITEMS_DIR / "item_rows.npy").stat().st_size < 4096
    assert _answers(app) == before and before[0] == expected
    assert call(app, "GET", "/users/user05/items").json()["item_ids"] == sorted(
        world["had"]["user05"], key=world["item_ids"].index)
    health = call(app, "GET", "/healthz")
    assert health.status_code == 503
    for name in ("indptr.npy", "item_rows.npy", "user_ids.npy"):
        assert f"seen_items/{name}" in health.json()["error"]


@pytest.mark.parametrize("part, donor", [("index.faiss", "seen-hnsw"), ("query_model", "history")])
def test_any_part_copied_over_from_another_bundle_changes_no_answer(world, tmp_path, part, donor):
    """Every part is held in memory: another bundle's index (HNSW over Flat) or query SavedModel
    copied over the served one changes no answer, and /healthz names what changed."""
    import shutil

    from retrieval.bundle import saved_models

    copy, app, expected = _serving_copy(world, tmp_path)
    before = _answers(app)
    if part in saved_models.SERVED_MODELS:
        target, source = saved_models.model_path(copy, part), saved_models.model_path(world[donor], part)
        for path in source.rglob("*"):
            if path.is_file():
                (target / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target / path.relative_to(source))
        changed = target.relative_to(copy).as_posix()
    else:
        shutil.copyfile(world[donor] / part, copy / part)
        changed = part
    assert _answers(app) == before and before[0] == expected
    health = call(app, "GET", "/healthz")
    assert health.status_code == 503 and f"since they were loaded: {changed}" in health.json()["error"]


def test_a_bundle_changed_while_it_loads_is_refused(world, tmp_path, monkeypatch):
    """A file rewritten between the fingerprint check and the end of the load: the parts in memory
    might mix old and new bytes, so the load is refused naming the file."""
    import shutil

    copy = tmp_path / "bundle"
    shutil.copytree(world["seen"], copy)
    load = SeenItems.load

    def rewritten_meanwhile(directory):
        loaded = load(directory)
        index = copy / "index.json"
        index.write_text(index.read_text() + " ")
        return loaded

    monkeypatch.setattr(SeenItems, "load", rewritten_meanwhile)
    with pytest.raises(BundleError, match="index.json changed while the bundle was being loaded"):
        Bundle.load(copy)


def test_the_user_and_history_inputs_come_from_the_run_config():
    from retrieval.bundle.manifest import Manifest

    def inputs(manifest, query_features):
        typed = Manifest.from_dict({"format_version": 2, "query_features": query_features, "doc_features": ["item_id"],
                                    "files": {}, **manifest})
        return typed.user_input, typed.history_input

    towers = {"query": {"features": [{"name": "age", "kind": "numeric"},
                                     {"name": "uid", "kind": "id", "source": "user_id"}],
                        "history": {"name": "clicks", "length": 5}}}
    assert inputs({"config": {"towers": towers}}, ["age", "uid", "clicks"]) == ("uid", "clicks")
    # No id feature on user_id: the user_id key every query of TowerTables.queries carries; no config: ID towers.
    towers["query"]["features"] = [{"name": "age", "kind": "numeric"}]
    assert inputs({"config": {"towers": towers}}, ["age", "clicks"]) == ("user_id", "clicks")
    assert inputs({}, ["user_id"]) == ("user_id", None)
    # Recorded in the manifest (bundles written since): read as recorded, whatever the config says.
    recorded = {"user_input": "member", "query_history": {"input": "clicks"}, "config": {"towers": towers}}
    assert inputs(recorded, ["member", "clicks"]) == ("member", "clicks")


def test_cli_excludes_seen_items_unless_asked(world, capsys):
    def served(*flags):
        serving.main(["--bundle", str(world["seen"]), "--user-id", "user02", "-k", "10", *flags])
        return json.loads(capsys.readouterr().out)["item_ids"]

    assert served() == exact_top(world, "user02", 10, exclude=world["had"]["user02"])
    assert served("--include-seen") == exact_top(world, "user02", 10)


# --- A trained bundle, and MovieLens 100K --------------------------------------------------------------


def _training_items(config) -> dict[str, set[str]]:
    from retrieval.data import ITEM, USER, load_dataset

    train = load_dataset(config.data, config.split).train
    return train.astype({USER: str, ITEM: str}).groupby(USER)[ITEM].agg(set).to_dict()


@pytest.fixture(scope="module")
def trained(trained_bundle):
    """The shared small synthetic run (tests/conftest.py): read here, and re-indexed into copies."""
    return trained_bundle.config, trained_bundle.result


@pytest.mark.slow
def test_trained_bundle_serves_no_training_item_and_reindexing_keeps_them(trained, tmp_path):
    from retrieval.jobs import reindex_bundle

    config, result = trained
    seen = _training_items(config)
    bundle = Bundle.load(result.directory)
    assert bundle.seen_items is not None and len(bundle.seen_items) == len(seen)
    ids = np.asarray(bundle.index.item_ids, dtype=object)
    for user, items in seen.items():  # the stored rows are the training items, user for user
        assert set(ids[bundle.seen_items.rows_of(user)]) == items
    users = sorted(seen)[:50]
    queries = [{"user_id": user} for user in users]
    served = bundle.recommend_batch(queries, k=10)
    before = bundle.recommend_batch(queries, k=10, exclude_seen=False)
    over_http = call(create_app(bundle), "POST", "/recommend", json={"queries": queries, "k": 10}).json()
    for user, result_, reply in zip(users, served, over_http["results"]):
        assert len(result_.item_ids) == 10 and not set(result_.item_ids) & seen[user]
        assert reply["item_ids"] == result_.item_ids
    assert sum(len(set(r.item_ids) & seen[u]) for u, r in zip(users, before)) > 0  # what the old code served
    copy = reindex_bundle(result.directory, tmp_path / "hnsw", "HNSW16")
    again = Bundle.load(copy)
    assert again.metadata()["excludes_seen"] is True
    for user, result_ in zip(users, again.recommend_batch(queries, k=10)):
        assert len(result_.item_ids) == 10 and not set(result_.item_ids) & seen[user]


@pytest.mark.slow
def test_movielens_100k_users_get_no_movie_they_rated_in_training(train_run):
    from retrieval.data import locate_movielens_100k

    try:
        locate_movielens_100k()
    except FileNotFoundError as error:
        pytest.skip(f"MovieLens 100K not available: {error}")
    config, result = train_run("ml100k.yaml", ["train.epochs=2", "train.validation_fraction=0"], "ml100k-seen")
    seen = _training_items(config)
    bundle = Bundle.load(result.directory)
    for user in ["196", "1", "13"]:
        assert len(seen[user]) > 10, user  # rated in training: what the bundle used to serve back
        served = bundle.recommend({"user_id": user}, k=10).item_ids
        assert len(served) == 10 and not set(served) & seen[user], user
        assert set(bundle.recommend({"user_id": user}, k=10, exclude_seen=False).item_ids) & seen[user]


@pytest.mark.slow
def test_a_reindexed_bundle_holds_what_it_serves_under_its_own_name(trained, tmp_path):
    """The copy is named by its directory, its config names its index, and the source's run outputs
    (which measured the old index) stay behind; where it came from is in its manifest."""
    import yaml

    from retrieval.bundle.manifest import read_manifest
    from retrieval.jobs import reindex_bundle

    _, result = trained
    assert {"metrics.json", "report.md", "train_log.csv"} <= {p.name for p in result.directory.iterdir()}
    copy = reindex_bundle(result.directory, tmp_path / "ivf-copy", "IVF8,Flat")
    names = {p.name for p in copy.iterdir()}
    assert not names & {"metrics.json", "metrics.md", "report.md", "train_log.csv", "tensorboard", "recall_at_k.png"}
    manifest, source = read_manifest(copy).to_dict(), read_manifest(result.directory).to_dict()
    assert Bundle.load(copy).version == manifest["run"] == "ivf-copy"
    assert yaml.safe_load((copy / "config.yaml").read_text())["index"]["factory"] == "IVF8,Flat"
    assert manifest["config"]["index"]["factory"] == "IVF8,Flat" and manifest["config"]["run"]["name"] == "ivf-copy"
    assert "metrics" not in manifest
    assert manifest["reindexed_from"]["run"] == source["run"]
    assert manifest["reindexed_from"]["metrics"] == source["metrics"]
    assert manifest["reindexed_from"]["index"]["factory"] == source["index"]["factory"]
    served = {Path(path).parts[0] for path in manifest["files"].values()}  # models/query/<version>: models
    assert names <= {*served, "manifest.json", "config.yaml"}


def test_a_user_id_that_is_not_unicode_text_is_named_by_every_entry_point(world, capsys):
    """A non-UTF-8 command-line argument reaches Python as a lone surrogate (surrogateescape), as a
    JSON \\ud800 escape does: the CLI, the Python API and HTTP each name the feature, no traceback."""
    assert serving.main(["--bundle", str(world["seen"]), "--user-id", "user0\udcff", "-k", "3"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "query 0 feature 'user_id' is not valid Unicode text" in error
    bundle = Bundle.load(world["seen"])
    with pytest.raises(serving.RequestError, match="query 1 feature 'user_id' is not valid Unicode text"):
        bundle.recommend_batch([{"user_id": "user01"}, {"user_id": "\ud800"}], 3)
    reply = call(create_app(bundle), "POST", "/recommend", content=b'{"query": {"user_id": "\\ud800"}}')
    assert reply.status_code == 422 and reply.json()["error"].startswith("query.user_id: not valid Unicode text")
