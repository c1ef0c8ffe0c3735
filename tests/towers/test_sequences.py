"""Sequence training: ordered logs, the causal transformer history and the all-positions loss.

The transformer tower is checked for causality and for serving what it trains; the loss over every
position of a batch of sequences against the in-batch softmax computed in numpy on the same
(query state, next item) pairs (``tests/reference_losses.py``); the source against the clicks it
is built from.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
from reference_losses import numpy_in_batch_loss

import retrieval  # noqa: F401
from retrieval.config import ConfigError, LossConfig, ModelConfig, TableConfig, TowersConfig, load_config
from retrieval.data import DataError, read_clicks
from retrieval.features import FeatureStatistics, TowerStatistics
from retrieval.features.histories import ClickHistories
from retrieval.losses import OwnItems, own_item_hits
from retrieval.model import build_model
from retrieval.towers import build_towers, position_states
from retrieval.training import SequenceClicks

LENGTH = 6
TOWERS = TowersConfig.model_validate({
    "query": {"features": [], "history": {"length": LENGTH, "pooling": "transformer",
                                          "transformer": {"blocks": 2, "heads": 2, "dropout": 0.1}}},
    "doc": {"features": [{"name": "item_id", "kind": "id"}]},
})


def _clicks(seed: int = 0, users: int = 12, items: int = 15) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = [(f"u{u}", f"i{rng.integers(items)}", t) for u in range(users) for t in range(rng.integers(1, 10))]
    frame = pd.DataFrame(rows, columns=["user_id", "item_id", "timestamp"])
    frame["weight"] = np.float32(1.0)
    return frame


def _model(clicks: pd.DataFrame, **settings):
    """A transformer-history model on ``clicks``' vocabularies (``settings``: ModelConfig keys)."""
    stats = FeatureStatistics.from_training_clicks(clicks)
    tf.keras.utils.set_random_seed(0)
    config = ModelConfig(**{"embedding_dim": 8, "temperature": 0.2, "loss": LossConfig(log_q_source="static"),
                            **settings})
    statistics = TowerStatistics.fit(TOWERS, clicks.assign(history=""), None)
    return build_model(config, stats, towers=build_towers(TOWERS, config, statistics)), stats


def _histories(clicks: pd.DataFrame, stats: FeatureStatistics) -> ClickHistories:
    users, items = pd.Index(stats.users.ids), pd.Index(stats.items.ids)
    return ClickHistories(users.get_indexer(clicks["user_id"]), items.get_indexer(clicks["item_id"]),
                          clicks["timestamp"].to_numpy(), stats.users.ids, stats.items.ids)


def test_a_state_never_sees_a_later_item_and_the_newest_state_is_what_the_tower_serves():
    model, stats = _model(_clicks())
    states = position_states(model.query_tower)
    assert states is not None
    rng = np.random.default_rng(1)
    items = np.asarray(stats.items.ids, dtype=object)
    history = rng.choice(items, size=(4, LENGTH)).astype(object)
    history[1, 4:] = ""  # a short history: padding after its oldest item
    out = states.model({"history": tf.constant(history)}, training=False).numpy()
    np.testing.assert_allclose(out[:, 0], model.query_tower({"history": tf.constant(history)}).numpy(), atol=1e-6)
    for p in range(LENGTH - 1):  # newest first: position p is later in time than p + 1, p + 2, ...
        changed = history.copy()
        changed[:, p] = np.where(changed[:, p] == items[0], items[1], items[0])
        changed[1, 4:] = ""
        again = states.model({"history": tf.constant(changed)}, training=False).numpy()
        np.testing.assert_allclose(again[:, p + 1:], out[:, p + 1:], atol=1e-6)  # older states: untouched
        assert not np.allclose(again[0, : p + 1], out[0, : p + 1], atol=1e-4)  # this one and newer: moved


