"""Typed, validated configuration: one frozen model per pipeline step.

Every field is documented here; the YAML files in ``configs/`` set a subset and
``--set section.key=value`` on the command line overrides any of them. Unknown
keys and wrong types are rejected when the config is loaded, with the dotted
path of the bad key in the message.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from retrieval.common.errors import UserError, nearest_name, yaml_problem


class ConfigError(UserError, ValueError):
    """A configuration file or override is invalid; the message names the key."""


_FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max: TensorFlow computes in float32
_FLOAT32_TINY = 1.1754943508222875e-38  # numpy.finfo(numpy.float32).tiny, the smallest normal float32
_INT64_MAX = 2**63 - 1
SEED_MAX = 2**32 - 1  # numpy.random.seed (set by tf.keras.utils.set_random_seed) takes 0 .. 2**32 - 1
# Every seed goes to numpy and TensorFlow: one range for all, checked when the config is loaded.
Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]
# Logits are q . d / temperature in float32: below this the softmax is a hard max, and near 1e-38
# 1 / temperature overflows float32 (1e-300 trained to NaN).
MIN_TEMPERATURE = 1e-4
# index.factory auto searches exactly while a query scans at most this many floats (items x dim): 100,000 items
# at 256 dims, the largest measured catalogue whose exact single-query p99 stayed within 5 ms, half of the
# 10 ms a query over HTTP is held to (benchmarks/results/bench_index_auto.md).
EXACT_MAX_FLOATS = 100_000 * 256


class _Section(BaseModel):
    # extra="forbid" is what turns a typo such as `train.epoch` into an error
    # instead of a silently ignored key. allow_inf_nan=False refuses inf and
    # NaN in every float field (an infinite learning rate trained to NaN).
    # strict=True: a value has the field's type, nothing converts silently (lax pydantic reads
    # `epochs: true` as 1, `out_of_core: 1` or "yes" as true, "3" as 3, 3.0 as 3). The deliberate
    # conversions: an int where a float goes (`learning_rate: 1`), a YAML list where a tuple goes, and
    # YAML 1.2 floats (`1e-3`, which PyYAML reads as text: ``read_yaml``). A str field takes only
    # text: quote `run.name: '2024'` (YAML would read 2024 as a number, and 0123 as 83).
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False, strict=True
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_silent_conversions(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML lists -> tuples; a boolean where the field takes none is refused (a Literal of
        ints compares ``True == 1`` even in strict mode)."""
        if isinstance(value, list):
            return tuple(value)
        if isinstance(value, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            if not _admits_bool(annotation):
                raise ValueError(f"expected {_expected(annotation)}, got a boolean ({_yaml_scalar(value)})")
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _fits_the_dtypes_it_is_used_in(cls, value: Any, info: ValidationInfo) -> Any:
        """Floats reach TensorFlow as float32 and ints numpy as int64: refuse values they cannot hold."""
        if isinstance(value, float) and abs(value) > _FLOAT32_MAX:
            raise ValueError(f"{value!r} overflows float32 (at most {_FLOAT32_MAX:.7g} in magnitude)")
        if isinstance(value, float) and 0 < abs(value) < _FLOAT32_TINY:
            raise ValueError(f"{value!r} underflows float32 (computes as 0; the smallest is {_FLOAT32_TINY:.7g})")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _INT64_MAX:
            raise ValueError(f"{value!r} does not fit in int64")
        return value


def _admits_bool(annotation: Any) -> bool:
    """Whether a field of this annotation takes a boolean (bool itself, Any, or a Literal of one)."""
    if annotation is bool or annotation is Any:
        return True
    if get_origin(annotation) is Literal:
        return any(isinstance(member, bool) for member in get_args(annotation))
    if get_origin(annotation) in (Union, UnionType, Annotated):
        return any(_admits_bool(member) for member in get_args(annotation))
    return False


def _expected(annotation: Any) -> str:
    """What a field of this annotation takes, in words: "an integer", "one of 'auto', 0, 1, 2", ..."""
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(_yaml_scalar(member) for member in get_args(annotation))
    if get_origin(annotation) in (Union, UnionType):
        return " or ".join(_expected(member) for member in get_args(annotation))
    if get_origin(annotation) is Annotated:
        return _expected(get_args(annotation)[0])
    if get_origin(annotation) is tuple:
        return "a list"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "a mapping"
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean (true or false)",
             type(None): "null"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _kind(value: Any) -> str:
    """A YAML value's kind, in words: "a boolean", "an integer", "a float", "a string", ..."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return "null" if value is None else type(value).__name__


def _yaml_scalar(value: Any) -> str:
    """A value as YAML spells it (true, null, 3, 'text'), for messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else repr(value)


TableFormat = Literal[
    "auto",  # from the file extension: .csv, .tsv/.txt, .parquet/.pq, .dat, .data
    "csv",
    "tsv",
    "parquet",
    "movielens-100k",  # u.data: user<TAB>item<TAB>rating<TAB>timestamp, no header
    "movielens-1m",  # ratings.dat: user::item::rating::timestamp, no header
    "user-items",  # "uid iid iid ...", one user a line, whitespace-separated, no header (LightGCN train.txt)
    "sequences",  # as user-items, the items in time order: each click's timestamp is its position
]


class TableConfig(_Section):
    """Where a table lives and how to parse it."""

    path: str = Field(description="File path; relative paths resolve against the working directory.")
    format: TableFormat = Field(
        "auto",
        description="File format; auto = from the extension (.csv; .tsv/.txt; .parquet/.pq; MovieLens "
        ".dat for 1M, .data for 100K).",
    )
    separator: str | None = Field(None, description="Field separator; None = from the format.")
    header: bool = Field(True, description="Whether the first line names the columns (CSV/TSV).")
    encoding: str = Field("utf-8", description="Text encoding of CSV/TSV files (MovieLens: latin-1).")


class ColumnsConfig(_Section):
    """Names of the click-log columns in the input files."""

    user: str = Field("user_id", description="Column holding the user id.")
    item: str = Field("item_id", description="Column holding the item id.")
    timestamp: str | None = Field("timestamp", description="None if the log has no time column.")
    weight: str | None = Field(None, description="Optional per-click weight (e.g. rating, dwell).")


class SyntheticConfig(_Section):
    """The embedded click-log generator used when ``data.source: synthetic``."""

    n_users: int = Field(2000, gt=0, description="Users in the generated log.")
    n_items: int = Field(1000, gt=0, description="Items in the generated catalogue.")
    n_clusters: int = Field(20, gt=0, description="Latent taste clusters shared by users and items.")
    mean_clicks_per_user: float = Field(40.0, gt=0, description="Mean of the per-user click counts.")
    popularity_exponent: float = Field(1.0, ge=0, description="Zipf exponent of item popularity.")
    taste_strength: float = Field(
        0.8, ge=0, le=1, description="Share of a user's clicks drawn from their own taste clusters."
    )
    days: int = Field(90, gt=0, description="Time span of the generated log.")
    seed: Seed = Field(0, description="Seed of the generator.")
    periods: int = Field(
        1,
        gt=0,
        description="Equal periods the `days` are cut into; with more than 1 the catalogue and tastes change "
        "at each period's start (new_items_per_period, retired_items_per_period, popularity_drift, "
        "taste_drift) and the item table gains launch_period and retire_period. 1 = a stationary log (the "
        "generator's original output, unchanged).",
    )
    new_items_per_period: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Share of n_items launched at the start of each period after the first (no clicks before "
        "it); the rest are live from the start. Needs periods > 1.",
    )
    retired_items_per_period: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Share of the live items retired at the start of each period after the first (no clicks "
        "from then on). Needs periods > 1.",
    )
    popularity_drift: float = Field(
        0.0,
        ge=0,
        description="Standard deviation of each item's log-popularity random walk, one step a period (1.0 "
        "moves a typical item by a factor of e per period). Needs periods > 1.",
    )
    taste_drift: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of users whose secondary taste cluster moves to another cluster at the start of "
        "each period after the first. Needs periods > 1.",
    )

    @model_validator(mode="after")
    def _churn_needs_periods_and_live_items(self) -> SyntheticConfig:
        churn = ("new_items_per_period", "retired_items_per_period", "popularity_drift", "taste_drift")
        if self.periods == 1:
            for key in churn:
                if getattr(self, key) != 0:
                    raise ValueError(
                        f"{key}: {getattr(self, key)} changes the log between periods, but periods is 1: "
                        "set periods > 1 (the days are cut into that many periods)"
                    )
        if self.periods > self.days:
            raise ValueError(f"periods: {self.periods} is more than days: {self.days} (a period is at least a day)")
        launched = round(self.new_items_per_period * self.n_items) * (self.periods - 1)
        if launched >= self.n_items:
            raise ValueError(
                f"new_items_per_period: {self.new_items_per_period} launches {launched} items over "
                f"{self.periods - 1} periods, leaving none of n_items: {self.n_items} live at the start: "
                "lower it or the periods"
            )
        return self


