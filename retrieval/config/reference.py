"""The config reference: every key of ``retrieval.config`` as Markdown tables.

    python -m retrieval.config.reference                                # print the reference
    python -m retrieval.config.reference --write docs/configuration.md  # replace the generated block
    python -m retrieval.config.reference --check docs/configuration.md  # exit 1 if the block is stale

The tables are generated from the pydantic models (dotted key, type with its
bounds, default, the field's ``description``), so docs/configuration.md cannot
drift from the code: ``tests/project/test_docs.py`` fails when the block between the
markers there differs from what this module generates. Feature kinds (the
``towers.*.features`` discriminated union) get one table each.

Imports only ``retrieval.config.sections`` (no TensorFlow).
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from retrieval.config.sections import Config

START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"
TARGET = "docs/configuration.md"  # the file that holds the generated block, relative to the repository root
REGENERATE = f"python -m retrieval.config.reference --write {TARGET}"
REQUIRED = "required"

# Constraint metadata (annotated_types.Gt, Ge, ... as pydantic stores them) -> how it reads after
# the type ("int, > 0").
_BOUNDS = {
    "gt": "> {}",
    "ge": ">= {}",
    "lt": "< {}",
    "le": "<= {}",
    "min_length": "length >= {}",
    "max_length": "length <= {}",
}


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _union_members(annotation: Any) -> tuple[Any, ...] | None:
    origin = typing.get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        return typing.get_args(annotation)
    return None


def _strip_annotated(annotation: Any) -> tuple[Any, list[Any]]:
    """``Annotated[X, meta...]`` -> (X, [meta...]); anything else -> (it, [])."""
    if typing.get_origin(annotation) is typing.Annotated:
        base, *metadata = typing.get_args(annotation)
        return base, metadata
    return annotation, []


def _feature_union(annotation: Any) -> tuple[type[BaseModel], ...] | None:
    """The member models of a discriminated union of sections (the feature kinds), else None."""
    annotation, _ = _strip_annotated(annotation)
    members = _union_members(annotation)
    if members and all(_is_section(m) for m in members):
        return members
    return None


def _value(value: Any) -> str:
    """A default or a choice as it is written in YAML (``null``, ``true``, ``[10, 20]``)."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", exclude_defaults=True)
    elif isinstance(value, (tuple, list)):
        value = [
            v.model_dump(mode="json", exclude_defaults=True) if isinstance(v, BaseModel) else v for v in value
        ]
    if isinstance(value, str) and value:
        return value
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10_000, allow_unicode=True)
    return text.strip().removesuffix("...").strip()


def type_name(annotation: Any) -> str:
    """A short human-readable type, e.g. "int", "str or null", "one of `a`, `b`", "list of int"."""
    annotation, _ = _strip_annotated(annotation)
    if annotation is type(None):
        return "null"
    if _feature_union(annotation):
        return "feature (one table per `kind` below)"
    members = _union_members(annotation)
    if members is not None:
        names = [type_name(m) for m in members if m is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in members else "")
    origin = typing.get_origin(annotation)
    if origin is Literal and len(typing.get_args(annotation)) == 1:
        return f"`{_value(typing.get_args(annotation)[0])}`"
    if origin is Literal:
        return "one of " + ", ".join(f"`{_value(choice)}`" for choice in typing.get_args(annotation))
    if origin in (tuple, list):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        if args and _feature_union(args[0]):
            return "list of features (one table per `kind` below)"
        inner = type_name(args[0]) if args else "any"
        return f"list of ({inner})" if " " in inner else f"list of {inner}"
    if origin is dict:
        key, item = typing.get_args(annotation)
        return f"mapping of {type_name(key)} to {type_name(item)}"
    if _is_section(annotation):
        return "section"
    name = getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
    return name


def _bounds(field: FieldInfo) -> str:
    parts = []
    for item in field.metadata:
        for attribute, template in _BOUNDS.items():
            if getattr(item, attribute, None) is not None:
                parts.append(template.format(getattr(item, attribute)))
        pattern = getattr(item, "pattern", None)
        if pattern:
            parts.append(f"matches `{pattern}`")
    return ", ".join(parts)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _section_summary(model: type[BaseModel]) -> str:
    doc = (model.__doc__ or "").strip()
    return " ".join(doc.split("\n\n")[0].split())


