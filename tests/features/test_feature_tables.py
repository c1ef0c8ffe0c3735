"""Raw tower inputs and their statistics, against independent pandas / pure-Python references."""

import numpy as np
import pandas as pd
import pytest
from feature_fixtures import ALL_KINDS, small_tables
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.data import DataError, hold_out_items
from retrieval.features import (
    NumericStatistics,
    TowerStatistics,
    TowerTables,
    Vocabulary,
    age_days,
    feature_arrays,
    history_before,
    latest_history,
    tower_inputs,
)


def _reference_history(clicks: pd.DataFrame, length: int) -> list[list[str]]:
    """Brute force: for each click, same-user clicks with a strictly smaller timestamp, newest first."""
    rows = list(clicks.itertuples(index=True))
    out = []
    for row in rows:
        earlier = [r for r in rows if r.user_id == row.user_id and r.timestamp < row.timestamp]
        earlier.sort(key=lambda r: (r.timestamp, r.Index), reverse=True)
        items = [r.item_id for r in earlier[:length]]
        out.append(items + [""] * (length - len(items)))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_history_matches_brute_force_and_never_sees_the_future(seed):
    clicks, _, _ = small_tables(seed, n_clicks=80)
    clicks = clicks.sample(frac=1.0, random_state=seed).reset_index(drop=True)  # history must not rely on order
    history = history_before(clicks, 4)
    assert history.shape == (len(clicks), 4)
    assert history.tolist() == _reference_history(clicks, 4)
    # No history entry is the click itself or anything at or after its time.
    time_of = {}
    for row in clicks.itertuples():
        time_of.setdefault((row.user_id, row.item_id), []).append(row.timestamp)
    for row, items in zip(clicks.itertuples(), history):
        for item in items[items != ""]:
            assert min(time_of[(row.user_id, item)]) < row.timestamp


def test_clicks_with_equal_timestamps_do_not_see_each_other():
    clicks = pd.DataFrame(
        {
            "user_id": ["a", "a", "a", "a", "b"],
            "item_id": ["x", "y", "z", "w", "x"],
            "timestamp": [10, 20, 20, 30, 20],
        }
    )
    history = history_before(clicks, 3)
    assert history.tolist() == [
        ["", "", ""],
        ["x", "", ""],  # y and z share t=20: neither sees the other
        ["x", "", ""],
        ["z", "y", "x"],  # ties among visible clicks: later rows first
        ["", "", ""],  # another user's clicks are never visible
    ]


def test_latest_history_sees_every_training_click_and_pads_unknown_users():
    clicks = pd.DataFrame({"user_id": ["a", "b", "a", "a"], "item_id": ["x", "y", "z", "w"], "timestamp": [3, 1, 2, 3]})
    assert latest_history(clicks, ["a", "nobody", "b"], 2).tolist() == [["w", "x"], ["", ""], ["y", ""]]


def test_history_needs_timestamps():
    with pytest.raises(DataError, match="timestamps"):
        history_before(pd.DataFrame({"user_id": ["a"], "item_id": ["x"]}), 2)


def test_examples_join_features_like_a_pandas_merge():
    clicks, users, items = small_tables(0)
    examples = TowerTables(ALL_KINDS, clicks, users, items).examples()
    reference = clicks.merge(users, on="user_id", how="left").merge(items, on="item_id", how="left")
    assert len(examples) == len(clicks)
    np.testing.assert_array_equal(examples["age"].to_numpy(), reference["age"].to_numpy(np.float32))
    np.testing.assert_array_equal(examples["released"].to_numpy(), reference["released"].to_numpy())
    assert examples["zip"].tolist() == reference["zip"].fillna("").tolist()
    assert examples["tags"].tolist() == reference["tags"].fillna("").tolist()  # split inside the tower
    padded = [tuple((g + ["", ""])[:2]) for g in reference["genres"]]
    assert examples["genres"].tolist() == padded
    assert [tuple(h) for h in history_before(clicks, 3)] == examples["history"].tolist()
    arrays = feature_arrays(examples)
    assert arrays["genres"].shape == (len(clicks), 2) and arrays["history"].shape == (len(clicks), 3)
    assert [spec.name for spec in tower_inputs(ALL_KINDS.query)] == ALL_KINDS.query.input_names


