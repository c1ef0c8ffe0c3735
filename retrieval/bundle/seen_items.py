"""Each known user's training items, stored compactly for serving to exclude.

A bundle serves top-k over the whole catalogue; without this, a user's top-k
is mostly what they already clicked (the towers are trained to score exactly
those items highest). The job writes every training user's distinct training
items here (``retrieval.jobs``), the bundle keeps them under ``seen_items/``
(``retrieval.bundle.writer.write_bundle``) and ``retrieval.serving.Bundle`` excludes
them from what it serves.

The layout is CSR, three ``.npy`` files, read whole into the process's own memory
when a bundle loads (``SeenItems.load``)::

    user_ids.npy    [num_users] fixed-width bytes (UTF-8), sorted: binary search, no hash table to build
    indptr.npy      [num_users + 1] int64: user u's items are item_rows[indptr[u]:indptr[u + 1]]
    item_rows.npy   [num_pairs] int32 rows of the bundle's index (item_ids.parquet), sorted per user

User ids are a sorted fixed-width ``.npy`` rather than Parquet: the array is read
with one copy, no decoding, and ``np.searchsorted`` finds a batch of ids in
``O(batch * log num_users)``, where Parquet would be decoded and then hashed
(seconds for tens of millions of users) before the first lookup. Fixed width
costs the longest id's length per user; ids of training logs are short.

The files are read, not memory-mapped: a mapped file edited or replaced under a
running server would change its answers, and one truncated under it (a smaller
bundle's files copied over) kills it with SIGBUS. Read, they cost their size in
memory (4 bytes a distinct pair, 8 a user, the id width a user).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from retrieval.common.arrays import write_parquet

SEEN_ITEMS_DIR = "seen_items"  # the folder of a bundle that holds them
USER_IDS_FILE = "user_ids.npy"
INDPTR_FILE = "indptr.npy"
ITEM_ROWS_FILE = "item_rows.npy"


def sorted_ids(ids: Sequence[str] | np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Distinct string ids as a sorted fixed-width UTF-8 bytes array, and the order that sorts them.

    Returns:
      (sorted [n] ``S<width>`` array, [n] int64 positions of ``ids`` in sorted order).

    Raises:
      ValueError: an id ends with NUL (fixed-width bytes drop trailing NULs) or appears twice in ``ids``.
    """
    encoded = [str(user).encode("utf-8") for user in ids]
    if any(user.endswith(b"\0") for user in encoded):
        raise ValueError(f"an id of {what} ends with a NUL character, which a fixed-width id array cannot hold")
    array = np.array(encoded, dtype=bytes) if encoded else np.zeros(0, "S1")
    order = np.argsort(array, kind="stable")
    array = array[order]
    if len(array) > 1 and (array[1:] == array[:-1]).any():
        raise ValueError(f"{what} holds an id twice")
    return array, order


def find_sorted(ids: np.ndarray, wanted: Sequence[str | None]) -> np.ndarray:
    """Positions of ``wanted`` ids in the sorted bytes array ``ids`` (``sorted_ids``): [len(wanted)] int64,
    -1 for an id not there or None (one binary search for all)."""
    width = ids.dtype.itemsize
    keys = [None if user is None else str(user).encode("utf-8") for user in wanted]
    # A key longer than every stored id is unknown (cast to their width, it would be truncated onto
    # another id), and so is one ending in NUL (fixed-width bytes drop trailing NULs).
    fits = np.array([key is not None and len(key) <= width and not key.endswith(b"\0") for key in keys], dtype=bool)
    found = np.full(len(keys), -1, np.int64)
    if not fits.any() or not len(ids):
        return found
    keys_that_fit = np.array([key for key, ok in zip(keys, fits) if ok], dtype=ids.dtype)
    positions = np.minimum(np.searchsorted(ids, keys_that_fit), len(ids) - 1)
    hits = ids[positions] == keys_that_fit
    found[np.flatnonzero(fits)[hits]] = positions[hits]
    return found


def write_keyed_table(path: str | Path, key: str, ids: np.ndarray, columns: dict) -> None:
    """A Parquet table of ``key`` (the sorted bytes ids of ``sorted_ids``, as strings) then ``columns``
    (Arrow arrays in that row order): what a bundle's user and item feature tables are."""
    import pyarrow as pa

    strings = pa.array(np.char.decode(ids, "utf-8").astype(object), pa.string())
    write_parquet(pa.table({key: strings, **columns}), path)


