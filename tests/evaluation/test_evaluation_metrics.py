"""Ranking, beyond-accuracy and per-segment metrics: hand-worked examples and a brute-force reference.

The reference below is written from the formulas in ``retrieval/evaluation/metrics.py``'s
docstring with Python sets and loops, sharing no code with the vectorised functions.
"""

import math

import numpy as np
import pytest

from retrieval.evaluation import (
    activity_segments,
    coverage_at_k,
    mean_log_popularity,
    metrics_by_segment,
    popularity_bias,
    ranking_metrics,
    score_ranking,
    tail_items,
    tail_recall,
)
from retrieval.evaluation.metrics import segment_labels


def test_ranking_metrics_by_hand():
    # user 0: relevant {3, 7}; ranking 5, 3, 9, 7  -> hits at ranks 2 and 4
    # user 1: relevant {1};    ranking 2, 4, 6, 8  -> no hit
    ranked = np.array([[5, 3, 9, 7], [2, 4, 6, 8]])
    relevant = [np.array([3, 7]), np.array([1])]
    m = ranking_metrics(ranked, relevant, ks=[2, 4])
    assert m["users"] == 2
    assert m["recall@2"] == pytest.approx((1 / 2 + 0) / 2)
    assert m["recall@4"] == pytest.approx((2 / 2 + 0) / 2)
    assert m["precision@2"] == pytest.approx((1 / 2 + 0) / 2)
    assert m["hit_rate@2"] == pytest.approx(0.5)
    dcg2 = 1 / math.log2(3)
    idcg2 = 1 / math.log2(2) + 1 / math.log2(3)
    assert m["ndcg@2"] == pytest.approx((dcg2 / idcg2) / 2)
    dcg4 = 1 / math.log2(3) + 1 / math.log2(5)
    assert m["ndcg@4"] == pytest.approx((dcg4 / idcg2) / 2)
    assert m["mrr@4"] == pytest.approx((1 / 2) / 2)


def test_a_relevant_item_listed_twice_counts_once():
    ranked = np.array([[5, 3, 9, 7], [2, 4, 6, 8]])
    once = ranking_metrics(ranked, [np.array([3, 7]), np.array([1])], ks=[2, 4])
    assert ranking_metrics(ranked, [np.array([3, 7, 3, 3]), np.array([1, 1])], ks=[2, 4]) == once


def test_ideal_dcg_uses_min_of_relevant_and_k():
    # One relevant item ranked first: perfect NDCG at every k.
    m = ranking_metrics(np.array([[4, 1, 2]]), [np.array([4])], ks=[1, 3])
    assert m["ndcg@1"] == pytest.approx(1.0)
    assert m["ndcg@3"] == pytest.approx(1.0)
    assert m["recall@1"] == pytest.approx(1.0)


def test_users_without_relevant_items_are_skipped_and_padding_never_hits():
    ranked = np.array([[-1, -1, 0], [0, 1, 2]])
    m = ranking_metrics(ranked, [np.array([0]), np.array([], dtype=np.int64)], ks=[2, 3])
    assert m["users"] == 1
    assert m["recall@2"] == 0.0
    assert m["recall@3"] == 1.0


# Three users over a catalogue of 6 items; training clicks per item:
COUNTS = np.array([9, 0, 3, 1, 0, 7])  # head (top 20% of 6 = ceil(1.2) = 2 items): 0 and 5
RANKED = np.array(
    [
        [0, 5, 2],  # relevant {2, 4}: hit at rank 3
        [1, 3, -1],  # relevant {3}: hit at rank 2; list ran out (padding)
        [5, 0, 2],  # relevant {0, 5}: hits at ranks 1 and 2, both head items
    ]
)
RELEVANT = [np.array([2, 4]), np.array([3]), np.array([0, 5])]


def test_coverage_by_hand():
    # top-2: {0, 5} ∪ {1, 3} ∪ {5, 0} = {0, 1, 3, 5} -> 4 / 6; top-3 adds 2 (padding skipped) -> 5 / 6
    assert coverage_at_k(RANKED, 6, 2) == pytest.approx(4 / 6)
    assert coverage_at_k(RANKED, 6, 3) == pytest.approx(5 / 6)
    assert coverage_at_k(RANKED, 10, 3) == pytest.approx(5 / 10)


