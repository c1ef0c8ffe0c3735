"""The model beside the baselines: every metric, overall and per activity segment.

All rankers see the same ``EvalSet`` (users, relevant rows, masks) and the same
catalogue, so the table's columns differ only in the scorer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np
import pandas as pd

from retrieval.config import EvaluationConfig
from retrieval.data import USER
from retrieval.evaluation.baselines import als_skip_reason, baseline_ranking
from retrieval.evaluation.metrics import (
    activity_segments,
    coverage_at_k,
    mean_log_popularity,
    metrics_by_segment,
    popularity_bias,
    ranking_metrics,
    segment_labels,
    tail_items,
    tail_recall,
)
from retrieval.evaluation.protocol import EvalSet, index_ranking, item_click_counts
from retrieval.index import ItemIndex

log = logging.getLogger("retrieval")

MODEL = "model"


def score_ranking(
    ranked: np.ndarray,
    relevant: Sequence[np.ndarray],
    ks: Sequence[int],
    item_counts: np.ndarray,
    is_tail: np.ndarray,
) -> dict[str, float]:
    """Accuracy and beyond-accuracy metrics of one ranking (definitions: ``metrics``).

    Args:
      ranked: [num_users, depth] catalogue rows, depth >= max(ks).
      relevant: num_users arrays of relevant rows.
      ks: cut-offs.
      item_counts: [num_items] training clicks per catalogue row.
      is_tail: [num_items] bool, from ``tail_items``.

    Returns:
      ``ranking_metrics`` plus ``coverage@k``, ``popularity_bias@k``, ``tail_recall@k``
      and ``tail_users`` (the users tail recall averages over).
    """
    results = ranking_metrics(ranked, relevant, ks)
    tail_users = 0
    for k in sorted(set(ks)):
        results[f"coverage@{k}"] = coverage_at_k(ranked, len(item_counts), k)
        results[f"popularity_bias@{k}"] = popularity_bias(ranked, item_counts, k)
        results[f"tail_recall@{k}"], tail_users = tail_recall(ranked, relevant, is_tail, k)
    results["tail_users"] = tail_users
    return results


def evaluate_against_baselines(
    index: ItemIndex,
    query_embeddings: np.ndarray,
    eval_set: EvalSet,
    train: pd.DataFrame,
    config: EvaluationConfig,
) -> dict[str, dict]:
    """Score the model's FAISS ranking and each configured baseline on ``eval_set``.

    Args:
      index: the catalogue index (its ``item_ids`` are the catalogue).
      query_embeddings: [num_users, dim], aligned with ``eval_set.user_ids``.
      eval_set: users, relevant rows and masks from ``build_eval_set``.
      train: the training clicks (popularity, ALS, tail and activity come from them).
      config: ks, baselines, head fraction, activity edges, query batch size.

    Returns:
      ``{"model": {...}, <baseline>: {...}, "segments": {ranker: {label: {...}}},
      "reference": {...}, "seconds": {ranker: s}, "counts": {...}}``; the per-ranker
      dicts are flat ``"metric@k" -> value`` maps (see ``score_ranking``).
    """
    depth = max(config.ks)
    catalogue_ids = list(index.item_ids)
    activity = train[USER].value_counts().reindex(pd.Index(eval_set.user_ids, dtype=object), fill_value=0)
    rankers = {MODEL: lambda: index_ranking(index, query_embeddings, eval_set, depth, config.query_batch_size)}
    skipped = skipped_baselines(len(train), config)
    for name in config.baselines.rankers:
        if name not in skipped:
            rankers[name] = partial(baseline_ranking, name, train, catalogue_ids, eval_set, depth, config.baselines)
    results = compare_rankers(rankers, eval_set, item_click_counts(train, catalogue_ids), activity.to_numpy(), config)
    return {**results, "skipped_baselines": skipped} if skipped else results


def skipped_baselines(train_clicks: int, config: EvaluationConfig) -> dict[str, str]:
    """The configured baselines not run on a training part of ``train_clicks`` clicks, with why (logged)."""
    skipped = {}
    if "als" in config.baselines.rankers:
        reason = als_skip_reason(train_clicks, config.baselines.als)
        if reason is not None:
            skipped["als"] = reason
            log.warning("ALS baseline skipped: %s", reason)
    return skipped


def compare_rankers(
    rankers: dict[str, Callable[[], np.ndarray]],
    eval_set: EvalSet,
    item_counts: np.ndarray,
    activity: np.ndarray,
    config: EvaluationConfig,
) -> dict[str, dict]:
    """Run each ranker and score it on ``eval_set``, overall and per activity segment.

    Args:
      rankers: name -> a function returning [num_users, max(ks)] catalogue rows.
      eval_set: users, relevant rows and masks from ``build_eval_set``.
      item_counts: [num_items] training clicks per catalogue row (tail, popularity bias).
      activity: [num_users] training clicks of each ``eval_set`` user (segments).
      config: ks, head fraction, activity edges.

    Returns:
      the dict ``evaluate_against_baselines`` documents.
    """
    ks = sorted(set(config.ks))
    is_tail = tail_items(item_counts, config.head_fraction)
    segments = activity_segments(activity, config.activity_edges)
    results: dict[str, dict] = {}
    by_segment, seconds = {}, {}
    for name, rank in rankers.items():
        started = time.perf_counter()
        ranked = rank()
        seconds[name] = round(time.perf_counter() - started, 3)
        results[name] = score_ranking(ranked, eval_set.relevant, ks, item_counts, is_tail)
        by_segment[name] = metrics_by_segment(
            ranked, eval_set.relevant, segments, ks, order=segment_labels(config.activity_edges)
        )
    relevant_rows = np.concatenate(eval_set.relevant) if eval_set.relevant else np.zeros(0, np.int64)
    results["segments"] = by_segment
    results["reference"] = {
        "test_items_log_popularity": mean_log_popularity(eval_set.relevant, item_counts),
        "catalogue_items": int(len(item_counts)),
        "head_fraction": config.head_fraction,
        "tail_items": int(is_tail.sum()),
        "relevant_pairs_on_tail_items": int(is_tail[relevant_rows].sum()),
        "segment_users": {label: int(np.sum(segments == label)) for label in segment_labels(config.activity_edges)},
    }
    results["seconds"] = seconds
    results["counts"] = dict(eval_set.counts)
    return results