class StreamConfig(_Section):
    """Out-of-core reading of the click log (``data.out_of_core: true``; retrieval/data/streaming.py)."""

    read_batch_size: int = Field(65_536, gt=0, description="Rows per record batch read from a shard.")
    shuffle_buffer: int = Field(
        1_000_000,
        gt=0,
        description="Training rows held and shuffled at a time, in the in-memory epoch order (bounded-memory "
        "shuffle; shard order is reshuffled every epoch too), seeded by train.seed as in memory. At least "
        "the training clicks: the in-memory batches exactly.",
    )
    max_test_users: int | None = Field(
        10_000,
        gt=0,
        description="Evaluate at most this many test users, drawn with `seed`; their test clicks (and "
        "training clicks, for masking) are the only clicks held in memory. None = every test user.",
    )
    seed: Seed = Field(0, description="Seed of the test-user sample (the training order is train.seed's).")
    max_train_batches: int | None = Field(
        None,
        gt=0,
        description="End each epoch after this many batches (smoke runs and benchmarks on a busy "
        "machine); None = every training click.",
    )


class DataConfig(_Section):
    """Input data: the click log and optional feature tables."""

    source: Literal["synthetic", "movielens-100k", "files"] = Field(
        "synthetic", description="Where clicks come from: the embedded generator, MovieLens 100K, or your files."
    )
    clicks: TableConfig | None = Field(
        None, description="Click log (source: files; a config naming it without data.source reads as files)."
    )
    test_clicks: TableConfig | None = Field(
        None, description="Separately given test log; required by split.kind: none."
    )
    columns: ColumnsConfig = ColumnsConfig()
    item_features: TableConfig | None = Field(None, description="Item feature table (one row per item id).")
    item_id_column: str = Field("item_id", description="Id column of the item feature table.")
    user_features: TableConfig | None = Field(None, description="User feature table (one row per user id).")
    user_id_column: str = Field("user_id", description="Id column of the user feature table.")
    movielens_dir: str | None = Field(
        None,
        description="MovieLens 100K folder; None = $RETRIEVAL_DATA_DIR or ../shared/datasets/ml-100k.",
    )
    duplicates: Literal["keep", "first"] = Field(
        "keep",
        description="Repeated (user, item) clicks: keep every click as a training example, or keep "
        "only the first.",
    )
    synthetic: SyntheticConfig = SyntheticConfig()
    out_of_core: bool = Field(
        False,
        description="Stream data.clicks (a Parquet or CSV file, a directory of them or a glob such as "
        "'logs/*.parquet') through tf.data instead of loading it: vocabularies and counts come from "
        "streaming passes, and only the sampled test users' clicks are held in memory. The same job, training "
        "loop, checkpoints and early stopping as in memory, ID or feature towers: data.item_features and "
        "data.user_features are read whole and joined onto each streamed batch; towers.query.history holds "
        "the training clicks coded, 16 bytes a click (docs/operations.md has the memory).",
    )
    stream: StreamConfig = Field(StreamConfig(), description="Out-of-core reading (data.out_of_core).")

    @model_validator(mode="before")
    @classmethod
    def _a_click_file_means_files(cls, raw: Any) -> Any:
        """A named click file is the log to train on: ``data.clicks.path`` without ``data.source``
        reads as ``source: files`` (the default, synthetic, would train on a made-up log and ignore the
        file); a source that is not files beside a click file is refused, naming both keys."""
        if not isinstance(raw, dict) or raw.get("clicks") is None:
            return raw
        if "source" not in raw:
            return {**raw, "source": "files"}
        if raw["source"] in ("synthetic", "movielens-100k"):
            raise ValueError(
                f"data.source is {raw['source']!r} but data.clicks names a file, which that source would "
                "ignore: set data.source: files to train on data.clicks, or remove data.clicks"
            )
        return raw

    @model_validator(mode="after")
    def _files_need_a_path(self) -> DataConfig:
        if self.source == "files" and self.clicks is None:
            raise ValueError("data.clicks is required when data.source is 'files'")
        if self.out_of_core:
            if self.source != "files":
                raise ValueError(f"data.out_of_core needs data.source: files (click shards), got {self.source!r}")
        return self


