"""Train/test splits on a hand-made log with known answers."""

import numpy as np
import pandas as pd
import pytest
from pydantic import ValidationError

from retrieval.config import ConfigError, DataConfig, SplitConfig, load_config
from retrieval.data import ITEM, TIME, USER, WEIGHT, DataError, load_dataset, split_clicks, temporal_cut
from retrieval.data.stream_splits import split_validation


def make_log(rows):
    users, items, times = zip(*rows)
    return pd.DataFrame(
        {USER: list(users), ITEM: list(items), TIME: np.array(times, dtype=np.int64), WEIGHT: np.float32(1)}
    )


# Items are named after their row so a split can be read off the item ids.
LOG = make_log(
    [
        ("a", "r0", 10),
        ("b", "r1", 20),
        ("a", "r2", 30),
        ("c", "r3", 40),
        ("a", "r4", 50),
        ("b", "r5", 60),
        ("a", "r6", 70),
        ("b", "r7", 80),
        ("c", "r8", 80),  # ties with r7
        ("a", "r9", 100),
    ]
)


def items(frame):
    return frame[ITEM].tolist()


def test_temporal_cut_is_the_lower_quantile_timestamp():
    # Sorted times: 10 20 30 40 50 60 70 80 80 100; quantile 0.8 sits at position 7.2 -> 80.
    assert temporal_cut(LOG, 0.2) == 80
    assert temporal_cut(LOG, 0.3) == 70  # position 6.3


def test_temporal_ties_at_the_cut_go_to_train():
    train, test = split_clicks(LOG, SplitConfig(kind="temporal", test_fraction=0.2))
    assert items(train) == ["r0", "r1", "r2", "r3", "r4", "r5", "r6", "r7", "r8"]
    assert items(test) == ["r9"]
    train, test = split_clicks(LOG, SplitConfig(kind="temporal", test_fraction=0.3))
    assert items(test) == ["r7", "r8", "r9"]
    assert train[TIME].max() <= 70 < test[TIME].min()
    assert train.index.tolist() == list(range(7)) and test.index.tolist() == [0, 1, 2]


def test_temporal_keeps_file_order_when_the_log_is_unsorted():
    shuffled = LOG.iloc[[9, 3, 0, 8, 5, 1, 7, 2, 6, 4]].reset_index(drop=True)
    train, test = split_clicks(shuffled, SplitConfig(kind="temporal", test_fraction=0.3))
    assert items(test) == ["r9", "r8", "r7"]
    assert items(train) == ["r3", "r0", "r5", "r1", "r2", "r6", "r4"]


def test_temporal_with_an_empty_test_part_explains():
    log = make_log([("a", "x", 10), ("a", "y", 20), ("b", "x", 30), ("b", "y", 30), ("c", "z", 30)])
    message = r"test part empty: no click is later than the cut at 30.*test_fraction"
    with pytest.raises(DataError, match=message):
        split_clicks(log, SplitConfig(kind="temporal", test_fraction=0.2))


def test_leave_last_k_takes_exactly_each_users_last_k():
    train, test = split_clicks(LOG, SplitConfig(kind="leave_last_k", k=1))
    assert items(test) == ["r7", "r8", "r9"]  # b's, c's and a's last clicks, in file order
    assert len(train) == 7
    train, test = split_clicks(LOG, SplitConfig(kind="leave_last_k", k=2))
    # a: r6, r9; b (3 clicks): r5, r7; c has only 2 clicks and stays in train.
    assert items(test) == ["r5", "r6", "r7", "r9"]
    assert items(train) == ["r0", "r1", "r2", "r3", "r4", "r8"]


def test_leave_last_k_orders_by_time_then_file_order():
    log = make_log([("d", "late-tie-2", 5), ("d", "early", 1), ("d", "late-tie-1", 5), ("e", "only", 3)])
    train, test = split_clicks(log, SplitConfig(kind="leave_last_k", k=1))
    # Two clicks share the last time: the one later in the file is the last one.
    assert items(test) == ["late-tie-1"]
    assert items(train) == ["late-tie-2", "early", "only"]


def test_leave_last_k_with_no_user_above_k():
    with pytest.raises(DataError, match=r"no user has more than split\.k=5 clicks"):
        split_clicks(LOG, SplitConfig(kind="leave_last_k", k=5))


