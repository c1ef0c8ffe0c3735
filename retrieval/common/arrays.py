"""Small numpy helpers shared by several stages (no stage imports needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def row_membership(rows: np.ndarray, members: Sequence[np.ndarray]) -> np.ndarray:
    """For each cell of ``rows``, whether it is in that row's member set.

    Args:
      rows: [n, width] non-negative ints; negative cells (padding) are never members.
      members: n arrays of ints, one set per row.

    Returns:
      [n, width] bool.
    """
    rows = np.asarray(rows, dtype=np.int64)
    if rows.ndim != 2:
        raise ValueError(f"rows must be 2-D, got shape {rows.shape}")
    if len(members) != rows.shape[0]:
        raise ValueError(f"{len(members)} member sets for {rows.shape[0]} rows")
    owner = np.repeat(np.arange(len(members)), [len(m) for m in members])
    values = (
        np.concatenate([np.asarray(m, dtype=np.int64) for m in members]) if len(owner) else np.zeros(0, np.int64)
    )
    # One int64 code per (row, value) pair makes the whole test a single np.isin.
    span = max(int(rows.max(initial=0)), int(values.max(initial=0))) + 2
    codes = np.arange(len(rows))[:, None] * span + (rows + 1)
    return np.isin(codes, owner * span + (values + 1)) & (rows >= 0)


def drop_members(rows: np.ndarray, scores: np.ndarray, members: Sequence[np.ndarray]):
    """Remove each row's members (and padding) from ranked lists, keeping order.

    Removed cells move to the end of their row as rows -1 / scores -inf, so the
    first k columns are the best k survivors.

    Args:
      rows: [n, width] ranked ints, best first; -1 = padding.
      scores: [n, width] floats aligned with ``rows``.
      members: n arrays of ints to remove, one per row.

    Returns:
      (rows, scores), both [n, width].
    """
    removed = row_membership(rows, members) | (np.asarray(rows) < 0)
    order = np.argsort(removed, axis=1, kind="stable")
    rows = np.take_along_axis(np.asarray(rows), order, axis=1)
    scores = np.take_along_axis(np.asarray(scores), order, axis=1)
    removed = np.take_along_axis(removed, order, axis=1)
    return np.where(removed, -1, rows), np.where(removed, -np.inf, scores)


def seeded_subset(values: np.ndarray, size: int | None, seed: int) -> np.ndarray:
    """At most ``size`` of ``values``, drawn uniformly without replacement with ``seed``, in their order.

    ``values`` itself when it has no more than ``size`` entries (or ``size`` is None).
    """
    values = np.asarray(values)
    if size is None or len(values) <= size:
        return values
    return values[np.sort(np.random.default_rng(seed).choice(len(values), size, replace=False))]


def write_faiss_index(index: Any, path: str | Path) -> None:
    """Write a FAISS ``index`` to ``path`` through Python's file layer, so a failed write is an OSError.

    ``faiss.write_index(index, path)`` reports a short write as a ``RuntimeError`` and a failed
    final flush (a small index on a full disk) only as a line on stderr, returning as if the
    file were whole. Serialized in memory first (a transient copy of the index's bytes) and
    written here, a full disk is ``OSError(ENOSPC)`` naming ``path``, which entry points print
    as one line.
    """
    import faiss

    data = faiss.serialize_index(index)
    try:
        with open(path, "wb") as handle:
            handle.write(np.ascontiguousarray(data).data)
    except OSError as error:
        raise OSError(error.errno, error.strerror or str(error), str(path)) from None


class CheckedSink:
    """A Python file as Arrow writes to it, every write and the close left to Python (which raises
    on a failed write or flush) rather than to Arrow's file sink (which ignores a failed last flush)."""

    def __init__(self, handle: Any):
        self._handle, self._position, self.closed = handle, 0, False

    def write(self, data: Any) -> int:
        written = len(memoryview(data))
        self._handle.write(data)
        self._position += written
        return written

    def tell(self) -> int:
        return self._position

    def flush(self) -> None:
        self._handle.flush()

    def close(self) -> None:  # the owner closes the file, so that its flush error is raised
        self.closed = True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False


def write_parquet(table: Any, path: str | Path) -> None:
    """Write the Arrow ``table`` to ``path`` as Parquet through Python's file layer (``CheckedSink``):
    a full disk is ``OSError(ENOSPC)`` naming ``path``, where ``pq.write_table(table, path)`` drops
    the error of its last flush and leaves a truncated file."""
    import pyarrow.parquet as pq

    try:
        with open(path, "wb") as handle:
            pq.write_table(table, CheckedSink(handle))
    except OSError as error:
        if error.errno is None:
            raise
        raise OSError(error.errno, error.strerror or str(error), str(path)) from None