def test_statistics_match_pandas_on_the_training_examples():
    clicks, users, items = small_tables(1)
    tables = TowerTables(ALL_KINDS, clicks, users, items)
    stats = TowerStatistics.fit(ALL_KINDS, tables.examples(), tables.reference_time)
    reference = clicks.merge(users, on="user_id", how="left").merge(items, on="item_id", how="left")

    age = reference["age"].astype("float32").astype("float64")
    assert stats["age"].mean == pytest.approx(age.mean())  # pandas skips NaN
    assert stats["age"].variance == pytest.approx(age.var(ddof=0))
    log_price = np.log1p(reference["price"].astype("float32").astype("float64").clip(lower=0))
    assert stats["price"].mean == pytest.approx(log_price.mean())
    assert stats["price"].std == pytest.approx(log_price.std(ddof=0))

    assert stats["user_id"].ids == tuple(sorted(clicks["user_id"].unique()))
    assert stats["zip"].ids == tuple(sorted(reference["zip"].dropna().str[:3].unique()))
    assert stats["genres"].ids == tuple(sorted({g for row in reference["genres"] for g in row[:2]}))
    assert stats["country"] is None and stats["tags"] is None and stats["title"] is None  # hashed
    assert stats.items.ids == tuple(sorted(clicks["item_id"].unique()))

    reference_time = float(clicks["timestamp"].max())
    age_in_days = (reference_time - reference["signup"]) / 86_400
    assert stats["signup"].reference == reference_time
    assert stats["signup"].age.mean == pytest.approx(age_in_days.mean())
    assert stats["signup"].log_age.variance == pytest.approx(np.log1p(age_in_days.clip(lower=0)).var(ddof=0))


def test_vocabulary_min_count_and_numeric_edge_cases():
    values = pd.Series(["a", "b", "a", "c", "a", "b"])
    assert Vocabulary.from_series(values, min_count=2).ids == ("a", "b")
    assert Vocabulary.from_series(values).lookup(["b", "zzz"]).tolist() == [2, 0]
    empty = NumericStatistics.from_values([np.nan, np.nan])
    assert (empty.mean, empty.std, empty.count) == (0.0, 1.0, 0)
    assert NumericStatistics.from_values([3.0, 3.0]).std == 1.0  # no spread: never divide by zero


def test_age_in_days_for_each_unit():
    reference = 86_400.0 * 100
    np.testing.assert_allclose(age_days([86_400.0 * 40], "seconds", reference), [60.0])
    np.testing.assert_allclose(age_days([40.0], "days", reference), [60.0])
    np.testing.assert_allclose(age_days([1970.0, np.nan], "years", reference), [100.0, np.nan])


def test_queries_and_catalogue_cover_unseen_users_and_items():
    clicks, users, items = small_tables(2)
    tables = TowerTables(ALL_KINDS, clicks, users, items)
    queries = tables.queries(["u1", "stranger"])
    assert queries["user_id"].tolist() == ["u1", "stranger"]
    assert queries.loc[1, "history"] == ("", "", "") and np.isnan(queries.loc[1, "age"])
    assert queries.loc[0, "history"] == tuple(latest_history(clicks, ["u1"], 3)[0])
    catalogue = tables.catalogue()
    assert catalogue["item_id"].tolist() == items["item_id"].tolist()  # i7 (never clicked) included


def test_a_feature_reading_a_missing_column_is_named():
    clicks, users, items = small_tables(0)
    with pytest.raises(DataError, match="feature 'age' reads column 'age'"):
        TowerTables(ALL_KINDS, clicks, users.drop(columns=["age"]), items).examples()
    bad = items.assign(price=["cheap"] + [1.0] * 7)
    with pytest.raises(DataError, match="'price'.*'cheap' is not a number"):
        TowerTables(ALL_KINDS, clicks, users, bad).catalogue()


