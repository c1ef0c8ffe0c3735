"""Out of core: click shards streamed through tf.data give what the in-memory path gives.

The reference is always the in-memory path on the same clicks read by the pandas
loader: ``read_clicks`` -> ``split_clicks`` -> ``FeatureStatistics.from_training_clicks``.
"""

from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

import retrieval  # noqa: F401
from retrieval.bundle.seen_items import SEEN_ITEMS_DIR, SeenItems
from retrieval.config import ColumnsConfig, ConfigError, SplitConfig, SyntheticConfig, TableConfig, load_config
from retrieval.data import (
    DataError,
    apply_duplicates,
    generate_clicks,
    hold_out_items,
    read_clicks,
    split_clicks,
    temporal_cut,
)
from retrieval.data.splits import training_split
from retrieval.data.stream_splits import split_validation
from retrieval.data.streaming import (
    ClickShards,
    collect_users,
    plan_hold_out,
    plan_split,
    plan_validation,
    random_test_mask,
    scan_counts,
    train_batches,
)
from retrieval.features import FeatureStatistics
from retrieval.index import ITEM_IDS_FILE
from retrieval.training import StreamedClicks, validation_split

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ColumnsConfig(user="user_id", item="item_id", timestamp="timestamp", weight="weight")
TEMPORAL = SplitConfig(kind="temporal", test_fraction=0.2)


def _log(seed: int, n_users: int = 300, n_items: int = 200) -> pd.DataFrame:
    clicks, _, _ = generate_clicks(
        SyntheticConfig(n_users=n_users, n_items=n_items, mean_clicks_per_user=15, seed=seed)
    )
    # Shuffled rows (shards are not in time order) and weights that are not all 1.
    clicks = clicks.sample(frac=1.0, random_state=seed).reset_index(drop=True)
    clicks["weight"] = np.random.default_rng(seed).choice([1.0, 2.0, 0.5], len(clicks)).astype(np.float32)
    return clicks


def _write(clicks: pd.DataFrame, folder: Path, fmt: str, shards: int = 3) -> Path:
    """The log as ``shards`` files in ``folder`` plus the whole log as one file beside it."""
    folder.mkdir(parents=True)
    for i, part in enumerate(np.array_split(np.arange(len(clicks)), shards)):
        rows = clicks.iloc[part]
        if fmt == "parquet":
            rows.to_parquet(folder / f"part-{i}.parquet", index=False)
        else:
            rows.to_csv(folder / f"part-{i}.csv", index=False)
    whole = folder.parent / f"{folder.name}-whole.{fmt}"
    clicks.to_parquet(whole, index=False) if fmt == "parquet" else clicks.to_csv(whole, index=False)
    return whole


@pytest.fixture(scope="module", params=["parquet", "csv"])
def logs(request, tmp_path_factory):
    """(shards, the in-memory clicks read by the pandas loader from the same data as one file)."""
    fmt = request.param
    folder = tmp_path_factory.mktemp(fmt) / "shards"
    whole = _write(_log(seed=3), folder, fmt)
    # A glob for parquet, a directory for CSV: both ways of naming shards.
    path = f"{folder}/*.parquet" if fmt == "parquet" else str(folder)
    shards = ClickShards.open(TableConfig(path=path), COLUMNS, read_batch_size=500)
    assert len(shards.files) == 3 and shards.format == fmt
    return shards, read_clicks(TableConfig(path=str(whole)), COLUMNS)


def test_streamed_statistics_equal_the_in_memory_ones(logs):
    shards, clicks = logs
    plan = plan_split(shards, TEMPORAL)
    assert plan.cut == temporal_cut(clicks, TEMPORAL.test_fraction)
    assert plan.rows == len(clicks)
    assert plan.time_range == (clicks["timestamp"].min(), clicks["timestamp"].max())
    counts = scan_counts(shards, plan)
    train, test = split_clicks(clicks, TEMPORAL)
    assert (counts.train_rows, counts.test_rows) == (len(train), len(test))
    streamed = FeatureStatistics.from_counts(counts.user_ids, counts.item_ids, counts.item_counts, counts.has_weights)
    reference = FeatureStatistics.from_training_clicks(train)
    assert streamed.users == reference.users
    assert streamed.items == reference.items
    np.testing.assert_array_equal(streamed.item_popularity.counts, reference.item_popularity.counts)
    assert streamed.has_weights and reference.has_weights
    assert sorted(counts.test_user_ids) == sorted(test["user_id"].unique())
    # The catalogue holds every logged item, train and test.
    assert set(counts.catalogue()) == set(clicks["item_id"])


