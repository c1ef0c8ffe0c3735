"""README.md and docs/ match the code and the results: the generated config reference
(docs/configuration.md) and bundle layout (docs/operations.md), every quoted figure against the
results file it cites, and no dangling file references."""

import json
import math
import re
from pathlib import Path

import pytest
import yaml

from retrieval.bundle import layout as bundle_layout
from retrieval.config import Config, IdFeature, TextFeature
from retrieval.config import reference as config_reference

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
CONFIGURATION = ROOT / config_reference.TARGET


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


def test_configuration_reference_is_up_to_date():
    block = config_reference.marked_block(CONFIGURATION.read_text(encoding="utf-8"))
    assert block == config_reference.reference_markdown(), (
        f"{config_reference.TARGET}'s config reference differs from retrieval/config/sections.py: regenerate it with "
        f"`{config_reference.REGENERATE}`"
    )


def test_bundle_layout_is_generated_from_the_parts():
    documented = bundle_layout.documented_layout((ROOT / bundle_layout.TARGET).read_text(encoding="utf-8"))
    assert documented == bundle_layout.layout_markdown(), (
        f"{bundle_layout.TARGET}'s bundle layout differs from retrieval/bundle/parts.py: regenerate it with "
        f"`{bundle_layout.REGENERATE}`"
    )


def test_the_bundle_layout_block_is_replaced_between_its_markers():
    stale = f"before\n{bundle_layout.START}\nold\n{bundle_layout.END}\nafter\n"
    fresh = bundle_layout.with_layout(stale)
    assert fresh.startswith("before\n") and fresh.endswith(f"{bundle_layout.END}\nafter\n")
    assert bundle_layout.documented_layout(fresh) == bundle_layout.layout_markdown()
    with pytest.raises(ValueError, match="bundle-layout:start"):
        bundle_layout.documented_layout("no block\n")


def test_readme_links_the_reference_instead_of_copying_it():
    readme = README.read_text(encoding="utf-8")
    assert config_reference.START not in readme and "#### `model`" not in readme
    assert f"({config_reference.TARGET})" in readme


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
    readme = tmp_path / "configuration.md"
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
        config_reference.marked_block("# no block here\n")


# -- quoted figures ----------------------------------------------------------------------
#
# A figure quoted in README.md or docs/ is followed by a marker naming the results file and the
# JSON pointer (RFC 6901: "/" between keys, "~1" for a "/" inside a key) of the value it shows,
# optionally with a scale factor for unit changes (seconds shown as ms: "* 1000"):
#
#     recall@20 0.479 <!-- result: benchmarks/results/bench_losses.json#/quality/synthetic/rankers/... -->
#
# The figure is the last number before the marker (a short unit such as "x", " ms" or " GiB" may sit
# between). It must equal the stored value rounded to the decimals printed.

_MARKER = re.compile(
    r"(?P<figure>\d[\d,]*(?:\.\d+)?)(?P<unit>[^\d<|`]{0,8}?)\s*"
    r"<!-- result: (?P<file>[^#\s]+)#(?P<pointer>/[^>]*?)(?: \* (?P<scale>[0-9.e+-]+))? -->"
)
_ANY_MARKER = re.compile(r"<!-- result:")
_RESULTS = "benchmarks/results/"


def _pointer(document, pointer: str):
    """The value at a JSON pointer (``/a/b/0``); KeyError naming the missing part."""
    value = document
    for part in pointer.lstrip("/").split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(value, list):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            raise KeyError(f"{part!r} (of {pointer})")
    return value


def figure_mismatches(text: str, root: Path = ROOT) -> tuple[int, list[str]]:
    """(markers checked, problems): each marked figure against the results file it cites."""
    problems, checked, loaded = [], 0, {}
    markers = list(_MARKER.finditer(text))
    if len(markers) != len(_ANY_MARKER.findall(text)):
        problems.append("a `<!-- result: ... -->` marker does not follow a figure or is malformed")
    for marker in markers:
        figure, file, pointer = marker["figure"], marker["file"], marker["pointer"]
        where = f"{figure} <- {file}#{pointer}"
        if not file.startswith(_RESULTS) or not file.endswith(".json"):
            problems.append(f"{where}: figures must cite a JSON file under {_RESULTS}")
            continue
        if file not in loaded:
            path = root / file
            loaded[file] = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
        if loaded[file] is None:
            problems.append(f"{where}: no such results file")
            continue
        try:
            value = _pointer(loaded[file], pointer)
        except (KeyError, IndexError, ValueError) as error:
            problems.append(f"{where}: not in the file: {error}")
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            problems.append(f"{where}: the cited value is not a number ({value!r})")
            continue
        shown = float(figure.replace(",", ""))
        decimals = len(figure.split(".")[1]) if "." in figure else 0
        stored = value * float(marker["scale"] or 1)
        checked += 1
        if not math.isclose(shown, stored, abs_tol=0.5 * 10**-decimals + 1e-9):
            problems.append(f"{where}: the file holds {stored!r}, which reads {stored:.{decimals}f}")
    return checked, problems


