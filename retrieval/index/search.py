"""Exact inner-product top-k: the result type, the oracle approximate indexes are measured against.

``TopK`` (scores and rows, best first), ``exact_search`` (brute force with
``ExactTopK`` or FAISS's IndexFlatIP, whichever an ``ExactRouting`` picks),
``flat_vectors`` (a Flat index's vectors without a copy) and ``recall_at_k``
(the share of the exact top-k an approximate search finds).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import faiss
import numpy as np

from retrieval.index.exact_topk import ExactTopK


@dataclass(frozen=True)
class TopK:
    """Search results, best first.

    Attributes:
      scores: [num_queries, k] float32 dot products; -inf where fewer than k
        items were available.
      rows: [num_queries, k] int64 index rows; -1 where no item.
    """

    scores: np.ndarray
    rows: np.ndarray


@dataclass(frozen=True)
class ExactRouting:
    """When exact search runs on ``ExactTopK`` rather than FAISS's ``IndexFlatIP``.

    ``ExactTopK`` wins from ``min_queries`` queries over ``min_items`` items on. Measured on 2 cores,
    64-d unit vectors: from 64 queries over 100k items it runs 1.1-2.8x FAISS's speed; over 1M items
    with 1000 queries, at k = 10-1000, 0.65-0.91 of the bare matrix product's speed against FAISS's
    0.12-0.17 (``benchmarks/results/bench_eval.md``; FAISS selects through a heap per score,
    ``ExactTopK`` with one vectorised comparison). Below that its fixed cost per call (thread pool,
    BLAS thread setting, per-block numpy calls) loses: 10-100x slower than FAISS for a few queries
    over 1.7k-10k items, 0.4-1.1x over 10k items at any batch size.

    ``FAISS_ONLY`` and ``EXACT_ALWAYS`` pin one path (benchmarks and tests compare the two).
    """

    min_queries: int = 64
    min_items: int = 50_000

    def uses_exact_top_k(self, num_queries: int, num_items: int) -> bool:
        """Whether a batch of ``num_queries`` over ``num_items`` goes to ``ExactTopK``."""
        return num_queries >= self.min_queries and num_items >= self.min_items


MEASURED_ROUTING = ExactRouting()
FAISS_ONLY = ExactRouting(min_queries=sys.maxsize, min_items=sys.maxsize)
EXACT_ALWAYS = ExactRouting(min_queries=1, min_items=1)


def flat_vectors(index: faiss.IndexFlat) -> np.ndarray:
    """The [ntotal, d] float32 vectors of a FAISS Flat index, as a view (no copy; valid while ``index`` lives)."""
    return faiss.rev_swig_ptr(index.get_xb(), index.ntotal * index.d).reshape(index.ntotal, index.d)


def exact_search(
    embeddings: np.ndarray, queries: np.ndarray, k: int, routing: ExactRouting = MEASURED_ROUTING
) -> TopK:
    """Brute-force inner-product top-k: the oracle approximate indexes are measured against.

    ``ExactTopK`` or FAISS's IndexFlatIP, whichever ``routing`` picks.

    Args:
      embeddings: [num_items, dim] float32.
      queries: [num_queries, dim] float32.
      k: results per query (<= num_items).
      routing: when ``ExactTopK`` runs instead of FAISS.
    """
    if routing.uses_exact_top_k(len(queries), len(embeddings)) and np.all(np.isfinite(queries)):
        scores, rows = ExactTopK(embeddings).search(np.asarray(queries, dtype=np.float32), k)
        return TopK(scores=scores, rows=rows)
    flat = faiss.IndexFlatIP(embeddings.shape[1])
    flat.add(np.ascontiguousarray(embeddings, dtype=np.float32))
    scores, rows = flat.search(np.ascontiguousarray(queries, dtype=np.float32), k)
    return TopK(scores=scores, rows=rows)


def recall_at_k(found: np.ndarray, exact: np.ndarray) -> float:
    """Mean share of each query's exact top-k that the approximate top-k contains.

    Args:
      found: [num_queries, k] rows returned by the index under test (-1 = none).
      exact: [num_queries, k] rows of exact search.
    """
    found, exact = np.asarray(found), np.asarray(exact)
    if found.shape != exact.shape or found.ndim != 2:
        raise ValueError(f"found {found.shape} and exact {exact.shape} must be the same [num_queries, k]")
    hits = sum(np.intersect1d(f[f >= 0], e[e >= 0]).size for f, e in zip(found, exact))
    return float(hits / max(int((exact >= 0).sum()), 1))


def _pad(scores: np.ndarray, rows: np.ndarray, k: int) -> TopK:
    missing = k - rows.shape[1]
    if missing > 0:
        scores = np.pad(scores, ((0, 0), (0, missing)), constant_values=-np.inf)
        rows = np.pad(rows, ((0, 0), (0, missing)), constant_values=-1)
    scores = np.where(rows < 0, -np.inf, scores).astype(np.float32)
    return TopK(scores=scores, rows=rows.astype(np.int64))
