"""The ``evaluation`` section (recall@k and NDCG@k over the full corpus, by activity bucket) and its
baselines (popularity, ALS)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from retrieval.config.base import Seed, _Section


class ALSConfig(_Section):
    """The ALS baseline: implicit-feedback matrix factorisation (Hu, Koren & Volinsky, ICDM 2008)
    fitted by ``implicit.cpu.als.AlternatingLeastSquares`` on the training clicks.

    Defaults: the grid point (factors 32-512 x regularization 1/10/100 x alpha 5/20/50) with the
    highest mean share of each log's best recall@20 over four logs, none scored on a test part:
    ML-100K and the synthetic log on the validation cut of their training part, Gowalla and
    MovieLens-1M on valid.txt: 512 factors, regularization 100, alpha 20, within 0.983 of each
    log's best on average, where the previous default (32 factors, regularization 1, alpha 5) was
    0.847 (0.113 against 0.200 recall@20 on Gowalla; benchmarks/results/bench_als_defaults.md,
    python -m benchmarks.bench_als_defaults). The factors grow with the log (``factors_for``):
    at regularization 100 and alpha 20, 32 factors score within 0.0011 of 512 on the two logs of
    80k clicks and fit 7x faster, while the logs of 800k+ clicks gain up to 0.08 from 512."""

    factors: int | None = Field(
        None,
        gt=0,
        description="Latent dimension; None = the power of 2 nearest training clicks / 2000, within 32..512 "
        "(32 on ML-100K, 512 on Gowalla and MovieLens-1M). The factors take (users + items) x factors x 4 bytes; "
        "the value used is in metrics.json (derived).",
    )
    regularization: float = Field(100.0, ge=0, description="L2 penalty on user and item factors.")
    alpha: float = Field(
        20.0, gt=0, description="Confidence of a clicked pair: alpha * (its number of training clicks)."
    )
    iterations: int = Field(15, gt=0, description="Alternating least-squares sweeps.")
    seed: Seed = Field(0, description="Seed of the ALS initialisation.")
    num_threads: int = Field(0, ge=0, description="Threads for the fit; 0 = every core.")
    max_train_clicks: int | None = Field(
        100_000_000,
        gt=0,
        description="Skip ALS, saying why in the log and metrics.json (skipped_baselines), when the training "
        "part holds more clicks; None = never skip. Its click matrix takes ~12 bytes a distinct (user, item) "
        "pair and is built from streamed counts out of core.",
    )

    def factors_for(self, train_clicks: int) -> int:
        """The latent dimension over ``train_clicks`` training clicks (None resolved)."""
        if self.factors is not None:
            return self.factors
        return int(min(512, max(32, 2 ** round(math.log2(max(train_clicks, 1) / 2000)))))


class BaselinesConfig(_Section):
    """Rankers scored beside the model on the same users, masks and catalogue."""

    rankers: tuple[Literal["popularity", "als"], ...] = Field(
        ("popularity", "als"),
        description="popularity: most clicked training items; als: implicit ALS. [] = the model alone.",
    )
    als: ALSConfig = ALSConfig()

    @model_validator(mode="after")
    def _no_repeats(self) -> BaselinesConfig:
        if len(set(self.rankers)) != len(self.rankers):
            raise ValueError(f"evaluation.baselines.rankers names a ranker twice: {list(self.rankers)}")
        return self


# The largest cut-off of an @k metric: deeper lists say nothing recall@10,000 does not.
MAX_EVALUATION_K = 10_000


class EvaluationConfig(_Section):
    """Offline evaluation over the full corpus (metric formulas: retrieval/evaluation/metrics.py)."""

    ks: tuple[int, ...] = Field((10, 20, 50, 100), description="Cut-offs k of every @k metric (each at most 10,000).")
    exclude_train_items: bool = Field(True, description="Never count a user's training items.")
    unseen_users: Literal["drop", "keep"] = Field(
        "drop",
        description="Test users with no training clicks: ID towers cannot represent them, so "
        "they are dropped (and counted) by default.",
    )
    unseen_items: Literal["keep", "drop"] = Field(
        "keep",
        description="Test clicks on items with no training clicks stay relevant by default (they "
        "are in the index; an ID model will rarely find them).",
    )
    query_batch_size: int = Field(4096, gt=0, description="Queries embedded and searched per FAISS call.")
    baselines: BaselinesConfig = BaselinesConfig()
    head_fraction: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="The most clicked share of the catalogue (by training clicks) that is 'head'; "
        "tail recall counts only relevant items outside it.",
    )
    activity_edges: tuple[int, ...] = Field(
        (10, 30, 100, 300),
        description="Per-segment metrics group users by training clicks: [0, e1), [e1, e2), ..., [eN, inf).",
    )
    plots: bool = Field(True, description="Write PNG plots beside report.md.")

    @model_validator(mode="after")
    def _ks_positive(self) -> EvaluationConfig:
        if not self.ks or any(k <= 0 for k in self.ks):
            raise ValueError(f"evaluation.ks must be positive integers, got {list(self.ks)}")
        if max(self.ks) > MAX_EVALUATION_K:
            # Evaluation ranks [query_batch_size, max(ks)] items per batch: a huge k is an allocation failure
            # after training, so it is refused before.
            raise ValueError(f"evaluation.ks must be at most {MAX_EVALUATION_K:,} (every user's top max(ks) "
                             f"is ranked), got {max(self.ks):,}")
        edges = list(self.activity_edges)
        if any(e <= 0 for e in edges) or edges != sorted(set(edges)):
            raise ValueError(f"evaluation.activity_edges must be increasing positive integers, got {edges}")
        return self
