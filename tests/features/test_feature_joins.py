"""Feature-tower inputs joined onto streamed click batches (``ExampleJoin``), against the in-memory
units: ``training_examples`` for the values, ``TowerStatistics.fit`` for the statistics."""

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
from feature_fixtures import ALL_KINDS, small_tables

from retrieval.config import ColumnsConfig, SplitConfig, TableConfig, TowersConfig
from retrieval.data import DataError
from retrieval.data.streaming import ClickShards, plan_split, scan_counts, scan_train_column
from retrieval.features import (
    ExampleJoin,
    FeatureStatistics,
    NumericStatistics,
    TimestampStatistics,
    TowerStatistics,
    feature_arrays,
    training_examples,
)
from retrieval.features.histories import ClickHistories
from retrieval.training import StreamedClicks

# Every feature kind of ALL_KINDS but the history, plus features of the click's own columns, one
# with a min_count (weighted counting) and one of a user's categorical repeated by click.
_raw = ALL_KINDS.model_dump()
_raw["query"]["history"] = None
_raw["query"]["features"] = [
    *_raw["query"]["features"],
    {"name": "clicked", "kind": "timestamp", "source": "timestamp"},
    {"name": "rare_zip", "kind": "categorical", "source": "zip", "min_count": 9},
]
_raw["doc"]["features"] = [*_raw["doc"]["features"], {"name": "rating", "kind": "numeric", "source": "weight"}]
TOWERS = TowersConfig.model_validate(_raw)


def _clicks(seed: int) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    clicks, users, items = small_tables(seed, n_clicks=80)
    clicks.loc[::9, "user_id"] = "u_unlisted"  # a user missing from the user table
    clicks["weight"] = np.random.default_rng(seed).choice([1.0, 3.0], len(clicks)).astype(np.float32)
    return clicks, users, items.iloc[1:]  # i0 is clicked but missing from the item table


def _batch(clicks: pd.DataFrame) -> dict[str, np.ndarray]:
    return {
        "user_id": clicks["user_id"].to_numpy(dtype=object),
        "item_id": clicks["item_id"].to_numpy(dtype=object),
        "timestamp": clicks["timestamp"].to_numpy(np.int64),
        "weight": clicks["weight"].to_numpy(np.float32),
    }


def _same(actual: np.ndarray, expected: np.ndarray) -> bool:
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return False
    if actual.dtype.kind == "f":
        return bool(np.array_equal(actual, expected, equal_nan=True))
    return actual.tolist() == expected.tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_joined_batch_holds_the_training_examples_of_its_clicks(seed):
    clicks, users, items = _clicks(seed)
    join = ExampleJoin(TOWERS, users, items, has_time=True)
    assert join.needs_time and join.scanned_columns == ["timestamp", "weight"]
    rows = clicks.sample(frac=0.5, random_state=seed).reset_index(drop=True)  # any batch, any order
    joined = join.batch(_batch(rows))
    expected = feature_arrays(training_examples(rows, users, items, TOWERS))
    for name, spec in join.specs.items():
        assert _same(joined[name], expected[name]), name
        assert list(joined[name].shape[1:]) == spec.shape[1:], name
    # Users and items missing from their tables join the missing values, as a pandas merge gives them.
    unlisted = rows["user_id"].to_numpy() == "u_unlisted"
    assert unlisted.any() and set(joined["country"][unlisted]) == {""} and np.isnan(joined["age"][unlisted]).all()
    missing_item = rows["item_id"].to_numpy() == "i0"
    assert np.isnan(joined["price"][missing_item]).all() and set(joined["title"][missing_item]) == {""}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_statistics_from_per_id_counts_are_those_of_the_training_examples(seed):
    clicks, users, items = _clicks(seed)
    join = ExampleJoin(TOWERS, users, items, has_time=True)
    end = float(clicks["timestamp"].max())
    reference = TowerStatistics.fit(TOWERS, training_examples(clicks, users, items, TOWERS), end)
    by_user, by_item = clicks["user_id"].value_counts(sort=False), clicks["item_id"].value_counts(sort=False)
    streamed = join.statistics(
        (by_user.index.to_numpy(dtype=object), by_user.to_numpy()),
        (by_item.index.to_numpy(dtype=object), by_item.to_numpy()),
        {"timestamp": clicks["timestamp"].to_numpy(), "weight": clicks["weight"].to_numpy()},
        FeatureStatistics.from_training_clicks(clicks).items,
        end,
    )
    assert streamed.items == reference.items and streamed.reference_time == end
    assert reference["rare_zip"] != reference["zip"]  # min_count counts clicks, not users
    for name, expected in reference.features.items():
        actual = streamed[name]
        if isinstance(expected, TimestampStatistics):
            assert isinstance(actual, TimestampStatistics) and actual.reference == expected.reference
            pairs = [(actual.age, expected.age), (actual.log_age, expected.log_age)]
        elif isinstance(expected, NumericStatistics):
            pairs = [(actual, expected)]
        else:  # vocabularies (exactly) and None
            assert actual == expected, name
            continue
        for got, want in pairs:
            assert got.count == want.count, name
            assert (got.mean, got.variance) == pytest.approx((want.mean, want.variance), rel=1e-12), name


def _histories(clicks: pd.DataFrame) -> ClickHistories:
    users, items = pd.Index(clicks["user_id"].unique()), pd.Index(clicks["item_id"].unique())
    return ClickHistories(users.get_indexer(clicks["user_id"]), items.get_indexer(clicks["item_id"]),
                          clicks["timestamp"].to_numpy(), users.to_numpy(), items.to_numpy())