def test_streamed_split_holds_the_rows_of_the_in_memory_split(logs):
    shards, clicks = logs
    plan = plan_split(shards, TEMPORAL)
    users = sorted(clicks["user_id"].unique())
    train, test = collect_users(shards, plan, users)
    ref_train, ref_test = split_clicks(clicks, TEMPORAL)
    # Shards are read in file order, which is the log's order: same rows, same order.
    pd.testing.assert_frame_equal(train, ref_train)
    pd.testing.assert_frame_equal(test, ref_test)
    # A subset of users gets exactly their rows.
    some = users[::7]
    sub_train, sub_test = collect_users(shards, plan, some)
    pd.testing.assert_frame_equal(sub_train, ref_train[ref_train["user_id"].isin(some)].reset_index(drop=True))
    pd.testing.assert_frame_equal(sub_test, ref_test[ref_test["user_id"].isin(some)].reset_index(drop=True))


def _multiset(users, items, weights) -> Counter:
    return Counter(zip(map(str, users), map(str, items), np.asarray(weights, np.float32).tolist()))


def test_tf_data_yields_every_training_click_once_per_epoch(logs):
    shards, clicks = logs
    plan = plan_split(shards, TEMPORAL)
    ref_train, _ = split_clicks(clicks, TEMPORAL)
    expected = _multiset(ref_train["user_id"], ref_train["item_id"], ref_train["weight"])
    source = StreamedClicks(shards, plan, 64, shuffle_buffer=700, seed=5, train_rows=len(ref_train))
    assert source.steps_per_epoch == -(-len(ref_train) // 64)
    orders = []
    for epoch in range(2):  # two epochs: each complete, in a different order
        users, items, weights, sizes = [], [], [], []
        for batch in source.epoch(epoch):
            users += [u.decode() for u in batch["user_id"].numpy()]
            items += [i.decode() for i in batch["item_id"].numpy()]
            weights += batch["weight"].numpy().tolist()
            sizes.append(len(batch["user_id"]))
            assert batch["weight"].dtype == tf.float32
        assert _multiset(users, items, weights) == expected
        assert all(size == 64 for size in sizes[:-1]) and 0 < sizes[-1] <= 64
        orders.append(list(zip(users, items)))
    assert orders[0] != orders[1]
    # Seeded: the same seed and epoch repeat the same batches.
    first = [b["user_id"].tolist() for b in train_batches(shards, plan, 64, shuffle_buffer=700, seed=5)]
    again = [b["user_id"].tolist() for b in train_batches(shards, plan, 64, shuffle_buffer=700, seed=5)]
    assert first == again


def test_random_split_is_a_seeded_partition(logs):
    shards, clicks = logs
    split = SplitConfig(kind="random", test_fraction=0.25, seed=1)
    plan = plan_split(shards, split)
    counts = scan_counts(shards, plan)
    assert counts.train_rows + counts.test_rows == len(clicks)
    # Binomial(n, 0.25): 5 standard deviations.
    assert abs(counts.test_rows - 0.25 * len(clicks)) < 5 * np.sqrt(len(clicks) * 0.25 * 0.75)
    train, test = collect_users(shards, plan, sorted(clicks["user_id"].unique()))
    streamed = Counter()
    for batch in train_batches(shards, plan, 100, shuffle_buffer=300, seed=0):
        streamed += _multiset(batch["user_id"], batch["item_id"], batch["weight"])
    assert streamed == _multiset(train["user_id"], train["item_id"], train["weight"])
    assert streamed + _multiset(test["user_id"], test["item_id"], test["weight"]) == _multiset(
        clicks["user_id"], clicks["item_id"], clicks["weight"]
    )
    # The side of a click depends on the click and the seed, not on the batch it is read in.
    batch = next(shards.scan())
    whole = random_test_mask(batch, 0.25, 1)
    halves = np.concatenate([random_test_mask(batch.take(m), 0.25, 1) for m in (np.arange(len(batch)) < 100,
                                                                               np.arange(len(batch)) >= 100)])
    np.testing.assert_array_equal(whole, halves)
    assert not np.array_equal(whole, random_test_mask(batch, 0.25, 2))


# --- Bad inputs: errors name the file. ---


def test_no_shards(tmp_path):
    with pytest.raises(DataError, match=r"no files match the pattern"):
        ClickShards.open(TableConfig(path=str(tmp_path / "*.parquet")), COLUMNS)
    with pytest.raises(DataError, match=r"holds no \.parquet/\.csv/\.tsv shards"):
        ClickShards.open(TableConfig(path=str(tmp_path)), COLUMNS)


def test_a_shard_missing_a_column_is_named(tmp_path):
    clicks = _log(seed=1, n_users=20, n_items=10)
    folder = tmp_path / "logs"
    _write(clicks, folder, "parquet")
    clicks.drop(columns=["timestamp"]).to_parquet(folder / "part-9.parquet", index=False)
    with pytest.raises(DataError, match=r"part-9\.parquet.*missing column 'timestamp'"):
        ClickShards.open(TableConfig(path=str(folder)), COLUMNS)
    csv = tmp_path / "csv"
    _write(clicks, csv, "csv")
    clicks.drop(columns=["item_id"]).to_csv(csv / "part-1.csv", index=False)
    with pytest.raises(DataError, match=r"part-1\.csv.*missing column 'item_id'"):
        ClickShards.open(TableConfig(path=str(csv)), COLUMNS)


def test_mixed_formats_are_refused(tmp_path):
    clicks = _log(seed=1, n_users=20, n_items=10)
    folder = tmp_path / "logs"
    _write(clicks, folder, "parquet")
    clicks.to_csv(folder / "extra.csv", index=False)
    with pytest.raises(DataError, match=r"mix formats: .*csv \(.*extra\.csv\).*parquet \(.*part-0\.parquet\)"):
        ClickShards.open(TableConfig(path=str(folder)), COLUMNS)


def test_a_bad_value_names_file_and_row(tmp_path):
    clicks = _log(seed=1, n_users=20, n_items=10)
    folder = tmp_path / "logs"
    _write(clicks, folder, "csv")
    bad = clicks.iloc[:5].copy()
    bad["weight"] = bad["weight"].astype(object)
    bad.loc[3, "weight"] = -1.0
    bad.to_csv(folder / "part-1.csv", index=False)
    shards = ClickShards.open(TableConfig(path=str(folder)), COLUMNS)
    with pytest.raises(DataError, match=r"part-1\.csv, line 5, column 'weight': negative weight"):
        list(shards.scan())


def _rows(frame: pd.DataFrame) -> Counter:
    return Counter(zip(frame["user_id"].astype(str), frame["item_id"].astype(str), frame["timestamp"]))


def test_streamed_validation_part_is_the_in_memory_one(logs):
    """Early stopping's validation part carved from the shards holds the rows ``validation_split``
    holds out in memory (the latest 10 % of training clicks), and the fit part streams the rest."""
    shards, clicks = logs
    plan = plan_split(shards, TEMPORAL)
    train, _ = split_clicks(clicks, TEMPORAL)
    fit_part, validation = validation_split(train, 0.1, TEMPORAL)
    carved = plan_validation(shards, plan, 0.1, TEMPORAL)
    counts = scan_counts(shards, carved)
    assert (counts.train_rows, counts.test_rows) == (len(fit_part), len(validation))
    users = np.sort(counts.test_user_ids)
    streamed_fit, streamed_validation = collect_users(shards, carved, users)
    assert _rows(streamed_validation) == _rows(validation)
    assert _rows(streamed_fit) == _rows(fit_part[fit_part["user_id"].isin(users)])
    source = StreamedClicks(shards, carved, 64, shuffle_buffer=500, seed=1, train_rows=counts.train_rows)
    streamed = Counter()
    for batch in source.epoch(0):
        streamed.update(zip(batch["user_id"].numpy().astype(str), batch["item_id"].numpy().astype(str)))
    assert streamed == Counter(zip(fit_part["user_id"].astype(str), fit_part["item_id"].astype(str)))


def test_random_split_holds_out_the_rows_the_in_memory_split_holds_out(logs):
    """One split per kind: a random split keeps a click on the same side whichever source reads it."""
    shards, clicks = logs
    split = SplitConfig(kind="random", test_fraction=0.25, seed=7)
    train, test = split_clicks(clicks, split)
    streamed_train, streamed_test = collect_users(shards, plan_split(shards, split), clicks["user_id"].unique())
    assert _rows(streamed_test) == _rows(test) and _rows(streamed_train) == _rows(train)


def test_early_stopping_nested_in_a_random_validation_split_takes_its_share_in_both_sources(logs):
    """A random split, evaluated on its validation part, with early stopping: three nested hashes.

    With the evaluated split's key reused, the early-stopping carve would take the clicks whose hash
    falls between the two fractions (none here: the same fraction); each level keys one deeper, so
    each takes its own share, and the streamed carve holds out the same rows as the in-memory one,
    timestamps or not (a random split is carved at random, not at a time quantile).
    """
    shards, clicks = logs
    split = SplitConfig(kind="random", test_fraction=0.2, seed=5, evaluate_on="validation")
    train, _ = split_clicks(clicks, split)
    inner_train, _ = split_validation(train, split)
    fit_part, validation = validation_split(inner_train, 0.2, training_split(split))
    assert len(validation) == pytest.approx(0.2 * len(inner_train), rel=0.2)

    evaluated = plan_validation(shards, plan_split(shards, split), split.test_fraction, split)
    carved = plan_validation(shards, evaluated, 0.2, training_split(split))
    users = clicks["user_id"].unique()
    streamed_fit, streamed_validation = collect_users(shards, carved, users)
    assert _rows(streamed_validation) == _rows(validation) and _rows(streamed_fit) == _rows(fit_part)


def test_streamed_validation_without_timestamps_is_a_seeded_hash(tmp_path):
    clicks = _log(seed=4).drop(columns=["timestamp"])
    folder = tmp_path / "shards"
    _write(clicks, folder, "parquet")
    columns = ColumnsConfig(user="user_id", item="item_id", timestamp=None, weight="weight")
    shards = ClickShards.open(TableConfig(path=str(folder)), columns)
    split = SplitConfig(kind="random", test_fraction=0.2, seed=3)
    plan = plan_split(shards, split)
    carved = plan_validation(shards, plan, 0.25, split)
    counts = scan_counts(shards, carved)
    train_rows = scan_counts(shards, plan).train_rows
    assert counts.train_rows + counts.test_rows == train_rows
    assert counts.test_rows == pytest.approx(0.25 * train_rows, rel=0.15)
    assert scan_counts(shards, plan_validation(shards, plan, 0.25, split)).test_rows == counts.test_rows


@pytest.fixture(scope="module", params=["parquet", "csv"])
def tied_logs(request, tmp_path_factory):
    """``logs`` with what the click-level plans must get right: timestamps in whole days (each user's
    last clicks tie, so row order decides) and repeated (user, item) pairs, some at the same time."""
    fmt = request.param
    clicks = _log(seed=6)
    clicks["timestamp"] = clicks["timestamp"] // 86_400 * 86_400
    again = clicks.sample(600, random_state=1)
    again.loc[again.index[:300], "timestamp"] += 86_400 * 3  # re-clicks later, and repeats of the same click
    clicks = pd.concat([clicks, again]).sample(frac=1.0, random_state=2).reset_index(drop=True)
    folder = tmp_path_factory.mktemp(f"tied-{fmt}") / "shards"
    whole = _write(clicks, folder, fmt)
    shards = ClickShards.open(TableConfig(path=str(folder)), COLUMNS, read_batch_size=300)
    return shards, read_clicks(TableConfig(path=str(whole)), COLUMNS)


def _same_rows(shards, plan, train: pd.DataFrame, test: pd.DataFrame) -> None:
    """The plan's two sides are ``train`` and ``test`` row for row (shards read in log order)."""
    users = sorted(set(train["user_id"]) | set(test["user_id"]))
    streamed_train, streamed_test = collect_users(shards, plan, users)
    pd.testing.assert_frame_equal(streamed_train, train)
    pd.testing.assert_frame_equal(streamed_test, test)


@pytest.mark.parametrize("k", [1, 3])
def test_leave_last_k_holds_out_the_rows_the_in_memory_split_holds_out(tied_logs, k):
    """Each user's last k clicks, ties at a user's threshold broken by log order as in memory, and
    early stopping's carve (each user's last k training clicks) likewise."""
    shards, clicks = tied_logs
    split = SplitConfig(kind="leave_last_k", k=k)
    train, test = split_clicks(clicks, split)
    last = clicks.groupby("user_id")["timestamp"].transform("max")
    assert (clicks["timestamp"] == last).groupby(clicks["user_id"]).sum().max() > k  # ties decided by row order
    plan = plan_split(shards, split)
    assert plan.rows == len(clicks)
    _same_rows(shards, plan, train, test)
    counts = scan_counts(shards, plan)
    assert (counts.train_rows, counts.test_rows) == (len(train), len(test))
    fit_part, validation = validation_split(train, 0.1, split)
    _same_rows(shards, plan_validation(shards, plan, 0.1, split), fit_part, validation)
    # Tuning's nested split: the training part split again by the same rule.
    inner, held = split_validation(train, split)
    _same_rows(shards, plan_validation(shards, plan, split.test_fraction, split), inner, held)


@pytest.mark.parametrize("kind", ["temporal", "leave_last_k", "random"])
def test_duplicates_first_keeps_the_rows_the_in_memory_loader_keeps(tied_logs, kind):
    """``data.duplicates: first`` streamed keeps each pair's earliest click (ties by log order) and
    splits what it keeps: the same rows on each side as ``apply_duplicates`` then ``split_clicks``."""
    shards, clicks = tied_logs
    kept = apply_duplicates(clicks, "first")
    assert len(kept) < len(clicks) - 300  # repeated pairs: more than the re-clicks were dropped
    split = SplitConfig(kind=kind, test_fraction=0.2, seed=4)
    train, test = split_clicks(kept, split)
    plan = plan_split(shards, split, "first")
    assert plan.rows == len(kept)
    _same_rows(shards, plan, train, test)
    assert scan_counts(shards, plan).train_rows == len(train)
    fit_part, validation = validation_split(train, 0.1, split)
    _same_rows(shards, plan_validation(shards, plan, 0.1, split), fit_part, validation)


@pytest.mark.parametrize("kind", ["temporal", "leave_last_k", "random"])
def test_held_out_items_are_the_in_memory_draw(tied_logs, kind):
    """``split.hold_out_items``: the same items drawn from the same seed, their training clicks dropped,
    their test clicks kept, and early stopping carved from what is left, as in memory."""
    shards, clicks = tied_logs
    split = SplitConfig(kind=kind, test_fraction=0.2, seed=9, hold_out_items=0.15)
    train, test = split_clicks(clicks, split)
    kept, held = hold_out_items(train, test, split.hold_out_items, split.seed)
    plan = plan_hold_out(shards, plan_split(shards, split), split.hold_out_items, split.seed)
    assert plan.items == held and len(held) == round(0.15 * clicks["item_id"].nunique())
    assert test["item_id"].isin(held).any()  # cold items keep their test clicks
    _same_rows(shards, plan, kept, test)
    counts = scan_counts(shards, plan)
    assert not set(counts.item_ids) & set(held)
    fit_part, validation = validation_split(kept, 0.1, split)
    _same_rows(shards, plan_validation(shards, plan, 0.1, split), fit_part, validation)
    # Another seed draws other items.
    assert plan_hold_out(shards, plan_split(shards, split), 0.15, 10).items != held


def test_held_out_items_are_drawn_from_a_given_test_log_too(tied_logs):
    """split.kind: none: the draw lists the given test log's items beside the shards' (as in memory)."""
    shards, clicks = tied_logs
    extra = pd.DataFrame({"user_id": ["u-new"], "item_id": ["only-in-the-test-log"]})
    _, held = hold_out_items(clicks, extra, 0.3, 2)
    plan = plan_hold_out(shards, plan_split(shards, SplitConfig(kind="none")), 0.3, 2, extra["item_id"])
    assert plan.items == held


def test_click_level_plans_refuse_what_they_cannot_plan(tmp_path, tied_logs):
    shards, clicks = tied_logs
    with pytest.raises(DataError, match=r"leave_last_k split left the test part empty: no user has more than "
                                        r"split.k=1000 clicks"):
        plan_split(shards, SplitConfig(kind="leave_last_k", k=1000))
    plan = plan_split(shards, SplitConfig(kind="leave_last_k", k=1))
    counts = clicks.groupby("user_id").size()
    k = int(counts.max()) - 1  # the outer split leaves no user more than k training clicks
    with pytest.raises(DataError, match=rf"validation part .*split.k={k}.* is empty"):
        plan_validation(shards, plan_split(shards, SplitConfig(kind="leave_last_k", k=k)), 0.1,
                        SplitConfig(kind="leave_last_k", k=k))
    one_item = clicks.assign(item_id="the-only-item")
    folder = tmp_path / "one-item"
    _write(one_item, folder, "parquet", shards=2)
    single = ClickShards.open(TableConfig(path=str(folder)), COLUMNS)
    with pytest.raises(DataError, match=r"split.hold_out_items=0.6 holds out every item with training clicks"):
        plan_hold_out(single, plan_split(single, SplitConfig(kind="random")), 0.6, 0)
    assert len(plan_hold_out(shards, plan, 0.2, 0).items) > 0
    untimed = ClickShards.open(TableConfig(path=str(folder)), COLUMNS.model_copy(update={"timestamp": None}))
    with pytest.raises(DataError, match=r"split.kind 'leave_last_k' needs timestamps"):
        plan_split(untimed, SplitConfig(kind="leave_last_k"))
    # Without timestamps a pair's first click is its first in log order.
    untimed_kept = apply_duplicates(one_item.drop(columns=["timestamp"]), "first")
    assert len(untimed_kept) == one_item["user_id"].nunique()
    split = SplitConfig(kind="random", test_fraction=0.5)
    _same_rows(untimed, plan_split(untimed, split, "first"), *split_clicks(untimed_kept, split))


def test_every_setting_of_the_job_loads_out_of_core():
    base = ["data.source=files", "data.clicks.path=x/*.parquet", "data.out_of_core=true",
            "evaluation.baselines.rankers=[popularity]"]
    load_config(None, base)  # supported
    load_config(None, base + ["data.item_features.path=items.csv", "data.user_features.path=users.csv",
                              *FEATURE_TOWERS])  # feature towers and tables too
    # Click-level plans: one split per kind, duplicates and held-out items, as in memory.
    load_config(None, base + ["split.kind=leave_last_k", "split.k=2", "data.duplicates=first",
                              "split.hold_out_items=0.1"])
    load_config(None, base + ["model.loss.hard_negatives=mined"])  # each user's items coded from the shards
    load_config(None, base + ["towers.query.history={length: 5}"])  # looked up in the coded training clicks
    with pytest.raises(ConfigError, match="data.out_of_core needs data.source: files"):
        load_config(None, ["data.out_of_core=true"])


# --- The optimiser for large tables. ---


def _adam_rows(var, m, v, grad, step, lr=0.1, b1=0.9, b2=0.999, eps=1e-7):
    m = b1 * m + (1 - b1) * grad
    v = b2 * v + (1 - b2) * grad**2
    alpha = lr * np.sqrt(1 - b2**step) / (1 - b1**step)
    return var - alpha * m / (np.sqrt(v) + eps), m, v


def test_lazy_adam_updates_only_the_touched_rows_as_adam_would():
    from retrieval.training import LazyAdam

    rng = np.random.default_rng(0)
    start = rng.normal(size=(6, 3)).astype(np.float32)
    table = tf.Variable(start)
    optimizer = LazyAdam(learning_rate=0.1)
    var, m, v = start.astype(np.float64), np.zeros((6, 3)), np.zeros((6, 3))
    for step, rows in enumerate([[1, 4], [4, 4, 0]], start=1):  # a repeated row: gradients add up
        values = rng.normal(size=(len(rows), 3)).astype(np.float32)
        optimizer.apply_gradients([(tf.IndexedSlices(tf.constant(values), tf.constant(rows), tf.constant([6, 3])),
                                    table)])
        grad = np.zeros((6, 3))
        np.add.at(grad, rows, values)
        touched = sorted(set(rows))
        var[touched], m[touched], v[touched] = _adam_rows(var[touched], m[touched], v[touched], grad[touched], step)
    np.testing.assert_allclose(table.numpy(), var, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(table.numpy()[[2, 3, 5]], start[[2, 3, 5]])  # never touched: unchanged



def test_rowwise_adagrad_keeps_one_accumulator_per_table_row_and_steps_as_numpy():
    from retrieval.training import RowWiseAdagrad

    rng = np.random.default_rng(1)
    start = rng.normal(size=(6, 4)).astype(np.float32)
    table = tf.Variable(start, name="embeddings")  # a table by name, as Keras Embedding names it
    bias = tf.Variable(np.zeros(4, np.float32), name="bias")
    lr, init = 0.1, 0.1
    optimizer = RowWiseAdagrad(learning_rate=lr, initial_accumulator_value=init)
    assert optimizer.weight_decay is None  # else tf-keras decays every row of every table each step
    optimizer.build([table, bias])
    assert [tuple(a.shape) for a in optimizer._accumulators] == [(6, 1), (4,)]  # rows x 1, elementwise
    var, row_acc = start.astype(np.float64), np.full((6, 1), init)
    b, b_acc = np.zeros(4), np.full(4, init)
    for rows in ([1, 4], [4, 4, 0]):  # a repeated row: its gradients add up first
        values = rng.normal(size=(len(rows), 4)).astype(np.float32)
        dense = rng.normal(size=4).astype(np.float32)
        optimizer.apply_gradients([
            (tf.IndexedSlices(tf.constant(values), tf.constant(rows), tf.constant([6, 4])), table),
            (tf.constant(dense), bias),
        ])
        grad = np.zeros((6, 4))
        np.add.at(grad, rows, values)
        touched = sorted(set(rows))
        row_acc[touched] += np.mean(grad[touched] ** 2, axis=1, keepdims=True)
        var[touched] -= lr * grad[touched] / (np.sqrt(row_acc[touched]) + 1e-7)
        b_acc += dense.astype(np.float64) ** 2
        b -= lr * dense / (np.sqrt(b_acc) + 1e-7)
    np.testing.assert_allclose(table.numpy(), var, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(table.numpy()[[2, 3, 5]], start[[2, 3, 5]])  # never touched: unchanged
    np.testing.assert_allclose(bias.numpy(), b, rtol=1e-5, atol=1e-6)

# --- The whole job, out of core against in memory. ---


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind",
    ["temporal", "random", "leave_last_k", "none", "temporal-validation", "random-validation",
     "leave_last_k-validation"],
)
def test_job_out_of_core_matches_the_in_memory_job(tmp_path, monkeypatch, kind):
    """The contract of the two click sources: the same job on the same clicks evaluates the same
    users on the same held-out clicks, for every split kind both read."""
    clicks, _, _ = generate_clicks(SyntheticConfig(n_users=500, n_items=300, mean_clicks_per_user=30, seed=0))
    _job_both_ways(tmp_path, monkeypatch, kind, clicks, [])  # asserts the contract


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "extra"),
    [
        ("temporal", ["data.duplicates=first"]),
        ("leave_last_k", ["split.hold_out_items=0.1"]),
        ("none", ["data.duplicates=first", "split.hold_out_items=0.1", "evaluation.unseen_items=keep"]),
    ],
)
def test_job_out_of_core_matches_the_in_memory_job_with_click_level_settings(tmp_path, monkeypatch, kind, extra):
    """The same contract with ``data.duplicates: first`` and ``split.hold_out_items``: the streamed
    plan keeps and holds out the clicks the in-memory frame does."""
    clicks, _, _ = generate_clicks(SyntheticConfig(n_users=500, n_items=300, mean_clicks_per_user=30, seed=0))
    assert clicks.duplicated(["user_id", "item_id"]).any()
    in_memory, streamed = _job_both_ways(tmp_path, monkeypatch, kind, clicks, extra)
    held = in_memory["data"]["held_out_items"]
    assert streamed["data"]["held_out_items"] == held and (held > 0) == ("split.hold_out_items=0.1" in extra)
    assert streamed["data"]["train_clicks"] == in_memory["data"]["train_clicks"]


