"""Typed, validated configuration: one frozen model per pipeline step.

Every field is documented here; the YAML files in ``configs/`` set a subset and
``--set section.key=value`` on the command line overrides any of them. Unknown
keys and wrong types are rejected when the config is loaded, with the dotted
path of the bad key in the message.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names the key."""


class _Section(BaseModel):
    # extra="forbid" is what turns a typo such as `train.epoch` into an error
    # instead of a silently ignored key.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


TableFormat = Literal[
    "auto",  # from the file extension: .csv, .tsv/.txt, .parquet
    "csv",
    "tsv",
    "parquet",
    "movielens-100k",  # u.data: user<TAB>item<TAB>rating<TAB>timestamp, no header
    "movielens-1m",  # ratings.dat: user::item::rating::timestamp, no header
]


class TableConfig(_Section):
    """Where a table lives and how to parse it."""

    path: str = Field(description="File path; relative paths resolve against the working directory.")
    format: TableFormat = "auto"
    separator: Optional[str] = Field(None, description="Field separator; None = from the format.")
    header: bool = Field(True, description="Whether the first line names the columns (CSV/TSV).")
    encoding: str = "utf-8"


class ColumnsConfig(_Section):
    """Names of the click-log columns in the input files."""

    user: str = "user_id"
    item: str = "item_id"
    timestamp: Optional[str] = Field("timestamp", description="None if the log has no time column.")
    weight: Optional[str] = Field(None, description="Optional per-click weight (e.g. rating, dwell).")


class SyntheticConfig(_Section):
    """The embedded click-log generator used when ``data.source: synthetic``."""

    n_users: int = Field(2000, gt=0)
    n_items: int = Field(1000, gt=0)
    n_clusters: int = Field(20, gt=0, description="Latent taste clusters shared by users and items.")
    mean_clicks_per_user: float = Field(40.0, gt=0)
    popularity_exponent: float = Field(1.0, ge=0, description="Zipf exponent of item popularity.")
    taste_strength: float = Field(
        0.8, ge=0, le=1, description="Share of a user's clicks drawn from their own taste clusters."
    )
    days: int = Field(90, gt=0, description="Time span of the generated log.")
    seed: int = 0


class DataConfig(_Section):
    """Input data: the click log and optional feature tables."""

    source: Literal["synthetic", "movielens-100k", "files"] = "synthetic"
    clicks: Optional[TableConfig] = Field(None, description="Click log (source: files).")
    test_clicks: Optional[TableConfig] = Field(
        None, description="Separately given test log; required by split.kind: none."
    )
    columns: ColumnsConfig = ColumnsConfig()
    item_features: Optional[TableConfig] = None
    item_id_column: str = Field("item_id", description="Id column of the item feature table.")
    user_features: Optional[TableConfig] = None
    user_id_column: str = Field("user_id", description="Id column of the user feature table.")
    movielens_dir: Optional[str] = Field(
        None,
        description="MovieLens 100K folder; None = $RETRIEVAL_DATA_DIR or ../shared/datasets/ml-100k.",
    )
    duplicates: Literal["keep", "first"] = Field(
        "keep",
        description="Repeated (user, item) clicks: keep every click as a training example, or keep "
        "only the first.",
    )
    synthetic: SyntheticConfig = SyntheticConfig()

    @model_validator(mode="after")
    def _files_need_a_path(self) -> "DataConfig":
        if self.source == "files" and self.clicks is None:
            raise ValueError("data.clicks is required when data.source is 'files'")
        return self


class SplitConfig(_Section):
    """How the log is split into training and test parts.

    ``temporal`` cuts the whole log at one timestamp (the last ``test_fraction``
    of clicks is test); ``leave_last_k`` holds out each user's last ``k``
    clicks; ``random`` holds out a random ``test_fraction``; ``none`` uses
    ``data.test_clicks`` as the test set.
    """

    kind: Literal["temporal", "leave_last_k", "random", "none"] = "temporal"
    test_fraction: float = Field(0.2, gt=0, lt=1)
    k: int = Field(1, gt=0)
    seed: int = 0