@pytest.mark.parametrize("seed", [0, 1])
def test_a_joined_batch_holds_each_clicks_history_in_the_whole_training_part(seed):
    """Every input of ALL_KINDS, the history included: a batch (any rows, any order) and a
    validation frame get the history each click has among all training clicks, as
    ``training_examples`` of the whole training part gives it, not among their own rows."""
    clicks, users, items = _clicks(seed)
    with pytest.raises(ValueError, match="history is joined from the training clicks' ClickHistories"):
        ExampleJoin(ALL_KINDS, users, items, has_time=True)
    join = ExampleJoin(ALL_KINDS, users, items, has_time=True, histories=_histories(clicks))
    assert join.needs_time
    expected = training_examples(clicks, users, items, ALL_KINDS)
    rows = clicks.sample(frac=0.5, random_state=seed)  # any batch, any order
    joined = join.batch(_batch(rows.reset_index(drop=True)))
    wanted = feature_arrays(expected.loc[rows.index].reset_index(drop=True))
    for name, spec in join.specs.items():
        if name in wanted:
            assert _same(joined[name], wanted[name]), name
        assert list(joined[name].shape[1:]) == spec.shape[1:], name
    assert (joined["history"] != "").any()
    frame = join.examples(rows.reset_index(drop=True))
    assert frame["history"].tolist() == expected.loc[rows.index, "history"].tolist()


def test_a_feature_reading_a_missing_column_is_named_as_in_memory():
    clicks, users, items = _clicks(0)
    with pytest.raises(DataError, match="feature 'age' reads column 'age', which is in neither"):
        ExampleJoin(TOWERS, users.drop(columns=["age"]), items, has_time=True)
    with pytest.raises(DataError, match="feature 'clicked' reads column 'timestamp'"):
        ExampleJoin(TOWERS, users, items, has_time=False)  # a log without timestamps


def test_streamed_batches_carry_the_joined_inputs(tmp_path):
    """``StreamedClicks`` with a join: tensors of the declared dtypes and shapes, every training
    click once with its own features, and the same batches again for the same (seed, epoch)."""
    clicks, users, items = _clicks(3)
    for i, part in enumerate(np.array_split(np.arange(len(clicks)), 2)):
        clicks.iloc[part].to_parquet(tmp_path / f"part-{i}.parquet", index=False)
    columns = ColumnsConfig(weight="weight")
    shards = ClickShards.open(TableConfig(path=str(tmp_path)), columns, read_batch_size=16)
    plan = plan_split(shards, SplitConfig(kind="temporal", test_fraction=0.25))
    counts = scan_counts(shards, plan)
    assert counts.last_train_time == scan_train_column(shards, plan, "timestamp").max()
    join = ExampleJoin(TOWERS, users, items, has_time=True)
    source = StreamedClicks(shards, plan, 8, shuffle_buffer=20, seed=1, train_rows=counts.train_rows, join=join)
    seen = []
    for batch in source.epoch(0):
        for name, spec in join.specs.items():
            assert batch[name].dtype == tf.as_dtype(spec.dtype) and batch[name].shape[1:] == spec.shape[1:], name
        seen += list(zip(batch["user_id"].numpy().astype(str), batch["item_id"].numpy().astype(str),
                         batch["timestamp"].numpy(), batch["country"].numpy().astype(str),
                         batch["genres"].numpy().astype(str).tolist(), batch["clicked"].numpy()))
    train = clicks[clicks["timestamp"] <= plan.cut].reset_index(drop=True)
    examples = training_examples(train, users, items, TOWERS)
    expected = list(zip(train["user_id"], train["item_id"], train["timestamp"], examples["country"],
                        [list(row) for row in examples["genres"]], examples["clicked"]))
    assert sorted(seen, key=repr) == sorted(expected, key=repr)
    again = [b["title"].numpy().tolist() for b in source.epoch(0, skip_batches=1)]
    assert again == [b["title"].numpy().tolist() for b in source.epoch(0)][1:]


def test_on_a_log_without_time_a_joined_batch_holds_each_clicks_other_items():
    """No timestamp column: the join needs no time, and each click's history is its user's other
    training items (ClickHistories.others), never the click's own item."""
    clicks, users, items = _clicks(0)
    clicks = clicks.drop(columns=["timestamp"])
    user_index, item_index = pd.Index(clicks["user_id"].unique()), pd.Index(clicks["item_id"].unique())
    histories = ClickHistories(user_index.get_indexer(clicks["user_id"]), item_index.get_indexer(clicks["item_id"]),
                               None, user_index.to_numpy(), item_index.to_numpy())
    towers = ALL_KINDS.model_copy(update={"query": ALL_KINDS.query.model_copy(
        update={"features": [f for f in ALL_KINDS.query.features if f.column != "timestamp"]})})
    join = ExampleJoin(towers, users, items, has_time=False, histories=histories)
    assert not join.needs_time
    batch = {"user_id": clicks["user_id"].to_numpy(object), "item_id": clicks["item_id"].to_numpy(object),
             "weight": np.ones(len(clicks), np.float32)}
    joined = join.batch(batch)
    length = towers.query.history.length
    assert joined["history"].tolist() == histories.others(batch["user_id"], batch["item_id"], length).tolist()
    assert not (joined["history"] == batch["item_id"][:, None]).any()
    assert (joined["history"] != "").any()
    examples = join.examples(clicks.head(50))
    assert [list(h) for h in examples["history"]] == joined["history"][:50].tolist()
