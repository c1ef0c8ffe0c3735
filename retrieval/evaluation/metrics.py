"""Ranking metrics over the full corpus, in plain numpy.

Conventions (the LightGCN / NGCF protocol, so numbers compare with papers):
  - ``relevant(u)`` is the set of u's test items (after masking), ``R_u`` its size;
  - ``recall@k    = |top_k(u) ∩ relevant(u)| / R_u``  (denominator R_u, not min(R_u, k));
  - ``precision@k = |top_k(u) ∩ relevant(u)| / k``;
  - ``hit_rate@k  = 1 if top_k(u) ∩ relevant(u) else 0``;
  - ``ndcg@k      = DCG@k / IDCG@k`` with binary gains, ``DCG@k = Σ_{r<k} hit_r / log2(r + 2)``
    and ``IDCG@k`` the DCG of a ranking with all min(R_u, k) relevant items first;
  - ``mrr@k       = 1 / (rank of the first relevant item)``, 0 if none in the top k.
Each is averaged over users with at least one relevant item.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from retrieval.arrays import row_membership


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
    ks = sorted(set(int(k) for k in ks))
    if not ks or ks[0] <= 0:
        raise ValueError(f"ks must be positive integers, got {ks}")
    if ranked.ndim != 2 or ranked.shape[1] < ks[-1]:
        raise ValueError(f"ranked must be [num_users, >= {ks[-1]}], got shape {ranked.shape}")
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
