"""The bundle's SavedModels in the layout TensorFlow Serving loads (``models/<name>/<version>/``), its
models.config, the topk model's exclusion input, and bundles of the older layout (``query_model/``).

``tensorflow_model_server`` cannot run here, so this checks what it relies on: an integer version
folder under each base path holding saved_model.pb and variables/, a ``serving_default`` signature
taking the documented inputs, and answers equal to the bundle's Python path.
"""

import json
import re
import shutil
from datetime import datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from test_service import _fixed_id_tower, _unit

import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow)
from retrieval.bundle import saved_models
from retrieval.bundle.fingerprints import fingerprint_files
from retrieval.bundle.manifest import MANIFEST_FILE
from retrieval.bundle.saved_models import SERVED_MODELS, model_path, save_topk_model
from retrieval.bundle.seen_items import SeenItems
from retrieval.bundle.writer import write_bundle
from retrieval.config import IndexConfig
from retrieval.index import build_index
from retrieval.jobs import reindex_bundle
from retrieval.serving import Bundle

DIM, NUM_ITEMS, NUM_USERS, K = 8, 120, 30, 10
USERS = ["user00", "user03", "user07", "user29", "stranger"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One bundle with every model (topk included), a Flat index and each user's first three items as seen."""
    rng = np.random.default_rng(3)
    centres = rng.normal(size=(5, DIM))
    item_ids = [f"item{i:03d}" for i in range(NUM_ITEMS)]
    user_ids = [f"user{u:02d}" for u in range(NUM_USERS)]
    items, users = _unit(rng, NUM_ITEMS, centres), _unit(rng, NUM_USERS, centres)
    popular = [item_ids[i] for i in rng.permutation(NUM_ITEMS)[:30]]
    seen = SeenItems.from_pairs(np.repeat(user_ids, 3), rng.integers(0, NUM_ITEMS, 3 * NUM_USERS))
    directory = tmp_path_factory.mktemp("tfs") / "bundle"
    directory.mkdir()
    write_bundle(
        directory,
        query_tower=_fixed_id_tower("user_id", user_ids, users),
        doc_tower=_fixed_id_tower("item_id", item_ids, items),
        index=build_index(item_ids, items, IndexConfig(factory="Flat")),
        manifest={"run": "bundle", "popular_item_ids": popular, "config": {}},
        item_embeddings=items,
        topk_k=K,
        probe_query=pd.DataFrame({"user_id": ["user00"]}),
        seen_items=seen,
    )
    return {"dir": directory, "popular": popular, "item_ids": item_ids, "seen": seen}


def _manifest(directory: Path) -> dict:
    return json.loads((directory / MANIFEST_FILE).read_text())


def _serve(directory: Path, key: str):
    return tf.saved_model.load(str(model_path(directory, key))).signatures["serving_default"]


def _padded(lists: list[list[str]]) -> tf.Tensor:
    """[batch, E] "" padded, as a TF Serving client sends the exclusion lists."""
    width = max(len(row) for row in lists)
    return tf.constant([row + [""] * (width - len(row)) for row in lists], dtype=tf.string, shape=[len(lists), width])


def test_each_model_is_an_integer_version_under_its_base_path(world):
    directory = world["dir"]
    manifest = _manifest(directory)
    version = manifest["model_version"]
    created = datetime.fromisoformat(manifest["created_at"])
    assert isinstance(version, int) and version == int(created.timestamp())  # the export's Unix time, seconds
    for key, name in SERVED_MODELS.items():
        assert manifest["files"][key] == f"models/{name}/{version}"
        base = directory / "models" / name  # tensorflow_model_server --model_base_path=<this>
        assert [p.name for p in base.iterdir()] == [str(version)]
        assert (base / str(version) / "saved_model.pb").is_file()
        assert (base / str(version) / "variables" / "variables.index").is_file()
    # The signatures TF Serving exposes: raw inputs in, the documented outputs out.
    query, doc, topk = (_serve(directory, key) for key in SERVED_MODELS)
    assert {n: (s.dtype, s.shape.as_list()) for n, s in query.structured_input_signature[1].items()} == {
        "user_id": (tf.string, [None])}
    assert set(doc.structured_input_signature[1]) == {"item_id"}
    assert {n: (s.dtype, s.shape.as_list()) for n, s in topk.structured_input_signature[1].items()} == {
        "user_id": (tf.string, [None]), "exclude_item_ids": (tf.string, [None, None])}
    assert set(topk.structured_outputs) == {"item_ids", "scores", "fallback"}
    bundle = Bundle.load(directory)
    queries = [{"user_id": user} for user in USERS]
    np.testing.assert_allclose(query(user_id=tf.constant(USERS))["embedding"].numpy(), bundle.embed(queries))


def test_models_config_lists_every_model_under_the_docker_mount(world):
    directory = world["dir"]
    manifest = _manifest(directory)
    assert manifest["files"]["tf_serving_config"] == "models/models.config"
    text = (directory / "models" / "models.config").read_text()
    assert text.count("model_config_list {") == 1
    entries = re.findall(r'config \{\s*name: "(\w+)"\s*base_path: "([^"]+)"\s*model_platform: "tensorflow"\s*\}', text)
    assert entries == [(name, f"/models/{name}") for name in SERVED_MODELS.values()]
    for _, base in entries:  # docker run -v <bundle>/models:/models: each base path holds one integer version
        versions = [p.name for p in (directory / "models" / Path(base).name).iterdir()]
        assert versions == [str(manifest["model_version"])]


def test_topk_model_never_returns_excluded_items_and_equals_recommend(world):
    directory = world["dir"]
    topk, bundle = _serve(directory, "topk_model"), Bundle.load(directory)
    queries = [{"user_id": user} for user in USERS]
    plain = bundle.recommend_batch(queries, k=K, exclude_seen=False)
    # Each query's own list: its top 3 and one id the catalogue does not hold; the stranger excludes popular items.
    exclude = [[*result.item_ids[:3], "not-an-item"] for result in plain[:-1]] + [world["popular"][:4]]
    out = topk(user_id=tf.constant(USERS), exclude_item_ids=_padded(exclude))
    ids, scores = out["item_ids"].numpy().astype(str), out["scores"].numpy()
    expected = bundle.recommend_batch(queries, k=K, exclude_item_ids=exclude, exclude_seen=False)
    assert out["fallback"].numpy().tolist() == [False] * 4 + [True]
    for row, result in enumerate(expected):
        assert not set(ids[row]) & set(exclude[row])
        assert list(ids[row]) == result.item_ids
    for row, result in enumerate(expected[:-1]):
        np.testing.assert_allclose(scores[row], result.scores, rtol=1e-5, atol=1e-6)
    assert list(ids[-1]) == [item for item in world["popular"] if item not in exclude[-1]][:K]
    assert np.isnan(scores[-1]).all()


@given(data=st.data())
@settings(max_examples=25, deadline=None)
def test_any_exclusion_lists_give_what_recommend_gives(world, data):
    """Lists of any length per query (padded to one width): catalogue ids, near-top ones, repeats,
    unknown ids and blanks, for known users and the stranger."""
    directory = world["dir"]
    topk, bundle = _serve(directory, "topk_model"), Bundle.load(directory)
    ids = st.sampled_from(world["item_ids"] + world["popular"][:5] + ["", "nope"])
    users = data.draw(st.lists(st.sampled_from(USERS), min_size=1, max_size=4), label="users")
    exclude = data.draw(st.lists(st.lists(ids, max_size=12), min_size=len(users), max_size=len(users)),
                        label="exclude")
    out = topk(user_id=tf.constant(users), exclude_item_ids=_padded([row or [""] for row in exclude]))
    expected = bundle.recommend_batch([{"user_id": u} for u in users], k=K, exclude_item_ids=exclude,
                                      exclude_seen=False)
    for row, result, excluded in zip(out["item_ids"].numpy().astype(str).tolist(), expected, exclude):
        assert row == result.item_ids
        assert not set(row) & (set(excluded) - {""})


@pytest.mark.parametrize("nothing", [[[""]] * len(USERS), tf.zeros([len(USERS), 0], tf.string)],
                         ids=["one blank id per query", "an empty-width tensor"])
def test_topk_model_with_nothing_to_exclude(world, nothing):
    directory = world["dir"]
    out = _serve(directory, "topk_model")(user_id=tf.constant(USERS), exclude_item_ids=tf.constant(nothing))
    expected = Bundle.load(directory).recommend_batch([{"user_id": u} for u in USERS], k=K, exclude_seen=False)
    assert out["item_ids"].numpy().astype(str).tolist() == [result.item_ids for result in expected]


def test_topk_model_given_the_users_seen_items_equals_the_default_recommend(world):
    """The topk model holds no seen items: a client that sends them among the exclusions gets what
    ``Bundle.recommend`` serves by default (``exclude_seen=True``)."""
    directory = world["dir"]
    bundle = Bundle.load(directory)
    known = USERS[:-1]
    seen = [[world["item_ids"][row] for row in world["seen"].rows_of(user)] for user in known]
    out = _serve(directory, "topk_model")(user_id=tf.constant(known), exclude_item_ids=_padded(seen))
    expected = bundle.recommend_batch([{"user_id": u} for u in known], k=K)
    assert out["item_ids"].numpy().astype(str).tolist() == [result.item_ids for result in expected]


def test_topk_model_pads_when_exclusions_leave_fewer_than_k_items(tmp_path):
    rng = np.random.default_rng(0)
    items = _unit(rng, 5, rng.normal(size=(2, DIM)))
    item_ids = [f"i{i}" for i in range(5)]
    save_topk_model(tmp_path / "topk", query_tower=_fixed_id_tower("user_id", ["u"], items[:1]),
                    item_ids=item_ids, item_embeddings=items, k=4)
    serve = tf.saved_model.load(str(tmp_path / "topk")).signatures["serving_default"]
    out = serve(user_id=tf.constant(["u"]), exclude_item_ids=tf.constant([["i0", "i3", "i4"]]))
    ids, scores = out["item_ids"].numpy()[0].astype(str), out["scores"].numpy()[0]
    order = [item_ids[i] for i in np.argsort(-(items @ items[0])) if item_ids[i] not in ("i0", "i3", "i4")]
    assert ids.tolist() == [*order, "", ""]
    assert np.isfinite(scores[:2]).all() and np.isnan(scores[2:]).all()


def test_a_query_feature_named_like_the_exclusion_input_is_refused(tmp_path):
    items = np.eye(3, DIM, dtype=np.float32)
    with pytest.raises(ValueError, match="input named 'exclude_item_ids'"):
        save_topk_model(tmp_path / "topk", query_tower=_fixed_id_tower("exclude_item_ids", ["u"], items[:1]),
                        item_ids=["a", "b", "c"], item_embeddings=items, k=2)


def test_reindexing_keeps_the_model_version(world, tmp_path):
    """A re-index serves the same SavedModels: the same version, so a model repository collecting versions
    never takes an older bundle's models, re-indexed later, for newer ones."""
    source = _manifest(world["dir"])
    out = reindex_bundle(world["dir"], tmp_path / "reindexed", "HNSW16")
    manifest = _manifest(out)
    assert manifest["model_version"] == source["model_version"]
    for key in [*SERVED_MODELS, "tf_serving_config"]:
        assert manifest["files"][key] == source["files"][key]
        assert manifest["fingerprints"]["files"].keys() >= {
            name for name in source["fingerprints"]["files"] if name.startswith(source["files"][key])}
    Bundle.load(out, verify="full")


def _to_old_layout(directory: Path) -> None:
    """Rewrite a bundle as exported before the versioned layout: query_model/, doc_model/, topk_model/
    at the top, manifest paths naming them, no model_version and no models.config."""
    manifest = _manifest(directory)
    for key in SERVED_MODELS:
        (directory / manifest["files"][key]).rename(directory / key)
        manifest["files"][key] = key
    shutil.rmtree(directory / "models")
    del manifest["files"]["tf_serving_config"], manifest["model_version"]
    manifest["fingerprints"] = fingerprint_files(directory, manifest["files"])
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_a_bundle_of_the_older_layout_still_loads_and_reindexes(world, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(world["dir"], old)
    _to_old_layout(old)
    assert (old / "query_model" / "saved_model.pb").is_file() and not (old / "models").exists()
    assert model_path(old, "topk_model") == old / "topk_model"
    queries = [{"user_id": user} for user in USERS]
    expected = Bundle.load(world["dir"]).recommend_batch(queries, k=K)
    assert Bundle.load(old, verify="full").recommend_batch(queries, k=K) == expected
    copy = reindex_bundle(old, tmp_path / "old-reindexed", "Flat")
    assert _manifest(copy)["files"]["query_model"] == "query_model"
    assert Bundle.load(copy).recommend_batch(queries, k=K) == expected


def test_model_dir_names_every_model_and_refuses_others():
    assert saved_models.model_dir("topk_model", 1796328000) == "models/topk/1796328000"
    for key, version in [("index", 1), ("query_model", 0), ("query_model", True), ("query_model", "1")]:
        with pytest.raises(ValueError):
            saved_models.model_dir(key, version)