def _documents() -> list[Path]:
    return [README, *DOCS]


def test_docs_exist():
    names = {path.name for path in DOCS}
    expected = {
        "configuration.md",
        "operations.md",
        "losses-and-log-q.md",
        "sampling.md",
        "feature-towers.md",
        "evaluation-protocol.md",
    }
    assert expected <= names, f"missing from docs/: {sorted(expected - names)}"


@pytest.mark.parametrize("path", _documents(), ids=lambda p: p.name)
def test_quoted_figures_equal_the_results_they_cite(path):
    checked, problems = figure_mismatches(path.read_text(encoding="utf-8"))
    assert not problems, f"{path.relative_to(ROOT)}: " + "; ".join(problems)


def test_quoted_figures_are_checked_at_all():
    counts = {p.name: figure_mismatches(p.read_text(encoding="utf-8"))[0] for p in _documents()}
    assert counts["README.md"] >= 3 and sum(counts.values()) >= 40, counts


def test_a_figure_that_differs_from_its_results_file_is_reported(tmp_path):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "r.json").write_text(json.dumps({"runs": [{"recall@20": 0.4792, "seconds": 0.0023}], "a/b": 3}))
    cite = "<!-- result: benchmarks/results/r.json#/runs/0/recall@20 -->"
    assert figure_mismatches(f"recall 0.479 {cite}", tmp_path) == (1, [])
    assert figure_mismatches(f"| 0.4792 {cite} |", tmp_path) == (1, [])
    checked, problems = figure_mismatches(f"recall 0.483 {cite}", tmp_path)
    assert checked == 1 and "reads 0.479" in problems[0]
    assert figure_mismatches(f"recall 0.48 {cite}", tmp_path)[1] == []  # fewer decimals, same value
    ms = "<!-- result: benchmarks/results/r.json#/runs/0/seconds * 1000 -->"
    assert figure_mismatches(f"2.3 ms {ms}", tmp_path) == (1, [])
    assert figure_mismatches(f"2.5 ms {ms}", tmp_path)[1]
    assert figure_mismatches("3 <!-- result: benchmarks/results/r.json#/a~1b -->", tmp_path) == (1, [])
    for bad, reason in [
        ("0.4 <!-- result: benchmarks/results/r.json#/runs/0/ndcg -->", "not in the file"),
        ("0.4 <!-- result: benchmarks/results/none.json#/x -->", "no such results file"),
        ("0.4 <!-- result: README.json#/x -->", "under benchmarks/results/"),
        ("no figure here <!-- result: benchmarks/results/r.json#/a~1b -->", "malformed"),
    ]:
        assert reason in " ".join(figure_mismatches(bad, tmp_path)[1]), bad


