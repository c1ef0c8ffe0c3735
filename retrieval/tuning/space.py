"""The search space and what a trial's config is made of.

A search space YAML maps dotted config keys to ``{type, low/high/log/step or choices}``;
``load_space`` reads it into ``Param`` records and checks, before any training, that every key is a
searchable config key and every bound or choice gives a valid config on the base. The same module
holds what every trial sets on top of the base config (``TRIAL_SETTINGS``, ``trial_settings``:
cheaper runs, scored on a validation part), the dotted-key helpers that build a trial's config dict
(``with_values``, ``value_at``) and the errors of the package (``TuneError``, ``SearchSpaceError``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import optuna
import yaml

from retrieval.common.errors import UserError, yaml_problem
from retrieval.config import Config, ConfigError, read_yaml

# What every trial sets on top of the base config: they change what a trial costs, where it writes
# and which part scores it, not the settings searched, so best.yaml leaves them out (the base
# config's values stay there). The baselines are scored once by `make train`, not per trial; a
# killed trial is tried again from the start, so it writes no checkpoints. `trial_settings` adds
# split.evaluate_on: validation where the config splits the log itself.
TRIAL_SETTINGS: dict[str, Any] = {
    # A trial is scored on its selection run (the best epoch's weights): a refit on the whole training
    # part would double its cost without changing which config wins; best.yaml keeps the base's refit.
    "train.refit": False,
    "evaluation.baselines.rankers": [],
    "evaluation.plots": False,
    "train.checkpoint_every_seconds": 0,
    "train.checkpoint_every_steps": 0,
    "run.overwrite": True,
}


def trial_settings(base: Config) -> dict[str, Any]:
    """``TRIAL_SETTINGS``, plus ``split.evaluate_on: validation`` unless ``base.split.kind`` is ``none``.

    Selecting settings by their score on the test part would overfit them to it (the test figure of
    the best config would be biased upwards), so a trial is scored on a validation part carved from
    the training part. With ``split.kind: none`` the given ``data.test_clicks`` is what the user
    chose to score on (a validation file when tuning), and there is no split to repeat.
    """
    settings = dict(TRIAL_SETTINGS)
    if base.split.kind != "none":
        settings["split.evaluate_on"] = "validation"
    return settings


def scored_on(base: Config) -> str:
    """In words, which clicks score the trials of ``base`` (for logs and the CLI)."""
    if base.split.kind == "none":
        return "the given data.test_clicks (split.kind: none): pass a validation file there, not the test file"
    return (f"a validation part: the training part of the {base.split.kind} split, split again the same way "
            "(split.evaluate_on: validation); the test part is never read")


class TuneError(UserError, ValueError):
    """A study cannot run as asked (bad metric, another process, a resume with another config)."""


class SearchSpaceError(TuneError):
    """The search space file is invalid; the message names the file and the key."""


@dataclass(frozen=True)
class Param:
    """One searched config key.

    Attributes:
      key: dotted config key, e.g. ``model.temperature``.
      type: ``float`` and ``int`` search ``[low, high]`` (``log``: uniformly in log space; ``step``:
        a grid), ``categorical`` picks one of ``choices`` (bool, int, float or str).
    """

    key: str
    type: Literal["float", "int", "categorical"]
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: tuple[Any, ...] = ()

    def suggest(self, trial: optuna.Trial) -> Any:
        """The trial's value of this key (recorded in the study under ``key``)."""
        if self.type == "categorical":
            return trial.suggest_categorical(self.key, list(self.choices))
        assert self.low is not None and self.high is not None  # __post_init__ checked them
        if self.type == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.key, float(self.low), float(self.high), step=self.step, log=self.log)

    def contains(self, value: Any) -> bool:
        """Whether ``value`` is a point of this key's space (the base config's value may not be)."""
        if self.type == "categorical":
            return any(type(value) is type(choice) and value == choice for choice in self.choices)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.type == "int" and not float(value).is_integer():
            return False
        assert self.low is not None and self.high is not None
        if not self.low <= value <= self.high:
            return False
        return self.step is None or math.isclose(((value - self.low) / self.step) % 1, 0, abs_tol=1e-9)

    def endpoints(self) -> list[Any]:
        """Values checked against the config before any training: the bounds, or every choice."""
        if self.type == "categorical":
            return list(self.choices)
        assert self.low is not None and self.high is not None
        if self.type == "int":
            return [int(self.low), int(self.high)]
        return [float(self.low), float(self.high)]

    def to_dict(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"type": self.type}
        if self.type == "categorical":
            spec["choices"] = list(self.choices)
        else:
            spec.update(low=self.low, high=self.high, log=self.log)
            if self.step is not None:
                spec["step"] = self.step
        return spec


_SPEC_KEYS = {"float": {"type", "low", "high", "log", "step"}, "int": {"type", "low", "high", "log", "step"},
              "categorical": {"type", "choices"}}