def test_random_split_is_seeded_and_partitions_the_log():
    cfg = SplitConfig(kind="random", test_fraction=0.3, seed=3)
    train, test = split_clicks(LOG, cfg)
    again_train, again_test = split_clicks(LOG, cfg)
    assert items(test) == items(again_test) and items(train) == items(again_train)
    assert len(test) > 0 and len(train) > 0
    assert sorted(items(train) + items(test)) == sorted(items(LOG))
    rows = [int(item[1:]) for item in items(test)]
    assert rows == sorted(rows)  # file order kept
    seeds = [SplitConfig(kind="random", test_fraction=0.3, seed=seed) for seed in range(5)]
    assert len({tuple(items(split_clicks(LOG, cfg)[1])) for cfg in seeds}) > 1


def test_random_split_too_small():
    message = r"random split of 10 clicks with split\.test_fraction=0\.01 leaves 0 test clicks"
    with pytest.raises(DataError, match=message):
        split_clicks(LOG, SplitConfig(kind="random", test_fraction=0.01))


def test_none_uses_the_given_test_log():
    test_log = make_log([("a", "new", 200)])
    train, test = split_clicks(LOG, SplitConfig(kind="none"), test_log)
    assert items(train) == items(LOG) and items(test) == ["new"]
    with pytest.raises(DataError, match="split.kind 'none' needs a separate test log: set data.test_clicks"):
        split_clicks(LOG, SplitConfig(kind="none"))
    with pytest.raises(DataError, match="the test part of the 'none' split is empty"):
        split_clicks(LOG, SplitConfig(kind="none"), test_log.iloc[:0])


@pytest.mark.parametrize("kind", ["temporal", "leave_last_k"])
def test_time_based_splits_need_a_timestamp(kind):
    message = rf"split.kind '{kind}' needs timestamps.*data\.columns\.timestamp.*split\.kind: random"
    with pytest.raises(DataError, match=message):
        split_clicks(LOG.drop(columns=[TIME]), SplitConfig(kind=kind))
    train, test = split_clicks(LOG.drop(columns=[TIME]), SplitConfig(kind="random"))
    assert len(train) + len(test) == len(LOG)


# --- split.evaluate_on: validation: the training part split again, the test part never read ---


def _timed_log(seed):
    """~300 clicks of 12 users with many tied timestamps; ``row`` names each click."""
    rng = np.random.default_rng(seed)
    n = 300
    return pd.DataFrame({
        USER: rng.choice([f"u{i}" for i in range(12)], n),
        ITEM: rng.choice([f"i{i}" for i in range(40)], n),
        TIME: rng.integers(0, 120, n).astype(np.int64),
        WEIGHT: np.float32(1),
        "row": np.arange(n),
    })


NESTED = [
    SplitConfig(kind="temporal", test_fraction=0.25, evaluate_on="validation"),
    SplitConfig(kind="random", test_fraction=0.3, seed=4, evaluate_on="validation"),
    SplitConfig(kind="leave_last_k", k=2, evaluate_on="validation"),
]


