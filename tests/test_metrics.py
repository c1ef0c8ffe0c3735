"""Ranking metrics against hand-worked examples and a brute-force reference."""

import math

import numpy as np
import pytest

from retrieval.evaluation import ranking_metrics


def test_hand_worked_example():
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


def _brute_force(ranked, relevant, k):
    recall, ndcg, mrr = [], [], []
    for row, rel in zip(ranked, relevant):
        rel = set(rel.tolist())
        if not rel:
            continue
        top = list(row[:k])
        hits = [1.0 if item in rel else 0.0 for item in top]
        recall.append(sum(hits) / len(rel))
        dcg = sum(h / math.log2(i + 2) for i, h in enumerate(hits))
        idcg = sum(1 / math.log2(i + 2) for i in range(min(len(rel), k)))
        ndcg.append(dcg / idcg)
        first = next((i for i, h in enumerate(hits) if h), None)
        mrr.append(0.0 if first is None else 1 / (first + 1))
    return np.mean(recall), np.mean(ndcg), np.mean(mrr)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_brute_force_on_random_rankings(seed):
    rng = np.random.default_rng(seed)
    num_items, depth = 60, 20
    ranked = np.stack([rng.permutation(num_items)[:depth] for _ in range(50)])
    relevant = [rng.choice(num_items, size=rng.integers(0, 8), replace=False) for _ in range(50)]
    m = ranking_metrics(ranked, relevant, ks=[5, 20])
    for k in (5, 20):
        recall, ndcg, mrr = _brute_force(ranked, relevant, k)
        assert m[f"recall@{k}"] == pytest.approx(recall)
        assert m[f"ndcg@{k}"] == pytest.approx(ndcg)
        assert m[f"mrr@{k}"] == pytest.approx(mrr)


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="ranked must be"):
        ranking_metrics(np.array([[1, 2]]), [np.array([1])], ks=[5])
    with pytest.raises(ValueError, match="relevant sets"):
        ranking_metrics(np.array([[1, 2]]), [], ks=[1])
