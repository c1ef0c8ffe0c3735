"""Reading and writing configs: YAML as configs are read (YAML 1.2 floats, no key twice),
``--set section.key=value`` overrides, ``load_config``, ``save_config`` and data paths made absolute."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from retrieval.common.errors import yaml_problem
from retrieval.config.base import ConfigError
from retrieval.config.run import Config
from retrieval.config.warm_start import warm_start_parent


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
