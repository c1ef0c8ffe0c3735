"""The ``model`` section: the loss (``model.loss``: softmax kind, negative samplers, log-Q sources,
the streaming frequency estimate and the kernel sampler), the embedding and the temperature."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from retrieval.config.base import Seed, _kind, _Section, _yaml_scalar

# Logits are q . d / temperature in float32: below this the softmax is a hard max, and near 1e-38
# 1 / temperature overflows float32 (1e-300 trained to NaN).
MIN_TEMPERATURE = 1e-4


class StreamingFrequencyConfig(_Section):
    """Streaming log-Q estimation for in-batch negatives (Yi et al., RecSys 2019): per hashed item,
    the last step it was seen and an exponential moving average of the steps between sightings."""

    num_buckets: int = Field(
        1 << 18, gt=0, description="Size of each hash array (>= live items keeps collisions rare)."
    )
    num_hashes: int = Field(2, ge=1, le=4, description="Hash functions; the estimate takes the largest gap over them.")
    learning_rate: float = Field(
        0.05, gt=0, le=1, description="EMA rate of the gap estimate: larger tracks drift faster, smaller is less noisy."
    )
    num_shards: int = Field(
        0, ge=0,
        description="Variables each hash array is split into (bucket b in shard b % num_shards), which "
        "ParameterServerStrategy places on its ps tasks in turn. 0: train.parameter_server.max_shards under "
        "train.distribute: parameter_server (as the ID tables), else 1.",
    )


class KernelSamplerConfig(_Section):
    """Kernel-based sampled softmax (Blanc & Rendle, ICML 2018): per-query negatives drawn exactly,
    with replacement, from K(q, d) = alpha * (q . d)^2 + 1 over the current doc embeddings, through a
    tree of sum(d d^T) over the items (retrieval/samplers/kernel.py)."""

    alpha: float = Field(
        100.0,
        gt=0,
        description="Kernel scale on the raw tower dot product q . d: larger follows the model's "
        "scores (logit = q . d / temperature) more sharply; the +1 keeps every item drawable.",
    )
    leaf_size: int = Field(32, gt=0, description="Items per leaf bucket of the kernel tree.")
    refresh_steps: int = Field(
        100,
        gt=0,
        description="Rebuild the tree from the doc tower's current embeddings of every item every this "
        "many training steps (the first step always builds it); in between it is stale.",
    )


# The negatives drawn from the whole corpus with a fixed distribution (samplers/corpus.py).
CORPUS_NEGATIVES = ("uniform", "unigram", "log_uniform")


class LossConfig(_Section):
    """The training objective and its candidates (retrieval/losses/, retrieval/samplers/).

    ``kind: softmax`` with ``negatives: in_batch`` is in-batch softmax; with a
    corpus sampler it is sampled softmax; ``mixed`` is in-batch plus corpus draws
    (Yang et al. 2020). Every sampled loss subtracts ``model.log_q_strength * log Q``
    when ``model.log_q_correction`` is on, Q being each candidate's expected count.
    """

    kind: Literal[
        "softmax", "full_softmax", "sgns", "hierarchical_softmax", "cosine_contrastive", "bsl", "gbce"
    ] = Field(
        "softmax",
        description="softmax: sampled softmax over `negatives`; full_softmax: exact, over every item "
        "(negatives ignored); sgns: word2vec binary logistic over `negatives` (NCE with log-Q "
        "correction); hierarchical_softmax: Huffman tree over items by training frequency (a "
        "comparison loss: not servable from an inner-product index); cosine_contrastive: SimpleX's "
        "CCL over `negatives`, (1 - s+) + negative_weight * mean relu(s- - margin) on raw cosines (needs "
        "model.normalize, refuses model.log_q_correction, ignores model.temperature); bsl: bilateral "
        "softmax, -s+ / temperature + bsl_temperature * logsumexp(s- / temperature) over `negatives`; "
        "gbce: gSASRec's generalised binary cross-entropy over num_negatives uniform draws, "
        "(beta * softplus(-s+) + sum softplus(s-)) / (negatives + 1) with beta from `calibration` (needs "
        "negatives: uniform; no log-Q correction).",
    )
    negatives: Literal["in_batch", "uniform", "unigram", "log_uniform", "mixed", "kernel"] = Field(
        "in_batch",
        description="Candidates of softmax, sgns, cosine_contrastive and bsl: the batch's positives, corpus "
        "draws (uniform, count^unigram_alpha, log-uniform over frequency ranks), mixed = in-batch + "
        "mixed_corpus draws, or kernel = num_negatives draws per query from the quadratic kernel of the current model "
        "(section `kernel`).",
    )
    num_negatives: int = Field(
        1024,
        gt=0,
        description="Corpus draws per batch (shared by its queries); with negatives=kernel or "
        "negatives_per_row, draws per query.",
    )
    negatives_per_row: bool = Field(
        False,
        description="uniform, unigram, log_uniform: draw num_negatives for each row of the batch "
        "([batch, num_negatives] candidates, with replacement, as SimpleX and BSL sample) instead of one "
        "set shared by the batch; costs batch_size times the doc-tower evaluations.",
    )
    mixed_corpus: Literal["uniform", "unigram", "log_uniform"] = Field(
        "uniform", description="The corpus part of negatives: mixed (uniform in Yang et al. 2020)."
    )
    unigram_alpha: float = Field(
        0.75, ge=0, description="Exponent of the unigram sampler (1 popularity, 0.75 word2vec)."
    )
    unique: bool = Field(False, description="Draw corpus negatives without replacement (TensorFlow's expected counts).")
    hard_negatives: Literal["none", "in_batch_top_k", "mined"] = Field(
        "none",
        description="in_batch_top_k: keep each row's num_hard_negatives highest corrected logits (TFRS "
        "num_hard_negatives); mined: add num_hard_negatives per query from a FAISS index over the "
        "current doc embeddings, excluding the positive and the user's training clicks.",
    )
    num_hard_negatives: int = Field(10, gt=0, description="k of hard_negatives.")
    reduction: Literal["mean", "sum"] = Field(
        "mean",
        description="Batch loss: mean over the batch (learning rates independent of batch_size), or sum, "
        "as tfrs.tasks.Retrieval (its tutorials' learning rates assume it).",
    )
    mining_refresh_steps: int = Field(100, gt=0, description="Rebuild the mining index every this many steps.")
    margin: float = Field(
        0.9,
        ge=-1,
        lt=1,
        description="cosine_contrastive: negatives with a cosine above it are pushed down (SimpleX's "
        "configs: 0.9).",
    )
    negative_weight: float = Field(
        150.0,
        ge=0,
        description="cosine_contrastive: weight of the mean over a row's negatives (SimpleX's configs: "
        "150-250).",
    )
    bsl_temperature: float = Field(
        1.22,
        gt=0,
        description="bsl: tau2, the weight of the negatives' log-sum-exp (the BSL authors' temperature_2, "
        "an exponent of the negatives' sum of exp(s / temperature)); 1 = softmax over the negatives. "
        "1.22: the authors' MF setting on Gowalla (with temperature 0.08).",
    )
    calibration: float = Field(
        0.75,
        ge=0,
        le=1,
        description="gbce: t, which sets the positive's exponent beta = alpha * (t * (1 - 1/alpha) + 1/alpha), "
        "alpha = num_negatives / (items - 1) the sampling rate: 0 is plain binary cross-entropy (beta 1), 1 "
        "gives beta = alpha (calibrated probabilities). 0.75 with 256 negatives a position: the gSASRec "
        "authors' recommendation.",
    )
    log_q_source: Literal["static", "streaming"] = Field(
        "streaming",
        description="Q of in-batch negatives: training click counts (`static`), or streaming frequency "
        "estimation (Yi et al. 2019), measured better on the public benchmarks (bench_losses.md).",
    )
    log_q_variant: Literal["standard", "corrected"] = Field(
        "standard",
        description="kind: softmax: standard subtracts log Q from every logit, the positive's included; "
        "corrected is the refined correction of Khrylchenko et al. (RecSys 2025): the positive is left out "
        "of the sampled part (log-sum-exp over the kept negatives, each corrected by log Q given that a draw "
        "is not the positive) and each row is weighted by the model's probability of misclassifying it (no "
        "gradient). Needs negatives in_batch, a corpus sampler with replacement, or mixed; no hard negatives.",
    )
    score_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Precision of the training logits' matmuls (queries x candidates): bfloat16 rounds both "
        "sides and the product to bfloat16 (cheaper where the CPU has bfloat16 instructions: lscpu's "
        "avx512_bf16 or amx_bf16; a logit then carries about 3 significant digits) and hands float32 "
        "logits to log-Q, the masks and the loss; evaluation, the index and serving stay float32. Not for "
        "hierarchical_softmax (no candidates).",
    )
    streaming: StreamingFrequencyConfig = StreamingFrequencyConfig()
    kernel: KernelSamplerConfig = Field(
        KernelSamplerConfig(), description="Kernel sampler settings (used when negatives=kernel)."
    )
    seed: Seed = Field(0, description="Seed of the corpus samplers' random generator.")

    @model_validator(mode="after")
    def _hierarchical_has_no_negatives(self) -> LossConfig:
        if self.kind == "hierarchical_softmax" and self.hard_negatives != "none":
            raise ValueError(
                f"model.loss.hard_negatives={self.hard_negatives!r} needs candidates; hierarchical_softmax has none"
            )
        if self.kind == "hierarchical_softmax" and self.score_dtype != "float32":
            raise ValueError(
                f"model.loss.score_dtype={self.score_dtype!r} sets the precision of candidate logits; "
                "hierarchical_softmax has none: set model.loss.score_dtype=float32"
            )
        return self

    @model_validator(mode="after")
    def _per_row_draws_from_the_corpus(self) -> LossConfig:
        if self.negatives_per_row and self.negatives not in CORPUS_NEGATIVES:
            raise ValueError(
                f"model.loss.negatives_per_row=true draws from a corpus sampler ({', '.join(CORPUS_NEGATIVES)}), "
                f"got negatives={self.negatives!r}"
            )
        if self.negatives_per_row and self.unique:
            raise ValueError("model.loss.negatives_per_row=true draws with replacement: set model.loss.unique=false")
        if self.negatives_per_row and self.kind in ("full_softmax", "hierarchical_softmax"):
            raise ValueError(
                f"model.loss.negatives_per_row=true needs negatives; model.loss.kind={self.kind!r} has none"
            )
        return self

    @model_validator(mode="after")
    def _kernel_draws_with_replacement(self) -> LossConfig:
        if self.negatives == "kernel" and self.unique:
            raise ValueError(
                "model.loss.unique=true is not supported with negatives='kernel' (it draws with replacement)"
            )
        return self

    @model_validator(mode="after")
    def _gbce_draws_uniformly(self) -> LossConfig:
        # beta accounts for the sampling rate of uniform negatives, alpha = num_negatives / (items - 1).
        if self.kind != "gbce":
            return self
        if self.negatives != "uniform":
            raise ValueError(
                f"model.loss.kind='gbce' with model.loss.negatives={self.negatives!r}: its beta assumes "
                "num_negatives uniform draws a row: set model.loss.negatives=uniform"
            )
        if self.hard_negatives != "none":
            raise ValueError(
                f"model.loss.kind='gbce' with model.loss.hard_negatives={self.hard_negatives!r}: its beta "
                "assumes uniform negatives: set model.loss.hard_negatives=none"
            )
        return self

    @model_validator(mode="after")
    def _corrected_log_q_needs_draws(self) -> LossConfig:
        # The refined correction divides each negative's expected count by the draws that are not the
        # positive: it needs a sampled softmax over draws with replacement from a known distribution.
        if self.log_q_variant != "corrected":
            return self
        refused = {
            "kind": (self.kind != "softmax", "it corrects a sampled softmax: set model.loss.kind=softmax"),
            "negatives": (
                self.negatives == "kernel",
                "kernel negatives are not supported: use in_batch, mixed or a corpus sampler",
            ),
            "hard_negatives": (
                self.hard_negatives != "none",
                "hard negatives are not draws from Q: set model.loss.hard_negatives=none",
            ),
            "unique": (
                self.unique,
                "draws without replacement have no per-draw probability: set model.loss.unique=false",
            ),
        }
        for key, (bad, why) in refused.items():
            if bad:
                raise ValueError(
                    f"model.loss.log_q_variant='corrected' with model.loss.{key}={getattr(self, key)!r}: {why}"
                )
        return self


class ModelConfig(_Section):
    """Towers and the training objective."""

    embedding_dim: int = Field(
        256,
        gt=0,
        description="Output size of both towers (and default size of feature embeddings). 256: better than "
        "64 and 128 on Gowalla and MovieLens-1M, no worse on ML-100K or the synthetic log (bench_public.md); "
        "tables cost (users + items) x dim x 4 bytes, x3 with lazy_adam's two slots.",
    )
    ensemble_members: int = Field(
        1,
        ge=1,
        le=16,
        description="K independently initialised (query, doc) tower pairs, each trained by its own loss on "
        "the same batches; served as one pair whose embeddings concatenate the members' (K x "
        "embedding_dim wide, each scaled by 1/sqrt(K)), so a dot product, the index and the bundle score "
        "the mean of the members' scores. Training and index memory grow K-fold.",
    )
    normalize: bool = Field(True, description="L2-normalise tower outputs (cosine similarity).")
    item_bias: bool = Field(
        False,
        description="A learned per-item bias outside the dot product: logits (q . d + b_item) / temperature, "
        "so L2-normalised towers keep the cosine for taste while the bias carries popularity. Served by the "
        "same inner-product index (the query tower appends 1, the doc tower b_item: both output "
        "embedding_dim + 1 wide); starts at the temperature times each item's centred log training count. "
        "Needs a doc tower that reads item_id, one ensemble member and a softmax, full_softmax or sgns loss. "
        "On in configs/demo.yaml for the embedded synthetic log, whose clicks are popularity times taste "
        "(benchmarks/results/bench_demo.md); off by default until measured on the public benchmarks.",
    )
    temperature: float | Literal["auto"] = Field(
        "auto",
        description="Logits are divided by this. auto = derived from the training log: "
        "min(0.2, 0.75 / ln(items / clicks per user)), so that the logit gap a cosine gap of 0.75 makes "
        "(0.75 / temperature) covers the log-odds of one of a user's items against the catalogue (0.75 "
        "fitted on Gowalla's valid part); 0.2 on logs with fewer than ~40 items per click of a user (every "
        "small benchmark), lower on large sparse catalogues (Gowalla: 0.10). The value used is logged and "
        "written to metrics.json and the manifest (derived).",
    )

    @field_validator("temperature", mode="before")
    @classmethod
    def _auto_or_a_temperature(cls, value: Any) -> Any:
        # One message for both kinds of wrong value, instead of one per member of the union.
        if value == "auto":
            return value
        wrong = f"must be 'auto' or a number of at least {MIN_TEMPERATURE:g} (1 / temperature scales the logits)"
        if isinstance(value, bool) or not isinstance(value, (int, float)):  # strict, as every field: "0.5" is text
            raise ValueError(f"{wrong}, got {_kind(value)} ({_yaml_scalar(value)})")
        number = float(value)
        if not math.isfinite(number) or number < MIN_TEMPERATURE:
            raise ValueError(f"{wrong}, got {value!r}")
        return number
    log_q_correction: bool = Field(
        True,
        description="Subtract log Q, each candidate's log expected count in the batch's candidates, from "
        "the logits of every sampled loss (in-batch, corpus-sampled, mixed; sgns then becomes NCE). "
        "full_softmax samples nothing and ignores it; gbce ignores it too (uniform negatives, its beta "
        "accounts for the sampling rate).",
    )
    log_q_strength: float = Field(
        1.0,
        ge=0,
        le=2,
        description="Subtract strength * log Q: 1 is the unbiased correction, 0 none, above 1 "
        "over-corrects (ranks popular items higher than the unbiased model would).",
    )
    remove_accidental_hits: bool = Field(
        True,
        description="Mask candidates (in-batch or sampled) equal to the row's own positive item; "
        "always on for full_softmax, where the positive is also a column of its own.",
    )
    remove_sequence_items: bool = Field(
        False,
        description="With train.examples: sequences, also mask the candidates that are any item of "
        "the pair's own sequence window (the user's items before and after its position), as "
        "remove_accidental_hits masks its next item: evaluation and serving exclude a user's items, "
        "so training does not push them down. Needs remove_accidental_hits.",
    )
    remove_user_items: bool = Field(
        False,
        description="With train.examples: clicks, also mask the candidates that are any training item of "
        "the row's user, as remove_accidental_hits masks its own item: evaluation and serving exclude a "
        "user's items, so training does not push them down. Holds each user's distinct training items in "
        "memory (16 bytes a pair) and searches them per row each step. Needs remove_accidental_hits.",
    )
    l2_regularization: float = Field(0.0, ge=0, description="L2 penalty on embedding tables.")
    embedding_init: Literal["uniform", "normal"] = Field(
        "uniform",
        description="The id embedding tables' initial rows: uniform(-0.05, 0.05), or normal(0, 0.02) as BERT "
        "and the SASRec+ reference initialise theirs. The out-of-vocabulary row starts at zero either way.",
    )
    embedding_dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Training only: dropout on each tower's input encodings (an ID tower's embedding; a "
        "feature tower's concatenated features, before its MLP), as SimpleX drops its embeddings.",
    )
    loss: LossConfig = Field(LossConfig(), description="Objective, negatives and log-Q source.")

    @property
    def output_dim(self) -> int:
        """The towers' output width: ``embedding_dim`` a member."""
        return self.embedding_dim * self.ensemble_members

    @property
    def reads_users_training_items(self) -> bool:
        """Whether training needs each user's training items: mined hard negatives and
        remove_user_items keep them out of a user's negatives."""
        return self.loss.hard_negatives == "mined" or self.remove_user_items

    @model_validator(mode="after")
    def _members_score_by_dot_products(self) -> ModelConfig:
        if self.ensemble_members > 1 and self.loss.kind == "hierarchical_softmax":
            raise ValueError(
                "model.ensemble_members > 1 serves the mean of the members' dot products; "
                "model.loss.kind='hierarchical_softmax' does not score by one: set ensemble_members=1"
            )
        return self

    @model_validator(mode="after")
    def _own_items_are_removed_as_hits(self) -> ModelConfig:
        for key in ("remove_sequence_items", "remove_user_items"):
            if getattr(self, key) and not self.remove_accidental_hits:
                raise ValueError(
                    f"model.{key} masks more than model.remove_accidental_hits does: set "
                    f"model.remove_accidental_hits=true, or model.{key}=false"
                )
        return self

    @model_validator(mode="after")
    def _item_bias_has_one_dot_product(self) -> ModelConfig:
        if not self.item_bias:
            return self
        if self.ensemble_members > 1:
            raise ValueError(
                "model.item_bias adds one bias to one dot product; with model.ensemble_members > 1 each member "
                "scores its own: set model.ensemble_members=1 or model.item_bias=false"
            )
        if self.loss.kind not in ("softmax", "full_softmax", "sgns"):
            raise ValueError(
                f"model.item_bias is for losses that score dot products (softmax, full_softmax, sgns); "
                f"model.loss.kind={self.loss.kind!r} is not one of them: set model.item_bias=false"
            )
        return self

    @model_validator(mode="after")
    def _corrected_log_q_corrects(self) -> ModelConfig:
        if self.loss.log_q_variant == "corrected":
            for key in ("log_q_correction", "remove_accidental_hits"):
                if not getattr(self, key):
                    raise ValueError(
                        f"model.loss.log_q_variant='corrected' leaves the positive out of log-Q corrected "
                        f"negatives: it needs model.{key}=true"
                    )
        return self

    @model_validator(mode="after")
    def _cosine_contrastive_scores_cosines(self) -> ModelConfig:
        # Its margin and the 1 - s+ term are cosines; its authors correct nothing for sampling.
        if self.loss.kind == "cosine_contrastive":
            if not self.normalize:
                raise ValueError(
                    "model.loss.kind='cosine_contrastive' compares cosines with model.loss.margin: set "
                    "model.normalize=true"
                )
            if self.log_q_correction:
                raise ValueError(
                    "model.loss.kind='cosine_contrastive' has no log-Q correction (its scores are raw cosines): "
                    "set model.log_q_correction=false"
                )
        return self