def _param(source: str, key: str, spec: Any) -> Param:
    where = f"search space {source}: {key}"
    if not isinstance(spec, dict):
        raise SearchSpaceError(f"{where}: expected a mapping such as {{type: float, low: 0.01, high: 1}}, got {spec!r}")
    kind = spec.get("type")
    if kind not in _SPEC_KEYS:
        raise SearchSpaceError(f"{where}: type must be one of float, int, categorical, got {kind!r}")
    unknown = sorted(set(spec) - _SPEC_KEYS[kind])
    if unknown:
        valid = sorted(_SPEC_KEYS[kind])
        raise SearchSpaceError(f"{where}: unknown field(s) {unknown} for type {kind}; valid: {valid}")
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise SearchSpaceError(f"{where}: categorical needs a non-empty list of choices, got {choices!r}")
        bad = [c for c in choices if c is not None and not isinstance(c, (bool, int, float, str))]
        if bad:
            raise SearchSpaceError(f"{where}: choices must be bool, int, float or str, got {bad[0]!r}")
        return Param(key, "categorical", choices=tuple(choices))
    step, log_scale = spec.get("step"), spec.get("log", False)
    number = int if kind == "int" else (int, float)
    for name, value in (("low", spec.get("low")), ("high", spec.get("high")), ("step", step)):
        if (value is not None or name != "step") and (isinstance(value, bool) or not isinstance(value, number)):
            raise SearchSpaceError(f"{where}: {name} must be {'an integer' if kind == 'int' else 'a number'}, "
                                   f"got {value!r}")
    cast = int if kind == "int" else float
    low, high = cast(spec["low"]), cast(spec["high"])
    if not isinstance(log_scale, bool):
        raise SearchSpaceError(f"{where}: log must be true or false, got {log_scale!r}")
    if low > high:
        raise SearchSpaceError(f"{where}: low ({low}) is above high ({high})")
    if log_scale and (low <= 0 or step is not None):
        raise SearchSpaceError(f"{where}: log needs low > 0 and no step, got low={low}, step={step}")
    if step is not None and step <= 0:
        raise SearchSpaceError(f"{where}: step must be positive, got {step}")
    return Param(key, kind, low=low, high=high, log=log_scale, step=step)


def load_space(path: str | Path, base: Config) -> list[Param]:
    """Read a search space (YAML: ``config.key: {type, low/high/log/step or choices}``) and check it.

    Every key must be a config key, and each bound or choice must give a valid config when set on
    ``base``, so a typo fails here, before any training.

    Raises:
      SearchSpaceError: naming the file, the key and what is wrong with it.
    """
    try:
        raw = read_yaml(Path(path).read_text(encoding="utf-8"))  # as configs are read: 1e-5 is a number
    except FileNotFoundError:
        raise SearchSpaceError(f"search space file not found: {path}") from None
    except UnicodeDecodeError:
        raise SearchSpaceError(f"search space {path}: not a text file (a search space is UTF-8 YAML)") from None
    except yaml.YAMLError as error:
        raise SearchSpaceError(f"search space {path}: not valid YAML: {yaml_problem(error)}") from None
    if not isinstance(raw, dict) or not raw:
        raise SearchSpaceError(f"search space {path}: expected a non-empty mapping of config keys, got {raw!r}")
    space = [_param(str(path), str(key), spec) for key, spec in raw.items()]
    base_raw = base.to_dict()
    for param in space:
        if param.key.startswith("run.") or param.key in trial_settings(base):
            raise SearchSpaceError(f"search space {path}: {param.key} is set by every trial and cannot be searched")
        if param.key.startswith("split."):
            raise SearchSpaceError(
                f"search space {path}: {param.key} cannot be searched: the split decides which clicks score a "
                "trial, so trials with different values would not be compared on the same clicks"
            )
        for value in param.endpoints():
            try:
                Config.from_dict(with_values(base_raw, {param.key: value}), source=f"{param.key}={value!r}")
            except ConfigError as error:
                raise SearchSpaceError(
                    f"search space {path}: key {param.key!r} (value {value!r}) does not give a valid config:\n{error}"
                ) from None
    return space


def with_values(raw: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """A copy of the config dict ``raw`` with each dotted key of ``values`` set (sections created).

    Raises:
      ConfigError: a key passes through a value that is not a section (``train.epochs.x``).
    """
    result = json.loads(json.dumps(raw))
    for key, value in values.items():
        node = result
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if child is None:  # an optional section left unset (data.clicks: null)
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"{key}: {part!r} is not a section")
            node = child
        node[parts[-1]] = value
    return result


def value_at(raw: dict[str, Any], key: str) -> Any:
    """The value of dotted ``key`` in the config dict ``raw`` (None where a section is missing)."""
    node: Any = raw
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node