def read_keyed_table(path: str | Path, key: str) -> tuple[np.ndarray, dict]:
    """``(ids, columns)`` of the table ``write_keyed_table`` wrote, read whole.

    Raises:
      ValueError: no ``key`` column, or ids that are not sorted and distinct as it wrote them.
    """
    import pyarrow.parquet as pq

    table = pq.read_table(str(path))
    name = Path(path).name
    if key not in table.column_names:
        raise ValueError(f"{name} has no {key!r} column")
    encoded, order = sorted_ids(table.column(key).to_numpy(zero_copy_only=False), name)
    if not np.array_equal(order, np.arange(len(order))):
        raise ValueError(f"{name}: the {key.removesuffix('_id')} ids are not in sorted order")
    return encoded, {column: table.column(column).combine_chunks() for column in table.column_names if column != key}


def client_value(scalar) -> Any:
    """An Arrow cell as a client sends it: str, float (None for NaN), list of str."""
    value = scalar.as_py()
    return None if isinstance(value, float) and math.isnan(value) else value


class UserRowTable:
    """Index rows per user id, CSR over sorted ids: the layout that ``seen_items/`` and
    ``retrieval.bundle.user_histories`` share (three ``.npy`` files, read whole, never memory-mapped).

    Args:
      user_ids: [num_users] sorted, distinct, UTF-8 bytes (dtype ``S<width>``).
      indptr: [num_users + 1] int64, from 0 to len(item_rows), non-decreasing.
      item_rows: [n] int32 index rows; user u's are item_rows[indptr[u]:indptr[u + 1]].
    """

    def __init__(self, user_ids: np.ndarray, indptr: np.ndarray, item_rows: np.ndarray):
        if user_ids.ndim != 1 or user_ids.dtype.kind != "S":
            raise ValueError(f"user_ids must be a 1-D bytes array, got {user_ids.dtype} {user_ids.shape}")
        if indptr.dtype != np.int64 or indptr.shape != (len(user_ids) + 1,):
            raise ValueError(f"indptr must be int64 [{len(user_ids) + 1}], got {indptr.dtype} {indptr.shape}")
        if item_rows.dtype != np.int32 or item_rows.ndim != 1:
            raise ValueError(f"item_rows must be a 1-D int32 array, got {item_rows.dtype} {item_rows.shape}")
        if indptr[0] != 0 or indptr[-1] != len(item_rows) or (np.diff(indptr) < 0).any():
            raise ValueError(
                f"indptr must rise from 0 to len(item_rows) = {len(item_rows)}, got {indptr[0]} to {indptr[-1]}"
            )
        self.user_ids, self.indptr, self.item_rows = user_ids, indptr, item_rows

    def __len__(self) -> int:
        return len(self.user_ids)

    def rows_or_none(self, user_ids: Sequence[str | None]) -> list[np.ndarray | None]:
        """Each id's [n] int32 index rows (views into ``item_rows``; one binary search for all), None
        for an id not in the table (or None)."""
        found: list[np.ndarray | None] = [None] * len(user_ids)
        for slot, position in enumerate(find_sorted(self.user_ids, user_ids)):
            if position >= 0:
                found[slot] = self.item_rows[self.indptr[position] : self.indptr[position + 1]]
        return found

    def save(self, directory: str | Path) -> None:
        """Write the three ``.npy`` files into ``directory`` (created)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        np.save(directory / USER_IDS_FILE, self.user_ids)
        np.save(directory / INDPTR_FILE, self.indptr)
        np.save(directory / ITEM_ROWS_FILE, self.item_rows)

    @staticmethod
    def read_arrays(directory: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(user_ids, indptr, item_rows) as ``save`` wrote them, read whole into memory (never
        memory-mapped: a mapped file edited under a server would change its answers)."""
        directory = Path(directory)
        user_ids, indptr, item_rows = (np.load(directory / name, allow_pickle=False)
                                       for name in (USER_IDS_FILE, INDPTR_FILE, ITEM_ROWS_FILE))
        return user_ids, indptr, item_rows


