"""Tuning of an approximate index's search parameters against exact search.

``Tuning`` records how the parameters (nprobe, efSearch, ...) were chosen and
the recall they reach; ``_explore`` chooses them (``sweep_parameter`` for one) with FAISS's
``ParameterSpace``: a sweep of the one parameter upwards, or the Pareto front
of several, taking the fastest setting that reaches the target recall.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import faiss
import numpy as np

MAX_EF_SEARCH = 4096  # highest HNSW efSearch tuning tries


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


def sweep_parameter(
    index: faiss.Index, queries: np.ndarray, exact_rows: np.ndarray, k: int, target_recall: float,
    name: str, values: Sequence[float], fixed: str = "",
) -> tuple[str | None, list[dict[str, Any]]]:
    """Sweep one search parameter upwards until recall@k's one-sided 95% lower bound reaches the target.

    Recall and cost both grow with the parameter (nprobe, efSearch), so the first
    value that reaches the target is the fastest one that does. "Reaching" means
    mean - 1.645 standard errors of the per-query recall is at least
    ``target_recall``, so that recall measured afterwards on other queries is not
    below the target half of the time.

    Args:
      index: the FAISS index; its search parameters are left at the last value tried.
      queries: [num_queries, dim] float32, num_queries >= 2.
      exact_rows: [num_queries, k] rows exact search returns for ``queries``.
      name: the parameter, e.g. "nprobe"; ``values`` in increasing order.
      fixed: other parameters set with each value, appended as ",<fixed>" (e.g. "k_factor_rf=4").

    Returns:
      (the params string of the first value reaching the target, or None; every
      point tried, ``{"params", "recall", "recall_lower_bound", "ms_per_query"}``).
    """
    space = faiss.ParameterSpace()
    points: list[dict[str, Any]] = []
    for value in values:
        params = f"{name}={int(value) if float(value).is_integer() else value}" + (f",{fixed}" if fixed else "")
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
    return None, points


def _explore(
    index: faiss.Index, queries: np.ndarray, exact_scores: np.ndarray, exact_rows: np.ndarray, k: int,
    target_recall: float,
) -> tuple[str, list[dict[str, Any]]]:
    """Choose search parameters with FAISS's ParameterSpace; return (params, operating points).

    One parameter (nprobe for IVF, efSearch for HNSW): its FAISS range is
    swept upwards by ``sweep_parameter`` and the first value reaching the
    target is taken (deterministic, unlike a choice among timings); none
    reaching it, the most accurate. Several parameters (e.g. nprobe and the coarse
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
        reached, points = sweep_parameter(index, queries, exact_rows, k, target_recall, name, values)
        return reached or max(points, key=lambda point: point["recall"])["params"], points
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