def test_popularity_bias_by_hand():
    # top-2 cells: 0, 5, 1, 3, 5, 0 -> ln(1 + 9, 7, 0, 1, 7, 9)
    expected = np.mean(np.log([10, 8, 1, 2, 8, 10]))
    assert popularity_bias(RANKED, COUNTS, 2) == pytest.approx(expected)
    # top-3 adds 2, 2 (padding skipped): 8 cells
    expected3 = np.mean(np.log([10, 8, 4, 1, 2, 8, 10, 4]))
    assert popularity_bias(RANKED, COUNTS, 3) == pytest.approx(expected3)
    assert mean_log_popularity(RELEVANT, COUNTS) == pytest.approx(np.mean(np.log([4, 1, 2, 10, 8])))


def test_tail_items_and_tail_recall_by_hand():
    is_tail = tail_items(COUNTS, 0.2)
    assert is_tail.tolist() == [False, True, True, True, True, False]
    # Tail-relevant: user 0 {2, 4}, user 1 {3}, user 2 none (left out).
    # top-3: user 0 finds 2 -> 1/2; user 1 finds 3 -> 1.  Mean over 2 users = 0.75.
    value, users = tail_recall(RANKED, RELEVANT, is_tail, 3)
    assert (value, users) == (pytest.approx(0.75), 2)
    # top-1: user 0 sees 0 (head), user 1 sees 1 (not relevant) -> 0.
    assert tail_recall(RANKED, RELEVANT, is_tail, 1) == (0.0, 2)


def test_tail_items_ties_and_unclicked_items():
    # ceil(0.5 * 4) = 2 head slots; items 1, 2 and 3 tie at 5 across the boundary: all head,
    # whatever their order in the catalogue.
    assert tail_items(np.array([1, 5, 5, 5]), 0.5).tolist() == [True, False, False, False]
    assert tail_items(np.array([5, 1, 5, 5]), 0.5).tolist() == [False, True, False, False]
    assert tail_items(np.array([9, 5, 5, 1]), 0.25).tolist() == [False, True, True, True]
    # Items without clicks are never head, even when the head has room for them.
    assert tail_items(np.array([3, 0, 0, 0]), 0.9).tolist() == [False, True, True, True]


def test_segments_by_hand():
    activity = np.array([0, 9, 10, 29, 30, 500])
    labels = activity_segments(activity, [10, 30])
    assert labels.tolist() == ["0-9", "0-9", "10-29", "10-29", "30+", "30+"]
    assert segment_labels([10, 30]) == ["0-9", "10-29", "30+"]
    by_segment = metrics_by_segment(RANKED, RELEVANT, np.array(["b", "a", "b"]), [3], order=["a", "b", "c"])
    assert list(by_segment) == ["a", "b"]  # ordered as asked, empty "c" left out
    assert by_segment["a"]["users"] == 1 and by_segment["a"]["recall@3"] == pytest.approx(1.0)
    assert by_segment["b"]["recall@3"] == pytest.approx((1 / 2 + 1) / 2)


def test_score_ranking_has_every_metric():
    results = score_ranking(RANKED, RELEVANT, [1, 3], COUNTS, tail_items(COUNTS))
    for k in (1, 3):
        for name in ("recall", "precision", "hit_rate", "ndcg", "mrr", "coverage", "popularity_bias", "tail_recall"):
            assert f"{name}@{k}" in results
    assert results["tail_users"] == 2
    assert results["recall@3"] == pytest.approx((1 / 2 + 1 + 1) / 3)


# --- independent brute-force reference -----------------------------------------------------