def test_unknown_items_are_dropped_from_a_history_and_a_history_of_none_embeds_to_zero():
    model, stats = _model(_clicks())
    a, b, c = stats.items.ids[:3]
    embed = lambda rows: model.query_tower({"history": tf.constant(rows, dtype=tf.string)}).numpy()  # noqa: E731
    without = embed([[a, b, c, "", "", ""]])
    for unknown_at in range(4):  # the newest place included: a new item must not blank the known ones
        history = [a, b, c, "", "", ""]
        history.insert(unknown_at, "never-seen")
        np.testing.assert_allclose(embed([history[:LENGTH]]), without, atol=1e-6)
    assert np.linalg.norm(without) == pytest.approx(1.0, rel=1e-5)
    assert not np.allclose(embed([[b, a, c, "", "", ""]]), without, atol=1e-4)  # order still counts
    np.testing.assert_array_equal(embed([[""] * LENGTH, ["nope", "", "", "", "", ""]]), np.zeros((2, 8)))


def test_latest_windows_are_each_users_latest_clicks_with_the_next_item_at_every_position():
    clicks = _clicks(seed=2)
    stats = FeatureStatistics.from_training_clicks(clicks)
    source = SequenceClicks(_histories(clicks, stats), "history", LENGTH, batch_size=5, seed=0, windows="latest")
    batches = [{k: v.numpy() for k, v in batch.items()} for batch in source.epoch(0)]
    seen = {}
    for batch in batches:
        for user, history, targets in zip(batch["user_id"], batch["history"], batch["item_id"], strict=True):
            seen[user.decode()] = (history.astype(str), targets.astype(str))
    for user, group in clicks.groupby("user_id"):
        items = group.sort_values("timestamp", kind="stable")["item_id"].tolist()[::-1]  # newest first
        if len(items) < 2:
            assert user not in seen  # nothing to predict a single click from
            continue
        history, targets = seen[user]
        window = items[: LENGTH + 1]
        assert list(history) == window[1:] + [""] * (LENGTH + 1 - len(window))
        assert list(targets) == window[:-1][: len(window) - 1] + [""] * (LENGTH + 1 - len(window))
    assert source.positions == sum(min(n, LENGTH + 1) - 1 for n in clicks.groupby("user_id").size() if n > 1)
    order = lambda epoch: [b["user_id"].numpy().tolist() for b in source.epoch(epoch)]  # noqa: E731
    assert order(3) == order(3) != order(4)  # a rerun repeats an epoch, the next one differs