@pytest.mark.slow
def test_job_with_mined_hard_negatives_out_of_core_matches_the_in_memory_job(tmp_path, monkeypatch):
    """The same contract with FAISS-mined hard negatives: the miner's per-user training items
    (excluded from each user's negatives) are coded from the shards, not read from a frame."""
    clicks, _, _ = generate_clicks(SyntheticConfig(n_users=500, n_items=300, mean_clicks_per_user=30, seed=0))
    mined = ["model.loss.hard_negatives=mined", "model.loss.num_hard_negatives=5", "model.loss.mining_refresh_steps=20"]
    _job_both_ways(tmp_path, monkeypatch, "temporal", clicks, mined)  # asserts the contract


# Feature towers on tables and click columns: a user table (categorical, numeric), an item table
# (categorical, text, numeric) and the click's own timestamp, as configs/synthetic_features.yaml.
FEATURE_TOWERS = [
    "towers.query.features=[{name: user_id, kind: id}, {name: country, kind: categorical, embedding_dim: 8},"
    " {name: age, kind: numeric}, {name: clicked, kind: timestamp, source: timestamp}]",
    "towers.doc.features=[{name: item_id, kind: id}, {name: category, kind: categorical, embedding_dim: 8},"
    " {name: title, kind: text, embedding_dim: 16, text: {buckets: 2000}}, {name: price, kind: numeric, log: true}]",
    "evaluation.unseen_users=keep",
]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["temporal-validation", "random"])
def test_job_with_feature_towers_out_of_core_matches_the_in_memory_job(tmp_path, monkeypatch, kind):
    """The same contract with feature towers: the tables are read whole and joined onto each
    streamed batch, the catalogue (every item of the item table, clicked or not) and the queries are
    embedded from them; some users and items are missing from the tables (missing features)."""
    clicks, items, users = generate_clicks(
        SyntheticConfig(n_users=500, n_items=300, mean_clicks_per_user=30, seed=0)
    )
    assert len(items) > clicks["item_id"].nunique()  # items without clicks are in the catalogue
    items_file, users_file = tmp_path / "items.parquet", tmp_path / "users.csv"
    items.iloc[5:].to_parquet(items_file, index=False)
    users.iloc[10:].to_csv(users_file, index=False)
    tables = [f"data.item_features.path={items_file}", f"data.user_features.path={users_file}", *FEATURE_TOWERS]
    in_memory, streamed = _job_both_ways(tmp_path, monkeypatch, kind, clicks, tables)
    assert in_memory["reference"]["catalogue_items"] == streamed["reference"]["catalogue_items"] == len(items)