class SeenItems(UserRowTable):
    """Distinct item rows per user id, CSR: ``rows_of(user)`` is that user's training items.

    Args:
      user_ids: [num_users] sorted, distinct, UTF-8 bytes (dtype ``S<width>``).
      indptr: [num_users + 1] int64, from 0 to num_pairs, non-decreasing.
      item_rows: [num_pairs] int32 index rows.
    """

    @classmethod
    def from_pairs(cls, user_ids: Sequence[str] | np.ndarray | pd.Series, item_rows: np.ndarray) -> SeenItems:
        """From one (user id, item row) pair per click, e.g. a training frame's user column and its
        items' index rows; repeated pairs count once.

        Args:
          user_ids: [num_clicks] user ids (strings).
          item_rows: [num_clicks] non-negative index rows.
        """
        codes, vocabulary = pd.factorize(pd.Series(np.asarray(user_ids, dtype=object)).astype(str), sort=False)
        return cls.from_coded_pairs(codes, item_rows, np.asarray(vocabulary, dtype=object))

    @classmethod
    def from_coded_pairs(
        cls, user_rows: np.ndarray, item_rows: np.ndarray, vocabulary: Sequence[str] | np.ndarray
    ) -> SeenItems:
        """From clicks already coded as rows of a user vocabulary (``streaming.scan_pairs``).

        Built with one in-place sort of int64 pair codes (about 18 bytes a click beyond the
        inputs, no per-click Python objects), so a streamed log of tens of millions of clicks fits.

        Args:
          user_rows: [num_clicks] rows of ``vocabulary``.
          item_rows: [num_clicks] non-negative index rows.
          vocabulary: [num_users] distinct user ids (strings), any order.
        """
        user_rows, item_rows = np.asarray(user_rows), np.asarray(item_rows)
        if user_rows.shape != item_rows.shape or user_rows.ndim != 1:
            raise ValueError(f"user_rows {user_rows.shape} and item_rows {item_rows.shape} must be equal 1-D shapes")
        ids, order = sorted_ids(vocabulary, "the user vocabulary")
        if len(user_rows) and (user_rows.min() < 0 or user_rows.max() >= len(ids)):
            raise ValueError(f"user_rows must be rows of the {len(ids)}-id vocabulary")
        if len(item_rows) and item_rows.min() < 0:
            raise ValueError("item_rows must be non-negative index rows (an item missing from the index?)")
        num_items = int(item_rows.max(initial=-1)) + 1
        if num_items > np.iinfo(np.int32).max:
            raise ValueError(f"item rows up to {num_items - 1} do not fit int32")
        rank = np.empty(len(ids), np.int64)
        rank[order] = np.arange(len(ids))
        # One int64 code per pair, sorted: by user (sorted id order), then item; repeats adjacent.
        codes = rank[user_rows]
        codes *= max(num_items, 1)
        codes += item_rows
        codes.sort()
        if len(codes):
            keep = np.empty(len(codes), bool)
            keep[0] = True
            np.not_equal(codes[1:], codes[:-1], out=keep[1:])
            codes = codes[keep]
            del keep
        indptr = np.searchsorted(codes, np.arange(len(ids) + 1, dtype=np.int64) * max(num_items, 1)).astype(np.int64)
        np.remainder(codes, max(num_items, 1), out=codes)
        return cls(ids, indptr, codes.astype(np.int32))

    def remapped(self, new_rows: np.ndarray) -> SeenItems:
        """The same users' items under another index row order: old row r becomes ``new_rows[r]``.

        Args:
          new_rows: [num_old_rows] int, each old row's row in the new index (e.g.
            ``pd.Index(new_ids).get_indexer(old_ids)``); -1 (an item the new index lacks) is refused.
        """
        new_rows = np.asarray(new_rows, dtype=np.int64)
        if self.num_pairs and int(self.item_rows.max()) >= len(new_rows):
            raise ValueError(f"new_rows maps {len(new_rows)} rows, the seen items use rows up to "
                             f"{int(self.item_rows.max())}")
        mapped = new_rows[np.asarray(self.item_rows)]
        if (mapped < 0).any():
            raise ValueError(f"{int((mapped < 0).sum())} seen (user, item) pairs name items the new index lacks")
        users = np.repeat(np.arange(len(self), dtype=np.int64), np.diff(np.asarray(self.indptr)))
        return SeenItems.from_coded_pairs(users, mapped, np.char.decode(np.asarray(self.user_ids), "utf-8"))

    @property
    def num_pairs(self) -> int:
        return len(self.item_rows)

    def info(self) -> dict[str, int]:
        """What the manifest records: ``{"num_users", "num_pairs"}``."""
        return {"num_users": len(self), "num_pairs": self.num_pairs}

    def rows_of(self, user_id: str) -> np.ndarray:
        """[n] int32 index rows of ``user_id``'s training items, sorted; empty for an unknown user."""
        return self.rows_of_many([user_id])[0]

    def rows_of_many(self, user_ids: Sequence[str | None]) -> list[np.ndarray]:
        """``rows_of`` for each id (one binary search for all); None means no user (empty)."""
        return [np.zeros(0, np.int32) if rows is None else np.array(rows) for rows in self.rows_or_none(user_ids)]

    @classmethod
    def load(cls, directory: str | Path) -> SeenItems:
        """Read the files ``save`` wrote whole into memory (never memory-mapped: see the module docstring)."""
        return cls(*cls.read_arrays(directory))