class SplitConfig(_Section):
    """How the log is split into training and test parts.

    ``temporal`` cuts the whole log at one timestamp (the last ``test_fraction``
    of clicks is test); ``leave_last_k`` holds out each user's last ``k``
    clicks; ``random`` holds out a random ``test_fraction``; ``none`` uses
    ``data.test_clicks`` as the test set.

    ``evaluate_on: validation`` (what ``pipelines.tune`` sets for its trials) drops the test part
    and splits the training part again the same way, so the job trains on the inner training part
    and is scored on a validation part; the test part is never read.
    """

    kind: Literal["temporal", "leave_last_k", "random", "none"] = Field(
        "temporal", description="How the test part is held out; none = data.test_clicks is the test part."
    )
    test_fraction: float = Field(0.2, gt=0, lt=1, description="Share of clicks in the test part (temporal, random).")
    k: int = Field(1, gt=0, description="Clicks held out per user (leave_last_k).")
    seed: Seed = Field(0, description="Seed of the random split.")
    hold_out_items: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Cold-start evaluation: a random share (seeded by split.seed) of the logged items "
        "loses every training click; their test clicks stay.",
    )
    evaluate_on: Literal["test", "validation"] = Field(
        "test",
        description="What the job is scored on: test = the test part; validation = the training part split "
        "again with the same kind, test_fraction and k (random: a hash keyed by the next seed, independent of "
        "the outer split's) (train on the rest), the test part never read; in memory and out of core alike "
        "(hyper-parameter tuning sets it; not with kind: none, whose data.test_clicks is already the "
        "chosen evaluation file).",
    )

    @model_validator(mode="after")
    def _validation_needs_a_split_of_the_log(self) -> SplitConfig:
        if self.evaluate_on == "validation" and self.kind == "none":
            raise ValueError(
                "split.evaluate_on: validation splits the training part again, but split.kind: none has no "
                "split to repeat: data.test_clicks is already the evaluation part, so give a validation file "
                "there (e.g. valid.txt) and keep evaluate_on: test"
            )
        return self


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

    kind: Literal["softmax", "full_softmax", "sgns", "hierarchical_softmax", "cosine_contrastive", "bsl"] = Field(
        "softmax",
        description="softmax: sampled softmax over `negatives`; full_softmax: exact, over every item "
        "(negatives ignored); sgns: word2vec binary logistic over `negatives` (NCE with log-Q "
        "correction); hierarchical_softmax: Huffman tree over items by training frequency (a "
        "comparison loss: not servable from an inner-product index); cosine_contrastive: SimpleX's "
        "CCL over `negatives`, (1 - s+) + negative_weight * mean relu(s- - margin) on raw cosines (needs "
        "model.normalize, refuses model.log_q_correction, ignores model.temperature); bsl: bilateral "
        "softmax, -s+ / temperature + bsl_temperature * logsumexp(s- / temperature) over `negatives`.",
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
        "full_softmax samples nothing and ignores it.",
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
                f"model.loss.kind={self.loss.kind!r} scores cosines or a tree: set model.item_bias=false"
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


# --- Towers: which raw features each tower reads and how it encodes them. ---
# Every feature is preprocessed *inside* its tower (lookup, hashing,
# normalisation), so the exported SavedModels take raw values as logged.

_FEATURE_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"  # becomes a SavedModel signature argument


class _Feature(_Section):
    # Not on every field, as _Section's is: pydantic takes no before-validator on the discriminator
    # `kind`, and no feature field is a tuple or a Literal of ints (strict mode refuses a bool elsewhere).
    @field_validator("name", "source", mode="before")
    @classmethod
    def _no_silent_conversions(cls, value: Any, info: ValidationInfo) -> Any:
        return value

    name: str = Field(pattern=_FEATURE_NAME, description="Tower input name (and serving argument).")
    source: str | None = Field(
        None,
        description="Column it is read from: the user (query) or item (doc) feature table, or the click "
        "log (user_id, item_id, timestamp). None = the name.",
    )

    @property
    def column(self) -> str:
        return self.source or self.name


class _EmbeddedFeature(_Feature):
    embedding_dim: int | None = Field(None, gt=0, description="None = model.embedding_dim.")


class _VocabularyFeature(_EmbeddedFeature):
    hash_buckets: int | None = Field(
        None, gt=0, description="Hash values into this many rows; None = vocabulary of training values."
    )
    oov_buckets: int = Field(1, gt=0, description="Rows shared by values outside the vocabulary.")
    min_count: int = Field(1, gt=0, description="Training examples a value needs to enter the vocabulary.")


class IdFeature(_EmbeddedFeature):
    """An id (user_id, item_id): training vocabulary, one zero-initialised OOV row."""

    kind: Literal["id"]
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Training only: replace the id by the OOV row with this probability, so the tower "
        "learns to embed unseen ids from its other features (DropoutNet, Volkovs et al., NeurIPS 2017).",
    )


class CategoricalFeature(_VocabularyFeature):
    """One string value per row (gender, occupation, zip prefix)."""

    kind: Literal["categorical"]
    prefix: int | None = Field(None, gt=0, description="Keep only the first n characters (zip -> region).")


class MultiCategoricalFeature(_VocabularyFeature):
    """Several string values per row (genres), mean-pooled; served as [batch, max_values] padded with ''."""

    kind: Literal["multi_categorical"]
    max_values: int = Field(8, gt=0, description="Values kept per row (serving shape [batch, max_values]).")
    separator: str | None = Field(
        None, min_length=1, description="Split string cells on this; None = cells are lists."
    )


class NumericFeature(_Feature):
    """A number, z-normalised with training mean/variance; NaN -> 0 plus an is-missing indicator."""

    kind: Literal["numeric"]
    log: bool = Field(False, description="Normalise log1p(max(x, 0)) instead of x (prices, counts).")


class TimestampFeature(_Feature):
    """A point in time, encoded as its age at the end of training (days and log-days, normalised)."""

    kind: Literal["timestamp"]
    unit: Literal["seconds", "days", "years"] = Field(
        "seconds", description="Raw value: seconds or days since the epoch, or a calendar year (1995)."
    )


class TextConfig(_Section):
    """Hashed bag of tokens; letter trigrams are DSSM word hashing (Huang et al., CIKM 2013)."""

    trigrams: bool = Field(True, description="Letter trigrams of each '#word#'.")
    words: bool = Field(True, description="Each whole word, as the token '#word#'.")
    buckets: int = Field(50_000, gt=0, description="Hash buckets (embedding rows) shared by all tokens.")

    @model_validator(mode="after")
    def _some_tokens(self) -> TextConfig:
        if not (self.trigrams or self.words):
            raise ValueError("text needs trigrams or words (or both)")
        return self


class TextFeature(_EmbeddedFeature):
    """Free text (titles, queries): lower-cased, split on non-alphanumerics, hashed, mean-pooled."""

    kind: Literal["text"]
    text: TextConfig = TextConfig()


FeatureConfig = Annotated[
    IdFeature | CategoricalFeature | MultiCategoricalFeature | NumericFeature | TimestampFeature | TextFeature,
    Field(discriminator="kind"),
]


class TransformerConfig(_Section):
    """The causal self-attention encoder of ``history.pooling: transformer`` (SASRec, Kang & McAuley 2018)."""

    blocks: int = Field(2, gt=0, description="Self-attention blocks (attention then a feed-forward layer each).")
    heads: int = Field(1, gt=0, description="Attention heads; the item dimension must divide by it.")
    dropout: float = Field(
        0.2, ge=0, lt=1, description="On the embedded inputs and after each sub-layer, training only."
    )
    layout: Literal["pre_norm", "sasrec"] = Field(
        "pre_norm",
        description="pre_norm: x + dropout(sublayer(norm(x))) for attention and the feed-forward layer; "
        "sasrec: the SASRec reference code's block (the item embeddings scaled by sqrt(dim), each residual "
        "taken from the normalised input, dropout on the attention weights and inside the feed-forward "
        "layer only, layer-norm epsilon 1e-8). Both: dropout on the embedded inputs, a final layer norm.",
    )


class HistoryConfig(_Section):
    """The user's last clicked items, strictly before each example (YouTube DNN, Covington et al. 2016);
    on a log without time (format: user-items), the user's other training items, the example's own item
    left out (SimpleX's pooled history, Mao et al. 2021), which mean / attention pooling read."""

    name: str = Field("history", pattern=_FEATURE_NAME, description="Input name; served as [batch, length].")
    length: int = Field(20, gt=0, description="Most recent clicks kept (most recent first, '' padded).")
    pooling: Literal["mean", "attention", "transformer"] = Field(
        "mean",
        description="mean; attention: learned scores plus a learned bias per position; transformer: causal "
        "self-attention over the items in time order with learned positions, the newest item's state "
        "(section `transformer`).",
    )
    transformer: TransformerConfig = Field(TransformerConfig(), description="Encoder of pooling: transformer.")
    share_item_embedding: bool = Field(
        True, description="Use the doc tower's item-id embedding (needs an id feature on item_id there)."
    )
    embedding_dim: int | None = Field(None, gt=0, description="Own table only; None = model.embedding_dim.")


