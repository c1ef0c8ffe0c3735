"""The ``data`` section (the click log and feature tables, or a synthetic or MovieLens log; streaming
reads) and the ``split`` section (how clicks are held out for evaluation)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from retrieval.config.base import Seed, _Section

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
