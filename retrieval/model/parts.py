"""Config names -> the model's parts: samplers, log-Q sources, losses, the hard-negative miner.

Each name maps to its class through an explicit dict; an unknown name raises
``ValueError`` naming it and the valid ones. ``resolved`` replaces the settings
derived from the data (``model.temperature: auto``) by their values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import pandas as pd
import tensorflow as tf

from retrieval.config import LossConfig, ModelConfig
from retrieval.data import ITEM, USER
from retrieval.features import FeatureStatistics
from retrieval.losses import (
    BilateralSoftmax,
    CosineContrastive,
    FullSoftmax,
    GeneralizedBinaryCrossEntropy,
    HierarchicalSoftmax,
    HuffmanTree,
    NegativeSampling,
    RetrievalLoss,
    SampledSoftmax,
)
from retrieval.samplers import (
    AllItems,
    CorpusSampler,
    FaissHardNegativeMiner,
    InBatchSampler,
    KernelSampler,
    MixedSampler,
    Sampler,
    StaticFrequency,
    StreamingFrequency,
    UserHistory,
    log_uniform_sampler,
    uniform_sampler,
    unigram_sampler,
)


def _choose(table: Mapping[str, Callable], key: str, what: str) -> Callable:
    if key not in table:
        raise ValueError(f"unknown {what} {key!r}; valid: {', '.join(table)}")
    return table[key]


CORPUS_SAMPLERS: dict[str, Callable[[np.ndarray, LossConfig], CorpusSampler]] = {
    "uniform": lambda counts, loss: uniform_sampler(
        len(counts) - 1, loss.num_negatives, unique=loss.unique, seed=loss.seed, per_row=loss.negatives_per_row
    ),
    "unigram": lambda counts, loss: unigram_sampler(
        counts,
        loss.num_negatives,
        alpha=loss.unigram_alpha,
        unique=loss.unique,
        seed=loss.seed,
        per_row=loss.negatives_per_row,
    ),
    "log_uniform": lambda counts, loss: log_uniform_sampler(
        counts, loss.num_negatives, unique=loss.unique, seed=loss.seed, per_row=loss.negatives_per_row
    ),
}

LOG_Q_SOURCES: dict[str, Callable[[np.ndarray, LossConfig], tf.Module]] = {
    "static": lambda counts, loss: StaticFrequency(counts),
    "streaming": lambda counts, loss: StreamingFrequency(
        num_buckets=loss.streaming.num_buckets,
        num_hashes=loss.streaming.num_hashes,
        learning_rate=loss.streaming.learning_rate,
        num_shards=loss.streaming.num_shards or 1,
    ),
}

NEGATIVE_SAMPLERS: dict[str, Callable[[np.ndarray, LossConfig], Sampler]] = {
    "in_batch": lambda counts, loss: InBatchSampler(
        _choose(LOG_Q_SOURCES, loss.log_q_source, "log_q_source")(counts, loss)
    ),
    "uniform": CORPUS_SAMPLERS["uniform"],
    "unigram": CORPUS_SAMPLERS["unigram"],
    "log_uniform": CORPUS_SAMPLERS["log_uniform"],
    "mixed": lambda counts, loss: MixedSampler(
        _choose(LOG_Q_SOURCES, loss.log_q_source, "log_q_source")(counts, loss),
        _choose(CORPUS_SAMPLERS, loss.mixed_corpus, "mixed_corpus")(counts, loss),
    ),
    "kernel": lambda counts, loss: KernelSampler(
        len(counts) - 1,
        loss.num_negatives,
        alpha=loss.kernel.alpha,
        leaf_size=loss.kernel.leaf_size,
        refresh_steps=loss.kernel.refresh_steps,
        seed=loss.seed,
    ),
}

LOSSES: dict[str, type[RetrievalLoss]] = {
    "softmax": SampledSoftmax,
    "full_softmax": FullSoftmax,
    "sgns": NegativeSampling,
    "hierarchical_softmax": HierarchicalSoftmax,
    "cosine_contrastive": CosineContrastive,
    "bsl": BilateralSoftmax,
    "gbce": GeneralizedBinaryCrossEntropy,
}

HARD_NEGATIVES = ("none", "in_batch_top_k", "mined")


def build_sampler(loss: LossConfig, counts: np.ndarray) -> Sampler:
    """The candidate sampler of ``loss`` over tower indices, given training ``counts`` ``[V + 1]``."""
    if loss.kind == "full_softmax":
        return AllItems(len(counts) - 1)
    if loss.kind == "hierarchical_softmax":
        # Its loss uses no candidates; in-batch costs nothing and keeps one code path.
        return InBatchSampler(StaticFrequency(counts))
    return _choose(NEGATIVE_SAMPLERS, loss.negatives, "model.loss.negatives")(counts, loss)


# The temperature of the measured defaults (benchmarks/results/bench_public.md): the best of 0.07-0.2 on
# ML-100K, ML-1M and the synthetic log, whose catalogues hold fewer than ~40 items per click of a user.
DENSE_LOG_TEMPERATURE = 0.2
# The cosine gap the rule below assumes between a user's item and an unrelated one: 0.75, fitted on
# Gowalla's valid part (temperature 0.1 scored recall@20 0.2013, 0.137 (gap 1) 0.1990, 0.2 0.1686); it
# leaves every smaller benchmark at the cap.
COSINE_GAP = 0.75


def derived_temperature(stats: FeatureStatistics) -> float:
    """``model.temperature: auto``: ``min(0.2, 0.75 / ln(items / clicks per user))``.

    With unit-norm towers a user's item scores some cosine gap ``g`` above an
    unrelated one (random directions in 64 dimensions are near-orthogonal), a
    logit gap of ``g / temperature``. For the full softmax the sampled loss
    estimates to rank a user's ``k`` items above the other ``n`` items, that
    gap has to reach their log-odds ``ln(n / k)``. ``k`` is estimated by the
    training clicks per user and ``n`` by the items with training clicks;
    ``g = COSINE_GAP``. Below the cap the rule only matters for large, sparse
    catalogues (Gowalla: 41k items, 27 clicks per user: 0.10).
    """
    clicks = float(np.sum(stats.item_popularity.counts))
    per_user = clicks / max(len(stats.users), 1)
    odds = len(stats.items) / max(per_user, 1.0)
    if odds <= np.e:
        return DENSE_LOG_TEMPERATURE
    return float(min(DENSE_LOG_TEMPERATURE, COSINE_GAP / np.log(odds)))


def resolved(config: ModelConfig, stats: FeatureStatistics) -> ModelConfig:
    """``config`` with every setting derived from the data (``auto``) replaced by its value."""
    if config.temperature == "auto":
        return config.model_copy(update={"temperature": round(derived_temperature(stats), 4)})
    return config


def build_objective(config: ModelConfig, counts: np.ndarray, embedding_dim: int) -> RetrievalLoss:
    """The loss of ``config.loss.kind`` with the model's temperature and log-Q settings."""
    loss = config.loss
    cls = _choose(LOSSES, loss.kind, "model.loss.kind")
    if loss.hard_negatives not in HARD_NEGATIVES:
        raise ValueError(
            f"unknown model.loss.hard_negatives {loss.hard_negatives!r}; valid: {', '.join(HARD_NEGATIVES)}"
        )
    if not isinstance(config.temperature, float):
        raise ValueError(f"model.temperature {config.temperature!r} must be resolved first (model.parts.resolved)")
    if cls is HierarchicalSoftmax:
        return HierarchicalSoftmax(
            HuffmanTree.from_counts(counts), embedding_dim, temperature=config.temperature
        )
    hard_k = loss.num_hard_negatives if loss.hard_negatives == "in_batch_top_k" else None
    # What every candidate loss takes from the config the same way.
    common = {"reduction": loss.reduction, "score_dtype": loss.score_dtype, "name": loss.kind}
    if cls is CosineContrastive:
        # Raw cosines: no temperature, no log-Q (ModelConfig refuses log_q_correction with it).
        return CosineContrastive(
            margin=loss.margin,
            negative_weight=loss.negative_weight,
            remove_accidental_hits=config.remove_accidental_hits,
            num_hard_negatives=hard_k,
            **common,
        )
    if cls is BilateralSoftmax:
        return BilateralSoftmax(
            negative_temperature=loss.bsl_temperature,
            temperature=config.temperature,
            log_q_weight=config.log_q_strength if config.log_q_correction else 0.0,
            remove_accidental_hits=config.remove_accidental_hits,
            num_hard_negatives=hard_k,
            **common,
        )
    if cls is GeneralizedBinaryCrossEntropy:
        # Uniform negatives, no log-Q: beta is gBCE's account of the sampling rate (LossConfig refuses
        # other samplers and hard negatives).
        return GeneralizedBinaryCrossEntropy(
            num_negatives=loss.num_negatives,
            num_items=len(counts) - 1,
            calibration=loss.calibration,
            temperature=config.temperature,
            remove_accidental_hits=config.remove_accidental_hits,
            **common,
        )
    exact = loss.kind == "full_softmax"
    # Full softmax has no sampling to correct for (every Q is 1).
    log_q_weight = config.log_q_strength if config.log_q_correction and not exact else 0.0
    # Over all items the positive is also a column of its own: it must be removed there.
    remove_hits = config.remove_accidental_hits or exact
    # Only the sampled softmax has a corrected variant (the config refuses it for every other kind).
    variant = {"log_q_variant": loss.log_q_variant} if cls is SampledSoftmax else {}
    return cls(
        temperature=config.temperature,
        log_q_weight=log_q_weight,
        remove_accidental_hits=remove_hits,
        num_hard_negatives=hard_k,
        **common,
        **variant,
    )


