"""docs/operations.md's bundle layout, generated from the parts (``retrieval.bundle.parts``).

    python -m retrieval.bundle.layout            # print it
    python -m retrieval.bundle.layout --write    # replace the block between the markers in docs/operations.md

``tests/project/test_docs.py`` fails when the block differs from ``layout_markdown()``, so a new part
(one class in ``parts.PARTS``) cannot be left out of the docs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from retrieval.bundle.parts import layout_markdown

START = "<!-- bundle-layout:start -->"
END = "<!-- bundle-layout:end -->"
TARGET = "docs/operations.md"  # relative to the repository root
REGENERATE = f"python -m retrieval.bundle.layout --write  (rewrites {TARGET})"


def documented_layout(text: str) -> str:
    """The text between the markers of ``text``.

    Raises:
      ValueError: the markers are missing or out of order.
    """
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{TARGET} has no {START} ... {END} block")
    return text[start + len(START):end].strip("\n") + "\n"


def with_layout(text: str) -> str:
    """``text`` with the block between the markers replaced by ``layout_markdown()``."""
    documented_layout(text)  # the markers are there
    head, rest = text.split(START, 1)
    return f"{head}{START}\n{layout_markdown()}{END}{rest.split(END, 1)[1]}"


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        path = Path(__file__).resolve().parents[2] / TARGET
        path.write_text(with_layout(path.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        print(layout_markdown(), end="")