@pytest.mark.slow
def test_job_with_a_click_history_out_of_core_matches_the_in_memory_job(tmp_path, monkeypatch):
    """The same contract with a query tower that pools each click's history: the streamed
    batches' histories are looked up in the coded training clicks (``ClickHistories``), as the
    in-memory examples take them from the whole training part."""
    clicks, _, _ = generate_clicks(SyntheticConfig(n_users=500, n_items=300, mean_clicks_per_user=30, seed=0))
    history = ["towers.query.features=[{name: user_id, kind: id}]",
               "towers.query.history={length: 5, pooling: attention}"]
    _job_both_ways(tmp_path, monkeypatch, "temporal", clicks, history)  # asserts the contract


def _job_both_ways(tmp_path, monkeypatch, kind: str, clicks: pd.DataFrame, extra: list[str]):
    """The job's metrics in memory and out of core on the same clicks (split ``kind``, with
    ``-validation``: ``split.evaluate_on: validation``), after the checks both must pass."""
    from retrieval import jobs

    folder = tmp_path / "shards"
    split = [f"split.kind={kind.split('-')[0]}"]
    if kind.endswith("-validation"):  # tuning's nested split: scored on a validation part of the training part
        split.append("split.evaluate_on=validation")
    if kind == "none":  # the log's later clicks as a given test file
        clicks, test = split_clicks(clicks, TEMPORAL)
        test_file = tmp_path / "test.parquet"
        test.to_parquet(test_file, index=False)
        split.append(f"data.test_clicks.path={test_file}")
    whole = _write(clicks, folder, "parquet")
    common = [
        "data.source=files",
        *split,
        "split.test_fraction=0.2",
        "train.epochs=6",
        "train.batch_size=256",
        "train.optimizer=lazy_adam",
        "train.verbose=0",
        "train.validation_fraction=0.1",  # early stopping + refit, checkpointed (the default), on both
        "model.loss.log_q_source=static",
        "evaluation.baselines.rankers=[popularity, als]",
        "evaluation.baselines.als.num_threads=1",
        "evaluation.plots=false",
        "export.topk_model=false",
        f"run.output_dir={tmp_path / 'runs'}",
        *extra,
    ]
    in_memory = jobs.train_evaluate_export(
        load_config(ROOT / "configs/default.yaml", common + [f"data.clicks.path={whole}", "run.name=mem"])
    ).metrics

    def refuse(*args, **kwargs):
        raise AssertionError("the out-of-core path must not load the log with pandas")

    refused = ["retrieval.data.dataset._read_source", "retrieval.data.dataset.ClickTable.from_frame"]
    tables = any("_features.path=" in setting for setting in extra)
    if kind != "none" and not tables:  # the (small) test file and feature tables are read whole, by pandas
        refused += ["retrieval.data.dataset.read_clicks", "retrieval.data.loaders.read_clicks",
                    "pandas.read_parquet", "pandas.read_csv"]
    for target in refused:
        monkeypatch.setattr(target, refuse)
    streamed = jobs.train_evaluate_export(
        load_config(
            ROOT / "configs/default.yaml",
            # A buffer that holds every training click (15k here): the stream yields FrameClicks'
            # batches, batch for batch (train.seed orders both).
            common + [f"data.clicks.path={folder}/*.parquet", "data.out_of_core=true",
                      "data.stream.max_test_users=null", "data.stream.shuffle_buffer=100000",
                      "run.name=ooc"],
        )
    ).metrics
    # Same evaluated users, relevant pairs and masks; popularity is deterministic, so exactly equal.
    assert streamed["counts"] == in_memory["counts"]
    assert streamed["popularity"] == pytest.approx(in_memory["popularity"])
    # ALS: the same click matrix (streamed pair codes vs the frame), the same seed.
    assert streamed["als"] == pytest.approx(in_memory["als"], abs=1e-6)
    assert streamed["reference"].pop("segment_users") == in_memory["reference"].pop("segment_users")
    assert streamed["reference"] == pytest.approx(in_memory["reference"])
    # The same batches from the same initial weights: the same model, up to float noise.
    assert streamed["final_train_loss"] == pytest.approx(in_memory["final_train_loss"], rel=1e-5)
    assert streamed["model"] == pytest.approx(in_memory["model"], rel=1e-5, abs=1e-6)
    assert streamed["model"]["recall@20"] > 1.2 * streamed["popularity"]["recall@20"]
    # The bundles exclude the same items from what they serve: each training user's training items.
    seen = [_seen_pairs(tmp_path / "runs" / run) for run in ("mem", "ooc")]
    assert len(seen[0]) > 0
    pd.testing.assert_frame_equal(seen[0], seen[1])
    # Both bundles reproduce their probe query (a training user's raw query) at load.
    monkeypatch.undo()  # the refusals above: loading reads item_ids.parquet with pandas
    from retrieval.serving import Bundle

    for name in ("mem", "ooc"):
        assert Bundle.load(tmp_path / "runs" / name).manifest["probe"]["item_ids"]
    return in_memory, streamed


def _seen_pairs(bundle: Path) -> pd.DataFrame:
    """A bundle's seen items as sorted (user id, item id) rows."""
    seen = SeenItems.load(bundle / SEEN_ITEMS_DIR)
    table = pq.read_table(bundle / ITEM_IDS_FILE)  # pyarrow: pandas' readers are refused here
    item_ids = np.empty(table.num_rows, dtype=object)
    item_ids[table.column("row").to_numpy()] = table.column("item_id").to_pylist()
    users = np.repeat(np.char.decode(np.asarray(seen.user_ids), "utf-8"), np.diff(seen.indptr))
    pairs = pd.DataFrame({"user_id": users, "item_id": item_ids[np.asarray(seen.item_rows)].astype(str)})
    return pairs.sort_values(["user_id", "item_id"], ignore_index=True)