def test_all_windows_make_every_click_but_a_users_first_a_target_once_after_its_own_past():
    clicks = _clicks(seed=4, users=10, items=30)
    clicks = pd.concat([clicks, pd.DataFrame({"user_id": "long", "item_id": [f"i{i % 30}" for i in range(20)],
                                              "timestamp": range(20), "weight": np.float32(1)})])
    stats = FeatureStatistics.from_training_clicks(clicks)
    source = SequenceClicks(_histories(clicks, stats), "history", LENGTH, batch_size=4, seed=0)
    pairs: dict[str, list[tuple[tuple[str, ...], str]]] = {}  # user -> (the state's history, oldest first; target)
    for batch in source.epoch(0):
        for user, history, targets in zip(*(batch[k].numpy() for k in ("user_id", "history", "item_id")),
                                          strict=True):
            history, targets = history.astype(str), targets.astype(str)
            for p in np.flatnonzero(targets != ""):
                pairs.setdefault(user.decode(), []).append((tuple(history[p:][history[p:] != ""][::-1]), targets[p]))
    for user, group in clicks.groupby("user_id"):
        items = group.sort_values("timestamp", kind="stable")["item_id"].tolist()  # oldest first
        n, expected = len(items), []
        for t in range(1, n):  # its window ends (exclusive) at n - k * LENGTH and starts LENGTH + 1 before
            end = n - (n - 1 - t) // LENGTH * LENGTH
            expected.append((tuple(items[max(0, end - LENGTH - 1):t]), items[t]))
        assert sorted(pairs.get(user, [])) == sorted(expected)  # every click but the first, once, after its past
    long_windows = [h for h, _ in pairs["long"]]
    assert len(long_windows) == 19 and max(map(len, long_windows)) == LENGTH  # 19 targets over 4 windows
    assert source.rows == sum(max(0, (n - 2) // LENGTH + 1) for n in clicks.groupby("user_id").size() if n > 1)
    assert source.positions == sum(n - 1 for n in clicks.groupby("user_id").size())


@pytest.mark.parametrize("remove_hits", [True, False])
@pytest.mark.parametrize("log_q", [True, False])
def test_the_all_positions_loss_is_the_in_batch_loss_of_its_pairs(remove_hits, log_q):
    clicks = _clicks(seed=3)
    model, stats = _model(clicks, log_q_correction=log_q, remove_accidental_hits=remove_hits)
    source = SequenceClicks(_histories(clicks, stats), "history", LENGTH, batch_size=8, seed=0)
    batch = next(iter(source.epoch(0)))
    loss = float(model.compute_loss(batch, training=False))
    per_position = position_states(model.query_tower).model({"history": batch["history"]}, training=False).numpy()
    targets = batch["item_id"].numpy().astype(str)
    trained = targets != ""
    q = per_position[trained]
    d = model.doc_tower({"item_id": tf.constant(targets[trained])}).numpy()
    counts = clicks["item_id"].value_counts()
    log_prob = np.log(counts.reindex(targets[trained]).to_numpy() / len(clicks))
    ids = pd.factorize(targets[trained])[0]
    expected = numpy_in_batch_loss(q, d, log_prob if log_q else np.zeros(len(q)), ids, 0.2, remove_hits=remove_hits)
    assert len(q) > 8 and len(set(ids)) < len(ids)  # more pairs than sequences, and accidental hits among them
    assert loss == pytest.approx(expected, rel=1e-5)


def test_with_sequence_items_removed_no_item_of_a_pairs_window_is_its_negative():
    clicks = _clicks(seed=3)
    model, stats = _model(clicks, remove_sequence_items=True)
    source = SequenceClicks(_histories(clicks, stats), "history", LENGTH, batch_size=8, seed=0)
    batch = next(iter(source.epoch(0)))
    loss = float(model.compute_loss(batch, training=False))
    per_position = position_states(model.query_tower).model({"history": batch["history"]}, training=False).numpy()
    targets, histories = batch["item_id"].numpy().astype(str), batch["history"].numpy().astype(str)
    trained = targets != ""
    sequence_of_pair = np.broadcast_to(np.arange(len(targets))[:, None], targets.shape)[trained]
    windows = [set(histories[s]) | set(targets[s]) for s in range(len(targets))]
    pair_items = targets[trained]
    removed = np.array([[item in windows[s] for item in pair_items] for s in sequence_of_pair])
    q = per_position[trained]
    d = model.doc_tower({"item_id": tf.constant(pair_items)}).numpy()
    counts = clicks["item_id"].value_counts()
    log_prob = np.log(counts.reindex(pair_items).to_numpy() / len(clicks))
    ids = pd.factorize(pair_items)[0]
    expected = numpy_in_batch_loss(q, d, log_prob, ids, 0.2, removed=removed)
    plain = numpy_in_batch_loss(q, d, log_prob, ids, 0.2)
    assert (removed & (ids[:, None] != ids[None, :])).any()  # the window removes more than accidental hits
    assert loss == pytest.approx(expected, rel=1e-5) and abs(expected - plain) > 1e-3


@pytest.mark.parametrize("loss", [{"negatives": "mixed", "num_negatives": 12}, {"kind": "full_softmax"}])
def test_sampled_and_full_softmax_columns_of_a_pairs_window_are_masked(loss, monkeypatch):
    clicks = _clicks(seed=3)
    model, stats = _model(clicks, remove_sequence_items=True,
                          loss=LossConfig(log_q_source="static", **loss))
    captured = {}
    monkeypatch.setattr(model.objective, "compute", lambda inputs: captured.setdefault("inputs", inputs) and 0.0)
    source = SequenceClicks(_histories(clicks, stats), "history", LENGTH, batch_size=8, seed=0)
    batch = next(iter(source.epoch(0)))
    model.compute_loss(batch, training=True)
    inputs = captured["inputs"]
    _, labels, kept = (x.numpy() for x in model.objective.candidate_columns(inputs))
    positives = inputs.positive_ids.numpy()
    head = positives if inputs.includes_batch_positives else positives[:, None]
    columns = np.concatenate([np.broadcast_to(head, (len(positives), head.shape[-1] if head.ndim == 1 else 1)),
                              *(np.broadcast_to(n.ids.numpy(), (len(positives), n.ids.shape[-1]))
                                for n in inputs.negatives)], axis=1)
    targets, histories = batch["item_id"].numpy().astype(str), batch["history"].numpy().astype(str)
    trained = targets != ""
    sequence_of_pair = np.broadcast_to(np.arange(len(targets))[:, None], targets.shape)[trained]
    window_ids = [set(model.item_index(tf.constant([*histories[s], *targets[s]])).numpy()) - {0}
                  for s in range(len(targets))]
    owned = np.array([[c in window_ids[s] for c in row] for s, row in zip(sequence_of_pair, columns, strict=True)])
    assert owned[labels == 0].any()  # the window's items do come up among the negatives
    assert not (kept & owned & (labels == 0)).any() and kept[labels == 1].all()
    assert kept[(labels == 0) & ~owned & (columns > 0)].all()  # and nothing else is


def test_own_item_hits_are_membership_in_each_rows_group():
    rng = np.random.default_rng(0)
    group_items = rng.integers(-1, 30, size=(4, 6))  # -1: padding
    group = rng.integers(0, 4, size=10)
    own = OwnItems(tf.constant(group_items, tf.int64), tf.constant(group, tf.int32))
    shared, per_row = rng.integers(0, 30, size=25), rng.integers(0, 30, size=(10, 7))
    members = [set(row[row >= 0]) for row in group_items]
    assert (own_item_hits(own, tf.constant(shared)).numpy()
            == np.array([[c in members[g] for c in shared] for g in group])).all()
    assert (own_item_hits(own, tf.constant(per_row)).numpy()
            == np.array([[c in members[g] for c in per_row[i]] for i, g in enumerate(group)])).all()


def test_sequence_files_read_in_order_with_positions_as_time(tmp_path):
    path = tmp_path / "sequences.txt"
    path.write_text("1 5 3 9\n\n2 7\n3  4 4 \n")
    clicks = read_clicks(TableConfig(path=str(path), format="sequences"), load_config(None, []).data.columns)
    assert clicks["user_id"].tolist() == ["1", "1", "1", "2", "3", "3"]
    assert clicks["item_id"].tolist() == ["5", "3", "9", "7", "4", "4"]
    assert clicks["timestamp"].tolist() == [0, 1, 2, 0, 0, 1]
    path.write_text("1 5 3\n1 4\n")
    with pytest.raises(DataError, match=r"line 2.*user '1' already has a line \(line 1\); the sequences format"):
        read_clicks(TableConfig(path=str(path), format="sequences"), load_config(None, []).data.columns)
    path.write_text("1,5,3\n")
    with pytest.raises(DataError, match="line 1.*sequences ids are separated by whitespace"):
        read_clicks(TableConfig(path=str(path), format="sequences"), load_config(None, []).data.columns)


def test_sequence_training_needs_a_transformer_history_alone():
    base = ["train.examples=sequences", "towers.doc.features=[{name: item_id, kind: id}]"]
    with pytest.raises(ConfigError, match="needs towers.query.history with pooling: transformer"):
        load_config(None, [*base, "towers.query.features=[]", "towers.query.history={pooling: mean}"])
    with pytest.raises(ConfigError, match=r"not yet supported with train.examples: sequences: query features.*age"):
        load_config(None, [*base, "towers.query.features=[{name: age, kind: numeric}]",
                           "towers.query.history={pooling: transformer}"])
    with pytest.raises(ConfigError, match="model.remove_sequence_items masks the items of a pair's sequence window"):
        load_config(None, ["model.remove_sequence_items=true"])
    with pytest.raises(ConfigError, match="set model.remove_accidental_hits=true"):
        load_config(None, [*base, "towers.query.features=[]", "towers.query.history={pooling: transformer}",
                           "model.remove_sequence_items=true", "model.remove_accidental_hits=false"])
    load_config(None, [*base, "towers.query.features=[{name: user_id, kind: id}]",
                       "towers.query.history={pooling: transformer}"])


@pytest.mark.slow
def test_a_sequence_job_exports_a_bundle_that_serves_a_history(tmp_path):
    """The job on an ordered log (leave-one-out, early stopping on each user's last training
    item): its bundle reproduces the trained tower's probe at load and serves a raw history,
    the history's own items excluded."""
    from retrieval.jobs import train_evaluate_export
    from retrieval.serving import Bundle

    clicks = _clicks(seed=4, users=80, items=40)
    lines = [" ".join([user, *group.sort_values("timestamp")["item_id"]]) for user, group in clicks.groupby("user_id")]
    path = tmp_path / "sequences.txt"
    path.write_text("\n".join(lines) + "\n")
    config = load_config(None, [
        "data.source=files", f"data.clicks.path={path}", "data.clicks.format=sequences",
        "split.kind=leave_last_k", "split.k=1", "towers.query.features=[]",
        f"towers.query.history={{length: {LENGTH}, pooling: transformer}}",
        "towers.doc.features=[{name: item_id, kind: id}]", "model.embedding_dim=8",
        "train.examples=sequences", "train.epochs=2", "train.batch_size=16", "train.validation_fraction=0.1",
        "train.refit=false", "train.verbose=0", "evaluation.baselines.rankers=[popularity]", "evaluation.plots=false",
        f"run.output_dir={tmp_path / 'runs'}", "run.name=seq",
    ])
    result = train_evaluate_export(config)
    several = int((clicks.groupby("user_id").size() > 1).sum())  # a user's only click stays in training
    assert result.metrics["data"]["test_clicks"] == several
    log = pd.read_csv(result.directory / "train_log.csv")
    assert len(log) == 2 and log["val_recall@20"].between(0, 1).all()  # early stopping watched both epochs
    bundle = Bundle.load(result.directory)  # reruns the probe: the SavedModel is the trained tower
    history = ["i3", "i7", "i1"]
    served = bundle.recommend({"history": history}, k=10)
    assert len(served.item_ids) == 10 and not set(history) & set(served.item_ids) and served.fallback is None
    empty = bundle.recommend({"history": []}, k=5)  # nothing known to read: the popular items, said so
    assert empty.fallback == "popular" and empty.item_ids == bundle.manifest["popular_item_ids"][:5]
    # A user id alone reads the user's stored training clicks: its line of the file but the held-out
    # last item, stored newest first, so the line's own order (oldest first) says history_order.
    for line in lines[:10]:
        user, *items = line.split()
        if len(items) < 2:
            continue
        assert bundle.recent_items(user) == items[:-1][::-1]
        alone = bundle.recommend({"user_id": user}, k=10)
        pasted = bundle.recommend({"user_id": user, "history": items[:-1]}, k=10, history_order="oldest_first")
        assert alone.item_ids == pasted.item_ids and alone.fallback is None
        np.testing.assert_allclose(alone.scores, pasted.scores, rtol=1e-6, atol=1e-7)
    stranger = bundle.recommend({"user_id": "nobody"}, k=5)
    assert stranger.fallback == "popular" and stranger.item_ids == bundle.manifest["popular_item_ids"][:5]


def test_parquet_sequences_are_lists_in_time_order(tmp_path):
    columns = load_config(None, []).data.columns
    path = tmp_path / "sequences.parquet"
    pd.DataFrame({"user_id": ["a", "b", "c"], "item_id": [["5", "3"], [], [" 7 ", "9", "5"]]}).to_parquet(path)
    clicks = read_clicks(TableConfig(path=str(path), format="sequences"), columns)
    assert clicks["user_id"].tolist() == ["a", "a", "c", "c", "c"]
    assert clicks["item_id"].tolist() == ["5", "3", "7", "9", "5"]
    assert clicks["timestamp"].tolist() == [0, 1, 0, 1, 2]
    pd.DataFrame({"user_id": ["a", "b"], "item_id": ["5 3", "7"]}).to_parquet(path)
    with pytest.raises(DataError, match=r"row 1, column 'item_id': a sequence is a list of item ids, got str"):
        read_clicks(TableConfig(path=str(path), format="sequences"), columns)
    pd.DataFrame({"user_id": ["a", "a"], "item_id": [["5"], ["7"]]}).to_parquet(path)
    with pytest.raises(DataError, match=r"row 2, column 'user_id': user 'a' already has a row"):
        read_clicks(TableConfig(path=str(path), format="sequences"), columns)
    pd.DataFrame({"user_id": ["a"], "item_id": [["5", ""]]}).to_parquet(path)
    with pytest.raises(DataError, match=r"row 1, column 'item_id': empty item id"):
        read_clicks(TableConfig(path=str(path), format="sequences"), columns)
