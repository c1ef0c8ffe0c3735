"""The notebooks execute top to bottom on small settings."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")))
def test_notebook_runs(name, tmp_path, monkeypatch):
    monkeypatch.setenv("RETRIEVAL_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("RETRIEVAL_NOTEBOOK_OUTPUT", str(tmp_path))
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    ).execute()
    errors = [o for cell in notebook.cells for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors


def test_every_documented_notebook_is_collected():
    # test_notebook_runs executes whatever is in notebooks/; the README names these two.
    assert {"quickstart.ipynb", "sampling.ipynb"} <= {p.name for p in NOTEBOOKS.glob("*.ipynb")}


def test_notebooks_are_committed_without_outputs():
    for path in NOTEBOOKS.glob("*.ipynb"):
        notebook = nbformat.read(path, as_version=4)
        assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), path.name