def test_hold_out_items_drops_only_their_training_clicks():
    clicks, _, _ = small_tables(0, n_clicks=200)
    train, test = clicks.iloc[:150], clicks.iloc[150:]
    kept, held = hold_out_items(train, test, 0.3, seed=5)
    logged = set(train["item_id"]) | set(test["item_id"])
    assert len(held) == round(0.3 * len(logged)) and set(held) <= logged
    assert not set(held) & set(kept["item_id"])
    assert len(kept) == int((~train["item_id"].isin(held)).sum())  # nothing else dropped
    assert hold_out_items(train, test, 0.3, seed=5)[1] == held != hold_out_items(train, test, 0.3, seed=6)[1]


# --- Histories looked up in the coded training clicks (ClickHistories). ---


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6), st.integers(0, 5)), min_size=1, max_size=40),
    length=st.integers(1, 4),
)
def test_click_histories_give_the_histories_of_the_whole_frame(rows, length):
    """Any batch of clicks, in any order, gets the history ``history_before`` gives it in the whole
    training frame (ties in time never see each other), and every user, known or not, the
    serving history ``latest_history`` gives."""
    from retrieval.features.histories import ClickHistories

    clicks = pd.DataFrame({
        "user_id": [f"u{u}" for u, _, _ in rows],
        "item_id": [f"i{i}" for _, i, _ in rows],
        "timestamp": np.array([t for _, _, t in rows], dtype=np.int64),
    })
    users, items = pd.Index(sorted(set(clicks["user_id"]))), pd.Index(sorted(set(clicks["item_id"])))
    histories = ClickHistories(users.get_indexer(clicks["user_id"]), items.get_indexer(clicks["item_id"]),
                               clicks["timestamp"].to_numpy(), users.to_numpy(), items.to_numpy())
    shuffled = np.random.default_rng(len(rows)).permutation(len(clicks))
    expected = history_before(clicks, length)[shuffled]
    got = histories.before(clicks["user_id"].to_numpy()[shuffled], clicks["timestamp"].to_numpy()[shuffled], length)
    assert got.tolist() == expected.tolist()
    asked = [*users, "nobody"]
    assert histories.latest(asked, length).tolist() == latest_history(clicks, asked, length).tolist()
    unknown = histories.before(["nobody"], np.array([99]), length)
    assert unknown.tolist() == [[""] * length]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6)), min_size=1, max_size=40),
    length=st.integers(1, 4),
)
def test_a_log_without_time_gives_each_click_its_users_other_items(rows, length):
    """Without timestamps a click's history is its user's latest items in log order with every
    click of its own item left out (a row never sees its positive), as a loop over the log gives it;
    the serving history is the user's latest items, all of them."""
    from retrieval.features.histories import ClickHistories

    users_of, items_of = [f"u{u}" for u, _ in rows], [f"i{i}" for _, i in rows]
    users, items = pd.Index(sorted(set(users_of))), pd.Index(sorted(set(items_of)))
    histories = ClickHistories(users.get_indexer(users_of), items.get_indexer(items_of), None,
                               users.to_numpy(), items.to_numpy())
    got = histories.others(np.array(users_of, dtype=object), np.array(items_of, dtype=object), length)
    for row, (user, item) in enumerate(zip(users_of, items_of)):
        newest_first = [i for u, i in zip(users_of, items_of) if u == user][::-1]
        expected = [i for i in newest_first[: length + 1] if i != item][:length]
        assert got[row].tolist() == expected + [""] * (length - len(expected))
        assert item not in got[row]
    assert histories.latest(["u0", "nobody"], length).tolist() == [
        ([i for u, i in zip(users_of, items_of) if u == "u0"][::-1] + [""] * length)[:length], [""] * length]
    with pytest.raises(ValueError, match="no timestamps.*others"):
        histories.before(users_of, np.zeros(len(rows), np.int64), length)