def _reference(ranked, relevant, k, counts, is_tail):
    recall, precision, hit, ndcg, mrr, tail = [], [], [], [], [], []
    shown, pops = set(), []
    for row, rel in zip(ranked.tolist(), relevant):
        top = [item for item in row[:k]]
        for item in top:
            if item >= 0:
                shown.add(item)
                pops.append(math.log(1 + counts[item]))
        rel = set(int(r) for r in rel)
        if not rel:
            continue
        hits = [1 if item in rel else 0 for item in top]
        recall.append(sum(hits) / len(rel))
        precision.append(sum(hits) / k)
        hit.append(1.0 if sum(hits) else 0.0)
        dcg = sum(h / math.log2(i + 2) for i, h in enumerate(hits))
        ndcg.append(dcg / sum(1 / math.log2(i + 2) for i in range(min(len(rel), k))))
        mrr.append(next((1 / (i + 1) for i, h in enumerate(hits) if h), 0.0))
        rel_tail = {r for r in rel if is_tail[r]}
        if rel_tail:
            tail.append(len(rel_tail & set(top)) / len(rel_tail))
    return {
        f"recall@{k}": np.mean(recall),
        f"precision@{k}": np.mean(precision),
        f"hit_rate@{k}": np.mean(hit),
        f"ndcg@{k}": np.mean(ndcg),
        f"mrr@{k}": np.mean(mrr),
        f"coverage@{k}": len(shown) / len(counts),
        f"popularity_bias@{k}": np.mean(pops),
        f"tail_recall@{k}": np.mean(tail) if tail else 0.0,
    }


def _reference_tail(counts, fraction):
    # Head: clicked items with at least the clicks of the ceil(fraction * n)-th most clicked.
    boundary = sorted(counts, reverse=True)[math.ceil(fraction * len(counts)) - 1]
    return np.array([not (c > 0 and c >= boundary) for c in counts])


@pytest.mark.parametrize("seed", range(5))
def test_every_metric_matches_the_reference_on_random_data(seed):
    rng = np.random.default_rng(seed)
    num_items, num_users, depth = 80, 60, 25
    counts = rng.zipf(1.5, size=num_items).clip(max=1000) * (rng.random(num_items) > 0.2)
    ranked = np.stack([rng.permutation(num_items)[:depth] for _ in range(num_users)])
    ranked[rng.random(ranked.shape) < 0.05] = -1  # some padding, anywhere
    relevant = [rng.choice(num_items, size=rng.integers(0, 10), replace=False) for _ in range(num_users)]
    fraction = float(rng.choice([0.1, 0.2, 0.5]))
    is_tail = tail_items(counts, fraction)
    np.testing.assert_array_equal(is_tail, _reference_tail(counts.tolist(), fraction))
    ks = [1, 5, 10, 25]
    got = score_ranking(ranked, relevant, ks, counts, is_tail)
    for k in ks:
        for key, value in _reference(ranked, relevant, k, counts, is_tail).items():
            assert got[key] == pytest.approx(value, abs=1e-12), key
    # Per segment = the metrics of that subset of users.
    segments = activity_segments(rng.integers(0, 50, size=num_users), [5, 20])
    by_segment = metrics_by_segment(ranked, relevant, segments, ks)
    for label, values in by_segment.items():
        members = np.flatnonzero(segments == label)
        expected = ranking_metrics(ranked[members], [relevant[i] for i in members], ks)
        assert values == expected
        for k in ks:
            ref = _reference(ranked[members], [relevant[i] for i in members], k, counts, is_tail)
            if values["users"]:
                assert values[f"ndcg@{k}"] == pytest.approx(ref[f"ndcg@{k}"], abs=1e-12)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="ranked must be"):
        ranking_metrics(np.array([[1, 2]]), [np.array([1])], ks=[5])
    with pytest.raises(ValueError, match="relevant sets"):
        ranking_metrics(np.array([[1, 2]]), [], ks=[1])
    with pytest.raises(ValueError, match="ranked must be"):
        coverage_at_k(RANKED, 6, 4)
    with pytest.raises(ValueError, match="num_items is 3"):
        coverage_at_k(RANKED, 3, 3)
    with pytest.raises(ValueError, match="head_fraction must be in"):
        tail_items(COUNTS, 1.0)
    with pytest.raises(ValueError, match="edges must be increasing"):
        activity_segments(np.array([1, 2]), [30, 10])
    with pytest.raises(ValueError, match="not in order"):
        metrics_by_segment(RANKED, RELEVANT, np.array(["a", "b", "z"]), [3], order=["a", "b"])
    with pytest.raises(ValueError, match="segment labels"):
        metrics_by_segment(RANKED, RELEVANT, np.array(["a"]), [3])
