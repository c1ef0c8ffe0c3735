"""Train, evaluate and export: ``python -m pipelines.train [--config F] [--set k=v ...]``.

``retrieval train`` (``retrieval/cli.py``) with ``--config`` defaulting to ``configs/default.yaml``
in the working directory.
"""

from __future__ import annotations

import sys

from retrieval.cli import run_command
from retrieval.common.errors import entry_point


@entry_point
def main(argv: list[str] | None = None) -> int:
    return run_command("train", argv, prog="pipelines.train", default_config="configs/default.yaml")


if __name__ == "__main__":
    sys.exit(main())
