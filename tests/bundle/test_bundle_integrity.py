"""A bundle proves it is whole before it serves: fingerprints of its files, paths inside it, the query
model's dimension against the index's, unique item ids, and a probe query that must give the items it
gave at export; over HTTP a reload of a bundle failing any of these keeps the old one serving."""

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import uvicorn
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_service import _fixed_id_tower, _unit, call

import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow)
from retrieval import cli
from retrieval.bundle import fingerprints, saved_models
from retrieval.bundle import manifest as bundle_manifest
from retrieval.bundle.fingerprints import check_fingerprints
from retrieval.bundle.manifest import MANIFEST_FILE
from retrieval.bundle.writer import write_bundle
from retrieval.config import IndexConfig
from retrieval.index import ItemIndex, build_index
from retrieval.jobs import reindex_bundle
from retrieval.serving.bundle import Bundle, BundleError
from retrieval.serving.http import create_app
from retrieval.serving.integrity import same_top_k as _same_top_k

NUM_ITEMS, NUM_USERS, PROBE_USER = 200, 40, "user00"
PARTS = ["query_model", "doc_model", "index.faiss", "item_ids.parquet", "index.json"]
EXAMPLES = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _write(directory: Path, dim: int, seed: int, *, factory: str = "Flat", permute: bool = False,
           topk: bool = False) -> Path:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(6, dim))
    item_ids = [f"item{i:03d}" for i in range(NUM_ITEMS)]
    if permute:  # the same catalogue in another row order
        item_ids = [item_ids[i] for i in rng.permutation(NUM_ITEMS)]
    user_ids = [f"user{u:02d}" for u in range(NUM_USERS)]
    items, users = _unit(rng, NUM_ITEMS, centres), _unit(rng, NUM_USERS, centres)
    index = build_index(item_ids, items, IndexConfig(factory=factory, tune_k=10), users, "test users")
    directory.mkdir()
    write_bundle(
        directory,
        query_tower=_fixed_id_tower("user_id", user_ids, users),
        doc_tower=_fixed_id_tower("item_id", item_ids, items),
        index=index,
        manifest={"run": directory.name, "popular_item_ids": item_ids[:5], "config": {}},
        item_embeddings=items if topk else None,
        topk_k=10 if topk else None,
        probe_query=pd.DataFrame({"user_id": [PROBE_USER]}),
    )
    return directory


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """"a": dim 16 (with topk_model/); "b": dim 16, other weights, items in another row order;
    "c": dim 8; "hnsw": an approximate index. Built once: each writes two or three SavedModels."""
    root = tmp_path_factory.mktemp("integrity")
    return {
        "a": _write(root / "a", 16, 0, topk=True),
        "b": _write(root / "b", 16, 1, permute=True),
        "c": _write(root / "c", 8, 2),
        "hnsw": _write(root / "hnsw", 16, 3, factory="HNSW16"),
    }


def _copy(source: Path, parent: Path, name: str = "copy") -> Path:
    target = parent / name
    shutil.copytree(source, target, symlinks=True)
    return target


def _manifest(directory: Path) -> dict:
    return json.loads((directory / MANIFEST_FILE).read_text())


def _reseal(directory: Path) -> None:
    """Fingerprints recomputed over the files as they are now: what a careless hand-edit would do."""
    manifest = _manifest(directory)
    manifest["fingerprints"] = fingerprints.fingerprint_files(directory, manifest["files"])
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))


def _at(directory: Path, part: str) -> Path:
    """A part of a bundle: a SavedModel by its manifest key (``saved_models.model_path``), else a file name."""
    return saved_models.model_path(directory, part) if part in saved_models.SERVED_MODELS else directory / part


def _relative(directory: Path, part: str) -> str:
    return _at(directory, part).relative_to(directory).as_posix()


