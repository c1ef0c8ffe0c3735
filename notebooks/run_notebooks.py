"""Execute the notebooks at full settings and write their outputs into the committed .ipynb files.

    make notebooks                                   # every notebook in notebooks/
    .venv/bin/python notebooks/run_notebooks.py notebooks/quickstart.ipynb

Each notebook runs top to bottom in a fresh kernel (nbclient), with its working
directory set to ``notebooks/``, and is saved with its outputs (tables, small PNG
plots) so a code host shows them. What changes from one run to the next without
the results changing is left out, so a re-run diffs only where a figure moved:
cell timing metadata, the kernel's Python version, widget state, stderr (see
``clean``). Execution counts stay (they are 1..n after a clean run). ``RETRIEVAL_NOTEBOOK_SMALL`` is removed
from the kernel's environment: the test suite sets it to run the same notebooks
on small settings (``tests/project/test_notebooks.py``) and never writes them back.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent
# Notebook-level metadata worth keeping; the rest (language_info's version, widgets, ...) is volatile.
KEEP_METADATA = ("kernelspec",)
MAX_BYTES = 1_000_000
LOG_PREFIXES = ("INFO:tensorflow:", "WARNING:tensorflow:")


def clean(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Drop what is volatile or noise, in place.

    Per-cell timings, display ids and notebook metadata other than the kernel spec go;
    so do stderr and TensorFlow's ``INFO:tensorflow:`` log lines on stdout (start-up notices,
    progress bars, SavedModel asset paths with the kernel's pid: they differ on every run and
    say nothing about the results; a failing cell raises instead). Consecutive stdout chunks
    are merged into one output.
    """
    notebook.metadata = nbformat.from_dict(
        {key: notebook.metadata[key] for key in KEEP_METADATA if key in notebook.metadata}
    )
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)
        outputs = []
        for output in cell.get("outputs", []):
            output.pop("transient", None)  # display ids
            if output.output_type == "stream":
                if output.name == "stderr":
                    continue
                output.text = "".join(
                    line for line in output.text.splitlines(keepends=True) if not line.startswith(LOG_PREFIXES)
                )
                if not output.text:
                    continue
            if output.output_type == "stream" and outputs and outputs[-1].output_type == "stream":
                outputs[-1].text += output.text
                continue
            outputs.append(output)
        if cell.cell_type == "code":
            cell.outputs = outputs
    return notebook


def run(path: Path, timeout: int) -> float:
    """Execute ``path`` at full settings and overwrite it with its outputs; return seconds taken."""
    notebook = nbformat.read(path, as_version=4)
    started = time.perf_counter()
    NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    seconds = time.perf_counter() - started
    nbformat.validate(clean(notebook))
    nbformat.write(notebook, path)
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise SystemExit(f"{path.name} is {size:,} bytes with outputs (limit {MAX_BYTES:,}): shrink its plots")
    print(f"{path.name}: {seconds:.0f} s, {size / 1000:.0f} kB", flush=True)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebook in notebooks/")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per cell")
    args = parser.parse_args(argv)
    os.environ.pop("RETRIEVAL_NOTEBOOK_SMALL", None)  # full settings; the kernel inherits this environment
    paths = args.notebooks or sorted(NOTEBOOKS.glob("*.ipynb"))
    for path in paths:
        run(path.resolve(), args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