def _rows(
    model: type[BaseModel], prefix: str, seen: dict[type, str], defaults: BaseModel | None = None
) -> Iterator[tuple[str, str, str, str]]:
    """(key, type, default, description) for every field of ``model``, nested sections inlined.

    ``defaults`` is the parent's default instance of ``model`` (``towers.query``
    defaults to a user_id feature although ``TowerConfig.features`` defaults to
    none); None = the class's own field defaults.
    """
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        if field.is_required():
            default_value = None
        elif defaults is not None:
            default_value = getattr(defaults, name)
        else:
            default_value = field.get_default(call_default_factory=True)
        annotation, _ = _strip_annotated(field.annotation)
        members = _union_members(annotation)
        section = annotation if _is_section(annotation) else None
        optional = False
        if members is not None and type(None) in members:
            rest = [m for m in members if m is not type(None)]
            if len(rest) == 1 and _is_section(rest[0]):
                section, optional = rest[0], True
        description = field.description or ""
        if section is not None:
            if section in seen and default_value is None:
                # An optional section class met before (data.clicks / data.test_clicks / ...).
                kind = "section" + (" or null" if optional else "")
                yield key, f"{kind}: the keys of `{seen[section]}`", _value(default_value), description
                continue
            seen.setdefault(section, key)
            if optional:
                yield key, "section or null (keys below)", _value(default_value), description
            yield from _rows(section, key + ".", seen, default_value)
            continue
        bounds = _bounds(field)
        kind = type_name(field.annotation) + (f", {bounds}" if bounds else "")
        yield key, kind, REQUIRED if field.is_required() else _value(default_value), description


def _table(rows: list[tuple[str, str, str, str]]) -> list[str]:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for key, kind, default, description in rows:
        shown = default if default == REQUIRED else f"`{_cell(default)}`"
        lines.append(f"| `{key}` | {_cell(kind)} | {shown} | {_cell(description)} |")
    return lines


def _feature_kinds(model: type[BaseModel]) -> list[type[BaseModel]]:
    """Every feature-kind model reachable from ``model`` (in definition order, once each)."""
    found: list[type[BaseModel]] = []
    for field in model.model_fields.values():
        annotation, _ = _strip_annotated(field.annotation)
        candidates = [annotation, *typing.get_args(annotation), *(_union_members(annotation) or ())]
        for candidate in candidates:
            union = _feature_union(candidate)
            if union:
                found += [m for m in union if m not in found]
            elif _is_section(candidate):
                found += [m for m in _feature_kinds(candidate) if m not in found]
    return found


def reference_markdown(config: type[BaseModel] = Config) -> str:
    """The config reference: a table per top-level section, then one per feature kind."""
    lines = [
        f"<!-- generated by `{REGENERATE}` from retrieval/config/sections.py; do not edit by hand -->",
        "",
    ]
    seen: dict[type, str] = {}
    for name, field in config.model_fields.items():
        section = field.annotation
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            raise TypeError(f"top-level config field {name!r} is not a section model: {section!r}")
        lines += [f"#### `{name}`", "", _section_summary(section), ""]
        lines += _table(list(_rows(section, f"{name}.", seen)))
        lines.append("")
    for kind_model in _feature_kinds(config):
        kind = typing.get_args(kind_model.model_fields["kind"].annotation)[0]
        heading = f"#### feature `kind: {kind}` (`towers.<query|doc>.features[]`)"
        lines += [heading, "", _section_summary(kind_model), ""]
        lines += _table(list(_rows(kind_model, "", {})))
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def marked_block(text: str) -> str:
    """The text between the reference markers of a Markdown file (ValueError if they are missing)."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {START} ... {END} block")
    return text[start + len(START) : end].strip("\n") + "\n"


def replace_block(text: str, reference: str) -> str:
    """``text`` with the block between the markers replaced by ``reference``."""
    marked_block(text)  # checks the markers
    start, end = text.find(START) + len(START), text.find(END)
    return text[:start] + "\n" + reference.rstrip("\n") + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", type=Path, metavar="FILE", help=f"replace the marked block of FILE ({TARGET})")
    action.add_argument("--check", type=Path, metavar="FILE", help="exit 1 if the marked block of FILE is stale")
    args = parser.parse_args(argv)
    reference = reference_markdown()
    if args.write:
        text = args.write.read_text(encoding="utf-8")
        args.write.write_text(replace_block(text, reference), encoding="utf-8")
    elif args.check:
        if marked_block(args.check.read_text(encoding="utf-8")) != reference:
            print(f"{args.check}: the config reference is out of date; run `{REGENERATE}`", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(reference)
    return 0


if __name__ == "__main__":
    sys.exit(main())