def _swap(directory: Path, donor: Path, part: str) -> None:
    target, source = _at(directory, part), _at(donor, part)
    if target.is_dir():
        shutil.rmtree(target)
        shutil.copytree(source, target)
    else:
        shutil.copyfile(source, target)


def _same_bytes(first: Path, second: Path) -> bool:
    if first.is_file():
        return first.read_bytes() == second.read_bytes()
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    return files == sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file()) and all(
        (first / f).read_bytes() == (second / f).read_bytes() for f in files
    )


def _duplicate_an_id(directory: Path, row: int) -> None:
    frame = pd.read_parquet(directory / "item_ids.parquet")
    frame.loc[row, "item_id"] = frame.loc[(row + 1) % len(frame), "item_id"]
    frame.to_parquet(directory / "item_ids.parquet", index=False)


def test_a_fresh_bundle_loads_and_its_probe_is_the_exact_top_k(bundles):
    manifest = _manifest(bundles["a"])
    assert manifest["format_version"] == bundle_manifest.BUNDLE_FORMAT_VERSION == 2
    probe = manifest["probe"]
    assert probe["query"] == {"user_id": PROBE_USER} and probe["k"] == 10
    bundle = Bundle.load(bundles["a"], verify="full")
    assert bundle.recommend(probe["query"], k=10).item_ids == probe["item_ids"]
    records = manifest["fingerprints"]["files"]
    assert {"index.faiss", "item_ids.parquet", "index.json", f"{manifest['files']['query_model']}/saved_model.pb",
            f"{manifest['files']['topk_model']}/saved_model.pb", "models/models.config"} <= set(records)
    assert all(r["quick_check"] == "whole" and len(r["blake2b"]) == 64 for r in records.values())
    Bundle.load(bundles["hnsw"])  # an approximate index gives the same top-k for the same query


@given(data=st.data())
@EXAMPLES
def test_any_edit_of_any_served_file_is_refused_naming_it(bundles, data):
    names = sorted(_manifest(bundles["a"])["fingerprints"]["files"])
    name = data.draw(st.sampled_from(names), label="file")
    how = data.draw(st.sampled_from(["flip a byte", "truncate", "append a byte"]), label="edit")
    with tempfile.TemporaryDirectory() as tmp:
        copy = _copy(bundles["a"], Path(tmp))
        path = copy / name
        content = bytearray(path.read_bytes())
        if how == "append a byte":
            content.append(data.draw(st.integers(0, 255)))
        elif not content:
            return  # an empty file has no byte to flip or cut
        elif how == "flip a byte":
            at = data.draw(st.integers(0, len(content) - 1), label="at")
            content[at] ^= data.draw(st.integers(1, 255), label="mask")
        else:
            del content[data.draw(st.integers(0, len(content) - 1), label="keep"):]
        path.write_bytes(bytes(content))
        with pytest.raises(BundleError) as refused:
            Bundle.load(copy)
    assert str(refused.value) == f"{copy}: {name}: content differs from the manifest's fingerprint"


@given(part=st.sampled_from(PARTS), donor=st.sampled_from(["b", "c"]))
@EXAMPLES
def test_a_part_swapped_in_from_another_bundle_is_refused_naming_it(bundles, part, donor):
    assume(not _same_bytes(_at(bundles["a"], part), _at(bundles[donor], part)))
    with tempfile.TemporaryDirectory() as tmp:
        copy = _copy(bundles["a"], Path(tmp))
        _swap(copy, bundles[donor], part)
        named = _relative(copy, part)
        with pytest.raises(BundleError) as refused:
            Bundle.load(copy)
    assert re.match(rf"{re.escape(f'{copy}: {named}')}[/:]", str(refused.value)), str(refused.value)


