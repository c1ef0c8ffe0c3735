"""What the loss benchmarks share: the loss variants, a split dataset with its evaluation set, its metrics.

``bench_losses`` compares the ``VARIANTS``; ``bench_kernel`` and ``bench_public`` score
their rows with the same ``Prepared`` data and ``metrics_of`` (recall, NDCG and tail
recall at ``K``), so their tables compare.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

import retrieval  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)
from retrieval.config import Config
from retrieval.data import ITEM, USER, load_dataset
from retrieval.evaluation import build_eval_set
from retrieval.evaluation.metrics import ranking_metrics, tail_items, tail_recall
from retrieval.features import FeatureStatistics

K = 20

# Each variant changes only the loss (and what it needs) on top of the shipped config.
# The comparison rows pin the static log-Q source (the shipped configs use streaming).
_SOFTMAX = [
    "model.loss.kind=softmax",
    "model.loss.hard_negatives=none",
    "model.log_q_correction=true",
    "model.loss.log_q_source=static",
]
VARIANTS: dict[str, list[str]] = {
    "defaults (configs/*.yaml)": [],
    # The dimension the defaults had until 2026-12-02 (e79bcc5), and the step between: what moving to 256 changed here.
    "defaults at dim 64": ["model.embedding_dim=64"],
    "defaults at dim 128": ["model.embedding_dim=128"],
    "in-batch, no log-Q": _SOFTMAX + ["model.loss.negatives=in_batch", "model.log_q_correction=false"],
    "in-batch + static log-Q": _SOFTMAX + ["model.loss.negatives=in_batch"],
    "in-batch + streaming log-Q": _SOFTMAX
    + ["model.loss.negatives=in_batch", "model.loss.log_q_source=streaming"],
    "sampled: uniform": _SOFTMAX + ["model.loss.negatives=uniform"],
    "sampled: unigram^0.75": _SOFTMAX + ["model.loss.negatives=unigram", "model.loss.unigram_alpha=0.75"],
    "sampled: log-uniform": _SOFTMAX + ["model.loss.negatives=log_uniform"],
    "mixed: in-batch + uniform": _SOFTMAX + ["model.loss.negatives=mixed", "model.loss.mixed_corpus=uniform"],
    "hard: in-batch top-k": _SOFTMAX
    + [
        "model.loss.negatives=in_batch",
        "model.loss.hard_negatives=in_batch_top_k",
        "model.loss.num_hard_negatives=100",
    ],
    "hard: FAISS-mined + in-batch": _SOFTMAX
    + [
        "model.loss.negatives=in_batch",
        "model.loss.hard_negatives=mined",
        "model.loss.num_hard_negatives=10",
    ],
    # The corrected log-Q (Khrylchenko et al., RecSys 2025) beside each standard row above.
    "defaults, corrected log-Q": ["model.loss.log_q_variant=corrected"],
    "in-batch + static log-Q, corrected": _SOFTMAX
    + ["model.loss.negatives=in_batch", "model.loss.log_q_variant=corrected"],
    "sampled: uniform, corrected log-Q": _SOFTMAX
    + ["model.loss.negatives=uniform", "model.loss.log_q_variant=corrected"],
    "mixed: in-batch + uniform, corrected log-Q": _SOFTMAX
    + ["model.loss.negatives=mixed", "model.loss.mixed_corpus=uniform", "model.loss.log_q_variant=corrected"],
    "full softmax": ["model.loss.kind=full_softmax", "model.loss.hard_negatives=none"],
    "SGNS (unigram^0.75, 20 shared)": [
        "model.loss.kind=sgns",
        "model.loss.hard_negatives=none",
        "model.loss.negatives=unigram",
        "model.loss.unigram_alpha=0.75",
        "model.loss.num_negatives=20",
        "model.log_q_correction=false",
    ],
    "hierarchical softmax": ["model.loss.kind=hierarchical_softmax", "model.loss.hard_negatives=none"],
    # https://www.tensorflow.org/recommenders/examples/basic_retrieval: ID embeddings of 32,
    # in-batch softmax, no normalisation, temperature or correction, Adagrad 0.1, 3 epochs of 8192.
    "TFRS tutorial recipe": [
        "model.loss.kind=softmax",
        "model.loss.negatives=in_batch",
        "model.loss.hard_negatives=none",
        "model.log_q_correction=false",
        "model.remove_accidental_hits=false",
        "model.normalize=false",
        "model.temperature=1.0",
        "model.embedding_dim=32",
        "train.optimizer=adagrad",
        "train.learning_rate=0.1",
        "model.loss.reduction=sum",  # tfrs.tasks.Retrieval sums over the batch; lr 0.1 assumes it
        "train.batch_size=8192",
        "train.epochs=3",
        "train.validation_fraction=0",
    ],
}


@dataclass
class Prepared:
    """One dataset, split, with everything every ranker is scored on."""

    name: str
    config: Config
    train: pd.DataFrame
    stats: FeatureStatistics
    catalogue_ids: list[str]
    eval_set: object
    is_tail: np.ndarray
    catalogue_index: np.ndarray  # tower index of each catalogue row (0 = no training click)


def prepare_config(name: str, config, eval_users: int | None = None) -> Prepared:
    """Split the config's data and build its evaluation set (at most ``eval_users`` test users, seeded)."""
    dataset = load_dataset(config.data, config.split)
    stats = FeatureStatistics.from_training_clicks(dataset.train)
    catalogue_ids = dataset.items[ITEM].astype(str).tolist()
    test = dataset.test
    users = test[USER].astype(str).unique()
    if eval_users is not None and len(users) > eval_users:
        keep = np.random.default_rng(0).choice(users, eval_users, replace=False)
        test = test[test[USER].astype(str).isin(set(keep))]
    eval_set = build_eval_set(dataset.train, test, catalogue_ids, config.evaluation)
    counts = dataset.train[ITEM].astype(str).value_counts().reindex(catalogue_ids, fill_value=0).to_numpy()
    return Prepared(
        name,
        config,
        dataset.train,
        stats,
        catalogue_ids,
        eval_set,
        tail_items(counts, 0.2),
        stats.items.lookup(catalogue_ids),
    )


def rank_scores(scores: np.ndarray, data: Prepared, k: int = K) -> np.ndarray:
    """Top-k catalogue rows per evaluated user from dense scores [num_users, num_catalogue]."""
    scores = np.array(scores, dtype=np.float64, copy=True)
    for row, excluded in enumerate(data.eval_set.exclude):
        scores[row, excluded] = -np.inf
    top = np.argpartition(-scores, k, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1, kind="stable")
    return np.take_along_axis(top, order, axis=1)


def metrics_of(ranked: np.ndarray, data: Prepared) -> dict[str, float]:
    results = ranking_metrics(ranked, data.eval_set.relevant, [K])
    tail, tail_users = tail_recall(ranked, data.eval_set.relevant, data.is_tail, K)
    return {
        f"recall@{K}": results[f"recall@{K}"],
        f"ndcg@{K}": results[f"ndcg@{K}"],
        f"tail_recall@{K}": tail,
        "users": results["users"],
        "tail_users": tail_users,
    }