class MLPConfig(_Section):
    """Layers from the concatenated feature encodings to the output (always a final linear projection)."""

    widths: tuple[int, ...] = Field((), description="Hidden widths; () = projection only.")
    activation: Literal["relu", "gelu", "tanh", "swish"] = Field("relu", description="Activation of the hidden layers.")
    dropout: float = Field(0.0, ge=0, lt=1, description="After each hidden layer, training only.")
    projection: bool = Field(
        True,
        description="End in a linear projection to model.embedding_dim. false: the output is the encoding "
        "itself (no hidden widths; one encoding of model.embedding_dim), as SASRec scores its encoder's "
        "state against the item table it reads (doc tower: the item-id embedding, unprojected).",
    )

    @model_validator(mode="after")
    def _positive_widths(self) -> MLPConfig:
        if any(width <= 0 for width in self.widths):
            raise ValueError(f"mlp.widths must be positive, got {list(self.widths)}")
        if not self.projection and self.widths:
            raise ValueError(
                f"mlp.projection=false outputs the encoding itself, so it takes no hidden layers: got "
                f"mlp.widths={list(self.widths)}; set mlp.widths=[] or mlp.projection=true"
            )
        return self


class TowerConfig(_Section):
    """One tower: its features, optional click history (query only) and MLP."""

    features: tuple[FeatureConfig, ...] = Field((), description="The tower's input features (see the feature kinds).")
    history: HistoryConfig | None = Field(None, description="Pooled click history (query tower only); None = none.")
    mlp: MLPConfig = MLPConfig()

    @model_validator(mode="after")
    def _has_inputs(self) -> TowerConfig:
        if not self.features and self.history is None:
            raise ValueError("a tower needs at least one feature or a history")
        return self

    @property
    def input_names(self) -> list[str]:
        return [f.name for f in self.features] + ([self.history.name] if self.history else [])


class TowersConfig(_Section):
    """Both towers. The default is ID-only (user_id | item_id), the original two-tower model."""

    query: TowerConfig = TowerConfig(features=(IdFeature(name="user_id", kind="id"),))
    doc: TowerConfig = TowerConfig(features=(IdFeature(name="item_id", kind="id"),))

    @model_validator(mode="after")
    def _consistent(self) -> TowersConfig:
        if self.doc.history is not None:
            raise ValueError("towers.doc.history: click history is a query-tower feature")
        names = self.query.input_names + self.doc.input_names
        if "weight" in names or "item_id" in self.query.input_names:
            raise ValueError("towers: 'weight' (and 'item_id' in the query tower) are reserved batch keys")
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"towers: input names must be unique across both towers, repeated: {repeated}")
        history = self.query.history
        if history is not None and history.share_item_embedding and self.item_id_feature is None:
            raise ValueError(
                "towers.query.history.share_item_embedding needs an id feature with source item_id in "
                "towers.doc.features (or set share_item_embedding: false)"
            )
        return self

    @property
    def item_id_feature(self) -> IdFeature | None:
        """The doc tower's item-id feature, if it has one."""
        return next((f for f in self.doc.features if f.kind == "id" and f.column == "item_id"), None)

    @property
    def is_id_only(self) -> bool:
        """True for the default towers (built by ``retrieval.towers.id_tower``)."""
        return self == TowersConfig()


class ParameterServerConfig(_Section):
    """How ``train.distribute: parameter_server`` shards the ID tables over the ``ps`` tasks of TF_CONFIG."""

    min_shard_bytes: int = Field(
        256 << 10, gt=0,
        description="Smallest shard of an ID table in bytes (MinSizePartitioner): a table of rows x dim x 4 "
        "bytes gets at most that size / min_shard_bytes shards.",
    )
    max_shards: int = Field(
        1, ge=1, description="Most shards of one ID table (at most the number of ps tasks is useful).",
    )
    input: Literal["chief", "workers"] = Field(
        "chief",
        description="Who reads the training batches. chief: the chief reads each batch and sends it with the "
        "step it schedules (one data path for every log; the chief's reading bounds the throughput). workers: "
        "the chief writes the training batches once as TFRecord files (staging_dir) and each worker reads "
        "them itself through the tf.data service (the chief runs its dispatcher on data_dispatcher_port; each "
        "worker task is started with --data-dispatcher CHIEF_HOST:PORT, as pipelines.local_cluster does); an "
        "epoch is then a number of steps of that stream, and a resumed run starts a new pass over it.",
    )
    data_dispatcher_port: int = Field(
        0, ge=0, le=65535,
        description="Port of the tf.data service dispatcher the chief runs under input: workers (required "
        "there; pipelines.local_cluster sets it).",
    )
    staging_dir: str = Field(
        "",
        description="Where the chief writes the staged batches under input: workers, in a directory of its own "
        "deleted after training; every worker must read it (on several hosts, a shared filesystem). Empty: "
        "the chief's temporary directory (one machine only).",
    )
    staged_files: int = Field(
        16, ge=1,
        description="TFRecord files the staged batches are spread over under input: workers: the tf.data "
        "service hands each file to one worker at a time, so at least a few per worker.",
    )

    @model_validator(mode="after")
    def _workers_need_the_dispatcher(self) -> ParameterServerConfig:
        if self.input == "workers" and self.data_dispatcher_port == 0:
            raise ValueError(
                "data_dispatcher_port: input: workers needs the port of the tf.data dispatcher the chief runs "
                "and the workers register with (python -m pipelines.local_cluster sets it)"
            )
        return self


