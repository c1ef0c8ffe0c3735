"""Tower inputs as tables: raw feature values per training example, catalogue item and query.

Towers do their own preprocessing, so the functions here only *gather* raw
values: user features joined onto each click (query side), item features onto
each click and onto the catalogue (doc side), and click histories. Every
column is in the format the tower (and the exported SavedModel) takes:

=====================================  ================  ==========================
kind                                   dtype, shape      missing value
=====================================  ================  ==========================
id, categorical, text                  string [n]        ""
multi_categorical (lists)              string [n, W]     "" (also the padding)
multi_categorical (``separator`` set)  string [n]        ""
numeric                                float32 [n]       NaN
timestamp                              float64 [n]       NaN
history                                string [n, L]     "" (also the padding)
=====================================  ================  ==========================

Fixed-width columns hold one tuple of W strings per row in a frame and become
``[n, W]`` arrays in ``feature_arrays``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from retrieval.common.errors import nearest_name
from retrieval.config import FeatureConfig, TowerConfig, TowersConfig
from retrieval.data import ITEM, TIME, USER, WEIGHT, DataError
from retrieval.data.values import BadValues, feature_numbers

if TYPE_CHECKING:
    from retrieval.features.histories import ClickHistories

PAD = ""


@dataclass(frozen=True)
class InputSpec:
    """One raw tower input: its name, dtype ("string", "float32", "float64") and width.

    ``width`` is None for one value per row (shape ``[batch]``), else W (shape ``[batch, W]``).
    """

    name: str
    dtype: str
    width: int | None = None

    @property
    def shape(self) -> list[int | None]:
        return [None] if self.width is None else [None, self.width]


def feature_input(feature: FeatureConfig) -> InputSpec:
    """The raw input a feature declares."""
    if feature.kind == "numeric":
        return InputSpec(feature.name, "float32")
    if feature.kind == "timestamp":
        return InputSpec(feature.name, "float64")  # float32 would round epoch seconds to ~2 minutes
    if feature.kind == "multi_categorical" and feature.separator is None:
        return InputSpec(feature.name, "string", feature.max_values)
    return InputSpec(feature.name, "string")


def tower_inputs(tower: TowerConfig) -> list[InputSpec]:
    """Every raw input of a tower, in declaration order (history last)."""
    specs = [feature_input(feature) for feature in tower.features]
    if tower.history is not None:
        specs.append(InputSpec(tower.history.name, "string", tower.history.length))
    return specs


def history_before(clicks: pd.DataFrame, length: int) -> np.ndarray:
    """Each click's history: the user's last ``length`` items clicked strictly earlier.

    Clicks with equal timestamps never see each other (their order within the
    second is unknown), so no example's history holds its own item or a later one.

    Args:
      clicks: canonical clicks with ``user_id``, ``item_id`` and ``timestamp``.
      length: items kept, most recent first.

    Returns:
      [len(clicks), length] object array of item ids, "" padded, aligned with ``clicks`` rows.
    """
    order, users, times, _ = _user_time_order(clicks)
    if not len(order):
        return np.empty((0, length), dtype=object)
    position = np.arange(len(order))
    new_user = np.r_[True, users[1:] != users[:-1]]
    new_time = new_user | np.r_[True, times[1:] != times[:-1]]
    # First sorted position of the row's user, and of its (user, timestamp) run:
    # the visible history is the sorted rows in [user_start, time_start).
    user_start = np.maximum.accumulate(np.where(new_user, position, 0))
    time_start = np.maximum.accumulate(np.where(new_time, position, 0))
    window = _window(clicks, order, user_start, time_start, length)
    history = np.empty_like(window)
    history[order] = window
    return history


def latest_history(clicks: pd.DataFrame, user_ids: Sequence[str] | np.ndarray, length: int) -> np.ndarray:
    """Each user's last ``length`` clicks in ``clicks``, all visible: the history at serving time.

    Returns:
      [len(user_ids), length] object array, most recent first, "" padded; all "" for users without clicks.
    """
    order, users, _, labels = _user_time_order(clicks)
    codes = np.arange(len(labels))
    first, stop = np.searchsorted(users, codes, "left"), np.searchsorted(users, codes, "right")
    code = pd.Index(labels, dtype=object).get_indexer(pd.Index(np.asarray(user_ids, dtype=object).astype(str)))
    known = code >= 0
    start = np.where(known, first[np.maximum(code, 0)] if len(codes) else 0, 0)
    end = np.where(known, stop[np.maximum(code, 0)] if len(codes) else 0, 0)
    return _window(clicks, order, start, end, length)


def _user_time_order(clicks: pd.DataFrame):
    """Row order by (user, time, row), with the sorted user codes and times, and the code labels."""
    if TIME not in clicks:
        raise DataError("click history needs timestamps: set data.columns.timestamp (or drop towers.query.history)")
    users, labels = pd.factorize(clicks[USER].astype(str))
    times = clicks[TIME].to_numpy()
    order = np.lexsort((np.arange(len(clicks)), times, users))
    return order, users[order], times[order], np.asarray(labels, dtype=object)


def _window(clicks: pd.DataFrame, order: np.ndarray, start: np.ndarray, end: np.ndarray, length: int) -> np.ndarray:
    """Per row, the sorted items at positions end-1, end-2, ... (newest first), "" once below start."""
    if length <= 0:
        raise ValueError(f"history length must be positive, got {length}")
    items = np.append(clicks[ITEM].astype(str).to_numpy(dtype=object)[order], PAD)
    index = end[:, None] - 1 - np.arange(length)[None, :]
    index = np.where(index >= start[:, None], index, len(items) - 1)  # the appended "" slot
    return items[index]


def missing_feature_column(name: str, column: str, side: str, available: Sequence[str]) -> str:
    """The error of tower feature ``name`` reading a ``column`` not ``available``, with the nearest name."""
    near = nearest_name(column, available)
    key = "source" if name != column else "name (or source)"
    return (
        f"towers.{side}: feature {name!r} reads column {column!r}, which is in neither the click log nor the "
        f"{'user' if side == 'query' else 'item'} features (columns: {sorted(set(available))})"
        + (f"; did you mean {near!r}? (the feature's {key} names the column)" if near else "")
    )


def tower_frame(
    tower: TowerConfig,
    rows: pd.DataFrame,
    table: pd.DataFrame | None,
    key: str,
    side: str,
    history: np.ndarray | None = None,
) -> pd.DataFrame:
    """Raw inputs of ``tower`` for each row of ``rows``.

    Args:
      tower: the tower's features.
      rows: one row per output row, with the ``key`` column; columns of its own
        (e.g. the click's ``timestamp``) are read before the table's.
      table: one row per key (user or item features), or None.
      key: ``user_id`` or ``item_id``.
      side: "query" or "doc", for error messages.
      history: [len(rows), L] item ids when the tower has a history.

    Returns:
      One column per tower input, named by the feature names, index 0..n-1.
    """
    wanted = list(dict.fromkeys(feature.column for feature in tower.features))
    from_table = [column for column in wanted if column not in rows.columns]
    available = list(rows.columns) + ([] if table is None else [c for c in table.columns if c != key])
    for feature in tower.features:
        if feature.column not in available:
            raise DataError(missing_feature_column(feature.name, feature.column, side, available))
    values = {column: rows[column].to_numpy() for column in wanted if column in rows.columns}
    if table is not None and from_table:  # a column missing from both raised above
        joined = table.set_index(key)[from_table].reindex(pd.Index(rows[key].astype(str).to_numpy(), dtype=object))
        values.update({column: joined[column].to_numpy() for column in from_table})
    out = {feature.name: _raw(feature, values[feature.column], side) for feature in tower.features}
    if tower.history is not None:
        if history is None or history.shape != (len(rows), tower.history.length):
            raise ValueError(f"towers.{side}.history needs a [{len(rows)}, {tower.history.length}] history array")
        out[tower.history.name] = list(map(tuple, history))
    return pd.DataFrame(out, index=pd.RangeIndex(len(rows)))


def training_examples(
    train: pd.DataFrame, users: pd.DataFrame | None, items: pd.DataFrame, towers: TowersConfig
) -> pd.DataFrame:
    """One row per training click: every input of both towers, plus ``user_id``, ``item_id``,
    ``weight`` and ``timestamp`` (when the log has one), in the order of ``train``.

    The query side sees the user's features and the history strictly before the
    click; the doc side the clicked item's features.
    """
    history = None
    if towers.query.history is not None:
        history = history_before(train, towers.query.history.length)
    query = tower_frame(towers.query, train, users, USER, "query", history)
    doc = tower_frame(towers.doc, train, items, ITEM, "doc")
    base = pd.DataFrame(
        {
            USER: train[USER].astype(str).to_numpy(dtype=object),
            ITEM: train[ITEM].astype(str).to_numpy(dtype=object),
            WEIGHT: (train[WEIGHT].to_numpy(np.float32) if WEIGHT in train else np.ones(len(train), np.float32)),
        }
    )
    if TIME in train:  # not a tower input unless declared; kept so the examples split by time like clicks
        base[TIME] = train[TIME].to_numpy()
    base = base.drop(columns=[c for c in base.columns if c in query.columns or c in doc.columns])
    return pd.concat([base, query, doc], axis=1)


def catalogue_inputs(items: pd.DataFrame, towers: TowersConfig) -> pd.DataFrame:
    """Doc-tower inputs for every catalogue item (items without clicks included), plus ``item_id``."""
    doc = tower_frame(towers.doc, items, items, ITEM, "doc")
    if ITEM not in doc:
        doc.insert(0, ITEM, items[ITEM].astype(str).to_numpy(dtype=object))
    return doc


def query_inputs(
    user_ids: Sequence[str] | np.ndarray,
    users: pd.DataFrame | None,
    train: pd.DataFrame | None,
    towers: TowersConfig,
    reference_time: float | None,
    histories: ClickHistories | None = None,
) -> pd.DataFrame:
    """Query-tower inputs for users queried after training, plus ``user_id``.

    Their history is their last training clicks (``histories``, or else the clicks of
    ``train``); a click-log ``timestamp`` read by a query feature is ``reference_time``
    (the end of training).
    """
    ids = np.asarray(user_ids, dtype=object).astype(str).astype(object)
    rows = pd.DataFrame({USER: ids})
    if reference_time is not None:
        rows[TIME] = np.full(len(ids), reference_time, dtype=np.float64)
    history = None
    if towers.query.history is not None:
        if histories is not None:
            history = histories.latest(ids, towers.query.history.length)
        elif train is not None:
            history = latest_history(train, ids, towers.query.history.length)
        else:
            raise ValueError("towers.query.history needs the training clicks or their ClickHistories")
    query = tower_frame(towers.query, rows, users, USER, "query", history)
    if USER not in query:
        query.insert(0, USER, ids)
    return query


def reference_time(train: pd.DataFrame) -> float | None:
    """The end of training (latest training click, seconds), or None without timestamps."""
    return float(train[TIME].max()) if TIME in train and len(train) else None


def feature_arrays(frame: pd.DataFrame, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Columns as arrays a tower takes: strings as object [n], tuple columns as object [n, W]."""
    arrays = {}
    for name in frame.columns if names is None else names:
        column = frame[name]
        if len(column) and isinstance(column.iloc[0], tuple):
            arrays[name] = np.array(column.tolist(), dtype=object)
        elif pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column):
            arrays[name] = column.to_numpy()
        else:
            arrays[name] = column.astype(str).to_numpy(dtype=object)
    return arrays


