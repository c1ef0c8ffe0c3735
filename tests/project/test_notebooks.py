"""The notebooks: executed top to bottom on small settings, and committed with their full-settings outputs.

Each run appends one probe cell that prints, as JSON, what the notebook computed
(metrics, tables, checks), so the test asserts results rather than only that no
cell raised. ``make notebooks`` (``notebooks/run_notebooks.py``) writes the
full-settings outputs into the committed files; the last test checks those.
"""

import json
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
NAMES = ["quickstart.ipynb", "sampling.ipynb"]
# The config each notebook starts from: the quickstart runs make train's demo, sampling the code's defaults.
CONFIGS = {"quickstart.ipynb": "demo.yaml", "sampling.ipynb": "default.yaml"}

PROBES = {
    "quickstart.ipynb": """
import json
print(json.dumps({
    "recall@20": {name: result.metrics[name]["recall@20"] for name in rankers},
    "indexed_items": sorted(map(str, bundle.index.item_ids)),
    "catalogue_items": sorted(dataset.items["item_id"].astype(str)),
    "recommended": recommendations.item_ids,
    "seen": seen,
    "embedding_shape": list(embedding.shape),
    "embedding_dim": config.model.embedding_dim + config.model.item_bias,  # the bias column, where there is one
    "shown_hits": shown,
}))
""",
    "sampling.ipynb": """
import json
print(json.dumps({
    "step_ms": step_ms,
    "sizes": SIZES,
    "log_q": log_q_table.to_dict(orient="index"),
    "recall_by_m": {name: {str(m): r for m, r in by_m.items()} for name, by_m in recall_by_m.items()},
    "references": references,
    "top_k_equal_or_tied": bool(np.all(same | np.all(ties, axis=1))),
    "normaliser_spread": float(spread.max()),
}))
""",
}


def _run_small(name, tmp_path, monkeypatch) -> tuple[nbformat.NotebookNode, dict]:
    monkeypatch.setenv("RETRIEVAL_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("RETRIEVAL_NOTEBOOK_OUTPUT", str(tmp_path))
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell(PROBES[name]))
    nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    ).execute()
    printed = "".join(o.get("text", "") for o in notebook.cells[-1].outputs if o.get("name") == "stdout")
    return notebook, json.loads(printed.strip().splitlines()[-1])


def _stdout(notebook) -> str:
    return "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.outputs)


@pytest.mark.slow
def test_quickstart_trains_indexes_and_serves(tmp_path, monkeypatch):
    notebook, probe = _run_small("quickstart.ipynb", tmp_path, monkeypatch)
    assert "settings: small" in _stdout(notebook)
    recall = probe["recall@20"]
    assert set(recall) >= {"model", "popularity"}
    assert recall["model"] > recall["popularity"], recall
    # The index the bundle serves holds the whole catalogue, cold items included.
    assert probe["indexed_items"] == probe["catalogue_items"]
    assert len(probe["recommended"]) == 10 and not set(probe["recommended"]) & set(probe["seen"])
    assert probe["embedding_shape"] == [1, probe["embedding_dim"]]
    if probe["shown_hits"] == 0:  # a user with no hit is not shown without a word
        assert "that happens: recall@10 is" in _stdout(notebook)


