"""Train/test splits on a hand-made log with known answers."""

import numpy as np
import pandas as pd
import pytest

from retrieval.config import SplitConfig
from retrieval.data import ITEM, TIME, USER, WEIGHT, DataError, split_clicks, temporal_cut


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
    assert len(test) == 3 and len(train) == 7
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
