"""The catalogue's display features (title, category, year, ...) by item id, shipped in the bundle.

A person looking at recommendations wants to see what the items are, not only their ids. When the
training config has an item feature table (``data.item_features``), the job writes its string,
numeric and list-of-string columns, one row per indexed item the table describes, to
``item_features.parquet`` (``retrieval.bundle.writer.write_bundle``); ``retrieval.serving.Bundle``
answers ``item_features(ids)`` from it and the HTTP service's ``POST /items`` sends it to the
web page. The towers never read this file: it is for display only, so it holds every such
column of the table, whether a tower reads it or not.

The file holds the ``item_id`` column (strings, sorted) and one column per feature: strings (None
missing), int64 / float64 numbers (NaN missing) or lists of strings. It is read whole at load:
the ids into a sorted fixed-width bytes array searched by ``np.searchsorted``
(``retrieval.bundle.seen_items.find_sorted``), the features into Arrow arrays.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from retrieval.bundle.seen_items import client_value, find_sorted, read_keyed_table, sorted_ids, write_keyed_table
from retrieval.data import ITEM

DISPLAY_FEATURES_FILE = "item_features.parquet"


class DisplayFeatures:
    """Display features by item id: ``values_of(ids)`` is each id's row as JSON-ready values.

    Args:
      item_ids: [num_items] sorted, distinct UTF-8 bytes (``retrieval.bundle.seen_items.sorted_ids``).
      columns: feature name -> Arrow array [num_items] aligned with ``item_ids``.
    """

    def __init__(self, item_ids: np.ndarray, columns: dict[str, pa.Array]):
        if item_ids.ndim != 1 or item_ids.dtype.kind != "S":
            raise ValueError(f"item_ids must be a 1-D bytes array, got {item_ids.dtype} {item_ids.shape}")
        for name, column in columns.items():
            if len(column) != len(item_ids):
                raise ValueError(f"feature {name!r} has {len(column)} values for {len(item_ids)} items")
        self.item_ids, self.columns = item_ids, columns

    @classmethod
    def from_frame(cls, frame: pd.DataFrame, catalogue: Sequence[str] | None = None) -> DisplayFeatures:
        """From an item feature table: its ``item_id`` column and every string, number or
        list-of-strings column (others, e.g. dates or nested objects, are left out).

        Args:
          frame: [rows] the raw item table (``data.item_features`` as read), ``item_id`` unique.
          catalogue: the indexed item ids; rows of other items are dropped (None keeps every row).
        """
        if ITEM not in frame:
            raise ValueError(f"the item feature frame has no {ITEM!r} column (columns: {list(frame.columns)})")
        frame = frame.assign(**{ITEM: frame[ITEM].astype(str)})
        if catalogue is not None:
            frame = frame[frame[ITEM].isin(pd.Index([str(item) for item in catalogue], dtype=object))]
        ids, order = sorted_ids(frame[ITEM].to_numpy(dtype=object), "the item feature table")
        columns = {}
        for name in frame.columns:
            if name == ITEM:
                continue
            column = _display_column(frame[name].to_numpy()[order])
            if column is not None:
                columns[str(name)] = column
        return cls(ids, columns)

    def __len__(self) -> int:
        return len(self.item_ids)

    @property
    def features(self) -> list[str]:
        return list(self.columns)

    def info(self) -> dict[str, Any]:
        """What the manifest records: ``{"file", "id_column", "features", "num_items"}``."""
        return {"file": DISPLAY_FEATURES_FILE, "id_column": ITEM, "features": self.features, "num_items": len(self)}

    @property
    def title_feature(self) -> str | None:
        """The string column that names an item, shown first on the page and searched by
        ``search``: one called title or name (any case), else the first string column; None without one."""
        strings = [name for name, column in self.columns.items() if pa.types.is_string(column.type)]
        named = [name for name in strings if name.lower() in ("title", "name")]
        chosen = named or strings
        return chosen[0] if chosen else None

    def search(self, text: str, limit: int) -> list[str]:
        """Up to ``limit`` item ids whose title (``title_feature``) contains ``text``, ignoring case,
        or whose id starts with it; titles that start with it first, then by title.

        A scan of the title column (Arrow's substring match: ~10 ms a million titles), no index to build.
        """
        import pyarrow.compute as pc

        text = text.strip()
        if not text or limit < 1:
            return []
        ids = np.char.decode(self.item_ids, "utf-8")
        by_id = np.char.startswith(ids, text)
        name = self.title_feature
        if name is None:
            return ids[by_id][:limit].tolist()
        titles = self.columns[name]
        hit = np.asarray(pc.fill_null(pc.match_substring(titles, text, ignore_case=True), False)) | by_id
        rows = np.flatnonzero(hit)
        shown = [titles[int(row)].as_py() or "" for row in rows]
        lowered = text.lower()
        order = sorted(range(len(rows)), key=lambda i: (not shown[i].lower().startswith(lowered), shown[i].lower()))
        return [str(ids[rows[i]]) for i in order[:limit]]

    def values_of(self, item_ids: Sequence[str]) -> list[dict[str, Any] | None]:
        """[len(item_ids)] each id's features (str, int, float, list of str; None for a missing
        value), or None for an id the table does not hold (one binary search for all)."""
        out: list[dict[str, Any] | None] = []
        for row in find_sorted(self.item_ids, list(item_ids)).tolist():
            if row < 0:
                out.append(None)
                continue
            out.append({name: client_value(column[row]) for name, column in self.columns.items()})
        return out

    def save(self, path: str | Path) -> None:
        """Write the Parquet file: ``item_id`` (sorted) then the feature columns."""
        write_keyed_table(path, ITEM, self.item_ids, self.columns)

    @classmethod
    def load(cls, path: str | Path) -> DisplayFeatures:
        """Read the file ``save`` wrote (whole).

        Raises:
          ValueError: no ``item_id`` column, or ids that are not sorted and distinct as ``save`` wrote them.
        """
        return cls(*read_keyed_table(path, ITEM))


def _display_column(values: np.ndarray) -> pa.Array | None:
    """``values`` [n] as an Arrow column a page can show, or None for a kind it cannot."""
    if values.dtype.kind == "b":
        return pa.array(values, pa.bool_())
    if values.dtype.kind in "iu":
        return pa.array(values.astype(np.int64), pa.int64())
    if values.dtype.kind == "f":
        return pa.array(values.astype(np.float64), pa.float64())
    if values.dtype.kind != "O":
        return None  # datetimes, timedeltas, ...: not a display feature here
    present = [value for value in values if not _missing(value)]
    if all(isinstance(value, str) for value in present):
        return pa.array([None if _missing(value) else value for value in values], pa.string())
    if all(isinstance(value, int | float | np.number) and not isinstance(value, bool) for value in present):
        # Nullable integer columns (pandas' Int64) arrive as objects with NA: as float, NaN missing.
        return pa.array([math.nan if _missing(value) else float(value) for value in values], pa.float64())
    if all(isinstance(value, list | tuple | np.ndarray) for value in present):
        # Lists of strings (genres, tags): "" pads of fixed-width lists are not shown.
        return pa.array([[] if _missing(value) else [str(v) for v in value if str(v) != ""] for value in values],
                        pa.list_(pa.string()))
    return None


def _missing(value: Any) -> bool:
    """None, NaN, pandas' NA or NaT (a list is a value, even an empty one)."""
    if isinstance(value, list | tuple | np.ndarray):
        return False
    return bool(pd.isna(value))
