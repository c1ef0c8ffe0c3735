"""bench_freshness's pure pieces against pandas: the period split, the "new item" definition, the
update periods and the scoring of a bundle's answers on the next period."""

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from benchmarks.bench_freshness import (
    WEEK_SECONDS,
    assign_periods,
    fresh_items,
    score,
    summarise,
    update_periods,
    weekly_starts,
)

RNG = np.random.default_rng(0)


@pytest.fixture(scope="module")
def log():
    clicks = pd.DataFrame({
        "user_id": RNG.choice([f"u{i}" for i in range(30)], 400),
        "item_id": RNG.choice([f"i{i}" for i in range(60)], 400),
        "timestamp": 1_000_000 + RNG.integers(0, 5 * WEEK_SECONDS + 3 * 86_400, 400),
    })
    starts = weekly_starts(clicks["timestamp"].to_numpy())
    return clicks.assign(period=assign_periods(clicks["timestamp"].to_numpy(), starts)), starts


def test_weeks_from_the_first_click_match_pandas_floor_division(log):
    clicks, starts = log
    first = clicks["timestamp"].min()
    assert len(starts) == 7 and starts[0] == first and (np.diff(starts) == WEEK_SECONDS).all()
    assert starts[-1] > clicks["timestamp"].max() >= starts[-2]
    expected = (clicks["timestamp"] - first) // WEEK_SECONDS
    assert (clicks["period"] == expected).all()
    # pd.cut over the same edges, left-closed, agrees too.
    cut = pd.cut(clicks["timestamp"], bins=starts, right=False, labels=False)
    assert (clicks["period"] == cut).all()


def test_a_time_outside_the_periods_is_refused():
    with pytest.raises(ValueError, match="outside the periods"):
        assign_periods(np.array([5, 10, 30]), np.array([5, 10, 20]))


def test_new_items_are_those_first_clicked_in_the_period(log):
    clicks, _ = log
    for period in range(6):
        earlier = set(clicks.loc[clicks["period"] < period, "item_id"])
        expected = sorted(set(clicks.loc[clicks["period"] == period, "item_id"]) - earlier)
        assert fresh_items(clicks, period).tolist() == expected


def test_update_periods_are_the_last_ones_with_a_period_before_and_after():
    assert update_periods(10, 3) == [6, 7, 8]
    assert update_periods(4, 2) == [1, 2]
    with pytest.raises(ValueError, match="--periods 3"):
        update_periods(4, 3)
    with pytest.raises(ValueError, match="--periods 0"):
        update_periods(4, 0)


class FakeBundle:
    """Answers every user with a fixed ranking of its catalogue, less the excluded ids (as serving does)."""

    def __init__(self, ranking):
        self.index = SimpleNamespace(item_ids=list(ranking))
        self.ranking = list(ranking)
        self.excluded = []

    def recommend_batch(self, queries, k, exclude_item_ids, exclude_seen):
        assert not exclude_seen
        self.excluded += [set(ids) for ids in exclude_item_ids]
        return [SimpleNamespace(item_ids=[i for i in self.ranking if i not in set(ids)][:k])
                for ids in exclude_item_ids]


