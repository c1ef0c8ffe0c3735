"""Re-evaluate an exported bundle: ``python -m pipelines.evaluate --run artifacts/<run> [--out D] [--set k=v]``.

``retrieval evaluate`` (``retrieval/cli.py``): the bundle's SavedModel and FAISS index on the data
and split its saved config names; metrics.json, report.md and the plots go to ``--out`` (default
``<run>/reevaluated``).
"""

from __future__ import annotations

import sys

from retrieval.cli import run_command
from retrieval.common.errors import entry_point


@entry_point
def main(argv: list[str] | None = None) -> int:
    return run_command("evaluate", argv, prog="pipelines.evaluate")


if __name__ == "__main__":
    sys.exit(main())
