"""The whole job: ``Config`` (every section, and the checks that span sections), the ``run`` section
(where results go), and the message naming each bad key of a config that fails validation (with a
"did you mean" for an unknown key, found by walking the sections from ``Config``)."""

from __future__ import annotations

import re
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, Field, ValidationError, model_validator

from retrieval.common.errors import nearest_name
from retrieval.config.base import ConfigError, _kind, _Section, _yaml_scalar
from retrieval.config.data import DataConfig, SplitConfig
from retrieval.config.evaluation import EvaluationConfig
from retrieval.config.export import ExportConfig
from retrieval.config.index import IndexConfig, faiss_index_problem
from retrieval.config.model import ModelConfig
from retrieval.config.towers import TowersConfig
from retrieval.config.train import TrainConfig


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
