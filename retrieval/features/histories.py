"""Click histories looked up for any click: each user's training clicks, coded and sorted once.

``towers.query.history`` gives each training click the items its user clicked
strictly before it (``tables.history_before`` over a whole click frame). A log
read part by part (``retrieval.data.ClickLog``, shards or a table in memory)
never holds that frame, so ``ClickHistories`` holds the training clicks coded
instead: a user row and an item row (int32 each) and a timestamp (int64) a
click, 16 bytes a click, sorted by (user, time, log order). A batch's histories
are then two binary searches a row, whatever the batch's order: the values
``history_before`` gives the same clicks, and at serving time the values
``latest_history`` gives (``tests/features/test_feature_tables.py``).

A log without time (``format: user-items``) has no "before": there a click's
history is its user's *other* training items (``others``: the latest in log
order, the click's own item left out, so a row never sees its positive), and at
serving time the user's latest training items, as with time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from retrieval.features.tables import PAD


class ClickHistories:
    """Each user's training clicks in time order, for the history of any click or user.

    Args:
      user_rows, item_rows: [n] int rows of ``user_ids`` / ``item_ids`` of every training click, in log order.
      times: [n] int64 timestamps of those clicks; None = a log without time (log order; ``others``
        gives the histories, ``before`` refuses).
      user_ids, item_ids: the id strings the rows point to.
    """

    def __init__(self, user_rows: np.ndarray, item_rows: np.ndarray, times: np.ndarray | None,
                 user_ids: Sequence[str] | np.ndarray, item_ids: Sequence[str] | np.ndarray):
        self.has_time = times is not None
        if times is None:
            times = np.zeros(len(user_rows), np.int64)
        if not len(user_rows) == len(item_rows) == len(times):
            raise ValueError(f"user_rows, item_rows and times differ in length: "
                             f"{len(user_rows)}, {len(item_rows)}, {len(times)}")
        times = np.asarray(times, dtype=np.int64)
        order = np.lexsort((np.arange(len(times)), times, user_rows))  # log order breaks ties, as history_before
        self._users = np.asarray(user_rows, dtype=np.int64)[order]
        self._items = np.asarray(item_rows, dtype=np.int32)[order]
        # (user, time) as one sortable int64: the user row times the distinct times, plus the time's rank.
        self._instants = np.unique(times)
        self._keys = self._key(self._users, np.searchsorted(self._instants, times[order]))
        self._user_index = pd.Index(np.asarray(user_ids, dtype=object), dtype=object)
        self._item_ids = np.append(np.asarray(item_ids, dtype=object), PAD)  # the last slot pads

    @property
    def clicks(self) -> int:
        return len(self._users)

    @property
    def user_ids(self) -> np.ndarray:
        """The ids ``user_rows`` point to, [users] object."""
        return self._user_index.to_numpy()

    def _key(self, users: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        return users.astype(np.int64) * (len(self._instants) + 1) + ranks

    def _rows(self, user_ids: Sequence[str] | np.ndarray) -> np.ndarray:
        return self._user_index.get_indexer(pd.Index(np.asarray(user_ids, dtype=object).astype(str)))

    def before(self, user_ids: Sequence[str] | np.ndarray, times: np.ndarray, length: int) -> np.ndarray:
        """Each (user, time)'s last ``length`` items clicked strictly before ``time`` (``history_before``).

        Returns:
          [len(user_ids), length] object array of item ids, newest first, "" padded; all "" for
          users without training clicks.
        """
        if not self.has_time:
            raise ValueError("these clicks have no timestamps: a click's history is its user's other items (others)")
        rows = self._rows(user_ids)
        known = rows >= 0
        start = np.searchsorted(self._users, rows, "left")
        end = np.searchsorted(self._keys, self._key(rows, np.searchsorted(self._instants, times, "left")), "left")
        return self._window(np.where(known, start, 0), np.where(known, end, 0), length)

    def latest(self, user_ids: Sequence[str] | np.ndarray, length: int) -> np.ndarray:
        """Each user's last ``length`` training clicks, all visible: the history at serving time
        (``latest_history``). Same shape and padding as ``before``."""
        rows = self._rows(user_ids)
        known = rows >= 0
        start, end = np.searchsorted(self._users, rows, "left"), np.searchsorted(self._users, rows, "right")
        return self._window(np.where(known, start, 0), np.where(known, end, 0), length)

    def recent(self, limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every user with training clicks: its last ``limit`` clicks, newest first, as CSR (what a
        bundle stores to fill a served history, ``retrieval.bundle.user_histories``). Row u of ``latest(..,
        length)`` is the first ``length`` of user u's clicks here, "" padded.

        Returns:
          ``(user_ids, indptr, item_rows)``: [u] object ids, [u + 1] int64 offsets, [n] int32 rows
          of ``item_ids``.
        """
        if limit <= 0:
            raise ValueError(f"the number of recent clicks kept must be positive, got {limit}")
        rows, starts, counts = np.unique(self._users, return_index=True, return_counts=True)
        kept = np.minimum(counts, limit)
        indptr = np.concatenate([[0], np.cumsum(kept)]).astype(np.int64)
        owner = np.repeat(np.arange(len(rows)), kept)
        newer = np.arange(int(indptr[-1])) - indptr[:-1][owner]  # 0 for the newest click of its user
        items = self._items[(starts + counts)[owner] - 1 - newer]
        return self.user_ids[rows], indptr, items.astype(np.int32)

    @property
    def item_ids(self) -> np.ndarray:
        """The ids ``item_rows`` point to, [items] object."""
        return self._item_ids[:-1]

    def windows(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Every user's training clicks cut into windows of ``length + 1`` consecutive clicks, newest
        first: the newest window ends at the user's last click, each older one ``length`` clicks before
        the next newer one ends, so two neighbours share one click and, read as (item, next item) pairs,
        the windows hold each pair of the user's clicks exactly once. A user's oldest window may be
        shorter ("" padded); a window needs two clicks, so a user with one click has none.

        Returns:
          ``(user_ids, windows)``: [w] object and [w, length + 1] object, a user's windows newest first.
        """
        if length <= 0:
            raise ValueError(f"history length must be positive, got {length}")
        rows, starts, counts = np.unique(self._users, return_index=True, return_counts=True)
        per_user = (counts - 2) // length + 1  # windows ending at n, n - L, ... while they hold two clicks
        per_user[counts < 2] = 0
        owner = np.repeat(np.arange(len(rows)), per_user)
        older = np.arange(len(owner)) - np.repeat(np.cumsum(per_user) - per_user, per_user)
        ends = starts[owner] + counts[owner] - older * length
        return self.user_ids[rows[owner]], self._window(starts[owner], ends, length + 1)

    def others(self, user_ids: Sequence[str] | np.ndarray, item_ids: Sequence[str] | np.ndarray,
               length: int) -> np.ndarray:
        """Each (user, item) click's history on a log without time: the user's latest ``length``
        training items other than ``item`` (every click of it left out, so a row never sees the
        positive it trains on), newest first.

        Of the user's latest ``length + 1`` clicks, those of ``item`` are dropped and the first
        ``length`` kept: a history is one shorter than ``length`` at most, when ``item`` was clicked
        more than once among them.

        Returns:
          [len(user_ids), length] object array of item ids, newest first, "" padded.
        """
        window = self.latest(user_ids, length + 1)
        own = window == np.asarray(item_ids, dtype=object).astype(str)[:, None]
        window[own] = PAD
        order = np.argsort(window == PAD, axis=1, kind="stable")  # the kept items first, in their order
        return np.take_along_axis(window, order, axis=1)[:, :length]

    def _window(self, start: np.ndarray, end: np.ndarray, length: int) -> np.ndarray:
        if length <= 0:
            raise ValueError(f"history length must be positive, got {length}")
        index = end[:, None] - 1 - np.arange(length)[None, :]
        rows = np.append(self._items, len(self._item_ids) - 1)  # position n: the padding slot
        return self._item_ids[rows[np.where(index >= start[:, None], index, len(self._items))]]