@pytest.mark.parametrize(
    "part, donor, message",
    [
        ("query_model", "b", "probe query for user 'user00' returned other items than at export: "
                             "the bundle's parts do not belong together"),
        ("query_model", "c", "the query model ({query_model}) embeds into 8 dimensions but index.faiss holds "
                             "16-dimensional vectors"),
        ("index.faiss", "b", "probe query for user 'user00' returned other items than at export"),
        ("index.faiss", "c", "the query model ({query_model}) embeds into 16 dimensions but index.faiss holds "
                             "8-dimensional vectors"),
        ("item_ids.parquet", "b", "probe query for user 'user00' returned other items than at export"),
    ],
)
def test_a_swap_behind_recomputed_fingerprints_is_still_refused(bundles, tmp_path, part, donor, message):
    """Fingerprints taken after the swap: the dimension check and the probe query tie the parts together."""
    copy = _copy(bundles["a"], tmp_path)
    _swap(copy, bundles[donor], part)
    _reseal(copy)
    message = message.format(query_model=_relative(copy, "query_model"))
    with pytest.raises(BundleError, match=re.escape(f"{copy}: {message}")):
        Bundle.load(copy)


def test_a_duplicated_item_id_is_refused_and_never_written(bundles, tmp_path):
    copy = _copy(bundles["a"], tmp_path)
    _duplicate_an_id(copy, 7)
    with pytest.raises(BundleError, match="item_ids.parquet: content differs from the manifest's fingerprint"):
        Bundle.load(copy)
    _reseal(copy)
    with pytest.raises(BundleError, match=re.escape(
        "item_ids.parquet: item ids must be unique: 1 rows repeat an earlier id (row 8 repeats row 7)"
    )):
        Bundle.load(copy)
    index = Bundle.load(bundles["a"]).index
    with pytest.raises(ValueError, match="item ids must be unique"):
        ItemIndex(index.index, ["same"] * len(index), "Flat")


@given(key=st.sampled_from(["query_model", "doc_model", "index", "item_ids", "index_info", "topk_model",
                            "tf_serving_config"]),
       how=st.sampled_from(["..", "absolute", "symlinked entry", "symlinked file inside"]))
@EXAMPLES
def test_no_served_path_may_leave_the_bundle(bundles, key, how):
    """Even when the file outside is byte for byte the bundle's own (the original "a" beside the copy)."""
    entry = _manifest(bundles["a"])["files"][key]
    outside = bundles["a"] / entry
    with tempfile.TemporaryDirectory() as tmp:
        copy = _copy(bundles["a"], Path(tmp))
        manifest = _manifest(copy)
        if how == "..":
            manifest["files"][key] = os.path.relpath(outside, copy)
            assert manifest["files"][key].startswith("../")
        elif how == "absolute":
            manifest["files"][key] = str(outside)
        elif how == "symlinked entry":
            (shutil.rmtree if (copy / entry).is_dir() else os.unlink)(copy / entry)
            (copy / entry).symlink_to(outside)
        else:
            inner = next(p for p in sorted((copy / entry).rglob("*")) if p.is_file()) if (copy / entry).is_dir() \
                else copy / entry
            inner.unlink()
            inner.symlink_to(bundles["a"] / inner.relative_to(copy))
        (copy / MANIFEST_FILE).write_text(json.dumps(manifest))
        with pytest.raises(BundleError, match="points outside the bundle"):
            Bundle.load(copy)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@given(where=st.sampled_from([("fingerprints",), ("fingerprints", "files"), ("fingerprints", "files", "index.json"),
                              ("fingerprints", "head_tail_bytes"), ("probe",), ("probe", "query"),
                              ("probe", "item_ids"), ("probe", "scores"), ("probe", "k"), ("files",),
                              ("files", "index"), ("embedding_dim",)]),
       value=JSON)
