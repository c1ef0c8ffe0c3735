"""Warm starts (``train.warm_start``): a run trained on from a finished run's weights.

The parent trains on the first part of a synthetic log (some users and items held back), the
child on the next part, which brings those users and items as new ids. References: the parent
bundle's own SavedModels and index vectors, a fresh build of the same model, python sets.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

from retrieval.config import ConfigError, SyntheticConfig, load_config
from retrieval.data.synthetic import generate_clicks
from retrieval.features import FeatureStatistics
from retrieval.samplers import StreamingFrequency
from retrieval.training.warm_start import (
    ParentState,
    carry_optimizer,
    grown_statistics,
    move_estimate,
    row_map,
)

NEW_ITEMS = [f"i{i:04d}" for i in range(70, 80)]
NEW_USERS = [f"u{i:04d}" for i in range(140, 150)]
SMALL = ["model.embedding_dim=8", "train.epochs=2", "train.batch_size=128", "train.validation_fraction=0",
         "train.verbose=0", "evaluation.baselines.rankers=[popularity]", "evaluation.plots=false",
         "split.kind=none"]


@pytest.fixture(scope="module")
def periods(tmp_path_factory):
    """Three periods of one synthetic log as CSV files: a (the new users and items held back), b, c."""
    folder = tmp_path_factory.mktemp("periods")
    clicks, _, _ = generate_clicks(SyntheticConfig(n_users=150, n_items=80, seed=3))
    first, second = clicks.timestamp.quantile([0.6, 0.85])
    a = clicks[(clicks.timestamp <= first) & ~clicks.item_id.isin(NEW_ITEMS) & ~clicks.user_id.isin(NEW_USERS)]
    b = clicks[(clicks.timestamp > first) & (clicks.timestamp <= second)]
    c = clicks[clicks.timestamp > second]
    paths = {}
    for name, frame in (("a", a), ("b", b), ("c", c)):
        paths[name] = folder / f"{name}.csv"
        frame.to_csv(paths[name], index=False)
    assert set(NEW_ITEMS) <= set(b.item_id) and set(NEW_USERS) & set(b.user_id)
    return paths, folder


def _config(paths, folder, clicks: str, test: str, *extra: str):
    return load_config(None, [f"data.clicks.path={paths[clicks]}", f"data.test_clicks.path={paths[test]}",
                              *SMALL, f"run.output_dir={folder / 'runs'}", *extra])


@pytest.fixture(scope="module")
def parent(periods):
    from retrieval.jobs import train_evaluate_export

    paths, folder = periods
    return train_evaluate_export(_config(paths, folder, "a", "b", "run.name=parent")).directory


def _child_data_and_model(periods, parent, *extra: str):
    from retrieval.jobs import build_job_model, read_and_split

    paths, folder = periods
    config = _config(paths, folder, "b", "c", f"train.warm_start={parent}", *extra)
    data = read_and_split(config, ParentState.read(parent))
    return config, data, build_job_model(config, data)


def _table(model, name: str) -> np.ndarray:
    layers = [layer for tower in (model.query_tower, model.doc_tower) for layer in tower.submodules
              if isinstance(layer, tf.keras.layers.Embedding) and layer.name == name]
    return layers[0].embeddings.numpy()


def test_before_any_step_known_ids_embed_as_in_the_parent_and_new_ids_get_the_fresh_init(periods, parent):
    from retrieval.jobs import build_job_model
    from retrieval.serving import Bundle
    from retrieval.training import embed_frame

    config, data, model = _child_data_and_model(periods, parent)
    old, state = Bundle.load(parent), ParentState.read(parent)
    users = state.users  # the parent's training users: known to its query tower
    reference = old.embed([{"user_id": user} for user in users])
    assert (np.abs(reference).sum(axis=1) > 0).all()  # every one known to the parent (unknown: zeros)
    np.testing.assert_allclose(embed_frame(model.query_tower, pd.DataFrame({"user_id": users})), reference, atol=1e-6)
    rows = pd.Index(old.index.item_ids).get_indexer(state.items)
    np.testing.assert_allclose(embed_frame(model.doc_tower, pd.DataFrame({"item_id": state.items})),
                               old.index.flat_vectors()[rows], atol=1e-6)
    # New ids: the rows a model built from scratch on the same (grown) vocabulary starts with.
    fresh = build_job_model(config, dataclasses.replace(data, parent=None))
    for name, vocabulary, known in (("user_id_embedding", data.stats.users, state.users),
                                    ("item_id_embedding", data.stats.items, state.items)):
        new = sorted(set(vocabulary.ids) - set(known))
        assert new
        rows = vocabulary.lookup(new)
        assert (rows > 0).all()
        np.testing.assert_array_equal(_table(model, name)[rows], _table(fresh, name)[rows])
        assert not np.allclose(_table(model, name)[rows], 0.0)


def test_vocabularies_and_static_counts_are_the_parents_plus_the_new_clicks(periods, parent):
    paths, _ = periods
    a, b = (pd.read_csv(paths[name], dtype={"user_id": str, "item_id": str}) for name in "ab")
    _, data, _ = _child_data_and_model(periods, parent)
    assert data.stats.users.ids == tuple(sorted(set(a.user_id) | set(b.user_id)))
    assert data.stats.items.ids == tuple(sorted(set(a.item_id) | set(b.item_id)))
    expected = pd.concat([a, b]).item_id.value_counts()
    counts = pd.Series(data.stats.item_popularity.counts[1:], index=list(data.stats.items.ids))
    pd.testing.assert_series_equal(counts.sort_index(), expected.astype(float).sort_index(), check_names=False)
    assert set(data.catalogue_ids) >= set(pd.read_parquet(parent / "item_ids.parquet").item_id) | set(NEW_ITEMS)


def test_grown_statistics_gather_counts_by_id_not_by_position():
    class Parent:  # the two attributes grown_statistics reads
        users, items = ["u1", "u3"], ["b", "d"]
        arrays = {"item_counts": np.array([5.0, 7.0])}

    new = FeatureStatistics.from_counts(["u2"], ["a", "b", "c"], [1, 2, 3], False)
    grown = grown_statistics(new, Parent())  # type: ignore[arg-type]
    assert grown.items.ids == ("a", "b", "c", "d") and grown.users.ids == ("u1", "u2", "u3")
    np.testing.assert_array_equal(grown.item_popularity.counts, [0, 1, 2 + 5, 3, 7])


def test_a_row_map_gathers_by_id_and_refuses_a_shrinking_vocabulary():
    parent_rows, new_rows = row_map(["b", "d"], ["a", "b", "c", "d"], 1, "item_id_lookup")
    np.testing.assert_array_equal(parent_rows, [0, 1, 2])
    np.testing.assert_array_equal(new_rows, [0, 2, 4])
    with pytest.raises(ConfigError, match="train.warm_start: the vocabulary of item_id_lookup would shrink"):
        row_map(["b", "z"], ["a", "b"], 1, "item_id_lookup")


def test_the_streaming_estimate_follows_each_item_to_its_new_tower_index():
    parent_items, items = ["b", "d", "f"], ["a", "b", "c", "d", "e", "f"]
    estimator = StreamingFrequency(num_buckets=4096, num_hashes=2)
    for keys in ([1, 1, 2], [1, 3], [1, 1, 1, 2], [3]):  # tower indices of b, d, f
        estimator.update(tf.constant(keys, tf.int64))
    before = estimator.expected_count_per_step(tf.constant([1, 2, 3], tf.int64)).numpy()
    step = int(estimator.step.numpy())
    move_estimate(estimator, parent_items, items)
    after = estimator.expected_count_per_step(tf.constant([2, 4, 6], tf.int64)).numpy()  # b, d, f now
    np.testing.assert_allclose(after, before)
    unseen = estimator.expected_count_per_step(tf.constant([1, 3, 5], tf.int64)).numpy()
    np.testing.assert_allclose(unseen, 1.0 / estimator.initial_gap)
    assert int(estimator.step.numpy()) == step


def test_carried_optimizer_slots_are_the_parents_gathered_by_id(periods, parent):
    from retrieval.training import make_optimizer

    config, data, model = _child_data_and_model(periods, parent)
    state = ParentState.read(parent)
    optimizer = make_optimizer(config.train)
    carry_optimizer(optimizer, model, state, config.train.optimizer)
    position = next(i for i, v in enumerate(model.variables) if v.name.startswith("item_id_embedding"))
    saved = state.arrays[f"slot/_momentums/{position}"]
    by_id = {item: saved[row + 1] for row, item in enumerate(state.items)}
    momentum = optimizer._momentums[optimizer._index_dict[optimizer._var_key(model.variables[position])]].numpy()
    for row, item in enumerate(data.stats.items.ids):
        np.testing.assert_array_equal(momentum[row + 1], by_id.get(item, np.zeros_like(momentum[0])))
    assert int(optimizer.iterations.numpy()) == state.info["optimizer"]["iterations"] > 0
    with pytest.raises(ConfigError, match="train.optimizer is 'adagrad'"):
        carry_optimizer(make_optimizer(config.train.model_copy(update={"optimizer": "adagrad"})), model, state,
                        "adagrad")


@pytest.mark.parametrize("optimizer", ["carry", "reset"])
def test_a_warm_start_trains_on_new_clicks_and_its_bundle_serves_new_ids(periods, parent, optimizer):
    from retrieval.bundle.manifest import read_manifest
    from retrieval.bundle.seen_items import SeenItems
    from retrieval.jobs import train_evaluate_export
    from retrieval.serving import Bundle

    paths, folder = periods
    result = train_evaluate_export(_config(paths, folder, "b", "c", f"train.warm_start={parent}",
                                           f"train.warm_start_optimizer={optimizer}", f"run.name=child-{optimizer}"))
    assert result.metrics["model"]["recall@20"] > result.metrics["popularity"]["recall@20"] * 0.8
    # Evaluated as it serves: the parent's clicks are its training clicks too (known users, excluded items).
    a, b, c = (pd.read_csv(paths[name], dtype={"user_id": str, "item_id": str}) for name in "abc")
    trained = set(zip(a.user_id, a.item_id, strict=True)) | set(zip(b.user_id, b.item_id, strict=True))
    counts = result.metrics["counts"]
    unknown = c.user_id[~c.user_id.isin(set(a.user_id) | set(b.user_id))]
    assert counts["test_users_unseen_in_training"] == unknown.nunique()
    repeats = set(zip(c.user_id, c.item_id, strict=True)) & trained
    assert counts["test_clicks_repeating_a_training_click"] == len(repeats) > 0
    manifest = read_manifest(result.directory)
    assert manifest.parent is not None and manifest.parent.change == "warm_start"
    assert manifest.parent.directory == str(parent) and manifest.parent.run == "parent"
    assert manifest.parent.created_at == read_manifest(parent).created_at
    bundle = Bundle.load(result.directory)
    assert set(NEW_ITEMS) <= set(bundle.index.item_ids)
    new_user = sorted(set(NEW_USERS) & set(pd.read_csv(paths["b"]).user_id))[0]
    served = bundle.recommend({"user_id": new_user}, k=5)
    assert served.fallback is None and len(served.item_ids) == 5
    # Seen items: the parent's pairs and the new log's, as a python set union.
    def pairs(seen: SeenItems, ids) -> set[tuple[str, str]]:
        users = np.char.decode(seen.user_ids, "utf-8")
        return {(users[u], ids[r]) for u in range(len(users))
                for r in seen.item_rows[seen.indptr[u]:seen.indptr[u + 1]]}

    old = pairs(SeenItems.load(parent / "seen_items"), list(Bundle.load(parent).index.item_ids))
    assert pairs(SeenItems.load(result.directory / "seen_items"), list(bundle.index.item_ids)) == \
        old | set(zip(b.user_id, b.item_id, strict=True))


def test_replay_adds_the_parents_pairs_before_the_new_clicks(periods, parent):
    from retrieval.bundle.seen_items import SeenItems
    from retrieval.jobs import read_and_split

    paths, folder = periods
    config = _config(paths, folder, "b", "c", f"train.warm_start={parent}", "train.replay_fraction=0.25")
    data = read_and_split(config, ParentState.read(parent))
    b = pd.read_csv(paths["b"])
    assert data.counts.train_rows == len(b) + round(0.25 / 0.75 * len(b))
    frame = data.clicks.table.to_pandas()
    replayed = frame.iloc[: data.counts.train_rows - len(b)]
    assert (replayed.timestamp < b.timestamp.min()).all()
    seen = SeenItems.load(parent / "seen_items")
    ids = pd.read_parquet(parent / "item_ids.parquet").item_id.tolist()
    users = np.char.decode(seen.user_ids, "utf-8")
    old = {(users[u], ids[r]) for u in range(len(users)) for r in seen.item_rows[seen.indptr[u]:seen.indptr[u + 1]]}
    assert set(zip(replayed.user_id, replayed.item_id, strict=True)) <= old


@pytest.mark.parametrize(("override", "key"), [
    ("model.embedding_dim=16", "model.embedding_dim"),
    ("model.item_bias=true", "model.item_bias"),
    ("model.loss.kind=sgns", "model.loss.kind"),
    ("towers.query={features: [{name: user_id, kind: id}], mlp: {widths: [16]}}", "towers.query.mlp.widths"),
])
def test_a_parent_of_another_shape_or_loss_is_refused_at_load_naming_the_key(periods, parent, override, key):
    paths, folder = periods
    with pytest.raises(ConfigError, match=f"train.warm_start=.*: {key}"):
        _config(paths, folder, "b", "c", f"train.warm_start={parent}", override)


def test_a_missing_or_stateless_parent_is_refused_naming_train_warm_start(periods, parent, tmp_path):
    import shutil

    paths, folder = periods
    with pytest.raises(ConfigError, match="train.warm_start=.* does not exist"):
        _config(paths, folder, "b", "c", f"train.warm_start={tmp_path / 'nowhere'}")
    with pytest.raises(ConfigError, match="train.warm_start=.* holds no manifest.json"):
        _config(paths, folder, "b", "c", f"train.warm_start={tmp_path}")
    copy = tmp_path / "copy"
    shutil.copytree(parent, copy, ignore=shutil.ignore_patterns("warm_start"))
    with pytest.raises(ConfigError, match="train.warm_start=.* holds no training state"):
        ParentState.read(copy)
    with pytest.raises(ConfigError, match="train.replay_fraction=0.2 replays a parent's clicks"):
        load_config(None, ["train.replay_fraction=0.2"])
    with pytest.raises(ConfigError, match="train.replay_fraction=0.2 .* split.kind 'random'"):
        _config(paths, folder, "b", "c", f"train.warm_start={parent}", "train.replay_fraction=0.2",
                "split.kind=random")


def test_the_warm_start_flag_is_the_config_key(periods, tmp_path):
    from retrieval.cli import _train

    paths, _ = periods
    args = argparse.Namespace(config=None, overrides=[f"data.clicks.path={paths['a']}"],
                              warm_start=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="train.warm_start='.*nowhere' does not exist"):
        _train(args)



FEATURE_TOWERS = (
    "towers={query: {features: [{name: user_id, kind: id}, {name: age, kind: numeric}, "
    "{name: country, kind: categorical, embedding_dim: 4}], history: {length: 5, pooling: mean, "
    "share_item_embedding: true}}, doc: {features: [{name: item_id, kind: id}, "
    "{name: category, kind: categorical, embedding_dim: 4}, {name: price, kind: numeric, log: true}], "
    "mlp: {widths: [16]}}}"
)


def test_feature_towers_grow_categorical_vocabularies_and_keep_the_numeric_scaling(periods, tmp_path):
    """A new category value sorts between known ones ("c000" between "c00" and "c01"), so known values'
    rows move: a gather by id, not a copy of the first rows; the price normalisation is the parent's,
    though the new log's prices differ (a recomputed one would move every item's embedding)."""
    from retrieval.jobs import build_job_model, read_and_split, train_evaluate_export
    from retrieval.serving import Bundle
    from retrieval.training import embed_frame

    paths, folder = periods
    _, items, users = generate_clicks(SyntheticConfig(n_users=150, n_items=80, seed=3))
    items.to_csv(tmp_path / "items.csv", index=False)
    users.to_csv(tmp_path / "users.csv", index=False)
    changed = items.copy()
    changed.loc[changed.item_id.isin(NEW_ITEMS), "category"] = "c000"
    changed.to_csv(tmp_path / "items-new.csv", index=False)
    features = [FEATURE_TOWERS, f"data.user_features.path={tmp_path / 'users.csv'}",
                "evaluation.unseen_users=keep"]
    parent = train_evaluate_export(_config(paths, folder, "a", "b", *features, "run.name=features-parent",
                                           f"data.item_features.path={tmp_path / 'items.csv'}")).directory
    config = _config(paths, folder, "b", "c", *features, f"train.warm_start={parent}",
                     f"data.item_features.path={tmp_path / 'items-new.csv'}")
    data = read_and_split(config, ParentState.read(parent))
    model = build_job_model(config, data)
    categories = data.fitted["tower_statistics"].features["category"].ids
    assert "c000" in categories and categories.index("c01") == categories.index("c000") + 1
    old, state = Bundle.load(parent), ParentState.read(parent)
    catalogue = items.set_index("item_id").loc[state.items].reset_index()
    rows = pd.Index(old.index.item_ids).get_indexer(state.items)
    np.testing.assert_allclose(embed_frame(model.doc_tower, catalogue[["item_id", "category", "price"]]),
                               old.index.flat_vectors()[rows], atol=1e-5)


def test_a_warm_started_run_is_a_parent_in_turn(periods, parent):
    """A chain: the child's own state (grown vocabularies, merged seen items) is what the grandchild reads."""
    from retrieval.bundle.manifest import read_manifest
    from retrieval.jobs import train_evaluate_export
    from retrieval.serving import Bundle

    paths, folder = periods
    child = train_evaluate_export(_config(paths, folder, "b", "c", f"train.warm_start={parent}",
                                          "run.name=chain-child")).directory
    config = load_config(None, [f"data.clicks.path={paths['c']}", *SMALL[:-1], "split.kind=temporal",
                                f"run.output_dir={folder / 'runs'}", f"train.warm_start={child}",
                                "run.name=chain-grandchild"])
    grandchild = train_evaluate_export(config).directory
    assert read_manifest(grandchild).parent.run == "chain-child"
    a = pd.read_csv(paths["a"], dtype={"user_id": str})
    state = ParentState.read(grandchild)
    assert set(a.user_id) <= set(state.users)  # the grandparent's users are still known
    served = Bundle.load(grandchild).recommend({"user_id": a.user_id.iloc[0]}, k=5)
    assert served.fallback is None


def test_export_warm_start_state_false_writes_no_state_and_the_run_is_no_parent(periods):
    from retrieval.jobs import train_evaluate_export

    paths, folder = periods
    run = train_evaluate_export(_config(paths, folder, "a", "b", "export.warm_start_state=false",
                                        "run.name=stateless")).directory
    assert (run / "manifest.json").is_file() and not (run / "warm_start").exists()
    with pytest.raises(ConfigError, match="holds no training state .* unless export.warm_start_state was false"):
        ParentState.read(run)