def test_score_is_recall_on_the_next_period_overall_and_on_new_items():
    history = pd.DataFrame({"user_id": ["a", "a", "b", "c", "c"], "item_id": ["x", "y", "x", "z", "n"]})
    test = pd.DataFrame({
        "user_id": ["a", "a", "a", "b", "b", "c", "d"],
        #            x: seen by a (dropped); w: unknown up to t (dropped); d: unknown user (dropped)
        "item_id": ["x", "n", "z", "w", "n", "y", "y"],
    })
    # The frozen model's catalogue lacks n (first clicked after it was trained): it never recommends it.
    frozen = FakeBundle(["z", "y", "x"])
    scores = score(frozen, history, test, fresh=np.array(["n"]), k=2)
    # a: relevant {n, z}, answer [z] (x, y excluded) -> 1/2; b: relevant {n}, answer [z, y] -> 0;
    # c: relevant {y}, answer [y, x] (z excluded) -> 1.
    assert scores["recall@2"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert scores["users"] == 3 and scores["test_clicks_scored"] == 4
    # New items: a and b have a test click on n; neither gets it.
    assert scores["recall@2_new"] == 0.0 and scores["users_new"] == 2 and scores["test_clicks_on_new_items"] == 2
    assert frozen.excluded == [{"x", "y"}, {"x"}, {"z"}]  # each user's items up to t that the bundle holds
    updated = FakeBundle(["n", "z", "y", "x"])
    scores = score(updated, history, test, fresh=np.array(["n"]), k=2)
    # a: [n, z] -> 1; b: [n, z] -> 1; c: [y, x] (n, z excluded) -> 1.
    assert scores["recall@2"] == 1.0 and scores["recall@2_new"] == 1.0


def test_summary_pools_users_over_periods_and_checks_the_targets_of_each_warm_variant():
    from benchmarks.bench_freshness import _ratios

    def arm(recall, seconds, users, new=0.0, users_new=1):
        return {"recall@20": recall, "recall@20_new": new, "users": users, "users_new": users_new,
                "seconds": seconds, "training_seconds": seconds / 2}

    def row(frozen, warm, retrain, warm_s, retrain_s, users):
        row = {"frozen": arm(frozen, 50.0, users), "warm": arm(warm, warm_s, users, 0.1),
               "warm-slow": arm(retrain, retrain_s / 2, users, 0.2), "retrain": arm(retrain, retrain_s, users, 0.2)}
        return row | _ratios(row)

    rows = [row(0.30, 0.29, 0.30, 4.0, 50.0, users=10), row(0.25, 0.20, 0.40, 7.0, 60.0, users=30)]
    assert rows[0]["over_retrain"]["warm"] == {"seconds": 0.08, "training_seconds": 0.08,
                                               "recall@20": round(0.29 / 0.30, 4), "recall@20_new": 0.5}
    summary = summarise(rows)
    assert summary["frozen_decay_recall@20"] == pytest.approx(-0.05)
    # Pooled by users: (10 x 0.29 + 30 x 0.20) / 40 against (10 x 0.30 + 30 x 0.40) / 40.
    assert summary["warm"]["recall@20"] == pytest.approx((2.9 + 6.0) / 40)
    assert summary["retrain"]["recall@20"] == pytest.approx((3.0 + 12.0) / 40)
    assert summary["retrain"]["seconds"] == 110.0 and summary["frozen"]["seconds"] == 50.0  # trained once
    warm, slow = summary["over_retrain"]["warm"], summary["over_retrain"]["warm-slow"]
    assert warm["seconds"] == pytest.approx(11.0 / 110.0, abs=1e-4)
    assert warm["recall@20"] == pytest.approx(8.9 / 15.0, abs=1e-4)
    assert warm["targets"] == {"seconds <= 0.10 x retrain": True, "recall@20 >= 0.97 x retrain": False}
    assert warm["periods_meeting"] == {"seconds": 1, "recall@20": 0}  # 7 / 60 > 0.10; 0.29 / 0.30 < 0.97
    assert slow["targets"] == {"seconds <= 0.10 x retrain": False, "recall@20 >= 0.97 x retrain": True}


def test_warm_variants_are_a_name_and_overrides():
    from benchmarks.bench_freshness import parse_warm

    assert parse_warm(["warm", "warm-replay train.replay_fraction=0.5 train.epochs=2"]) == {
        "warm": [], "warm-replay": ["train.replay_fraction=0.5", "train.epochs=2"]}
    for bad in (["warm", "warm"], ["retrain"], ["warm train.epochs"], ["a/b"]):
        with pytest.raises(SystemExit, match="--warm"):
            parse_warm(bad)


@pytest.mark.parametrize(
    "name", ["bench_freshness_ml100k", "bench_freshness_synthetic", "bench_freshness_ml100k_update_recipes"]
)
def test_the_stored_results_agree_with_their_rows(name):
    import json
    from pathlib import Path

    report = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/results" / f"{name}.json").read_text())
    assert report["summary"] == json.loads(json.dumps(summarise(report["rows"])))
    assert report["updates"] == [row["period"] for row in report["rows"]]
    for row in report["rows"]:
        arms = [arm for arm in ("frozen", "warm", "retrain") if arm in row]
        assert arms == ["frozen", "warm", "retrain"]
        assert len({row[arm]["users"] for arm in arms}) == 1  # every arm scored on the same users
