"""The bundle format's one home: the typed manifest (unknown keys refused, old versions migrated),
the one writer (a caller cannot replace what the parts say) and every part written and read back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf  # noqa: E402

import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow)
from retrieval.bundle import parts
from retrieval.bundle.fingerprints import fingerprint_files
from retrieval.bundle.manifest import BUNDLE_FORMAT_VERSION, MANIFEST_FILE, Manifest, ManifestError, read_manifest
from retrieval.bundle.seen_items import SeenItems
from retrieval.bundle.user_histories import UserHistories
from retrieval.bundle.writer import CALLER_KEYS, WRITER_KEYS, rewrite_bundle, write_bundle
from retrieval.index import ItemIndex

ITEM_IDS = [f"item{i}" for i in range(6)]
USER_IDS = ["u1", "u2", "u3"]
MINIMAL = {"format_version": 2, "query_features": ["user_id"], "doc_features": ["item_id"],
           "files": {"query_model": "models/query/1"}}


def test_a_manifest_with_an_unknown_key_is_refused_naming_it():
    with pytest.raises(ManifestError, match=r"manifest.json: fingerprint: unknown key; did you mean fingerprints\?"):
        Manifest.from_dict({**MINIMAL, "fingerprint": {}})
    with pytest.raises(ManifestError, match=r"zzz: unknown key \(the keys are "):
        Manifest.from_dict({**MINIMAL, "zzz": 1})
    # Inside a typed record too, named by its path.
    spec = {"dtype": "string", "shape": [None], "dtyp": "x"}
    with pytest.raises(ManifestError, match=r"query_inputs.user_id.dtyp: unknown key; did you mean dtype\?"):
        Manifest.from_dict({**MINIMAL, "query_inputs": {"user_id": spec}})
    with pytest.raises(ManifestError, match=r"files.query_model: Input should be a valid string"):
        Manifest.from_dict({**MINIMAL, "files": {"query_model": 3}})
    with pytest.raises(ManifestError, match="doc_features: Field required"):
        Manifest.from_dict({key: value for key, value in MINIMAL.items() if key != "doc_features"})


def test_a_format_version_this_library_does_not_read_is_refused():
    for version in (0, 3, "2", True, None):
        with pytest.raises(ManifestError, match=rf"bundle format {version!r}, this library reads \[1, 2\]"):
            Manifest.from_dict({**MINIMAL, "format_version": version})
    with pytest.raises(ManifestError, match="bundle format None"):
        Manifest.from_dict(["not", "an", "object"])


def test_an_old_manifest_migrates_to_the_current_shape():
    """Format 1 without index_info in files, the first jobs' timings at the top, and no user_input or
    query_history (found in the run's config since): one shape after ``migrate``."""
    config = {"towers": {"query": {
        "features": [{"kind": "id", "name": "uid", "source": "user_id"}, {"kind": "numeric", "name": "age"}],
        "history": {"name": "history", "length": 20, "pooling": "transformer"},
    }}}
    old = {"format_version": 1, "created_at": "2026-11-29T10:00:00+00:00", "run": "old",
           "query_features": ["uid", "age", "history"], "doc_features": ["item_id"], "embedding_dim": 8,
           "files": {"query_model": "query_model", "doc_model": "doc_model", "index": "index.faiss",
                     "item_ids": "item_ids.parquet"},
           "epoch_seconds": [1.5], "clicks_per_second": 1000.0, "config": config}
    manifest = Manifest.from_dict(old)
    assert manifest.format_version == 1  # what the file holds: serving warns it has no fingerprints
    assert manifest.files == {**old["files"], "index_info": "index.json"}
    assert manifest.user_input == "uid" and manifest.history_input == "history"
    assert manifest.query_history is not None and manifest.query_history.length == 20
    assert "skipped" in str(manifest.query_history.order)  # a transformer skips unknown items
    dumped = manifest.to_dict()
    assert "epoch_seconds" not in dumped and "clicks_per_second" not in dumped
    assert Manifest.from_dict(dumped) == manifest  # the current shape is a fixed point
    # Without a config: the user id key of ``TowerTables.queries`` and no history.
    bare = Manifest.from_dict(MINIMAL)
    assert bare.user_input == "user_id" and bare.history_input is None and bare.query_history is None


def test_a_history_input_the_query_features_lack_is_none():
    manifest = Manifest.from_dict({**MINIMAL, "query_history": {"input": "history"}})
    assert manifest.history_input is None


def test_the_writer_refuses_a_caller_key_it_derives_from_the_parts(tmp_path):
    assert WRITER_KEYS.isdisjoint(CALLER_KEYS) and {"files", "format_version", "fingerprints"} <= WRITER_KEYS
    for key in ("files", "format_version", "index"):
        with pytest.raises(ValueError, match=rf"manifest keys \['{key}'\] are written by the bundle writer"):
            write_bundle(tmp_path, query_tower=None, doc_tower=None, index=None,  # type: ignore[arg-type]
                         manifest={"run": "r", key: {}})
    assert not any(tmp_path.iterdir())  # refused before anything was written
    source = Manifest.from_dict(MINIMAL)
    with pytest.raises(ValueError, match=r"manifest keys \['files', 'format_version'\]"):
        rewrite_bundle(tmp_path, source, index=None, probe=None,  # type: ignore[arg-type]
                       changes={"format_version": 3, "files": {}, "run": "r"})
    with pytest.raises(ManifestError, match="runn: unknown key; did you mean run"):
        write_bundle(tmp_path, query_tower=_tower("user_id", USER_IDS), doc_tower=_tower("item_id", ITEM_IDS),
                     index=_index(), manifest={"runn": "r"})


def _tower(feature: str, ids: list[str]) -> tf.keras.Model:
    inputs = {feature: tf.keras.Input(shape=(), dtype=tf.string, name=feature)}
    lookup = tf.keras.layers.StringLookup(vocabulary=ids, mask_token=None, num_oov_indices=1)
    vectors = np.random.default_rng(len(ids)).normal(size=(len(ids) + 1, 4)).astype(np.float32)
    embedding = tf.keras.layers.Embedding(len(vectors), 4)
    model = tf.keras.Model(inputs, embedding(lookup(inputs[feature])))
    embedding.set_weights([vectors])
    return model


def _index() -> ItemIndex:
    return ItemIndex.build(ITEM_IDS, np.random.default_rng(0).normal(size=(len(ITEM_IDS), 4)).astype(np.float32))


def _round_trip(part, directory: Path):
    """Write ``part`` alone, describe it in a manifest as the writer would, read it back."""
    directory.mkdir()
    files = part.write(directory)
    assert files == part.write_entries
    manifest = Manifest.from_dict({**MINIMAL, "files": {**MINIMAL["files"], **files}, **part.info()})
    assert set(part.fingerprint(directory)) == set(fingerprint_files(directory, files)["files"]) != set()
    return type(part).read(directory, manifest)


def test_every_part_round_trips(tmp_path):
    seen = SeenItems.from_pairs(["u2", "u1", "u1"], np.array([3, 0, 5]))
    back = _round_trip(parts.SeenItemsPart(seen, len(ITEM_IDS)), tmp_path / "seen")
    assert back.info() == seen.info() and back.rows_of("u1").tolist() == [0, 5] and back.rows_of("u2").tolist() == [3]

    histories = UserHistories.from_recent(["u3", "u1"], np.array([0, 2, 3]), np.array([4, 1, 2]), limit=5)
    back = _round_trip(parts.UserHistoriesPart(histories, len(ITEM_IDS)), tmp_path / "histories")
    assert back.info() == histories.info()
    found = back.rows_of_many(["u1", "u3", "u9"])
    assert [None if rows is None else rows.tolist() for rows in found] == [[2], [4, 1], None]

    frame = pd.DataFrame({"user_id": ["u2", "u1"], "age": [30.0, np.nan]})
    back = _round_trip(parts.UserFeaturesPart.from_frame(frame, ["user_id", "age"]), tmp_path / "users")
    rows = back.rows_of(["u1", "u2", "u9"])
    assert rows[2] == -1
    assert back.values(int(rows[1]), ["age"]) == {"age": 30.0} and back.values(int(rows[0]), ["age"]) == {"age": None}

    items = pd.DataFrame({"item_id": ["item1", "item4", "elsewhere"], "title": ["One", "Four", "x"], "year": [1, 4, 9]})
    display = parts.DisplayFeaturesPart.from_frame(items, ITEM_IDS)
    assert display is not None
    back = _round_trip(display, tmp_path / "display")
    assert back.info()["num_items"] == 2  # only indexed items
    assert back.values_of(["item4", "item0"]) == [{"title": "Four", "year": 4}, None]

    index = _index()
    back = _round_trip(parts.IndexPart(index), tmp_path / "index")
    assert list(back.item_ids) == ITEM_IDS
    query = np.random.default_rng(1).normal(size=(2, 4)).astype(np.float32)
    np.testing.assert_array_equal(back.search(query, 3).rows, index.search(query, 3).rows)

    towers = parts.SavedModelsPart(_tower("user_id", USER_IDS), _tower("item_id", ITEM_IDS), version=7)
    loaded = _round_trip(towers, tmp_path / "models")
    served = loaded.signatures["serving_default"](user_id=tf.constant(USER_IDS))["embedding"]
    np.testing.assert_allclose(served.numpy(), towers.query_tower.predict({"user_id": np.array(USER_IDS)}, verbose=0))
    assert towers.info()["query_inputs"] == {"user_id": {"dtype": "string", "shape": [None]}}


def test_a_user_rows_part_refuses_rows_past_the_index(tmp_path):
    with pytest.raises(ValueError, match="seen_items holds index rows up to 6, past the 6 items of the index"):
        parts.SeenItemsPart(SeenItems.from_pairs(["u1"], np.array([6])), len(ITEM_IDS)).write(tmp_path)
    with pytest.raises(ValueError, match=r"user_features columns \['age'\] are not inputs of the query tower"):
        parts.UserFeaturesPart.from_frame(pd.DataFrame({"user_id": ["u1"], "age": [1.0]}), ["user_id"])


def test_a_written_bundle_reads_back_as_the_typed_manifest(tmp_path):
    written = write_bundle(tmp_path, query_tower=_tower("user_id", USER_IDS), doc_tower=_tower("item_id", ITEM_IDS),
                           index=_index(), manifest={"run": "small", "popular_item_ids": ITEM_IDS[:2]},
                           seen_items=SeenItems.from_pairs(["u1"], np.array([2])))
    on_disk = json.loads((tmp_path / MANIFEST_FILE).read_text())
    assert read_manifest(tmp_path) == written and on_disk == written.to_dict()
    assert written.format_version == BUNDLE_FORMAT_VERSION and written.run == "small"
    assert set(written.files) == {"query_model", "doc_model", "tf_serving_config", "index", "item_ids", "index_info",
                                  "seen_items"}
    assert written.fingerprints is not None
    assert set(written.fingerprints["files"]) == set(fingerprint_files(tmp_path, written.files)["files"])


def test_the_layout_lists_every_file_of_every_part():
    layout = parts.layout_markdown()
    for part in parts.PARTS:
        for path, _ in part.LAYOUT:
            assert path.strip() in layout, f"{part.__name__}'s {path} is missing from the layout"
    for name in ("manifest.json", "user_features.parquet", "item_features.parquet", "user_histories/"):
        assert name in layout


def test_serving_refuses_a_bundle_whose_manifest_has_an_unknown_key_naming_it(tmp_path):
    from retrieval.serving import Bundle, BundleError

    write_bundle(tmp_path, query_tower=_tower("user_id", USER_IDS), doc_tower=_tower("item_id", ITEM_IDS),
                 index=_index(), manifest={"run": "small"})
    assert Bundle.load(tmp_path).manifest_model.run == "small"
    raw = json.loads((tmp_path / MANIFEST_FILE).read_text())
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({**raw, "colour": "blue"}))
    with pytest.raises(BundleError, match=r"manifest.json cannot be loaded: colour: unknown key \(the keys are "):
        Bundle.load(tmp_path)