def build_miner(
    loss: LossConfig,
    stats: FeatureStatistics,
    train_clicks: pd.DataFrame | None,
    history: UserHistory | None = None,
) -> FaissHardNegativeMiner | None:
    """The FAISS hard-negative miner when ``loss.hard_negatives == "mined"``, else None.

    Each user's training items come from ``history`` (rows of ``stats.users``, tower
    indices of ``stats.items``; a streamed log codes it from its shards) or else from
    the ``train_clicks`` frame.
    """
    if loss.hard_negatives != "mined":
        return None
    history = users_training_items(stats, train_clicks, history, needed_by="model.loss.hard_negatives='mined'")
    return FaissHardNegativeMiner(loss.num_hard_negatives, loss.mining_refresh_steps, history)


def users_training_items(
    stats: FeatureStatistics,
    train_clicks: pd.DataFrame | None,
    history: UserHistory | None = None,
    *,
    needed_by: str,
) -> UserHistory:
    """Each user's training items: ``history`` when given (a streamed log codes it from its
    shards), else coded from the ``train_clicks`` frame (rows of ``stats.users``, tower indices of
    ``stats.items``)."""
    if history is not None:
        return history
    if train_clicks is None:
        raise ValueError(
            f"{needed_by} excludes each user's training clicks from their negatives: pass train_clicks "
            "(or user_history) to build_model"
        )
    return UserHistory(
        stats.users.lookup(train_clicks[USER]) - 1, stats.items.lookup(train_clicks[ITEM]), len(stats.users)
    )
