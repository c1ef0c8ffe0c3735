"""Each known user's raw query features as the training saw them, shipped in the bundle for serving.

A query tower that reads user features (age, country, ...) needs them in every request; a client
often knows only the user id. The job writes, per known user (in the user feature table or in
training), the raw value of every query feature read from the user table (``TowerTables.user_features``)
to ``user_features.parquet`` (``retrieval.bundle.writer.write_bundle``), and ``retrieval.serving.Bundle``
fills the features a request lacks from the row of its user id: what the request sends wins,
feature by feature.

The file holds the ``user_id`` column (strings) and one column per feature, named by the feature
(the request key), in the tower's raw format (``retrieval.features.tables``): strings ("" missing),
float32/float64 numbers (NaN missing), lists of strings (a fixed-width ``multi_categorical``
without its "" padding). It is read whole at load: the ids into a sorted fixed-width bytes array
searched by ``np.searchsorted`` (``retrieval.bundle.seen_items.find_sorted``, no hash table of millions
of Python strings), the features into Arrow arrays (compact: one buffer per column).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from retrieval.bundle.seen_items import client_value, find_sorted, read_keyed_table, sorted_ids, write_keyed_table
from retrieval.data import USER

USER_FEATURES_FILE = "user_features.parquet"


class UserFeatures:
    """Raw query features by user id: ``values(row_of(user))`` is what the training saw for that user.

    Args:
      user_ids: [num_users] sorted, distinct UTF-8 bytes (``retrieval.bundle.seen_items.sorted_ids``).
      columns: feature name -> Arrow array [num_users] aligned with ``user_ids``.
    """

    def __init__(self, user_ids: np.ndarray, columns: dict[str, pa.Array]):
        if user_ids.ndim != 1 or user_ids.dtype.kind != "S":
            raise ValueError(f"user_ids must be a 1-D bytes array, got {user_ids.dtype} {user_ids.shape}")
        for name, column in columns.items():
            if len(column) != len(user_ids):
                raise ValueError(f"feature {name!r} has {len(column)} values for {len(user_ids)} users")
        self.user_ids, self.columns = user_ids, columns

    @classmethod
    def from_frame(cls, frame: pd.DataFrame) -> UserFeatures:
        """From a ``user_id`` column and one column per feature (``TowerTables.user_features``).

        Fixed-width list cells (tuples of strings) lose their "" padding; the tower pads them again.
        """
        if USER not in frame:
            raise ValueError(f"the user feature frame has no {USER!r} column (columns: {list(frame.columns)})")
        ids, order = sorted_ids(frame[USER].to_numpy(dtype=object), "the user feature table")
        columns = {}
        for name in frame.columns:
            if name == USER:
                continue
            values = frame[name].to_numpy()[order]
            if len(values) and isinstance(values[0], tuple | list):
                columns[name] = pa.array([[v for v in value if v != ""] for value in values], pa.list_(pa.string()))
            elif values.dtype.kind == "f":
                columns[name] = pa.array(values)
            else:
                columns[name] = pa.array([str(v) for v in values], pa.string())
        return cls(ids, columns)

    def __len__(self) -> int:
        return len(self.user_ids)

    @property
    def features(self) -> list[str]:
        return list(self.columns)

    def info(self) -> dict[str, Any]:
        """What the manifest records: ``{"file", "id_column", "features", "num_users"}``."""
        return {"file": USER_FEATURES_FILE, "id_column": USER, "features": self.features, "num_users": len(self)}

    def rows_of(self, user_ids: Sequence[str | None]) -> np.ndarray:
        """[len(user_ids)] int64 rows of the table; -1 for an id not in it (or None)."""
        return find_sorted(self.user_ids, user_ids)

    def values(self, row: int, features: Sequence[str]) -> dict[str, Any]:
        """Row ``row``'s ``features`` as a client would send them: str, float (None for NaN), list of str."""
        out = {}
        for name in features:
            out[name] = client_value(self.columns[name][row])
        return out

    def save(self, path: str | Path) -> None:
        """Write the Parquet file: ``user_id`` (sorted) then the feature columns."""
        write_keyed_table(path, USER, self.user_ids, self.columns)

    @classmethod
    def load(cls, path: str | Path) -> UserFeatures:
        """Read the file ``save`` wrote (whole).

        Raises:
          ValueError: no ``user_id`` column, or ids that are not sorted and distinct as ``save`` wrote them.
        """
        return cls(*read_keyed_table(path, USER))