@pytest.mark.parametrize("cfg", NESTED, ids=lambda cfg: cfg.kind)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_validation_part_partitions_the_training_part_and_avoids_the_test_part(cfg, seed):
    log = _timed_log(seed)
    train, test = split_clicks(log, cfg)
    inner, validation = split_validation(train, cfg)
    rows = {name: set(part["row"]) for name, part in
            (("train", train), ("test", test), ("inner", inner), ("validation", validation))}
    assert rows["validation"] and rows["inner"]
    assert not rows["validation"] & rows["test"] and not rows["inner"] & rows["test"]
    assert not rows["validation"] & rows["inner"]
    assert len(inner) + len(validation) == len(train) and rows["inner"] | rows["validation"] == rows["train"]
    # Whole rows, in the training part's order, with a fresh index.
    pd.testing.assert_frame_equal(
        pd.concat([inner, validation]).sort_values("row").reset_index(drop=True), train.reset_index(drop=True)
    )
    assert inner["row"].is_monotonic_increasing and validation["row"].is_monotonic_increasing
    assert validation.index.tolist() == list(range(len(validation)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_temporal_validation_lies_between_the_inner_training_part_and_the_test_part(seed):
    cfg = NESTED[0]
    log = _timed_log(seed)
    train, test = split_clicks(log, cfg)
    inner, validation = split_validation(train, cfg)
    assert inner[TIME].max() < validation[TIME].min()
    assert validation[TIME].max() < test[TIME].min()
    # The latest test_fraction of the training clicks, cut at their own lower quantile (ties to train).
    cut = np.sort(train[TIME].to_numpy())[int(np.floor((1 - cfg.test_fraction) * (len(train) - 1)))]
    assert set(validation["row"]) == set(train.loc[train[TIME] > cut, "row"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_leave_last_k_validation_is_each_users_last_k_training_clicks(seed):
    cfg = NESTED[2]
    train, _ = split_clicks(_timed_log(seed), cfg)
    _, validation = split_validation(train, cfg)
    expected = set()
    for _, clicks in train.groupby(USER):
        if len(clicks) > cfg.k:
            ordered = sorted(zip(clicks[TIME], clicks["row"]))  # by time, ties by file order
            expected |= {row for _, row in ordered[-cfg.k:]}
    assert set(validation["row"]) == expected


def test_random_validation_is_a_seeded_share_of_the_training_rows():
    cfg = NESTED[1]
    train, _ = split_clicks(_timed_log(0), cfg)
    _, validation = split_validation(train, cfg)
    assert len(validation) == round(cfg.test_fraction * len(train))
    assert split_validation(train, cfg)[1]["row"].tolist() == validation["row"].tolist()
    other = split_validation(train, cfg.model_copy(update={"seed": 5}))[1]
    assert other["row"].tolist() != validation["row"].tolist()


def test_an_empty_validation_part_says_it_is_the_nested_split():
    train = make_log([("a", "x", 10), ("a", "y", 20), ("b", "x", 30), ("b", "y", 30), ("c", "z", 30)])
    with pytest.raises(DataError, match=r"evaluate_on: validation splits the training part \(5 clicks\).*"
                                        r"test part empty: no click is later than the cut at 30"):
        split_validation(train, SplitConfig(kind="temporal", test_fraction=0.2, evaluate_on="validation"))


def test_validation_is_refused_for_a_given_test_log():
    with pytest.raises(ValidationError, match=r"split\.kind: none has no split to repeat.*validation file"):
        SplitConfig(kind="none", evaluate_on="validation")
    with pytest.raises(ValueError, match="data.test_clicks is already the evaluation part"):
        split_validation(LOG, SplitConfig(kind="none"))
    with pytest.raises(ConfigError, match=r"evaluate_on"):
        load_config(None, ["split.evaluate_on=sometimes"])
    shards = ["data.source=files", "data.clicks={path: c.parquet}", "data.out_of_core=true",
              "train.validation_fraction=0", "evaluation.baselines.rankers=[popularity]"]
    load_config(None, [*shards, "split.evaluate_on=validation"])  # out of core carves it too


def test_load_dataset_evaluates_on_the_validation_part_and_never_reads_the_test_part():
    data = DataConfig(synthetic={"n_users": 150, "n_items": 120, "mean_clicks_per_user": 12})
    outer = SplitConfig(kind="temporal", test_fraction=0.2)
    nested = outer.model_copy(update={"evaluate_on": "validation"})
    full = load_dataset(data, outer)
    tuned = load_dataset(data, nested)
    inner, validation = split_validation(full.train, nested)
    pd.testing.assert_frame_equal(tuned.train, inner)
    pd.testing.assert_frame_equal(tuned.test, validation)
    assert tuned.test[TIME].max() < full.test[TIME].min()
    summary = tuned.summary()
    assert summary["evaluated_on"] == "validation" and full.summary()["evaluated_on"] == "test"
    assert summary["test_clicks"] == len(validation) != len(full.test)


def test_ids_known_only_from_the_test_part_stay_out_of_the_catalogues(tmp_path):
    rows = [*((u, i, t) for u, i, t in zip(LOG[USER], LOG[ITEM], LOG[TIME])), ("late", "new", 200)]
    path = tmp_path / "clicks.csv"
    make_log(rows).drop(columns=[WEIGHT]).to_csv(path, index=False)
    data = DataConfig(source="files", clicks={"path": str(path)})
    nested = SplitConfig(kind="temporal", test_fraction=0.3, evaluate_on="validation")
    full = load_dataset(data, nested.model_copy(update={"evaluate_on": "test"}))
    assert items(full.test) == ["r9", "new"]
    tuned = load_dataset(data, nested)
    assert items(tuned.train) == ["r0", "r1", "r2", "r3", "r4", "r5"] and items(tuned.test) == ["r6", "r7", "r8"]
    assert set(tuned.items[ITEM]) == {f"r{i}" for i in range(9)}
    assert "late" not in set(tuned.users[USER]) and "late" in set(full.users[USER])
