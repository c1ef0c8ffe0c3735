"""Ranking metrics over the full corpus, in plain numpy.

Every function takes ``ranked`` [num_users, depth]: catalogue rows, best first,
``-1`` where a list ran out (padding never counts as a hit or as a
recommendation). Relevance is binary.

Accuracy (the LightGCN / NGCF protocol, so numbers compare with papers):
  - ``rel(u)``: u's test items after masking, ``R_u = |rel(u)|``; ``hit_r = 1`` if the item
    at rank r (0-based) is in ``rel(u)``;
  - ``recall@k    = Σ_{r<k} hit_r / R_u``.  The denominator is R_u, as in LightGCN
    (He et al., SIGIR 2020) and NGCF. Another common convention divides by
    ``min(R_u, k)`` ("R-precision"-like, reaches 1 even when R_u > k), e.g. in some
    RecBole and Microsoft Recommenders settings; numbers under the two conventions
    differ whenever users have more than k relevant items and must not be compared;
  - ``precision@k = Σ_{r<k} hit_r / k``;
  - ``hit_rate@k  = 1 if Σ_{r<k} hit_r > 0 else 0``;
  - ``ndcg@k      = DCG@k / IDCG@k``, ``DCG@k = Σ_{r<k} hit_r / log2(r + 2)``, ``IDCG@k`` the DCG
    of a list with all ``min(R_u, k)`` relevant items first;
  - ``mrr@k       = 1 / (r* + 1)`` with r* the first hit's rank, 0 if none in the top k.
  Each is the mean over users with ``R_u > 0``.

Beyond accuracy (``count(i)``: item i's training clicks; ``T``: the set of test users):
  - ``coverage@k  = |∪_u top_k(u)| / num_items``: the share of the catalogue that any
    user is shown (Herlocker et al., 2004; "catalogue coverage");
  - ``popularity_bias@k = mean over the (u, r < k) cells of ln(1 + count(top_k(u)_r))``: the
    mean log-popularity of what is recommended (higher = more head-heavy; compare with
    the same mean over the test items themselves, ``mean_log_popularity``);
  - ``tail_recall@k = mean over users with R_u^tail > 0 of |top_k(u) ∩ rel(u) ∩ tail| / R_u^tail``,
    where ``tail`` is every catalogue item outside the ``head_fraction`` (20% by default)
    most clicked in training (``tail_items``; ties at the boundary are head),
    ``R_u^tail = |rel(u) ∩ tail|``; items with no training clicks are tail.
    Users without a relevant tail item are left out of the mean.

Segments: ``activity_segments`` labels users by their number of training clicks and
``metrics_by_segment`` computes ``ranking_metrics`` inside each label.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from retrieval.common.arrays import row_membership


def ranking_metrics(
    ranked: np.ndarray, relevant: Sequence[np.ndarray], ks: Sequence[int]
) -> dict[str, float]:
    """recall, precision, hit_rate, ndcg and mrr at each k, averaged over users.

    Args:
      ranked: [num_users, depth] item rows, best first, depth >= max(ks).
      relevant: num_users arrays of relevant item rows; users with none are skipped.
      ks: cut-offs.

    Returns:
      ``{"recall@10": ..., "ndcg@10": ..., ...}`` plus ``"users"`` (the count averaged over).
    """
    ranked = np.asarray(ranked, dtype=np.int64)
    if len(relevant) != len(ranked):
        raise ValueError(f"{len(relevant)} relevant sets for {len(ranked)} ranked lists")
    ks = _check_ks(ranked, ks)
    num_relevant = np.array([len(np.unique(r)) for r in relevant], dtype=np.float64)
    keep = num_relevant > 0
    hits = row_membership(ranked, relevant)[keep].astype(np.float64)
    num_relevant = num_relevant[keep]
    results: dict[str, float] = {"users": int(keep.sum())}
    if not keep.any():
        return results | {f"{name}@{k}": 0.0 for k in ks for name in _NAMES}
    discounts = 1.0 / np.log2(np.arange(ranked.shape[1]) + 2.0)
    cumulative_ideal = np.cumsum(discounts)
    first_hit = np.where(hits.any(axis=1), hits.argmax(axis=1), np.iinfo(np.int64).max)
    for k in ks:
        found = hits[:, :k].sum(axis=1)
        ideal = cumulative_ideal[np.minimum(num_relevant, k).astype(np.int64) - 1]
        results[f"recall@{k}"] = float(np.mean(found / num_relevant))
        results[f"precision@{k}"] = float(np.mean(found / k))
        results[f"hit_rate@{k}"] = float(np.mean(found > 0))
        results[f"ndcg@{k}"] = float(np.mean((hits[:, :k] @ discounts[:k]) / ideal))
        results[f"mrr@{k}"] = float(np.mean(np.where(first_hit < k, 1.0 / (first_hit + 1.0), 0.0)))
    return results


_NAMES = ("recall", "precision", "hit_rate", "ndcg", "mrr")


def coverage_at_k(ranked: np.ndarray, num_items: int, k: int) -> float:
    """Share of the catalogue that appears in at least one user's top k.

    Args:
      ranked: [num_users, depth] item rows, depth >= k; -1 = padding.
      num_items: catalogue size (the denominator).
      k: cut-off.
    """
    ranked = np.asarray(ranked, dtype=np.int64)
    _check_ks(ranked, [k])
    if num_items <= 0:
        raise ValueError(f"num_items must be positive, got {num_items}")
    shown = ranked[:, :k]
    shown = shown[shown >= 0]
    if shown.size and shown.max() >= num_items:
        raise ValueError(f"ranked holds row {int(shown.max())} but num_items is {num_items}")
    return float(np.unique(shown).size / num_items)


def popularity_bias(ranked: np.ndarray, item_counts: np.ndarray, k: int) -> float:
    """Mean ``ln(1 + training clicks)`` of the items recommended in the top k.

    Args:
      ranked: [num_users, depth] item rows, depth >= k; -1 = padding (skipped).
      item_counts: [num_items] training clicks per catalogue row.
      k: cut-off.

    Returns:
      The mean over every non-padding (user, rank < k) cell; 0.0 if there is none.
    """
    ranked = np.asarray(ranked, dtype=np.int64)
    _check_ks(ranked, [k])
    shown = ranked[:, :k]
    shown = shown[shown >= 0]
    if shown.size == 0:
        return 0.0
    return float(np.mean(np.log1p(np.asarray(item_counts, dtype=np.float64)[shown])))


def mean_log_popularity(rows: Sequence[np.ndarray], item_counts: np.ndarray) -> float:
    """Mean ``ln(1 + training clicks)`` over every row of ``rows`` (e.g. the relevant test items):
    the reference ``popularity_bias`` would have if a ranker recommended what users clicked."""
    flat = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows]) if len(rows) else np.zeros(0, np.int64)
    if flat.size == 0:
        return 0.0
    return float(np.mean(np.log1p(np.asarray(item_counts, dtype=np.float64)[flat])))


def tail_items(item_counts: np.ndarray, head_fraction: float = 0.2) -> np.ndarray:
    """Which catalogue rows are tail: outside the ``head_fraction`` most clicked in training.

    The head is every item with at least as many clicks as the
    ``ceil(head_fraction * num_items)``-th most clicked one, so items tied at the
    boundary are all head (the split does not depend on catalogue order, and the
    head can exceed the fraction when many items tie); items without training
    clicks are never head.

    Args:
      item_counts: [num_items] training clicks per catalogue row.
      head_fraction: share of the catalogue that is head, in (0, 1).

    Returns:
      [num_items] bool, True for tail items.
    """
    counts = np.asarray(item_counts, dtype=np.float64)
    if counts.ndim != 1 or counts.size == 0:
        raise ValueError(f"item_counts must be a non-empty 1-D array, got shape {counts.shape}")
    if not 0 < head_fraction < 1:
        raise ValueError(f"head_fraction must be in (0, 1), got {head_fraction}")
    threshold = np.sort(counts)[::-1][int(np.ceil(head_fraction * counts.size)) - 1]
    return ~((counts >= threshold) & (counts > 0))


def tail_recall(
    ranked: np.ndarray, relevant: Sequence[np.ndarray], is_tail: np.ndarray, k: int
) -> tuple[float, int]:
    """Recall@k restricted to relevant tail items.

    Args:
      ranked: [num_users, depth] item rows, depth >= k.
      relevant: num_users arrays of relevant item rows.
      is_tail: [num_items] bool from ``tail_items``.
      k: cut-off.

    Returns:
      ``(mean recall over users with a relevant tail item, number of such users)``;
      ``(0.0, 0)`` when no user has one.
    """
    is_tail = np.asarray(is_tail, dtype=bool)
    tail_relevant = []
    for rows in relevant:
        rows = np.asarray(rows, dtype=np.int64)
        tail_relevant.append(rows[is_tail[rows]])
    metrics = ranking_metrics(np.asarray(ranked)[:, :k], tail_relevant, [k])
    return metrics[f"recall@{k}"], int(metrics["users"])


def activity_segments(activity: np.ndarray, edges: Sequence[int]) -> np.ndarray:
    """Label each user by activity bucket: ``[0, e1)``, ``[e1, e2)``, ..., ``[eN, inf)``.

    Args:
      activity: [num_users] non-negative counts (training clicks).
      edges: increasing positive integers.

    Returns:
      [num_users] object array of labels such as ``"0-9"``, ``"10-29"``, ``"300+"``.
    """
    edges = [int(e) for e in edges]
    if any(e <= 0 for e in edges) or edges != sorted(set(edges)):
        raise ValueError(f"edges must be increasing positive integers, got {edges}")
    activity = np.asarray(activity)
    if activity.ndim != 1 or (activity.size and activity.min() < 0):
        raise ValueError(f"activity must be a 1-D array of counts >= 0, got shape {activity.shape}")
    labels = np.array(segment_labels(edges), dtype=object)
    return labels[np.searchsorted(np.asarray(edges), activity, side="right")]


def segment_labels(edges: Sequence[int]) -> list[str]:
    """The labels ``activity_segments`` uses, in increasing order of activity."""
    bounds = [0, *[int(e) for e in edges]]
    return [f"{lo}-{hi - 1}" for lo, hi in zip(bounds, bounds[1:])] + [f"{bounds[-1]}+"]


def metrics_by_segment(
    ranked: np.ndarray,
    relevant: Sequence[np.ndarray],
    segments: np.ndarray,
    ks: Sequence[int],
    order: Sequence[str] | None = None,
) -> dict[str, dict[str, float]]:
    """``ranking_metrics`` inside each segment.

    Args:
      ranked: [num_users, depth] item rows.
      relevant: num_users arrays of relevant item rows.
      segments: [num_users] labels (e.g. from ``activity_segments``).
      ks: cut-offs.
      order: the labels in the order wanted (e.g. ``segment_labels(edges)``); labels
        with no user are left out. None = order of first appearance.

    Returns:
      ``{label: ranking_metrics(...)}`` for every label with at least one user.
    """
    ranked = np.asarray(ranked, dtype=np.int64)
    segments = np.asarray(segments, dtype=object)
    if len(segments) != len(ranked) or len(relevant) != len(ranked):
        raise ValueError(
            f"{len(ranked)} ranked lists, {len(relevant)} relevant sets and {len(segments)} segment labels"
        )
    present = dict.fromkeys(segments.tolist())
    if order is not None and set(present) - set(order):
        raise ValueError(f"segment labels {sorted(set(present) - set(order))} are not in order={list(order)}")
    results = {}
    for label in [label for label in order if label in present] if order is not None else present:
        members = np.flatnonzero(segments == label)
        results[str(label)] = ranking_metrics(ranked[members], [relevant[int(i)] for i in members], ks)
    return results


def _check_ks(ranked: np.ndarray, ks: Sequence[int]) -> list[int]:
    ks = sorted(set(int(k) for k in ks))
    if not ks or ks[0] <= 0:
        raise ValueError(f"ks must be positive integers, got {ks}")
    if ranked.ndim != 2 or ranked.shape[1] < ks[-1]:
        raise ValueError(f"ranked must be [num_users, >= {ks[-1]}], got shape {ranked.shape}")
    return ks