@EXAMPLES
def test_a_manifest_value_of_any_shape_loads_or_is_a_bundle_error(bundles, where, value):
    """Never another exception (which the service would answer as a 500, or serve would print as a traceback)."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = _copy(bundles["a"], Path(tmp))
        manifest = _manifest(copy)
        parent = manifest
        for key in where[:-1]:
            parent = parent[key]
        parent[where[-1]] = value
        (copy / MANIFEST_FILE).write_text(json.dumps(manifest))
        try:
            Bundle.load(copy)
        except BundleError:
            pass


def test_a_symlink_inside_the_bundle_is_followed(bundles, tmp_path):
    copy = _copy(bundles["a"], tmp_path)
    (copy / "index.faiss").rename(copy / "kept.faiss")
    (copy / "index.faiss").symlink_to("kept.faiss")
    Bundle.load(copy)


def test_files_missing_or_not_in_the_manifest_are_refused(bundles, tmp_path):
    copy = _copy(bundles["a"], tmp_path)
    query, doc = _relative(copy, "query_model"), _relative(copy, "doc_model")
    (copy / query / "extra.bin").write_bytes(b"x")
    with pytest.raises(BundleError, match=re.escape(
        f"{query}/extra.bin: in the bundle's served files but not in the manifest's fingerprints"
    )):
        Bundle.load(copy)
    (copy / query / "extra.bin").unlink()
    (copy / query / "fingerprint.pb").unlink()
    with pytest.raises(BundleError, match=re.escape(
        f"{query}/fingerprint.pb: in the manifest's fingerprints but missing from the bundle"
    )):
        Bundle.load(copy)
    shutil.rmtree(copy / doc)
    with pytest.raises(BundleError, match=f"{doc}: listed in manifest.json files.doc_model but missing"):
        Bundle.load(copy)


def test_large_files_are_checked_by_their_ends_unless_full_is_asked(bundles, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fingerprints, "FULL_HASH_MAX_BYTES", 4096)
    monkeypatch.setattr(fingerprints, "HEAD_TAIL_BYTES", 1024)
    copy = _copy(bundles["a"], tmp_path)
    _reseal(copy)
    record = _manifest(copy)["fingerprints"]
    assert record["head_tail_bytes"] == 1024
    assert record["files"]["index.faiss"]["quick_check"] == "head+tail"
    assert record["files"]["index.json"]["quick_check"] == "whole"
    path = copy / "index.faiss"
    content = bytearray(path.read_bytes())
    assert len(content) > 3 * 1024
    content[len(content) // 2] ^= 0xFF  # a byte in the middle, outside both ends
    path.write_bytes(bytes(content))
    check_fingerprints(copy, _manifest(copy))  # quick: size and ends agree
    with pytest.raises(ValueError, match="index.faiss: content differs"):
        check_fingerprints(copy, _manifest(copy), full=True)
    with pytest.raises(BundleError, match="index.faiss: content differs from the manifest's fingerprint"):
        Bundle.load(copy, verify="full")
    # retrieval serve --verify full: the same at start (and for every reload).
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: None)
    assert cli.main(["serve", "--bundle", str(copy), "--verify", "full"]) == 2
    assert "index.faiss: content differs" in capsys.readouterr().err
    app = create_app(bundles["a"], verify="full")
    assert app.state.holder.verify == "full"
    assert "index.faiss: content differs" in call(app, "POST", "/admin/reload", json={"bundle": str(copy)}).text
    content[:4] = b"XXXX"  # the head
    path.write_bytes(bytes(content))
    with pytest.raises(BundleError, match="index.faiss: content differs"):
        Bundle.load(copy)


def test_format_1_bundles_load_with_a_warning_and_keep_the_other_checks(bundles, tmp_path, caplog):
    copy = _copy(bundles["a"], tmp_path)
    manifest = _manifest(copy)
    manifest["format_version"] = 1
    for key in ("fingerprints", "probe"):
        del manifest[key]
    del manifest["files"]["index_info"]
    (copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="retrieval.serving"):
        Bundle.load(copy)
    assert "bundle format 1 has no fingerprints or probe query" in caplog.text and "re-export" in caplog.text
    _swap(copy, bundles["c"], "query_model")
    with pytest.raises(BundleError, match="embeds into 8 dimensions but index.faiss holds 16"):
        Bundle.load(copy)
    manifest["files"]["query_model"] = str(_at(bundles["a"], "query_model"))
    (copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="points outside the bundle"):
        Bundle.load(copy)


def test_reindexing_writes_new_fingerprints_and_a_new_probe(bundles, tmp_path):
    out = reindex_bundle(bundles["a"], tmp_path / "reindexed", "HNSW16")
    manifest, source = _manifest(out), _manifest(bundles["a"])
    assert manifest["index"]["factory"] == "HNSW16" and manifest["probe"]["query"] == source["probe"]["query"]
    assert manifest["fingerprints"]["files"]["index.faiss"] != source["fingerprints"]["files"]["index.faiss"]
    Bundle.load(out, verify="full")


def test_probe_comparison_tolerates_ties_only():
    ids, scores = ["a", "b", "c", "d"], [0.9, 0.5, 0.5, 0.1]
    assert _same_top_k(ids, scores, ["a", "c", "b", "d"], [0.9, 0.5, 0.5 + 1e-7, 0.1])
    assert _same_top_k(ids, scores, ["a", "b", "c", "e"], scores)  # the last place: another item of that score
    assert not _same_top_k(ids, scores, ["b", "a", "c", "d"], scores)
    assert not _same_top_k(ids, scores, ids, [0.9, 0.5, 0.5, 0.2])
    assert not _same_top_k(ids, scores, ids[:3], scores[:3])


# --- over HTTP -----------------------------------------------------------------------------------------


def _break_for_reload(bundles, directory: Path, how: str) -> None:
    if how == "query_model of another dimension":
        _swap(directory, bundles["c"], "query_model")
    elif how == "query_model of the same dimension, resealed":
        _swap(directory, bundles["b"], "query_model")
        _reseal(directory)
    elif how == "manifest path outside":
        manifest = _manifest(directory)
        manifest["files"]["query_model"] = os.path.relpath(_at(bundles["b"], "query_model"), directory)
        (directory / MANIFEST_FILE).write_text(json.dumps(manifest))
    elif how == "duplicated id, resealed":
        _duplicate_an_id(directory, 3)
        _reseal(directory)
    else:
        raise ValueError(how)


@pytest.mark.parametrize("how", ["query_model of another dimension", "query_model of the same dimension, resealed",
                                 "manifest path outside", "duplicated id, resealed"])
def test_reload_of_a_bundle_that_is_not_whole_keeps_the_old_one(bundles, tmp_path, how):
    app = create_app(bundles["a"])
    broken = _copy(bundles["a"], tmp_path, "broken")
    _break_for_reload(bundles, broken, how)
    response = call(app, "POST", "/admin/reload", json={"bundle": str(broken)})
    assert response.status_code == 422, response.text
    assert "not loaded, still serving 'a'" in response.json()["error"]
    health = call(app, "GET", "/healthz")
    assert health.status_code == 200 and health.json() == {"status": "ok", "bundle": "a", "num_items": NUM_ITEMS}
    served = call(app, "POST", "/recommend", json={"query": {"user_id": PROBE_USER}})
    assert served.status_code == 200 and served.json()["bundle"] == "a"
    assert call(app, "POST", "/admin/reload", json={"bundle": str(bundles["b"])}).status_code == 200


def test_healthz_fails_when_the_live_bundle_cannot_answer_its_probe(bundles):
    app = create_app(bundles["a"])
    assert call(app, "GET", "/healthz").status_code == 200
    live = app.state.holder.current
    live.index = ItemIndex.load(bundles["b"])  # the parts in memory no longer belong together
    health = call(app, "GET", "/healthz")
    assert health.status_code == 503
    assert health.json() == {
        "status": "failing", "bundle": "a",
        "error": "probe query for user 'user00' returned other items than at export: "
                 "the bundle's parts do not belong together",
    }
    assert str(bundles["a"].parent) not in health.text
