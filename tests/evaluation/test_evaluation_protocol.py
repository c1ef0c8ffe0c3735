"""The offline protocol by hand: who is evaluated, what is relevant, what is masked, and the ranking."""

import numpy as np
import pandas as pd
import pytest

from retrieval.config import EvaluationConfig
from retrieval.data import ITEM, USER, DataError
from retrieval.evaluation import build_eval_set, index_ranking
from retrieval.index import ItemIndex

CATALOGUE = ["a", "b", "c", "d", "e", "f"]  # rows 0..5
TRAIN = pd.DataFrame({USER: ["u1", "u1", "u2", "u3"], ITEM: ["a", "b", "c", "a"]})
TEST = pd.DataFrame(
    {
        USER: ["u1", "u1", "u1", "u2", "u2", "u9", "u3"],
        ITEM: ["a", "c", "c", "e", "f", "b", "a"],
        # u1: a re-click of "a", "c" twice; u2: "e" and "f", which nobody clicked in training;
        # u9: a user without training clicks; u3: only a re-click.
    }
)


def _frame(eval_set):
    """{user: (relevant rows, masked rows)}."""
    rows = zip(eval_set.user_ids, eval_set.relevant, eval_set.exclude)
    return {user: (relevant.tolist(), sorted(masked.tolist())) for user, relevant, masked in rows}


def test_default_policy_by_hand():
    eval_set = build_eval_set(TRAIN, TEST, CATALOGUE, EvaluationConfig())
    # u1: "a" is a training click again (masked, so not relevant); "c" once, duplicates collapse.
    # u2: "e" and "f" have no training clicks but are in the index: kept by default.
    # u9: no training clicks: dropped. u3: only a re-click: nothing left to find, not evaluated.
    assert _frame(eval_set) == {"u1": ([2], [0, 1]), "u2": ([4, 5], [2])}
    assert eval_set.counts["test_clicks"] == 6  # after dropping the exact duplicate
    assert eval_set.counts["test_users_unseen_in_training"] == 1
    assert eval_set.counts["test_clicks_repeating_a_training_click"] == 2
    assert eval_set.counts["test_clicks_on_items_unseen_in_training"] == 2  # u2's "e" and "f"
    assert eval_set.counts["evaluated_users"] == 2 and eval_set.counts["relevant_pairs"] == 3


def test_policies_switch_each_rule_off():
    keep_all = EvaluationConfig(exclude_train_items=False, unseen_users="keep")
    eval_set = build_eval_set(TRAIN, TEST, CATALOGUE, keep_all)
    assert _frame(eval_set) == {
        "u1": ([0, 2], []),
        "u2": ([4, 5], []),
        "u3": ([0], []),
        "u9": ([1], []),
    }
    drop_new_items = build_eval_set(TRAIN, TEST, CATALOGUE, EvaluationConfig(unseen_items="drop"))
    assert _frame(drop_new_items) == {"u1": ([2], [0, 1])}  # u2 had only items new to training


def test_no_user_left_is_an_error_that_says_why():
    with pytest.raises(DataError, match="unseen_users"):
        build_eval_set(TRAIN, TEST[TEST[USER] == "u9"], CATALOGUE, EvaluationConfig())


@pytest.mark.parametrize("batch_size", [1, 2, 100])
def test_index_ranking_masks_each_users_rows_in_any_batching(batch_size):
    rng = np.random.default_rng(batch_size)
    items = rng.normal(size=(len(CATALOGUE), 4)).astype(np.float32)
    eval_set = build_eval_set(TRAIN, TEST, CATALOGUE, EvaluationConfig(unseen_users="keep"))
    queries = rng.normal(size=(len(eval_set.user_ids), 4)).astype(np.float32)
    ranked = index_ranking(ItemIndex.build(CATALOGUE, items), queries, eval_set, 5, batch_size=batch_size)
    scores = queries @ items.T
    for row, masked in enumerate(eval_set.exclude):
        scores[row, masked] = -np.inf
    expected = np.argsort(-scores, axis=1, kind="stable")[:, :5]
    expected = np.where(np.take_along_axis(scores, expected, 1) == -np.inf, -1, expected)  # padded, not masked rows
    np.testing.assert_array_equal(ranked, expected)


def test_index_ranking_reports_its_progress_batch_by_batch():
    import io

    from retrieval.common.progress import Progress

    eval_set = build_eval_set(TRAIN, TEST, CATALOGUE, EvaluationConfig(unseen_users="keep"))
    items = np.random.default_rng(0).normal(size=(len(CATALOGUE), 4)).astype(np.float32)
    ticks = iter(range(0, 1000, 10))  # every reading of the clock is 10 s after the last
    stream = io.StringIO()
    progress = Progress(len(eval_set.user_ids), "rank users", "users", stream=stream, interval=5,
                        clock=lambda: float(next(ticks)))
    assert len(eval_set.user_ids) == 3  # u1, u2, u9 (u3's only test click repeats a training one)
    index_ranking(ItemIndex.build(CATALOGUE, items), np.ones((3, 4), np.float32), eval_set, 3, batch_size=2,
                  progress=progress)
    assert stream.getvalue().splitlines() == [
        "rank users: 2 / 3 users (66.7%), 0.2 users/s, ETA 5s",
        "rank users: 3 / 3 users (100.0%), 0.15 users/s, ETA 0s",
        "rank users: 3 users in 30s, 0.1 users/s",
    ]