def _prose(text: str) -> str:
    """``text`` without fenced code blocks, code spans, the generated reference and result markers."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(re.escape(config_reference.START) + ".*?" + re.escape(config_reference.END), "", text, flags=re.S)
    text = _MARKER.sub("", text)
    return re.sub(r"`[^`]*`", "", text)


@pytest.mark.parametrize("path", _documents(), ids=lambda p: p.name)
def test_every_three_decimal_figure_cites_its_results_file(path):
    # Metrics are printed with three decimals (recall@20 0.479): one without a marker is a figure
    # copied from somewhere no test can check.
    loose = re.findall(r"(?<![\w.])\d+\.\d{3,}(?![\w.])", _prose(path.read_text(encoding="utf-8")))
    assert not loose, f"{path.relative_to(ROOT)} quotes figures without a result marker: {loose}"


# -- links --------------------------------------------------------------------------------

_TOP_LEVEL = ("retrieval", "configs", "benchmarks", "tests", "notebooks", "pipelines", "tools", "docs")


def _links(text: str, anchors: bool = False) -> list[str]:
    """Relative Markdown link targets (resolved against the file's folder), with their #anchor if asked."""
    targets = re.findall(r"\[[^\][]+\]\(([^)\s\"'=]+)\)", text)
    links = [t for t in targets if not re.match(r"^(https?:|mailto:|#)", t)]
    return links if anchors else [t.split("#")[0] for t in links]


def _slugs(markdown: str) -> set[str]:
    """The anchors a code host gives the headings: lower case, punctuation dropped, spaces -> '-'."""
    headings = re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def _spans(text: str) -> list[str]:
    """`code` spans naming a repository path (resolved against the repository root)."""
    return [
        s
        for s in re.findall(r"`([^`\s]+)`", text)
        if s.split("/")[0] in _TOP_LEVEL and "/" in s and not re.search(r"[<>{}*]", s)
    ]


def _missing(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    links = [target for target in _links(text) if not (path.parent / target).exists()]
    for target in _links(text, anchors=True):
        file, _, anchor = target.partition("#")
        linked = path.parent / file
        if anchor and linked.suffix == ".md" and linked.exists() and anchor not in _slugs(linked.read_text()):
            links.append(target)
    spans = [span for span in _spans(text) if not (ROOT / span.rstrip(".,")).exists()]
    return sorted(set(links + spans))


def test_readme_and_docs_name_no_missing_files():
    assert "retrieval/config/sections.py" in _spans(README.read_text(encoding="utf-8"))  # the check sees paths at all
    missing = {str(path.relative_to(ROOT)): _missing(path) for path in _documents()}
    missing = {name: paths for name, paths in missing.items() if paths}
    assert not missing, f"files referred to that do not exist: {missing}"


def test_readme_links_every_doc():
    readme = README.read_text(encoding="utf-8")
    linked = {target.split("#")[0] for target in _links(readme)}
    unlinked = [f"docs/{path.name}" for path in DOCS if f"docs/{path.name}" not in linked]
    assert not unlinked, f"README.md does not link {unlinked}"


def test_missing_file_references_are_found(tmp_path):
    text = "see [the config](retrieval/nothing.py) and `configs/absent.yaml`, not `artifacts/<run>/`"
    assert _links(text) == ["retrieval/nothing.py"] and _spans(text) == ["configs/absent.yaml"]
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# top\n")
    doc = tmp_path / "docs" / "x.md"
    (tmp_path / "README.md").write_text("# top\n\n## Out of core: big logs\n\n```\n# not a heading\n```\n")
    doc.write_text(
        "[ok](../README.md), [bad](README.md), `retrieval/config/sections.py`, `retrieval/nothing.py`, "
        "[ok](../README.md#out-of-core-big-logs), [bad](../README.md#limits), [bad](../README.md#not-a-heading)"
    )
    assert _missing(doc) == ["../README.md#limits", "../README.md#not-a-heading", "README.md", "retrieval/nothing.py"]


# A repository path a module's docstring or comment cites: retrieval/serving/bundle.py, docs/operations.md, configs/.
_CITED_PATH = re.compile(r"(?<![\w/.])((?:retrieval|docs|configs|benchmarks|pipelines|notebooks)/[\w./-]*[\w/])")


def _cited_paths(text: str) -> list[str]:
    return [path for path in _CITED_PATH.findall(text) if re.search(r"\.(py|md|ya?ml|ipynb|html)$|/$", path)]


def test_source_files_cite_no_missing_paths():
    sources = [path for folder in ("retrieval", "benchmarks", "pipelines") for path in (ROOT / folder).rglob("*.py")]
    assert _cited_paths((ROOT / "retrieval" / "config" / "sections.py").read_text())  # the check sees paths at all
    missing = {
        str(path.relative_to(ROOT)): cited
        for path in sources
        if (cited := sorted({p for p in _cited_paths(path.read_text(encoding="utf-8")) if not (ROOT / p).exists()}))
    }
    assert not missing, f"paths cited in source files that do not exist: {missing}"


def test_cited_paths_are_found():
    text = "see retrieval/service.py and ``retrieval/losses/``; docs/x.md, not artifacts/run/ or my.retrieval/a.py"
    assert _cited_paths(text) == ["retrieval/service.py", "retrieval/losses/", "docs/x.md"]
