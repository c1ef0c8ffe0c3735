"""Offline evaluation over the full corpus (numpy + FAISS, no TensorFlow)."""

from retrieval.evaluation.metrics import ranking_metrics
from retrieval.evaluation.protocol import (
    EvalSet,
    build_eval_set,
    evaluate_against_baselines,
    format_table,
    index_ranking,
    popularity_ranking,
)

__all__ = [
    "EvalSet",
    "build_eval_set",
    "evaluate_against_baselines",
    "format_table",
    "index_ranking",
    "popularity_ranking",
    "ranking_metrics",
]
