"""Each known user's most recent training clicks, newest first, shipped in a bundle whose query
tower reads a click history.

A client often knows only the user id; the tower needs the history. The job writes, per training
user, its last ``export.history_clicks`` training clicks (``ClickHistories.recent``: time order,
log order breaking ties; a log without time: log order) as rows of the bundle's index, **newest
first** (the order a served ``history`` is read in), to ``user_histories/``
(``retrieval.bundle.writer.write_bundle``). ``retrieval.serving.Bundle`` fills the history of a query that
lacks it from its user's row (the tower reads its first ``towers.query.history.length`` of them),
and the web page lists them as the user's training items in time order.

The layout is CSR, three ``.npy`` files read whole into private, read-only arrays at load (no
memory map: a served part must not change under a running server)::

    user_ids.npy    [num_users] fixed-width bytes (UTF-8), sorted: binary search (``seen_items.find_sorted``)
    indptr.npy      [num_users + 1] int64: user u's clicks are item_rows[indptr[u]:indptr[u + 1]]
    item_rows.npy   [num_clicks] int32 rows of the bundle's index (item_ids.parquet), newest first per user

A click repeated in time stays repeated: this is the sequence the tower reads, not a set (the
bundle's ``seen_items/`` is the set).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from retrieval.bundle.seen_items import UserRowTable, sorted_ids

USER_HISTORIES_DIR = "user_histories"
ORDER = "newest first"


class UserHistories(UserRowTable):
    """Item rows per user id, newest first, CSR: ``rows_of_many([user])[0]`` is that user's history.

    Args:
      user_ids: [num_users] sorted, distinct UTF-8 bytes (``seen_items.sorted_ids``).
      indptr: [num_users + 1] int64, from 0 to num_clicks, non-decreasing.
      item_rows: [num_clicks] int32 index rows, each user's newest first.
      limit: the most clicks kept per user (``export.history_clicks``).
    """

    def __init__(self, user_ids: np.ndarray, indptr: np.ndarray, item_rows: np.ndarray, limit: int):
        super().__init__(user_ids, indptr, item_rows)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be a positive number of clicks, got {limit!r}")
        if len(indptr) > 1 and int(np.diff(indptr).max()) > limit:
            raise ValueError(f"a user holds {int(np.diff(indptr).max())} clicks, more than the limit {limit}")
        self.limit = limit

    @classmethod
    def from_recent(cls, user_ids: Sequence[str] | np.ndarray, indptr: np.ndarray, item_rows: np.ndarray,
                    limit: int) -> UserHistories:
        """From CSR histories in any user order (``ClickHistories.recent`` with its item rows recoded to
        index rows): the users sorted, each user's clicks kept in their order.

        Args:
          user_ids: [u] distinct user ids.
          indptr: [u + 1] int64 offsets into ``item_rows``.
          item_rows: [n] non-negative index rows, each user's newest first.
          limit: the most clicks a user holds.
        """
        indptr, item_rows = np.asarray(indptr, dtype=np.int64), np.asarray(item_rows)
        if len(item_rows) and item_rows.min() < 0:
            raise ValueError("item_rows must be non-negative index rows (an item missing from the index?)")
        ids, order = sorted_ids(user_ids, "the user histories")
        lengths = np.diff(indptr)[order]
        new_indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        owner = np.repeat(order, lengths)
        offset = np.arange(int(new_indptr[-1])) - np.repeat(new_indptr[:-1], lengths)
        return cls(ids, new_indptr, item_rows[indptr[owner] + offset].astype(np.int32), limit)

    def remapped(self, new_rows: np.ndarray) -> UserHistories:
        """The same histories under another index row order: old row r becomes ``new_rows[r]``
        (-1, an item the new index lacks, is refused)."""
        new_rows = np.asarray(new_rows, dtype=np.int64)
        if self.num_clicks and int(self.item_rows.max()) >= len(new_rows):
            raise ValueError(f"new_rows maps {len(new_rows)} rows, the histories use rows up to "
                             f"{int(self.item_rows.max())}")
        mapped = new_rows[self.item_rows]
        if (mapped < 0).any():
            raise ValueError(f"{int((mapped < 0).sum())} history clicks name items the new index lacks")
        return UserHistories(self.user_ids, self.indptr, mapped.astype(np.int32), self.limit)

    @property
    def num_clicks(self) -> int:
        return len(self.item_rows)

    def info(self) -> dict[str, object]:
        """What the manifest records: ``{"num_users", "num_clicks", "limit", "order"}``."""
        return {"num_users": len(self), "num_clicks": self.num_clicks, "limit": self.limit, "order": ORDER}

    def rows_of_many(self, user_ids: Sequence[str | None]) -> list[np.ndarray | None]:
        """Each id's [n] int32 index rows, newest first (one binary search for all); None for an id
        not in the table (or None)."""
        return self.rows_or_none(user_ids)

    @classmethod
    def load(cls, directory: str | Path, limit: int) -> UserHistories:
        """Read the files ``save`` wrote whole into private read-only arrays (``limit``: the manifest's)."""
        arrays = cls.read_arrays(directory)
        for array in arrays:
            array.setflags(write=False)
        return cls(*arrays, limit)