class TrainConfig(_Section):
    """Optimisation."""

    epochs: int = Field(
        30, gt=0, description="Training epochs; with validation_fraction > 0 the most early stopping may run."
    )
    batch_size: int = Field(
        1024, gt=1, description="Global batch; in-batch softmax gives each query this many candidates."
    )
    optimizer: Literal["adam", "adagrad", "sgd", "lazy_adam", "rowwise_adagrad"] = Field(
        "lazy_adam",
        description="adam (and tf-keras sgd, whose momentum slot is always updated densely) touch every "
        "embedding row at every step, slow for large tables; lazy_adam, adagrad and rowwise_adagrad update "
        "only the rows a batch touches. Optimizer state per embedding table: adam and lazy_adam 2x the "
        "table, adagrad 1x, rowwise_adagrad one float per row (for tables of millions of rows).",
    )
    learning_rate: float = Field(0.01, gt=0, description="Optimiser learning rate.")
    use_weights: bool = Field(
        False, description="Use the log's weight column as per-example loss weights."
    )
    seed: Seed = Field(42, description="Seeds weights init, batch order and TensorFlow ops (deterministic).")
    verbose: Literal["auto", 0, 1, 2] = Field(
        "auto", description="Keras progress: bar on a terminal, a line per epoch otherwise."
    )
    validation_fraction: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="Early stopping: hold out this share of the training part, carved like split.kind "
        "(temporal: the latest clicks), and stop when its recall@validation_k has not improved for "
        "early_stopping_patience epochs; `epochs` is then the maximum. 0 = train `epochs` epochs.",
    )
    examples: Literal["clicks", "sequences"] = Field(
        "clicks",
        description="clicks: one training example per click, its query the user's history before it; "
        "sequences: windows of each user's training clicks in time order (sequence_windows), the query state at "
        "every position predicting the next item, all in one pass of a transformer history (needs a query tower "
        "of that history alone).",
    )
    sequence_windows: Literal["all", "latest"] = Field(
        "all",
        description="train.examples: sequences only. all: each user's training clicks cut into windows of "
        "towers.query.history.length + 1, so every click but a user's first is a next-item target once; "
        "latest: only each user's last window (SASRec's truncation: older clicks are never targets).",
    )
    validation_users: int | None = Field(
        10_000,
        gt=0,
        description="Early stopping watches the validation clicks of at most this many users, drawn with "
        "data.stream.seed (each epoch ranks them over the catalogue; a streamed log takes at most "
        "data.stream.max_test_users too); None = every validation user of a log in memory, "
        "data.stream.max_test_users of a streamed one. 10,000: on Gowalla (29,858 validation users) it chose the "
        "epoch that all of them chose, the same model in 904 s instead of 1,060; 5,000 chose an earlier one, "
        "recall@20 0.2173 against 0.2192 (benchmarks/results/bench_public_selection/).",
    )
    early_stopping_patience: int = Field(2, gt=0, description="Epochs without a better validation recall.")
    validation_k: int = Field(20, gt=0, description="k of the validation recall early stopping watches.")
    refit: bool = Field(
        True,
        description="After early stopping, train again on the whole training part (the held-out latest "
        "clicks matter on a temporal split), from where refit_from says; false keeps the best weights of "
        "the run on the reduced part.",
    )
    refit_from: Literal["initial", "best"] = Field(
        "initial",
        description="Where a refit starts: the initial weights, retrained for the best number of epochs; or "
        "the best epoch's weights, trained refit_epochs more epochs on the whole training part (the held-out "
        "part included), which costs refit_epochs instead of the best number.",
    )
    refit_epochs: int = Field(1, gt=0, description="Epochs of a refit from the best weights (refit_from: best).")
    checkpoint_every_seconds: float | None = Field(
        300.0,
        ge=0,
        description="Save the training state (weights, optimizer slots, sampler / log-Q estimator state and "
        "RNG, data position, logs) once this many seconds of training passed since the last save, and at "
        "the end of training, so a run killed mid-epoch resumes where it stopped when started again with "
        "the same run.name and config. By time, not steps: a save costs a pass over the ID tables and a "
        "step does not, so only a time interval bounds the share of training spent saving. "
        "None or 0 (and no checkpoint_every_steps) = no checkpoints.",
    )
    checkpoint_every_steps: int | None = Field(
        None,
        ge=0,
        description="Also save every this many steps (None or 0 = by time only).",
    )
    checkpoint_dir: str | None = Field(
        None,
        description="The checkpoints go to `<checkpoint_dir>/.<run.name>.checkpoints`; None = run.output_dir. "
        "They outlive a killed run and are deleted once the run directory is complete.",
    )
    resume: bool = Field(
        True,
        description="Resume from the checkpoints of an unfinished run of the same run.name (the config must "
        "be the same); false deletes them and starts over.",
    )
    distribute: Literal["none", "mirrored", "multi_worker", "parameter_server"] = Field(
        "none",
        description="tf.distribute strategy: none (one device), mirrored (MirroredStrategy over every local "
        "GPU, or the CPU), multi_worker (MultiWorkerMirroredStrategy; the cluster comes from the TF_CONFIG "
        "environment variable). batch_size is the global batch, split over the replicas, and in-batch "
        "negatives are gathered across replicas, so every query still sees batch_size candidates. "
        "parameter_server: ParameterServerStrategy over the TF_CONFIG cluster (one chief running the job, "
        "worker and ps tasks running python -m retrieval.training.cluster; python -m pipelines.local_cluster "
        "starts one on this machine): the ID tables sharded by rows over the ps tasks, each batch read by the "
        "chief and its step run on a worker, asynchronously (a step's in-batch negatives are its own batch).",
    )
    parameter_server: ParameterServerConfig = Field(
        default_factory=ParameterServerConfig,
        description="Sharding of the ID tables under distribute: parameter_server.",
    )
    steps_per_execution: int = Field(
        1,
        gt=0,
        description="Training steps run inside one tf.function call (a graph loop over the batches), so "
        "Python dispatches once per this many steps. The steps, their order and their logged values are "
        "those of one step a call; a call ends early at the epoch's end and at a step that "
        "checkpoint_every_steps names, and a save by time waits for the call's end. One device only "
        "(distribute: none).",
    )

    warm_start: str | None = Field(
        None,
        description="A finished run (its run directory, which is its bundle) to train on from: the towers start "
        "from its trained weights, the id and categorical vocabularies grow to the parent's ids plus the new "
        "log's (known ids keep their trained rows; new ids get the model's fresh initialisation), the streaming "
        "log-Q estimate continues and a static one counts the parent's clicks plus the new ones, the bundle's "
        "seen items are the parent's plus the new clicks and its index holds the parent's catalogue plus the new "
        "items; the manifest records the parent. The parent must have the same tower shape and loss (the model "
        "and towers keys warm_start_conflicts lists). None = train from scratch. `retrieval train --warm-start`.",
    )
    warm_start_optimizer: Literal["carry", "reset"] = Field(
        "carry",
        description="train.warm_start: carry the parent's optimizer state (moments / accumulators, rows "
        "remapped by id like the weights, new rows at zero; needs the same train.optimizer) or reset it "
        "(a new optimizer, whose first steps are as large as from scratch). carry: recall@20 0.481 against "
        "reset's 0.468 on a small time-split case, mean of 3 seeds (benchmarks/results/bench_warm_start.json).",
    )
    replay_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="train.warm_start: mix a sample of the parent's training clicks (its bundle's seen "
        "items, one (user, item) pair per click kept there) into the new training clicks, this share of "
        "the training clicks after mixing, drawn with train.seed; 0 = the new clicks only.",
    )

    @model_validator(mode="after")
    def _warm_start_settings_need_a_parent(self) -> TrainConfig:
        if self.warm_start is None and self.replay_fraction > 0:
            raise ValueError(
                f"train.replay_fraction={self.replay_fraction} replays a parent's clicks; it needs train.warm_start"
            )
        if self.warm_start is not None and self.distribute == "parameter_server":
            raise ValueError(
                "train.warm_start is not yet supported with train.distribute: parameter_server "
                "(its tables are sharded over the ps tasks)"
            )
        return self

    @model_validator(mode="after")
    def _steps_per_execution_on_one_device(self) -> TrainConfig:
        if self.steps_per_execution > 1 and self.distribute != "none":
            raise ValueError(
                f"train.steps_per_execution={self.steps_per_execution} runs several steps in one call on one "
                f"device; train.distribute={self.distribute!r} runs one step a call: set "
                "train.steps_per_execution=1 or train.distribute=none"
            )
        return self

    @property
    def checkpoints(self) -> bool:
        """Whether training is checkpointed (by time, by steps or both)."""
        return bool(self.checkpoint_every_seconds) or bool(self.checkpoint_every_steps)