def test_a_bundle_records_the_commit_of_the_code_that_wrote_it(tmp_path, monkeypatch):
    import subprocess

    import retrieval.bundle.writer as writer

    root = Path(retrieval.__file__).resolve().parents[1]

    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True).stdout.strip()

    if not (root / ".git").exists():
        pytest.skip(f"{root} is not a git checkout")
    expected = git("rev-parse", "HEAD") + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    written = write_bundle(tmp_path / "b", query_tower=_tower("user_id", USER_IDS),
                           doc_tower=_tower("item_id", ITEM_IDS), index=_index(), manifest={"run": "r"})
    assert written.source_commit == expected == read_manifest(tmp_path / "b").source_commit
    # An installed package (not the top of a checkout) records none.
    installed = tmp_path / "site-packages" / "retrieval"
    installed.mkdir(parents=True)
    monkeypatch.setattr(retrieval, "__file__", str(installed / "__init__.py"))
    assert writer.source_commit() is None


def test_a_parent_records_the_lineage_and_round_trips():
    raw = {"format_version": BUNDLE_FORMAT_VERSION, "query_features": ["user_id"], "doc_features": ["item_id"],
           "files": {}, "parent": {"directory": "/bundles/v1", "run": "v1", "change": "warm_start"}}
    manifest = Manifest.from_dict(raw)
    assert manifest.parent is not None and manifest.parent.change == "warm_start"
    assert Manifest.from_dict(manifest.to_dict()) == manifest
    with pytest.raises(ManifestError, match="parent"):
        Manifest.from_dict({**raw, "parent": {"directory": "/bundles/v1"}})  # how it changed is required