class ModelConfig(_Section):
    """Towers and the training objective."""

    embedding_dim: int = Field(64, gt=0)
    normalize: bool = Field(True, description="L2-normalise tower outputs (cosine similarity).")
    temperature: float = Field(0.2, gt=0, description="Logits are divided by this.")
    log_q_correction: bool = Field(
        True, description="Subtract log Q(item) (training popularity) from in-batch logits."
    )
    log_q_strength: float = Field(
        1.0,
        ge=0,
        le=2,
        description="Subtract strength * log Q: 1 is the unbiased correction, 0 none, above 1 "
        "over-corrects (ranks popular items higher than the unbiased model would).",
    )
    remove_accidental_hits: bool = Field(
        True, description="Mask in-batch negatives that are the row's own positive item."
    )
    l2_regularization: float = Field(0.0, ge=0, description="L2 penalty on embedding tables.")


class TrainConfig(_Section):
    """Optimisation."""

    epochs: int = Field(5, gt=0)
    batch_size: int = Field(1024, gt=1)
    optimizer: Literal["adam", "adagrad", "sgd"] = "adam"
    learning_rate: float = Field(0.01, gt=0)
    use_weights: bool = Field(
        False, description="Use the log's weight column as per-example loss weights."
    )
    seed: int = 42
    verbose: Literal["auto", 0, 1, 2] = Field(
        "auto", description="Keras progress: bar on a terminal, a line per epoch otherwise."
    )


class IndexConfig(_Section):
    """The FAISS index over every catalogue item."""

    factory: str = Field("Flat", description="FAISS index factory string.")


class EvaluationConfig(_Section):
    """Offline evaluation over the full corpus."""

    ks: tuple[int, ...] = (10, 20, 50, 100)
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
    query_batch_size: int = Field(4096, gt=0)

    @model_validator(mode="after")
    def _ks_positive(self) -> "EvaluationConfig":
        if not self.ks or any(k <= 0 for k in self.ks):
            raise ValueError(f"evaluation.ks must be positive integers, got {list(self.ks)}")
        return self


class RunConfig(_Section):
    """Where results go."""

    name: Optional[str] = Field(None, description="Run name; None = <UTC time>-<config name>.")
    output_dir: str = "artifacts"
    overwrite: bool = Field(False, description="Replace an existing run directory of the same name.")

    @model_validator(mode="after")
    def _plain_name(self) -> "RunConfig":
        if self.name is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", self.name):
            raise ValueError(f"run.name must use letters, digits, '.', '_' and '-', got {self.name!r}")
        return self


class Config(_Section):
    """The whole job: data -> split -> model -> train -> index -> evaluation -> run."""

    data: DataConfig = DataConfig()
    split: SplitConfig = SplitConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    index: IndexConfig = IndexConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    run: RunConfig = RunConfig()

    @model_validator(mode="after")
    def _split_none_needs_test_file(self) -> "Config":
        if self.split.kind == "none" and self.data.test_clicks is None:
            raise ValueError("split.kind 'none' needs data.test_clicks (the separately given test log)")
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/YAML-serialisable dict; ``Config.from_dict`` inverts it."""
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "<dict>") -> "Config":
        """Validate ``raw``; raise ConfigError naming each bad key."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a mapping at the top level, got {type(raw).__name__}")
        try:
            return cls.model_validate(raw)
        except ValidationError as error:
            raise ConfigError(_describe(error, source)) from None


def _describe(error: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid configuration"]
    for problem in error.errors():
        key = ".".join(str(part) for part in problem["loc"]) or "<top level>"
        message = problem["msg"]
        if problem["type"] == "extra_forbidden":
            message = "unknown key"
        elif "input" in problem and problem["type"] != "value_error":
            message += f" (got {problem['input']!r})"
        lines.append(f"  {key}: {message}")
    return "\n".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``"train.epochs=3"`` into (["train", "epochs"], 3); values are YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} must look like section.key=value")
    return key.strip().split("."), yaml.safe_load(value) if value.strip() else None


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
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"{path}: not valid YAML: {error}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    if overrides:
        raw = apply_overrides(raw, overrides)
        source += " + --set " + " ".join(overrides)
    return Config.from_dict(raw, source)


def save_config(config: Config, path: str | os.PathLike) -> None:
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False), encoding="utf-8")
