"""Atomic file writes: a hidden file beside the target, renamed over it once complete.

A reader (or a resumed run) sees the old file or the new one, never half of one:
``os.replace`` is atomic within a file system. A whole directory is written the
same way by ``retrieval.bundle.run_directory.atomic_directory`` (a run's bundle,
with its name lock and the recovery of an interrupted overwrite).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield the path to write, ``.<name>.tmp`` beside ``path``, renamed to ``path`` if the block succeeds.

    On an exception (a full disk, Ctrl-C) the partial file is deleted and ``path`` is untouched.

    Example::

        with atomic_file(directory / "state.json") as partial:
            partial.write_text(json.dumps(state))
    """
    path = Path(path)
    partial = path.with_name(f".{path.name}.tmp")
    try:
        yield partial
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
