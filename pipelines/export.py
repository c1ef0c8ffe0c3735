"""Re-export a bundle with another FAISS index:
``python -m pipelines.export --run artifacts/<run> --out artifacts/<run>-ivf --set index.factory=IVF64,Flat``.

``retrieval export`` (``retrieval/cli.py``): rebuilds only the index, atomically, into a new directory.
"""

from __future__ import annotations

import sys

from retrieval.cli import run_command
from retrieval.common.errors import entry_point


@entry_point
def main(argv: list[str] | None = None) -> int:
    return run_command("export", argv, prog="pipelines.export")


if __name__ == "__main__":
    sys.exit(main())