class IndexConfig(_Section):
    """The FAISS index over every catalogue item (inner product; cosine when towers normalise).

    Approximate indexes are tuned after building: the fastest nprobe / efSearch
    / ... setting whose recall@``tune_k`` against exact search reaches
    ``target_recall`` on held-out queries is kept with the index.
    """

    factory: str = Field(
        "auto",
        description='FAISS index factory string: "Flat", "IVF1024,Flat", "HNSW32", "OPQ16,IVF1024,PQ16", ...; '
        "auto = Flat (exact) up to exact_max_items catalogue items, else IVF<nlist>,Flat with nlist the power of "
        "2 nearest 4 sqrt(items), tuned to target_recall. The factory used is in the manifest (index.factory) "
        "and metrics.json (derived).",
    )
    exact_max_items: int | None = Field(
        None,
        gt=0,
        description="factory auto: the largest catalogue searched exactly (Flat); None = EXACT_MAX_FLOATS / the "
        "embedding dimension (100,000 items at 256 dims, 400,000 at 64): exact search scans items x dim floats a "
        "query, and that size is the largest whose single-query p99 stayed within 5 ms in "
        "benchmarks/results/bench_index_auto.md (python -m benchmarks.bench_index_auto).",
    )
    train_sample_size: int = Field(
        200_000, gt=0, description="Indexes that need training (IVF, PQ, OPQ) train on at most this many items."
    )
    target_recall: float = Field(
        0.95, gt=0, le=1, description="Recall@tune_k vs exact search the tuned search parameters must reach."
    )
    tune_k: int = Field(100, gt=0, description="The k of the recall that tuning measures.")
    tune_queries: int = Field(
        1000, ge=2, description="Queries sampled for tuning: half choose the setting, half measure its recall."
    )
    search_params: str | None = Field(
        None, description='Fixed FAISS search parameters, e.g. "nprobe=32" (recall is still measured); None = tune.'
    )
    seed: Seed = Field(0, description="Seed of the training and tuning samples.")

    def factory_for(self, num_items: int, dim: int) -> str:
        """The FAISS factory string this config builds over ``num_items`` vectors of ``dim`` floats (auto resolved)."""
        if self.factory != "auto":
            return self.factory
        exact_max_items = self.exact_max_items or EXACT_MAX_FLOATS // dim
        if num_items <= exact_max_items:
            return "Flat"
        nlist = 2 ** round(math.log2(4 * math.sqrt(num_items)))
        return f"IVF{nlist},Flat"

    @model_validator(mode="after")
    def _auto_has_no_fixed_parameters(self) -> IndexConfig:
        if self.factory == "auto" and self.search_params:
            raise ValueError(
                f"index.search_params {self.search_params!r} fix one factory's parameters, but index.factory is auto "
                "(Flat or IVF by catalogue size): set index.factory too"
            )
        return self


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


class ExportConfig(_Section):
    """What the bundle holds besides the query/doc SavedModels and the FAISS index."""

    topk_model: bool = Field(
        True,
        description="Also write the topk model (models/topk/<version>/): a SavedModel holding the query "
        "tower and every item embedding that returns top-k ids itself, leaving out the ids it is asked "
        "to exclude (brute force; num_items x dim floats, so large catalogues may want it off).",
    )
    topk_k: int = Field(100, gt=0, description="How many ids the topk model returns per query.")
    history_clicks: int = Field(
        200,
        gt=0,
        description="With a query tower that reads a click history: each training user's most recent "
        "training clicks the bundle stores (user_histories/, newest first; 4 bytes a click), from which "
        "serving fills the history of a query that sends only the user id. At least "
        "towers.query.history.length (the tower reads that many); more lets a page list them.",
    )
    warm_start_state: bool = Field(
        True,
        description="Write <run>/warm_start/ (every variable, the optimizer's slots, the vocabularies and counts: "
        "about the model's size plus its slots, x3 the tables with lazy_adam), from which a later run can "
        "train on (train.warm_start). false saves the disk and the write; the run then cannot be a parent.",
    )


class RunConfig(_Section):
    """Where results go."""

    name: str | None = Field(None, description="Run name; None = <UTC time>-<config name>.")
    output_dir: str = Field("artifacts", description="Directory that holds run directories.")
    overwrite: bool = Field(False, description="Replace an existing run directory of the same name.")

    @model_validator(mode="after")
    def _plain_name(self) -> RunConfig:
        # One plain path component: no separators, not '.'/'..', not hidden (the job's own scratch,
        # lock and checkpoint names beside the run start with '.'), short enough for those suffixes.
        if self.name is not None and not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}", self.name):
            raise ValueError(
                "run.name must be one plain directory name: up to 200 letters, digits, '.', '_' and '-', "
                f"starting with a letter, digit or '_', got {self.name!r}"
            )
        return self


class Config(_Section):
    """The whole job: data -> split -> towers -> model -> train -> index -> evaluation -> export -> run."""

    data: DataConfig = DataConfig()
    split: SplitConfig = SplitConfig()
    towers: TowersConfig = TowersConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    index: IndexConfig = IndexConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    export: ExportConfig = ExportConfig()
    run: RunConfig = RunConfig()

    @model_validator(mode="after")
    def _parameter_server_supported(self) -> Config:
        if self.train.distribute != "parameter_server":
            if self.train.parameter_server.input == "workers":
                raise ValueError(
                    "train.parameter_server.input: workers needs train.distribute: parameter_server (under the "
                    "other strategies each worker process runs the job and reads its own data already)"
                )
            return self
        loss = self.model.loss
        refused = {
            "model.loss.kind": loss.kind == "full_softmax",
            "model.loss.hard_negatives": loss.hard_negatives == "mined",
            "train.examples": self.train.examples == "sequences",
            "towers.query.history": self.towers.query.history is not None,
            "model.ensemble_members": self.model.ensemble_members > 1,
            "model.remove_user_items": self.model.remove_user_items,
        }
        bad = [key for key, refuse in refused.items() if refuse]
        if bad:
            raise ValueError(
                f"not yet supported with train.distribute: parameter_server: {bad[0]} (a whole-table read, "
                "or a history the first cluster runs did not test); use ID towers with in-batch negatives"
            )
        return self

    @model_validator(mode="after")
    def _replay_lands_in_training(self) -> Config:
        if self.train.replay_fraction == 0:
            return self
        if self.split.kind not in ("temporal", "none"):
            raise ValueError(
                f"train.replay_fraction={self.train.replay_fraction} puts the parent's clicks before the new log's "
                f"first click, which only split.kind temporal or none keeps on the training side; split.kind "
                f"{self.split.kind!r} could hold a replayed click out as a test click"
            )
        if self.data.out_of_core:
            raise ValueError("train.replay_fraction is not yet supported with data.out_of_core (the replayed "
                             "clicks join a log held in memory)")
        return self

    @model_validator(mode="after")
    def _split_none_needs_test_file(self) -> Config:
        if self.split.kind == "none" and self.data.test_clicks is None:
            raise ValueError("split.kind 'none' needs data.test_clicks (the separately given test log)")
        return self

    @model_validator(mode="after")
    def _ordered_history_needs_timestamps(self) -> Config:
        # Found here, not after the log is read: a user-items log has no time column to name. Pooled histories
        # work there (a click's history is its user's other items); a transformer reads an order there is not.
        clicks, history = self.data.clicks, self.towers.query.history
        if history is not None and history.pooling == "transformer" and clicks is not None \
                and clicks.format == "user-items":
            raise ValueError(
                "towers.query.history.pooling 'transformer' reads each user's clicks in time order, and "
                "data.clicks.format 'user-items' has none: pool them (pooling: mean or attention: a click's "
                "history is then its user's other items), use format: sequences when each line's items are in "
                "time order, or give the log as a table with a timestamp column (data.columns.timestamp)"
            )
        return self

    @model_validator(mode="after")
    def _stored_histories_cover_the_tower(self) -> Config:
        history = self.towers.query.history
        if history is not None and self.export.history_clicks < history.length:
            raise ValueError(
                f"export.history_clicks ({self.export.history_clicks}) is below towers.query.history.length "
                f"({history.length}): a query filled from the bundle's stored history would read fewer clicks "
                "than the tower was trained on; raise export.history_clicks"
            )
        return self

    @model_validator(mode="after")
    def _sequences_need_a_sequence_tower(self) -> Config:
        if self.train.examples != "sequences":
            if self.model.remove_sequence_items:
                raise ValueError(
                    "model.remove_sequence_items masks the items of a pair's sequence window, which "
                    "train.examples: clicks does not have: set train.examples: sequences, or "
                    "model.remove_sequence_items: false"
                )
            return self
        if self.model.remove_user_items:
            raise ValueError(
                "model.remove_user_items masks a click's user's training items; with train.examples: "
                "sequences use model.remove_sequence_items (the items of each pair's window)"
            )
        history = self.towers.query.history
        if history is None or history.pooling != "transformer":
            raise ValueError(
                "train.examples: sequences trains the query state at every position of a history, so it needs "
                "towers.query.history with pooling: transformer"
            )
        others = [f.name for f in self.towers.query.features if f.column != "user_id"]
        if others:
            raise ValueError(
                f"not yet supported with train.examples: sequences: query features other than the user id "
                f"({', '.join(others)}); a sequence batch carries the user id, the history and the next items"
            )
        if self.model.loss.hard_negatives == "mined":
            raise ValueError("not yet supported with train.examples: sequences: model.loss.hard_negatives: mined")
        return self

    @model_validator(mode="after")
    def _faiss_understands_the_index(self) -> Config:
        # Found here, not when the index is built after training.
        problem = faiss_index_problem(self.index.factory, self.index.search_params, self.model.output_dim)
        if problem:
            raise ValueError(problem)
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/YAML-serialisable dict; ``Config.from_dict`` inverts it."""
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "<dict>") -> Config:
        """Validate ``raw``; raise ConfigError naming each bad key."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a mapping at the top level, got {type(raw).__name__}")
        try:
            return cls.model_validate(raw)
        except ValidationError as error:
            raise ConfigError(_describe(error, source)) from None