@pytest.mark.slow
def test_sampling_measures_what_its_text_says(tmp_path, monkeypatch):
    notebook, probe = _run_small("sampling.ipynb", tmp_path, monkeypatch)
    assert "settings: small" in _stdout(notebook)
    # One step time per loss and corpus size (their ratio is noisy on a shared machine: not asserted).
    assert {name: len(values) for name, values in probe["step_ms"].items()} == dict.fromkeys(probe["step_ms"], 2)
    assert all(value > 0 for values in probe["step_ms"].values() for value in values)
    log_q = probe["log_q"]
    assert set(log_q) == {"no log-Q", "log-Q corrected"}
    # The corrected model recommends more head items than the uncorrected one (section 2's point).
    assert log_q["log-Q corrected"]["head share of top 20"] > log_q["no log-Q"]["head share of top 20"], log_q
    for name, by_m in probe["recall_by_m"].items():
        assert by_m and all(0 < r <= 1 for r in by_m.values()), name
    assert set(probe["references"]) == {"full softmax", "in-batch + log-Q"}
    assert probe["top_k_equal_or_tied"]
    assert probe["normaliser_spread"] < 1e-4  # z - log p is one constant per query


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebooks_show_their_full_settings_outputs(name):
    path = NOTEBOOKS / name
    assert path.stat().st_size < 1_000_000, f"{name}: {path.stat().st_size:,} bytes"
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    # One clean top-to-bottom run (make notebooks), not cells run by hand out of order.
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1))
    outputs = [output for cell in code for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert "settings: full" in _stdout(notebook)
    assert any("image/png" in o.get("data", {}) for o in outputs), "no plot"
    # Volatile metadata stripped, so a re-run diffs only where results moved.
    assert set(notebook.metadata) <= {"kernelspec"}
    assert not [cell for cell in code if "execution" in cell.metadata]
    assert not [o for o in outputs if o.output_type == "stream" and o.name == "stderr"]
    assert "INFO:tensorflow:" not in _stdout(notebook)
    assert str(NOTEBOOKS.parent) not in path.read_text(encoding="utf-8")  # no paths of the machine that ran it


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebooks_ran_on_the_current_defaults(name):
    """Each notebook prints the model and train settings it trained with and the overrides it set; a
    change of the code's defaults without ``make notebooks`` leaves a stale record, and fails here."""
    import yaml

    from retrieval.config import load_config

    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    record = _folded_record(notebook)
    if record is None:
        printed = _stdout(notebook)
        assert "config this run trained with:\n" in printed, f"{name} records no config"
        record = yaml.safe_load(printed.split("config this run trained with:\n", 1)[1].split("\n\n", 1)[0])
    current = load_config(NOTEBOOKS.parent / "configs" / CONFIGS[name], record["overrides"]).to_dict()
    for section in ("model", "train"):
        # A key added after the notebook ran is compared as the value the code had then: none, so only
        # keys that change no earlier run (new options, off by default) are listed here.
        recorded = _with_keys_added_since(record[section], current[section])
        assert recorded == current[section], f"{name}: {section} differs from the defaults; run make notebooks"


def _folded_record(notebook) -> dict | None:
    """The config record a notebook displays folded (an ``application/json`` output whose root names it)."""
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if output.get("metadata", {}).get("application/json", {}).get("root") == "config this run trained with":
                return output["data"]["application/json"]
    return None


def test_the_quickstart_runs_the_public_api_and_prints_a_short_config_summary():
    notebook = nbformat.read(NOTEBOOKS / "quickstart.ipynb", as_version=4)
    source = "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "code")
    assert "retrieval.train(" in source and "run.recommend(" in source
    assert "train_evaluate_export" not in source and "Bundle.load" not in source  # the job's internals
    summary = next(cell for cell in notebook.cells if "config this run trained with" in cell.source)
    printed = "".join(o.get("text", "") for o in summary.outputs if o.get("name") == "stdout")
    assert 1 <= len(printed.splitlines()) <= 3, printed  # the full record is folded, not printed
    assert _folded_record(notebook) is not None


ADDED_SINCE = {
    "loss": {"negatives_per_row": False, "margin": 0.9, "negative_weight": 150.0, "bsl_temperature": 1.22,
             "streaming": {"num_shards": 0}},
    "parameter_server": {"min_shard_bytes": 262144, "max_shards": 1, "input": "chief", "data_dispatcher_port": 0,
                         "staging_dir": "", "staged_files": 16},  # read only by distribute: parameter_server
    "sequence_windows": "all",  # read only by train.examples: sequences
    "remove_user_items": False,  # model: off by default
}


def _with_keys_added_since(recorded: dict, current: dict, added: dict = ADDED_SINCE) -> dict:
    """``recorded`` with the keys of ``added`` it lacks set to their listed values (nested)."""
    out = dict(recorded)
    for key, value in added.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _with_keys_added_since(out[key], current.get(key, {}), value)
        elif key in current and key not in out:
            out[key] = value
    return out


def test_every_notebook_is_tested():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(PROBES) == NAMES