def _raw(feature: FeatureConfig, values: np.ndarray, side: str) -> Any:
    if feature.kind in ("numeric", "timestamp"):
        return _numbers(values, "float32" if feature.kind == "numeric" else "float64", feature, side)
    if feature.kind == "multi_categorical" and feature.separator is None:
        return [_padded(value, feature.max_values) for value in values]
    return _strings(values)


def _strings(values: np.ndarray) -> np.ndarray:
    return np.array([_string(value) for value in values], dtype=object)


def _string(value: Any) -> str:
    """A raw value as the string a tower sees: missing -> "", 3.0 -> "3"."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return PAD
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        return str(int(value))
    return str(value)


def _padded(value: Any, width: int) -> tuple[str, ...]:
    """A list cell as exactly ``width`` strings: first values kept, "" padded; missing -> all ""."""
    if isinstance(value, str):
        values = [value]
    elif value is None or (isinstance(value, float) and math.isnan(value)):
        values = []
    else:
        values = [_string(v) for v in value]
    values = [v for v in values if v != PAD][:width]
    return tuple(values) + (PAD,) * (width - len(values))


def _numbers(values: np.ndarray, dtype: str, feature: FeatureConfig, side: str) -> np.ndarray:
    """A numeric (float32) or timestamp (float64) feature's values, by the rule of ``feature_numbers``.

    The feature tables were checked at their lines when read; this catches the values they could not
    (text cells spelling a number, frames built in code) and names the feature instead.
    """
    try:
        return feature_numbers(pd.Series(values, dtype=object if values.dtype == object else None), dtype=dtype)
    except BadValues as error:
        _, count, message = error.first()
        more = f" ({count} bad rows in all)" if count > 1 else ""
        raise DataError(
            f"towers.{side}: feature {feature.name!r} ({feature.kind}) reads column {feature.column!r}: "
            f"{message}{more}"
        ) from None


@dataclass(frozen=True)
class TowerTables:
    """Raw tower inputs for one split dataset: training examples, the catalogue and queries.

    Attributes:
      towers: the towers' features.
      train: canonical training clicks; None when the job reads them part by part (the training
        examples are then joined batch by batch, ``retrieval.features.ExampleJoin``).
      users: user feature table (``Dataset.users``), or None.
      items: the catalogue with item features (``Dataset.items``).
      end_time: the latest training click's time when ``train`` is None (else read from ``train``).
      histories: the training clicks' histories when ``train`` is None and the query tower has one.
    """

    towers: TowersConfig
    train: pd.DataFrame | None
    users: pd.DataFrame | None
    items: pd.DataFrame
    end_time: float | None = None
    histories: ClickHistories | None = None

    @classmethod
    def from_dataset(cls, dataset: Any, towers: TowersConfig) -> TowerTables:
        """From a ``retrieval.data.Dataset`` (train, users, items)."""
        return cls(towers, dataset.train, dataset.users, dataset.items)

    @property
    def reference_time(self) -> float | None:
        return self.end_time if self.train is None else reference_time(self.train)

    def examples(self) -> pd.DataFrame:
        """``training_examples``: one row per training click."""
        if self.train is None:
            raise ValueError("the training clicks are streamed: join them batch by batch (ExampleJoin)")
        return training_examples(self.train, self.users, self.items, self.towers)

    def catalogue(self) -> pd.DataFrame:
        """``catalogue_inputs``: one row per catalogue item, in catalogue order."""
        return catalogue_inputs(self.items, self.towers)

    def queries(self, user_ids: Sequence[str] | np.ndarray) -> pd.DataFrame:
        """``query_inputs`` at the end of training: one row per user id."""
        return query_inputs(user_ids, self.users, self.train, self.towers, self.reference_time, self.histories)

    def user_table_features(self) -> list[FeatureConfig]:
        """The query features ``queries`` reads from the user table: every one but those of the
        ``user_id`` column and the click-log ``timestamp`` (the end of training); no history."""
        if self.users is None:
            return []
        from_rows = {USER} | ({TIME} if self.reference_time is not None else set())
        return [feature for feature in self.towers.query.features
                if feature.column not in from_rows and feature.column in self.users.columns]

    def user_features(self, user_ids: Sequence[str] | np.ndarray | None = None) -> pd.DataFrame | None:
        """``user_id`` and the raw value of each ``user_table_features`` for ``user_ids`` (default: every
        row of the user table), as ``queries`` gives them; None when the query tower reads none.

        What a bundle ships so that a request may send the user id alone (``retrieval.bundle.user_features``).
        """
        features = self.user_table_features()
        if not features or self.users is None:
            return None
        ids = self.users[USER] if user_ids is None else user_ids
        ids = np.asarray(ids, dtype=object).astype(str).astype(object)
        tower = self.towers.query.model_copy(update={"features": features, "history": None})
        frame = tower_frame(tower, pd.DataFrame({USER: ids}), self.users, USER, "query")
        frame.insert(0, USER, ids)
        return frame
