"""Offline evaluation over the full corpus (numpy + FAISS, no TensorFlow).

- ``protocol``: who is evaluated on what (``build_eval_set``), the model's FAISS ranking;
- ``metrics``: metric functions and their formulas;
- ``baselines``: popularity, implicit ALS and EASE rankers under the same protocol;
- ``compare``: every ranker and metric on one ``EvalSet``;
- ``report``: Markdown tables, ``report.md`` and PNG plots.
"""

from retrieval.evaluation.baselines import (
    BASELINES,
    als_factors_ranking,
    als_ranking,
    baseline_ranking,
    ease_ranking,
    ease_weights,
    fit_als,
    fit_als_pairs,
    popularity_ranking,
    popularity_ranking_from_counts,
)
from retrieval.evaluation.compare import compare_rankers, evaluate_against_baselines, score_ranking, skipped_baselines
from retrieval.evaluation.metrics import (
    activity_segments,
    coverage_at_k,
    mean_log_popularity,
    metrics_by_segment,
    popularity_bias,
    ranking_metrics,
    tail_items,
    tail_recall,
)
from retrieval.evaluation.protocol import EvalSet, build_eval_set, index_ranking, item_click_counts
from retrieval.evaluation.report import format_table, ranker_names, summary_table, write_report

__all__ = [
    "BASELINES",
    "EvalSet",
    "activity_segments",
    "als_factors_ranking",
    "als_ranking",
    "baseline_ranking",
    "build_eval_set",
    "coverage_at_k",
    "compare_rankers",
    "ease_ranking",
    "ease_weights",
    "evaluate_against_baselines",
    "fit_als",
    "fit_als_pairs",
    "format_table",
    "index_ranking",
    "item_click_counts",
    "mean_log_popularity",
    "metrics_by_segment",
    "popularity_bias",
    "popularity_ranking",
    "popularity_ranking_from_counts",
    "ranker_names",
    "ranking_metrics",
    "score_ranking",
    "skipped_baselines",
    "summary_table",
    "tail_items",
    "tail_recall",
    "write_report",
]
