"""README.md matches the code: the generated config reference, and no dangling file references."""

import re
from pathlib import Path

import pytest
import yaml

from retrieval import config_reference
from retrieval.config import Config, IdFeature, TextFeature

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _flatten(value, prefix=""):
    """Dotted leaf keys of a nested dict (lists and None are leaves)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flatten(item, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), value


def _rows(reference: str) -> dict[str, list[str]]:
    """key -> its table cells (type, default, description), from the generated Markdown."""
    rows = {}
    for line in reference.splitlines():
        found = re.match(r"^\| `([^`]+)` \| (.*) \|$", line)
        if found:
            cells = re.split(r"(?<!\\) \| ", found.group(2))
            rows.setdefault(found.group(1), cells)
    return rows


def _yaml(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def test_readme_config_reference_is_up_to_date():
    block = config_reference.readme_block(README.read_text(encoding="utf-8"))
    assert block == config_reference.reference_markdown(), (
        "README.md's config reference differs from retrieval/config.py: regenerate it with "
        f"`{config_reference.REGENERATE}`"
    )


def test_reference_lists_every_key_with_the_default_pydantic_dumps():
    # Independent of the generator's walk over field annotations: pydantic's own dump of the
    # default config gives every leaf key and its default value.
    rows = _rows(config_reference.reference_markdown())
    leaves = dict(_flatten(Config().model_dump(mode="json")))
    assert len(leaves) > 50
    for key, value in leaves.items():
        assert key in rows, f"{key} is missing from the config reference"
        if isinstance(value, list) and value and isinstance(value[0], dict):
            continue  # feature lists are shown with their non-default fields only (checked below)
        shown = rows[key][1].strip("`")
        expected = value if isinstance(value, str) and value else _yaml(value)
        assert shown == expected, f"{key}: reference shows {shown!r}, default is {expected!r}"
    assert rows["towers.query.features"][1] == "`[{name: user_id, kind: id}]`"


def test_reference_rows_carry_types_bounds_and_descriptions():
    rows = _rows(config_reference.reference_markdown())
    assert rows["train.epochs"][0] == "int, > 0"
    assert rows["model.log_q_strength"][0] == "float, >= 0, <= 2"
    assert rows["index.search_params"][0] == "str or null"
    assert rows["data.clicks.path"][1] == "required"
    assert rows["model.loss.kind"][0].startswith("one of `softmax`, `full_softmax`")
    described = Config.model_fields["model"].annotation.model_fields["temperature"].description
    assert rows["model.temperature"][2] == described


def test_every_feature_kind_has_a_table_with_its_own_fields():
    reference = config_reference.reference_markdown()
    kinds = re.findall(r"^#### feature `kind: (\w+)`", reference, flags=re.M)
    assert kinds == ["id", "categorical", "multi_categorical", "numeric", "timestamp", "text"]
    text_table = reference.split("#### feature `kind: text`")[1]
    for key in ["name", "source", "kind", "text.trigrams", "text.buckets"]:
        assert f"| `{key}` |" in text_table
    buckets = TextFeature.model_fields["text"].default.buckets
    assert f"| `text.buckets` | int, > 0 | `{buckets}` |" in text_table
    id_table = reference.split("#### feature `kind: id`")[1].split("#### ")[0]
    assert set(re.findall(r"^\| `([\w.]+)` \|", id_table, flags=re.M)) == set(IdFeature.model_fields)


def test_check_and_write_round_trip(tmp_path, capsys):
    readme = tmp_path / "README.md"
    stale = f"# title\n\nbefore\n{config_reference.START}\n| old | table |\n{config_reference.END}\nafter\n"
    readme.write_text(stale)
    assert config_reference.main(["--check", str(readme)]) == 1
    assert config_reference.REGENERATE in capsys.readouterr().err
    assert config_reference.main(["--write", str(readme)]) == 0
    assert config_reference.main(["--check", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n") and text.endswith(f"{config_reference.END}\nafter\n")
    assert "| old | table |" not in text


def test_missing_markers_are_an_error():
    with pytest.raises(ValueError, match="config-reference:start"):
        config_reference.readme_block("# no block here\n")


# -- links --------------------------------------------------------------------------------

_TOP_LEVEL = ("retrieval", "configs", "benchmarks", "tests", "notebooks", "pipelines", "tools")


def _referenced_paths(text: str) -> list[str]:
    """Relative Markdown link targets and `code` spans naming a repository path."""
    targets = re.findall(r"\[[^\][]+\]\(([^)\s\"'=]+)\)", text)
    links = [t for t in targets if not re.match(r"^(https?:|mailto:|#)", t)]
    spans = [
        s
        for s in re.findall(r"`([^`\s]+)`", text)
        if s.split("/")[0] in _TOP_LEVEL and "/" in s and not re.search(r"[<>{}*]", s)
    ]
    return [t.split("#")[0] for t in links] + spans


def test_readme_names_no_missing_files():
    paths = _referenced_paths(README.read_text(encoding="utf-8"))
    assert "retrieval/config.py" in paths  # the check sees the README's paths at all
    missing = sorted({p for p in paths if not (ROOT / p).exists()})
    assert not missing, f"README.md refers to files that do not exist: {missing}"


def test_missing_file_references_are_found():
    text = "see [the config](retrieval/nothing.py) and `configs/absent.yaml`, not `artifacts/<run>/`"
    assert _referenced_paths(text) == ["retrieval/nothing.py", "configs/absent.yaml"]
