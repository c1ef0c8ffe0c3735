"""``train.warm_start``: the keys a warm start must share with its parent run, and the check, at load,
that the parent is a finished run whose config builds the same variables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from retrieval.config.base import ConfigError
from retrieval.config.run import Config

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