def faiss_index_problem(factory: str, search_params: str | None, dim: int) -> str | None:
    """Why FAISS cannot build ``factory`` over ``dim``-dimensional vectors or apply ``search_params``
    to it; None when it can.

    An empty index is made from the factory string (FAISS imported here, only
    when the factory is not the default ``Flat``), and the parameters are set
    on it. IVF list counts are capped for this check, since an IVF index
    allocates its lists when made; they are validated against the catalogue
    when the index is trained.
    """
    if factory in ("Flat", "auto") and not search_params:
        return None  # auto builds Flat or IVF<n>,Flat, both valid for any dimension
    import faiss  # here, so that loading a config imports FAISS only when it has to check one

    # IVF lists and PQ codebooks are allocated when the index is made (PQ8x24 takes 4 GB): shrink
    # them for the check. Neither number changes whether the string parses.
    probe = re.sub(r"IVF(\d+)", lambda m: f"IVF{min(int(m.group(1)), 64)}", factory)
    probe = re.sub(r"(PQ\d+)x(\d+)", lambda m: f"{m.group(1)}x{min(int(m.group(2)), 8)}", probe)
    try:
        index = faiss.index_factory(dim, probe, faiss.METRIC_INNER_PRODUCT)
    except Exception as error:  # FAISS raises RuntimeError with a C++ trace; SWIG may raise TypeError
        return f"index.factory {factory!r} is not a FAISS index for model.embedding_dim={dim}: {_faiss_reason(error)}"
    if not search_params:
        return None
    try:
        # faiss's stub lists the (cno: int) and (param_string: str) overloads without @overload.
        faiss.ParameterSpace().set_index_parameters(index, search_params)  # type: ignore[arg-type]
    except Exception as error:
        reason = _faiss_reason(error)
        return f"index.search_params {search_params!r} do not apply to index.factory {factory!r}: {reason}"
    for pair in search_params.split(","):
        name, _, value = (part.strip() for part in pair.partition("="))
        if name in ("nprobe", "efSearch", "k_factor") and not _number(value) >= 1:  # NaN fails too
            return f"index.search_params {search_params!r}: {name} must be a number >= 1, got {value!r}"
    return None


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("nan")


def _faiss_reason(error: Exception) -> str:
    """The last line of a FAISS error ("Error: '...' failed: ..."), without the C++ location."""
    text = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
    text = re.sub(r"^Error in .*? at \S+:\d+: ", "", text)
    return text.split(" Error: ", 1)[-1].strip()


# Type errors of strict validation, by pydantic error type: what the key takes.
_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "a boolean (true or false)",
    "tuple_type": "a list",
    "model_type": "a mapping",
    "dict_type": "a mapping",
}


