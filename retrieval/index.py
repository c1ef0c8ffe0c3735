"""A FAISS inner-product index over every catalogue item, with the row -> id map.

Retrieval is an argmax over logits: softmax is monotone, so
``argmax_i softmax(z)_i == argmax_i z_i`` and the top-k by dot product is the
top-k by model probability. Neither softmax nor the log-Q correction (a
training-time fix for how negatives were sampled) is applied at inference.

The metric is always inner product. When the towers L2-normalise their
outputs (``model.normalize``) every non-zero embedding is a unit vector and
inner product *is* cosine similarity; ``ItemIndex.normalized`` records whether
that held for the indexed vectors.

Approximate indexes (IVF, HNSW, PQ, ...) are tuned after building: over the
settings FAISS's ``ParameterSpace`` knows for the index (nprobe, efSearch,
...), recall@k against exact search is measured on a sample of queries, and
the fastest setting that reaches the target recall is kept
(``ItemIndex.search_params``) and saved with the index, so a loaded index
searches exactly as measured.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pandas as pd

from retrieval.arrays import drop_members
from retrieval.config import IndexConfig
from retrieval.exact_topk import ExactTopK, checked_search_args

INDEX_FILE = "index.faiss"
ITEM_IDS_FILE = "item_ids.parquet"
INDEX_INFO_FILE = "index.json"
ADD_BATCH_SIZE = 100_000  # vectors per index.add call: bounds the progress interval
MAX_EF_SEARCH = 4096  # highest HNSW efSearch tuning tries
# Exact search runs on ``ExactTopK`` (blocked sgemm + threshold selection) from this many
# queries and items on, FAISS's IndexFlatIP below (see ``use_exact_top_k``).
EXACT_MIN_QUERIES = 64
EXACT_MIN_ITEMS = 50_000

log = logging.getLogger("retrieval.index")


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
class Tuning:
    """How the search parameters of an approximate index were chosen, and what they achieve.

    Attributes:
      params: FAISS parameter string applied at search time, e.g. ``"nprobe=16"``
        ("" = the index's defaults).
      recall: recall@k against exact search measured on ``validation_queries``
        queries that took no part in choosing ``params``.
      k: the k of recall@k.
      target_recall: the recall asked for.
      reached_target: ``recall >= target_recall``.
      query_source: where the queries came from, e.g. ``"training users"``
        (real query embeddings) or ``"items"`` (item embeddings standing in
        for queries when none were given).
      tuning_queries: queries used to choose ``params``.
      validation_queries: queries used to measure ``recall``.
      method: ``"faiss.ParameterSpace"`` or ``"config"`` (params given in
        ``index.search_params``, only measured).
      operating_points: the settings tried (one parameter) or the Pareto
        front ``ParameterSpace.explore`` found (several), each
        ``{"params", "recall", "ms_per_query"}`` on the tuning queries (a
        sweep adds ``"recall_lower_bound"``, the value compared with the target).
    """

    params: str
    recall: float
    k: int
    target_recall: float
    reached_target: bool
    query_source: str
    tuning_queries: int
    validation_queries: int
    method: str
    operating_points: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ItemIndex:
    """FAISS index + item ids; row r of the index is ``item_ids[r]``."""

    def __init__(
        self,
        index: faiss.Index,
        item_ids: Sequence[str],
        factory: str,
        *,
        normalized: bool = False,
        search_params: str = "",
        tuning: Tuning | None = None,
    ):
        if index.ntotal != len(item_ids):
            raise ValueError(f"index holds {index.ntotal} vectors but {len(item_ids)} item ids were given")
        self.index = index
        self.item_ids = np.asarray(item_ids, dtype=object)
        self.factory = factory
        self.normalized = normalized
        self.tuning = tuning
        self.search_params = ""
        self.set_search_params(search_params)

    @classmethod
    def build(
        cls,
        item_ids: Sequence[str],
        embeddings: np.ndarray,
        factory: str = "Flat",
        *,
        train_sample_size: int | None = None,
        seed: int = 0,
    ) -> ItemIndex:
        """Index ``embeddings`` [num_items, dim] for inner-product search.

        Args:
          item_ids: [num_items] unique string ids, in embedding row order.
          embeddings: [num_items, dim] float32.
          factory: a FAISS index factory string ("Flat", "IVF256,Flat", "HNSW32",
            "OPQ16,IVF1024,PQ16", ...).
          train_sample_size: indexes that need training (IVF, PQ, OPQ) are
            trained on at most this many rows drawn at random (None = all rows).
          seed: seed of that sample.
        """
        embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
        if embeddings.ndim != 2 or embeddings.shape[0] == 0:
            raise ValueError(f"embeddings must be [num_items, dim] with num_items > 0, got {embeddings.shape}")
        if len(item_ids) != embeddings.shape[0]:
            raise ValueError(f"{len(item_ids)} item ids for {embeddings.shape[0]} embeddings")
        if len(set(item_ids)) != len(item_ids):
            raise ValueError("item ids must be unique")
        if not np.all(np.isfinite(embeddings)):
            raise ValueError("embeddings contain NaN or inf")
        if train_sample_size is not None and train_sample_size <= 0:
            raise ValueError(f"train_sample_size must be positive, got {train_sample_size}")
        try:
            index = faiss.index_factory(embeddings.shape[1], factory, faiss.METRIC_INNER_PRODUCT)
        except RuntimeError as error:
            raise ValueError(f"index.factory {factory!r} is not a valid FAISS factory string: {error}") from None
        if not index.is_trained:
            sample = embeddings
            if train_sample_size is not None and len(embeddings) > train_sample_size:
                rows = np.random.default_rng(seed).choice(len(embeddings), train_sample_size, replace=False)
                sample = embeddings[np.sort(rows)]
            started = time.perf_counter()
            try:
                index.train(sample)
            except RuntimeError as error:
                raise ValueError(
                    f"index.factory {factory!r} cannot be trained on {len(sample)} vectors: {error}"
                ) from None
            log.info("trained %s on %d vectors in %.1f s", factory, len(sample), time.perf_counter() - started)
        _add_with_progress(index, embeddings)
        return cls(index, list(item_ids), factory, normalized=_is_normalized(embeddings))

    @property
    def dim(self) -> int:
        return self.index.d

    def __len__(self) -> int:
        return self.index.ntotal

    @property
    def is_exact(self) -> bool:
        """True when search is brute force (results equal a full argsort)."""
        return isinstance(self.index, (faiss.IndexFlatIP, faiss.IndexFlat))

    def set_search_params(self, params: str) -> None:
        """Apply a FAISS parameter string such as ``"nprobe=16"`` or ``"efSearch=128"``."""
        if params:
            try:
                # faiss's stub lists the (cno: int) and (param_string: str) overloads without @overload.
                faiss.ParameterSpace().set_index_parameters(self.index, params)  # type: ignore[arg-type]
            except RuntimeError as error:
                raise ValueError(f"search params {params!r} do not apply to {self.factory!r}: {error}") from None
        self.search_params = params

    def search(
        self,
        queries: np.ndarray,
        k: int,
        exclude: Sequence[np.ndarray] | None = None,
    ) -> TopK:
        """Top-k rows by inner product for each query.

        Args:
          queries: [num_queries, dim] float32.
          k: results per query.
          exclude: optional per-query arrays of index rows that must not be
            returned (e.g. items the user already clicked).

        Returns:
          TopK with [num_queries, k] scores and rows.

        A Flat index searches with ``ExactTopK`` when ``use_exact_top_k`` says
        it is faster (it masks ``exclude`` in place instead of over-fetching),
        with FAISS otherwise; both return the exact top-k.
        """
        queries = checked_search_args(queries, self.dim, k, exclude)
        if isinstance(self.index, faiss.IndexFlat) and self.index.metric_type == faiss.METRIC_INNER_PRODUCT:
            if use_exact_top_k(len(queries), len(self)) and np.all(np.isfinite(queries)):
                scores, rows = ExactTopK(flat_vectors(self.index)).search(queries, k, exclude)
                return TopK(scores=scores, rows=rows)
        extra = 0 if exclude is None else max((len(rows) for rows in exclude), default=0)
        depth = min(k + extra, len(self))
        scores, rows = self.index.search(queries, depth)
        if exclude is not None and extra:
            rows, scores = drop_members(rows, scores, exclude)
        return _pad(scores[:, :k], rows[:, :k], k)

    def tune(
        self,
        embeddings: np.ndarray,
        queries: np.ndarray,
        *,
        k: int = 100,
        target_recall: float = 0.95,
        query_source: str = "queries",
        params: str | None = None,
        exact: TopK | None = None,
    ) -> Tuning:
        """Choose search parameters reaching ``target_recall`` recall@k against exact search.

        The queries are shuffled (seeded) and split in two halves. On the
        first, settings from FAISS's ``ParameterSpace`` are measured (recall =
        the share of the exact top-k found in the approximate top-k, FAISS's
        ``IntersectionCriterion``) and the fastest that reaches the target is
        chosen (see ``_explore``); its recall is then measured on the second
        half, which took no part in the choice.
        When no setting reaches the target, the most accurate one is kept and
        ``reached_target`` is False.

        Args:
          embeddings: [num_items, dim] the indexed vectors, for the exact reference.
          queries: [num_queries, dim] query embeddings (>= 2); all-zero rows
            (out-of-vocabulary queries, which tie with every item) are dropped.
          k: the k of recall@k (capped at the index size).
          target_recall: recall to reach, in (0, 1].
          query_source: where ``queries`` come from, recorded in the result.
          params: if given, apply these instead of exploring, and only measure.
          exact: ``exact_search(embeddings, queries, k)`` if already computed
            (e.g. to tune several indexes on the same queries); else computed here.

        Returns:
          The Tuning, also kept in ``self.tuning``; ``self.search_params`` is set.
        """
        embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        if embeddings.shape != (len(self), self.dim):
            raise ValueError(f"embeddings must be [{len(self)}, {self.dim}], got {embeddings.shape}")
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise ValueError(f"queries must be [num_queries, {self.dim}], got {queries.shape}")
        if not 0 < target_recall <= 1:
            raise ValueError(f"target_recall must be in (0, 1], got {target_recall}")
        known = np.any(queries != 0, axis=1)
        queries = queries[known]
        if len(queries) < 2:
            raise ValueError(f"tuning needs at least 2 non-zero queries, got {len(queries)}")
        k = min(k, len(self))
        half = len(queries) // 2
        if exact is None:
            exact = exact_search(embeddings, queries, k)
        else:
            if exact.rows.shape != (len(known), k):
                raise ValueError(f"exact must be [{len(known)}, {k}] results for these queries, got {exact.rows.shape}")
            exact = TopK(scores=exact.scores[known], rows=exact.rows[known])
        # Shuffle so that both halves follow the same distribution whatever the input order.
        order = np.random.default_rng(0).permutation(len(queries))
        queries, exact = queries[order], TopK(scores=exact.scores[order], rows=exact.rows[order])
        operating_points: list[dict[str, Any]] = []
        if params is None:
            params, operating_points = _explore(self.index, queries[:half], exact.scores[:half], exact.rows[:half],
                                                k, target_recall)
            method = "faiss.ParameterSpace"
        else:
            method = "config"
        self.set_search_params(params)
        recall = recall_at_k(self.index.search(queries[half:], k)[1], exact.rows[half:])
        self.tuning = Tuning(
            params=params,
            recall=recall,
            k=k,
            target_recall=target_recall,
            reached_target=recall >= target_recall,
            query_source=query_source,
            tuning_queries=half if method != "config" else 0,
            validation_queries=len(queries) - half,
            method=method,
            operating_points=operating_points,
        )
        log.info("tuned %s: %s -> recall@%d %.4f (target %.2f)", self.factory, params or "defaults", k, recall,
                 target_recall)
        return self.tuning

    def info(self) -> dict[str, Any]:
        """What ``index.json`` holds: factory, sizes, metric, search params and tuning."""
        return {
            "factory": self.factory,
            "dim": self.dim,
            "ntotal": len(self),
            "metric": "inner_product",
            "normalized": self.normalized,
            "exact": self.is_exact,
            "search_params": self.search_params,
            "tuning": self.tuning.to_dict() if self.tuning else None,
        }

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        faiss.write_index(self.index, str(directory / INDEX_FILE))
        pd.DataFrame({"row": np.arange(len(self)), "item_id": self.item_ids.astype(str)}).to_parquet(
            directory / ITEM_IDS_FILE, index=False
        )
        (directory / INDEX_INFO_FILE).write_text(json.dumps(self.info(), indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> ItemIndex:
        """Load a saved index and apply its saved search parameters."""
        directory = Path(directory)
        info = json.loads((directory / INDEX_INFO_FILE).read_text())
        item_ids = pd.read_parquet(directory / ITEM_IDS_FILE).sort_values("row")["item_id"].tolist()
        tuning = Tuning(**info["tuning"]) if info.get("tuning") else None
        return cls(
            faiss.read_index(str(directory / INDEX_FILE)),
            item_ids,
            info["factory"],
            normalized=bool(info.get("normalized", False)),
            search_params=info.get("search_params", ""),
            tuning=tuning,
        )


def build_index(
    item_ids: Sequence[str],
    embeddings: np.ndarray,
    config: IndexConfig,
    queries: np.ndarray | None = None,
    query_source: str = "queries",
) -> ItemIndex:
    """Build the index ``config`` describes and, unless it is exact, tune it.

    Args:
      item_ids: [num_items] unique string ids.
      embeddings: [num_items, dim] float32 item embeddings.
      config: factory string, training sample, tuning target.
      queries: [num_queries, dim] real query embeddings to tune on; when
        None (or fewer than 2 non-zero rows), a sample of the item embeddings
        stands in for queries and the tuning record says so.
      query_source: what ``queries`` are, recorded in the tuning record.
    """
    index = ItemIndex.build(
        item_ids, embeddings, config.factory, train_sample_size=config.train_sample_size, seed=config.seed
    )
    if index.is_exact:
        return index
    rng = np.random.default_rng(config.seed)
    source = query_source
    if queries is not None:
        queries = np.asarray(queries, dtype=np.float32)
        queries = queries[np.any(queries != 0, axis=1)]
    if queries is None or len(queries) < 2:
        source, queries = "items", np.asarray(embeddings, dtype=np.float32)
        queries = queries[np.any(queries != 0, axis=1)]
    if len(queries) > config.tune_queries:
        queries = queries[rng.choice(len(queries), config.tune_queries, replace=False)]
    if len(queries) < 2:
        log.warning("index %s left untuned: fewer than 2 non-zero embeddings to tune on", config.factory)
        if config.search_params:
            index.set_search_params(config.search_params)
        return index
    index.tune(
        embeddings,
        queries,
        k=config.tune_k,
        target_recall=config.target_recall,
        query_source=source,
        params=config.search_params,
    )
    return index


def use_exact_top_k(num_queries: int, num_items: int) -> bool:
    """Whether ``ExactTopK`` beats FAISS's ``IndexFlatIP`` on a batch of this size.

    Measured on 2 cores, 64-d unit vectors: from 64 queries over 100k items,
    ``ExactTopK`` runs 1.1-2.8x FAISS's speed; over 1M items with 1000 queries,
    at k = 10-1000, 0.65-0.91 of the bare matrix product's speed against
    FAISS's 0.12-0.17 (``benchmarks/results/bench_eval.md``; FAISS selects
    through a heap per score, ``ExactTopK`` with one vectorised comparison).
    Below that its fixed cost per call (thread pool, BLAS thread
    setting, per-block numpy calls) loses: 10-100x slower than FAISS for a few
    queries over 1.7k-10k items, 0.4-1.1x over 10k items at any batch size.
    """
    return num_queries >= EXACT_MIN_QUERIES and num_items >= EXACT_MIN_ITEMS


def flat_vectors(index: faiss.IndexFlat) -> np.ndarray:
    """The [ntotal, d] float32 vectors of a FAISS Flat index, as a view (no copy; valid while ``index`` lives)."""
    return faiss.rev_swig_ptr(index.get_xb(), index.ntotal * index.d).reshape(index.ntotal, index.d)


def exact_search(embeddings: np.ndarray, queries: np.ndarray, k: int) -> TopK:
    """Brute-force inner-product top-k: the oracle approximate indexes are measured against.

    ``ExactTopK`` or FAISS's IndexFlatIP, whichever ``use_exact_top_k`` picks.

    Args:
      embeddings: [num_items, dim] float32.
      queries: [num_queries, dim] float32.
      k: results per query (<= num_items).
    """
    if use_exact_top_k(len(queries), len(embeddings)) and np.all(np.isfinite(queries)):
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


def _explore(
    index: faiss.Index, queries: np.ndarray, exact_scores: np.ndarray, exact_rows: np.ndarray, k: int,
    target_recall: float,
) -> tuple[str, list[dict[str, Any]]]:
    """Choose search parameters with FAISS's ParameterSpace; return (params, operating points).

    One parameter (nprobe for IVF, efSearch for HNSW): recall and cost both
    grow with it, so its FAISS range is swept upwards and the first value
    reaching the target is the fastest; this is deterministic, unlike a
    choice among timings. "Reaching" means the one-sided 95% lower bound of
    the mean recall (mean - 1.645 standard errors over the queries) is at
    least the target, so that the recall measured afterwards on other
    queries is not below the target half of the time. Several parameters (e.g. nprobe and the coarse
    quantizer's efSearch, or PQ's Hamming threshold): ``ParameterSpace.explore``
    finds the recall/time Pareto front and the fastest point reaching the
    target is taken.
    """
    space = faiss.ParameterSpace()
    space.initialize(index)
    ranges = [space.parameter_ranges.at(i) for i in range(space.parameter_ranges.size())]
    if not ranges:
        return "", []
    if len(ranges) == 1:
        name = ranges[0].name
        values = [ranges[0].values.at(i) for i in range(ranges[0].values.size())]
        if name == "efSearch":
            # HNSW searches with max(efSearch, k): values below k all mean k at tuning time but
            # less at a smaller serving k, so tune from k upwards; FAISS's range stops at 512,
            # which large, hard catalogues need to exceed.
            values = sorted({float(k), *(v for v in values if v > k)})
            while values[-1] < MAX_EF_SEARCH:
                values.append(values[-1] * 2)
        points: list[dict[str, Any]] = []
        for value in values:
            params = f"{name}={int(value) if float(value).is_integer() else value}"
            # faiss's stub lists the (cno: int) and (param_string: str) overloads without @overload.
            space.set_index_parameters(index, params)  # type: ignore[arg-type]
            started = time.perf_counter()
            rows = index.search(queries, k)[1]
            seconds = time.perf_counter() - started
            per_query = np.array([np.intersect1d(f[f >= 0], e).size / k for f, e in zip(rows, exact_rows)])
            lower = per_query.mean() - 1.645 * per_query.std(ddof=1) / np.sqrt(len(per_query))
            points.append({"params": params, "recall": float(per_query.mean()), "recall_lower_bound": float(lower),
                           "ms_per_query": 1e3 * seconds / len(queries)})
            if lower >= target_recall:
                return params, points
        return max(points, key=lambda point: point["recall"])["params"], points
    criterion = faiss.IntersectionCriterion(len(queries), k)
    # faiss's Python wrapper replaces set_groundtruth(gt_nnn, D, I) and explore(index, nq, xq, crit, ops)
    # with (D, I) and (index, xq, crit) -> OperatingPoints; its stub still describes the SWIG signatures.
    criterion.set_groundtruth(  # type: ignore[call-overload]
        np.ascontiguousarray(exact_scores), np.ascontiguousarray(exact_rows)
    )
    space.verbose = 0
    space.min_test_duration = 0.05  # repeat fast settings so their timings are not pure noise
    # keep it alive: optimal_pts points into it
    explored = space.explore(index, queries, criterion)  # type: ignore[call-overload]
    pareto = explored.optimal_pts
    # Pareto front: sorted by time, recall increasing. Row 0 is FAISS's
    # placeholder ("", perf 0).
    front = [
        {"params": pareto.at(i).key, "recall": float(pareto.at(i).perf),
         "ms_per_query": 1e3 * pareto.at(i).t / len(queries)}
        for i in range(pareto.size())
        if pareto.at(i).key
    ]
    if not front:
        return "", []
    reaching = [point for point in front if point["recall"] >= target_recall]
    chosen = reaching[0] if reaching else max(front, key=lambda point: point["recall"])
    return chosen["params"], front


def _add_with_progress(index: faiss.Index, embeddings: np.ndarray) -> None:
    total = len(embeddings)
    started = time.perf_counter()
    for start in range(0, total, ADD_BATCH_SIZE):
        index.add(embeddings[start : start + ADD_BATCH_SIZE])
        if total > ADD_BATCH_SIZE:
            done = min(start + ADD_BATCH_SIZE, total)
            log.info("index add: %d / %d vectors (%.0f%%), %.1f s", done, total, 100 * done / total,
                     time.perf_counter() - started)


def _is_normalized(embeddings: np.ndarray, tolerance: float = 1e-3) -> bool:
    """True when every non-zero row is a unit vector (inner product == cosine)."""
    norms = np.linalg.norm(embeddings, axis=1)
    norms = norms[norms > 0]
    return bool(len(norms)) and bool(np.all(np.abs(norms - 1) <= tolerance))


def _pad(scores: np.ndarray, rows: np.ndarray, k: int) -> TopK:
    missing = k - rows.shape[1]
    if missing > 0:
        scores = np.pad(scores, ((0, 0), (0, missing)), constant_values=-np.inf)
        rows = np.pad(rows, ((0, 0), (0, missing)), constant_values=-1)
    scores = np.where(rows < 0, -np.inf, scores).astype(np.float32)
    return TopK(scores=scores, rows=rows.astype(np.int64))