def _describe(error: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid configuration"]
    for problem in error.errors():
        key = ".".join(str(part) for part in problem["loc"]) or "<top level>"
        message = problem["msg"]
        if problem["type"] == "extra_forbidden":
            message = "unknown key" + _did_you_mean(problem["loc"])
        elif problem["type"] in _EXPECTED and "input" in problem:
            value = problem["input"]
            shown = "" if value is None or isinstance(value, (dict, list, tuple)) else f" ({_yaml_scalar(value)})"
            message = f"expected {_EXPECTED[problem['type']]}, got {_kind(value)}{shown}"
            if problem["type"] == "string_type" and isinstance(value, (int, float)):
                message += f"; quote it ('{_yaml_scalar(value)}') if it is text"
        elif problem["type"] == "value_error":
            message = message.removeprefix("Value error, ")
        elif "input" in problem:
            message += f" (got {problem['input']!r})"
        lines.append(f"  {key}: {message}")
    return "\n".join(lines)


def _did_you_mean(loc: tuple[int | str, ...]) -> str:
    """``"; did you mean train.epochs?"`` for the unknown key at ``loc`` (``("train", "epoch")``): the
    closest valid key of its section (difflib ratio >= 0.6), or "" when none is that close."""
    *section, key = loc
    close = nearest_name(key, _keys_at(section))
    if close is None:
        return ""
    return f"; did you mean {'.'.join(str(part) for part in [*section, close])}?"


def _keys_at(section: list[int | str]) -> list[str]:
    """The keys of the config section at a pydantic error location (``["model", "loss"]``; a feature
    is ``["towers", "query", "features", 0, "categorical"]``: list index, then the kind); [] when
    the location names no section."""
    models: list[type[BaseModel]] = [Config]
    for part in section:
        if isinstance(part, int):  # an item of a list of sections: the same models
            continue
        kinds = [model for model in models if _kind_of(model) == part]
        if len(models) > 1 and kinds:  # a member of a discriminated union, named by its kind
            models = kinds
            continue
        models = [
            member for model in models if part in model.model_fields
            for member in _sections_in(model.model_fields[part].annotation)
        ]
    return sorted({key for model in models for key in model.model_fields})


def _sections_in(annotation: Any) -> list[type[BaseModel]]:
    """The section models a field holds: ``X``, ``X | None``, ``tuple[X, ...]``, a union of features."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) is Annotated:
        return _sections_in(get_args(annotation)[0])
    if get_origin(annotation) in (Union, UnionType, tuple):
        return [model for member in get_args(annotation) for model in _sections_in(member)]
    return []


def _kind_of(model: type[BaseModel]) -> Any:
    """The one value of a section's ``kind`` field (a feature kind), else None."""
    field = model.model_fields.get("kind")
    choices = get_args(field.annotation) if field is not None and get_origin(field.annotation) is Literal else ()
    return choices[0] if len(choices) == 1 else None


class _Yaml12Floats(yaml.SafeLoader):
    """PyYAML's safe loader, strict: ``1e-3`` and ``5E+6`` read as floats as YAML 1.2 does (YAML 1.1 needs a
    dot), and a key given twice in one mapping, at any depth, is an error naming the key and both lines
    (PyYAML keeps the last silently, so a second ``train:`` block would undo the first)."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # a merge key (<<) may be overridden; complex keys are refused by PyYAML itself
                key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                if key in first_line:
                    raise yaml.constructor.ConstructorError(
                        None, None,
                        f"duplicate key {key!r}: set on line {first_line[key]} and again on line {line}",
                        key_node.start_mark,
                    )
                first_line[key] = line
        return super().construct_mapping(node, deep=deep)


_Yaml12Floats.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def read_yaml(text: str) -> Any:
    """YAML as configs, search spaces and ``--set`` values are read: safe, YAML 1.2 floats (``1e-3`` is a
    number), and no key twice in one mapping (``yaml.YAMLError`` naming the key and both lines)."""
    return yaml.load(text, Loader=_Yaml12Floats)  # noqa: S506 (a SafeLoader subclass)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``"train.epochs=3"`` into (["train", "epochs"], 3); values are YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} must look like section.key=value")
    try:
        parsed = read_yaml(value) if value.strip() else None
    except yaml.YAMLError as error:
        problem = str(getattr(error, "problem", None) or error).strip()
        raise ConfigError(
            f"override {text!r}: the value of {key.strip()} is not valid YAML ({problem}); "
            "a string holding YAML syntax ([ ] { } : # ...) must be quoted"
        ) from None
    return key.strip().split("."), parsed


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``raw`` with each ``section.key=value`` override set."""
    result = _deep_copy(raw)
    for text in overrides:
        path, value = parse_override(text)
        node = result
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return result


def _deep_copy(raw: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in raw.items()}


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or the defaults when ``path`` is None) and apply overrides."""
    raw: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: not a text file (a YAML config is UTF-8 text)") from None
        try:
            raw = read_yaml(text) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"{path}: not valid YAML: {yaml_problem(error)}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    if overrides:
        raw = apply_overrides(raw, overrides)
        source += " + --set " + " ".join(overrides)
    config = Config.from_dict(raw, source)
    warm_start_parent(config)  # a parent that cannot be trained on from is refused now, not after the data
    return config


def with_absolute_data_paths(config: Config, base: str | os.PathLike | None = None) -> Config:
    """``config`` with every data path (click logs, feature tables, data.movielens_dir) made absolute
    against ``base`` (default: the working directory), so that a run's config reads the same files
    wherever the run is later opened (``retrieval evaluate --run`` from another directory)."""
    root = Path(base) if base is not None else Path.cwd()

    def absolute(path: str) -> str:
        expanded = Path(path).expanduser()
        return path if expanded.is_absolute() else os.path.normpath(root / expanded)

    data = config.data
    tables = {
        key: table.model_copy(update={"path": absolute(table.path)})
        for key in ("clicks", "test_clicks", "item_features", "user_features")
        if (table := getattr(data, key)) is not None
    }
    if data.movielens_dir is not None:
        tables["movielens_dir"] = absolute(data.movielens_dir)
    return config.model_copy(update={"data": data.model_copy(update=tables)})


def save_config(config: Config, path: str | os.PathLike) -> None:
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False), encoding="utf-8")


# What decides the variables a model builds and their shapes (the towers section decides too, whole):
# a warm start must match its parent on each, its weights being matched one by one.
WARM_START_SHAPE_KEYS = (
    "model.embedding_dim",
    "model.ensemble_members",
    "model.normalize",
    "model.item_bias",
    "model.loss.kind",
    "model.loss.negatives",
    "model.loss.hard_negatives",
    "model.loss.log_q_source",
    "model.loss.streaming",
    "model.loss.kernel",
    "model.log_q_correction",
)


def warm_start_conflicts(config: Config, parent: Config) -> list[str]:
    """The dotted keys where ``config`` would build other variables than its ``train.warm_start`` parent:
    ``WARM_START_SHAPE_KEYS`` and every key of ``towers`` (features, history length and layout, MLP
    sizes ...) whose value differs; empty when the weights can be carried."""
    new, old = config.to_dict(), parent.to_dict()

    def differing(a: Any, b: Any, prefix: str) -> list[str]:
        if isinstance(a, dict) and isinstance(b, dict):
            return [key for name in sorted(set(a) | set(b)) for key in differing(a.get(name), b.get(name),
                                                                                  f"{prefix}.{name}")]
        return [] if a == b else [prefix]

    conflicts = [key for key in WARM_START_SHAPE_KEYS if _value_at(new, key) != _value_at(old, key)]
    return conflicts + differing(new["towers"], old["towers"], "towers")


def warm_start_parent(config: Config) -> Config | None:
    """The config of ``train.warm_start``'s parent run (its ``manifest.json``'s), checked against ``config``
    (``warm_start_conflicts``); None without a warm start. Read at load, before any data or TensorFlow.

    Raises:
      ConfigError: the parent is not a run or bundle directory, or it builds other variables (naming
        the first differing key and both values).
    """
    path = config.train.warm_start
    if path is None:
        return None
    manifest = Path(path).expanduser() / "manifest.json"
    if not manifest.is_file():
        what = "does not exist" if not Path(path).expanduser().exists() else "holds no manifest.json"
        raise ConfigError(f"train.warm_start={path!r} {what}: it must be a finished run directory (a bundle)")
    try:
        raw = json.loads(manifest.read_text(encoding="utf-8")).get("config")
    except (OSError, ValueError, AttributeError) as error:
        raise ConfigError(f"train.warm_start={path!r}: its manifest.json cannot be read ({error})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"train.warm_start={path!r}: its manifest.json records no config to check against")
    parent = Config.from_dict(raw, source=f"{manifest} (train.warm_start's parent)")
    conflicts = warm_start_conflicts(config, parent)
    if conflicts:
        key = conflicts[0]
        new, old = (_value_at(c.to_dict(), key) for c in (config, parent))
        more = f" (and {len(conflicts) - 1} more: {', '.join(conflicts[1:4])})" if len(conflicts) > 1 else ""
        raise ConfigError(
            f"train.warm_start={path!r}: {key} is {new!r}, the parent's is {old!r}{more}; a warm start carries "
            f"the parent's weights, so {key} must be the parent's (or train from scratch)"
        )
    return parent


def _value_at(raw: Any, key: str) -> Any:
    for part in key.split("."):
        raw = raw.get(part) if isinstance(raw, dict) else None
    return raw
