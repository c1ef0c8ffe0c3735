"""Query-time filters over the bundle's item table: which catalogue items a request may be answered with.

A request's ``filters`` is a JSON object, one key per column of the bundle's display features
(``item_features.parquet``, ``retrieval.bundle.display_features``) or ``item_id``; every condition
must hold (AND)::

    {"category": {"in": ["Comedy", "Drama"]},   # a string column: one of these values
     "tags": "indie",                            # a list-of-strings column: holds this value
     "year": {"min": 1990, "max": 1999},         # a number column: in this range, both ends included
     "item_id": {"in": ["12", 50, "77"]}}        # an allow-list of ids (ints read as their decimal strings)

A condition is a bare value (``"Comedy"``, ``1995``, ``true``: equality, ``{"eq": value}``) or an
object of operators, all of which must hold:

=========  =====================================  ==========================================
operator   columns                                an item passes when
=========  =====================================  ==========================================
``eq``     string, number, bool, list, item_id    its value equals it (a list: holds it)
``in``     string, number, list, item_id          its value is one of them (a list: holds any)
``min``    number                                 its value >= min
``max``    number                                 its value <= max
=========  =====================================  ==========================================

A missing value (None, NaN, an empty list) passes no condition, and neither does an item the table
does not describe; an ``item_id`` list may name ids outside the catalogue (they match nothing).
A bundle without an item table takes only ``item_id``.

``parse_filters`` checks the shape (shared by the HTTP models, the command line and the Python API,
before any bundle is at hand); ``FilterTable.allowed_rows`` checks the columns against the table and
evaluates the filters over it, vectorised (numpy over Arrow's dictionary-encoded columns), into the
sorted index rows that pass. Every refusal is a ``RequestError`` naming the column, the operator and
the value.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from retrieval.bundle.display_features import DisplayFeatures
from retrieval.bundle.seen_items import find_sorted
from retrieval.common.errors import nearest_name
from retrieval.data import ITEM
from retrieval.serving.request_checks import RequestError, checked_id, checked_ids, short

OPERATORS = ("eq", "in", "min", "max")
Kind = Literal["string", "number", "bool", "list"]
# What each kind of column takes.
KIND_OPERATORS: dict[str, tuple[str, ...]] = {
    "string": ("eq", "in"),
    "number": ("eq", "in", "min", "max"),
    "bool": ("eq",),
    "list": ("eq", "in"),
    ITEM: ("eq", "in"),
}
KIND_NAMES = {"string": "a string column", "number": "a number column", "bool": "a true/false column",
              "list": "a list-of-strings column", ITEM: "the item id"}
MAX_VALUES = 100_000  # values an "in" list may hold (an item_id allow-list is the long one)
# The passing rows a FilterTable keeps, of 16 or more distinct filters: evaluating one over 500k items takes
# 0.2-0.9 ms (benchmarks/results/bench_filters.md), more than an IVF search; at most 4 MB each for 500k items.
CACHED_FILTERS = 32  # entries: a filter's canonical key and the JSON it was sent as

Scalar = str | float | bool


@dataclass(frozen=True)
class Condition:
    """One column's condition: ``eq`` (one value), ``in`` (values), ``min``/``max`` (numbers), each None when absent.

    Values are as sent (strings, numbers, bools); ``item_id`` values are id strings (``checked_ids``).
    """

    column: str
    eq: Scalar | None = None
    values: tuple[Scalar, ...] | None = None
    low: float | None = None
    high: float | None = None

    def operators(self) -> list[str]:
        given = [("eq", self.eq is not None), ("in", self.values is not None), ("min", self.low is not None),
                 ("max", self.high is not None)]
        return [name for name, present in given if present]

    def wanted(self) -> tuple[Scalar, ...] | None:
        """The values of ``eq`` and ``in`` together, or None when neither is given."""
        if self.eq is None:
            return self.values
        return (self.eq,) if self.values is None else (self.eq, *self.values)


@dataclass(frozen=True)
class ItemFilters:
    """Parsed filters: one ``Condition`` per column, all of which must hold. ``key`` is their canonical JSON."""

    conditions: tuple[Condition, ...]

    @property
    def columns(self) -> list[str]:
        return [condition.column for condition in self.conditions]

    @property
    def key(self) -> str:
        return json.dumps([[c.column, c.eq, c.values, c.low, c.high] for c in self.conditions], sort_keys=True)


def parse_filters(value: Any, name: str = "filters") -> ItemFilters | None:
    """A request's ``filters`` (a JSON object, see the module docstring) as ``ItemFilters``; None or ``{}``: None.

    Only the shape is checked here (operators, value types, min <= max): which columns exist and
    of what kind is the bundle's to say (``FilterTable.allowed_rows``).

    Raises:
      RequestError: naming the column, the operator and the value that are wrong.
    """
    if value is None or isinstance(value, ItemFilters):
        return value
    if not isinstance(value, Mapping):
        raise RequestError(f"{name} must be an object of column: condition, e.g. {{\"genre\": {{\"in\": "
                           f"[\"Comedy\"]}}, \"year\": {{\"min\": 1990}}}}, got {short(value)}")
    conditions = []
    for column, condition in value.items():
        if not isinstance(column, str) or not column:
            raise RequestError(f"{name} has the key {short(column)}: a column name must be a non-empty string")
        conditions.append(_parse_condition(column, condition, f"{name}.{column}"))
    return ItemFilters(tuple(conditions)) if conditions else None


def _parse_condition(column: str, condition: Any, where: str) -> Condition:
    if not isinstance(condition, Mapping):  # a bare value: equality
        condition = {"eq": condition}
    if not condition:
        raise RequestError(f"{where} is an empty condition; give one of the operators {list(OPERATORS)}")
    for operator in condition:
        if operator not in OPERATORS:
            near = nearest_name(operator, OPERATORS)
            raise RequestError(f"{where} has the operator {short(operator)}, which is not one of {list(OPERATORS)}"
                               + (f"; did you mean {near!r}?" if near else ""))
    if column == ITEM:
        for operator in ("min", "max"):
            if operator in condition:
                raise RequestError(f"{where}.{operator}: the item id takes 'eq' and 'in' (an allow-list), not ranges")
        one_id = checked_id(condition["eq"], f"{where}.eq") if "eq" in condition else None
        ids = None
        if "in" in condition:  # may be empty: an allow-list a caller computed may hold nothing
            _check_list(condition["in"], f"{where}.in")
            ids = tuple(checked_ids(condition["in"], f"{where}.in"))
        return Condition(column, eq=one_id, values=ids)
    eq = _scalar(condition["eq"], f"{where}.eq") if "eq" in condition else None
    values = None
    if "in" in condition:
        listed = condition["in"]
        _check_list(listed, f"{where}.in")
        if not listed:
            raise RequestError(f"{where}.in is an empty list, which no item passes; leave the condition out instead")
        values = tuple(_scalar(item, f"{where}.in[{position}]") for position, item in enumerate(listed))
        kinds = {_scalar_kind(item) for item in values}
        if len(kinds) > 1:
            mixed = " and ".join(kind + "s" for kind in sorted(kinds))
            raise RequestError(f"{where}.in mixes {mixed}; a column holds one kind of value")
    low = _number(condition["min"], f"{where}.min") if "min" in condition else None
    high = _number(condition["max"], f"{where}.max") if "max" in condition else None
    if low is not None and high is not None and low > high:
        raise RequestError(f"{where}: min {short(condition['min'])} is above max {short(condition['max'])}, "
                           "a range no item is in")
    return Condition(column, eq=eq, values=values, low=low, high=high)


def _check_list(value: Any, where: str) -> None:
    if not isinstance(value, list | tuple | np.ndarray):
        raise RequestError(f"{where} must be a list of values, got {short(value)}")
    if len(value) > MAX_VALUES:
        raise RequestError(f"{where} holds {len(value)} values, more than {MAX_VALUES}")


def _scalar(value: Any, where: str) -> Scalar:
    """A string, a finite number or a bool, as a condition compares with; RequestError naming ``where`` otherwise."""
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, str):
        return value
    if isinstance(value, int | float | np.integer | np.floating):
        if not math.isfinite(float(value)):
            raise RequestError(f"{where} must be a finite number, got {short(value)}")
        return float(value)
    raise RequestError(f"{where} must be a string, a number or true/false, got {short(value)}")


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.integer | np.floating):
        raise RequestError(f"{where} must be a number, got {short(value)}")
    if not math.isfinite(float(value)):
        raise RequestError(f"{where} must be a finite number, got {short(value)}")
    return float(value)


def _scalar_kind(value: Scalar) -> str:
    return "bool" if isinstance(value, bool) else "string" if isinstance(value, str) else "number"


def _raw_key(filters: Any) -> str | None:
    """A mapping of filters as canonical JSON, for the cache: None when it is not plain JSON (or no mapping)."""
    if not isinstance(filters, Mapping) or not filters:
        return None
    try:
        return "raw:" + json.dumps(filters, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):
        return None


def column_kind(column: pa.Array) -> Kind | None:
    """The kind of a display column a filter can test (``DisplayFeatures`` writes these types); None otherwise."""
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return "string"
    if pa.types.is_integer(column.type) or pa.types.is_floating(column.type):
        return "number"
    if pa.types.is_boolean(column.type):
        return "bool"
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        return "list"
    return None


class FilterTable:
    """The item table in index-row order, ready to evaluate filters against.

    Args:
      table: the bundle's display features, None for a bundle without an item table.
      item_ids: [num_items] the index's item ids, row r is ``item_ids[r]``.

    Each column is converted on first use (codes of its distinct strings, float64 numbers) and kept;
    evaluating a filter is then a few vectorised passes over [num_items] arrays.
    """

    def __init__(self, table: DisplayFeatures | None, item_ids: Sequence[str] | np.ndarray):
        self.table = table
        self.item_ids = np.asarray(item_ids, dtype=object)
        self.num_items = len(self.item_ids)
        self.kinds: dict[str, Kind] = {}
        if table is not None:
            for name, column in table.columns.items():
                kind = column_kind(column)
                if kind is not None and name != ITEM:
                    self.kinds[name] = kind
        self._lock = threading.Lock()
        self._table_rows: np.ndarray | None = None
        self._prepared: dict[str, Any] = {}
        self._id_rows: dict[str, int] | None = None  # item id -> index row, built on the first item_id filter
        # The rows of the last CACHED_FILTERS distinct filters (by ``ItemFilters.key``), most recent last: the
        # same array object for the same filter, which ``ItemIndex`` keys its bitmap on.
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()

    def check(self, filters: ItemFilters) -> None:
        """Refuse a column the table lacks, or an operator or value its kind does not take (RequestError)."""
        for condition in filters.conditions:
            where = f"filters.{condition.column}"
            if condition.column == ITEM:
                continue
            kind = self.kinds.get(condition.column)
            if kind is None:
                if self.table is None:
                    raise RequestError(f"{where}: this bundle has no item table (item_features.parquet), so it "
                                       f"filters only by {ITEM!r} (an allow-list: {{\"{ITEM}\": {{\"in\": [...]}}}})")
                known = [ITEM, *self.kinds]
                near = nearest_name(condition.column, known)
                raise RequestError(f"{where}: the item table has no column {condition.column!r} (its columns: "
                                   f"{known})" + (f"; did you mean {near!r}?" if near else ""))
            allowed = KIND_OPERATORS[kind]
            for operator in condition.operators():
                if operator not in allowed:
                    raise RequestError(f"{where}: {condition.column!r} is {KIND_NAMES[kind]}, which takes "
                                       f"{list(allowed)}, not {operator!r}")
            expected = "number" if kind == "number" else "bool" if kind == "bool" else "string"
            for value in condition.wanted() or ():
                if _scalar_kind(value) != expected:
                    raise RequestError(f"{where}: {condition.column!r} is {KIND_NAMES[kind]}, so it compares with "
                                       f"{expected}s, not {short(value)}")

    def allowed_rows(self, filters: ItemFilters | Mapping[str, Any] | None) -> np.ndarray | None:
        """The sorted index rows [m] int64 that pass ``filters`` (None: no filter, every row passes).

        Raises:
          RequestError: the filters' shape (``parse_filters``) or a column, operator or value (``check``).
        """
        raw = _raw_key(filters)  # a filter sent again as the same JSON is found before it is parsed again
        if raw is not None:
            with self._lock:
                if raw in self._cache:
                    self._cache.move_to_end(raw)
                    return self._cache[raw]
        parsed = parse_filters(filters)
        if parsed is None:
            return None
        key = parsed.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                if raw is not None:
                    self._cache[raw] = self._cache[key]
                return self._cache[key]
        rows = np.flatnonzero(self.mask(parsed)).astype(np.int64)
        rows.flags.writeable = False  # shared by every request with this filter
        with self._lock:
            self._cache[key] = rows
            if raw is not None:
                self._cache[raw] = rows
            while len(self._cache) > CACHED_FILTERS:
                self._cache.popitem(last=False)
        return rows

    def mask(self, filters: ItemFilters) -> np.ndarray:
        """[num_items] bool: which index rows pass every condition of ``filters`` (checked first)."""
        self.check(filters)
        passing = np.ones(self.num_items, dtype=bool)
        for condition in filters.conditions:
            passing &= self._condition_mask(condition)
        return passing

    def _condition_mask(self, condition: Condition) -> np.ndarray:
        """[num_items] bool: the rows passing every operator of ``condition`` (eq, in, min, max)."""
        kind: str = ITEM if condition.column == ITEM else self.kinds[condition.column]
        passing = np.ones(self.num_items, dtype=bool)
        for wanted in ([condition.eq] if condition.eq is not None else None, condition.values):
            if wanted is not None:  # an empty allow-list passes nothing
                passing &= self._membership(condition.column, kind, wanted)
        if condition.low is not None or condition.high is not None:
            values = self._column(condition.column, "number")  # float64, NaN where missing or not described
            if condition.low is not None:
                passing &= values >= condition.low  # NaN compares False: a missing value is in no range
            if condition.high is not None:
                passing &= values <= condition.high
        return passing

    def _membership(self, column: str, kind: str, wanted: Sequence[Scalar]) -> np.ndarray:
        """[num_items] bool: the rows whose value is one of ``wanted`` (a list column: holds one of them)."""
        if kind == ITEM:
            if self._id_rows is None:
                self._id_rows = {str(item): row for row, item in enumerate(self.item_ids)}
            passing = np.zeros(self.num_items, dtype=bool)
            passing[np.array([self._id_rows[str(item)] for item in wanted if str(item) in self._id_rows],
                             dtype=np.int64)] = True
            return passing
        prepared = self._column(column, kind)  # type: ignore[arg-type]
        if kind == "number":
            return np.isin(prepared, np.array(wanted, dtype=np.float64))  # NaN is in no list
        if kind == "bool":
            return np.isin(prepared, np.array([int(bool(value)) for value in wanted], dtype=np.int8))
        dictionary, codes = prepared[0], prepared[1]
        hits = np.isin(dictionary, np.array(list(wanted), dtype=object))
        if kind == "string":  # codes [num_items]; len(dictionary) where missing: the False appended
            return np.concatenate([hits, [False]])[codes]
        passing = np.zeros(self.num_items, dtype=bool)  # a list column: flat codes and their index rows
        passing[prepared[2][hits[codes]]] = True
        return passing

    def _column(self, name: str, kind: Kind) -> Any:
        with self._lock:  # concurrent requests convert a column once
            if name not in self._prepared:
                self._prepared[name] = self._prepare(name, kind)
            return self._prepared[name]

    def _prepare(self, name: str, kind: Kind) -> Any:
        assert self.table is not None  # kinds is empty without a table
        if self._table_rows is None:
            self._table_rows = find_sorted(self.table.item_ids, [str(item) for item in self.item_ids])
        table_rows = self._table_rows  # [num_items]: the table's row of each index row, -1 not described
        described = table_rows >= 0
        column = self.table.columns[name]
        if kind == "number":
            values = np.asarray(column.cast(pa.float64()).fill_null(math.nan).to_numpy(zero_copy_only=False))
            return np.where(described, values[np.maximum(table_rows, 0)], math.nan) if len(values) else \
                np.full(self.num_items, math.nan)
        if kind == "bool":
            values = np.asarray(column.cast(pa.int8()).fill_null(-1).to_numpy(zero_copy_only=False), dtype=np.int8)
            return np.where(described, values[np.maximum(table_rows, 0)] if len(values) else -1, -1)
        if kind == "string":
            encoded = column.dictionary_encode()
            dictionary = np.array(encoded.dictionary.to_pylist(), dtype=object)
            codes = np.asarray(encoded.indices.fill_null(-1).to_numpy(zero_copy_only=False), dtype=np.int64)
            # -1 (missing, or not described) indexes the False appended after the dictionary's hits.
            codes = np.where(codes < 0, len(dictionary), codes)
            by_row = np.where(described, codes[np.maximum(table_rows, 0)] if len(codes) else 0, len(dictionary))
            return dictionary, by_row
        # A list of strings: its flat values' codes and, for each, the index row that holds it.
        flat = column.flatten()
        encoded = flat.dictionary_encode()
        dictionary = np.array(encoded.dictionary.to_pylist(), dtype=object)
        codes = np.asarray(encoded.indices.fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
        offsets = np.asarray(column.offsets.to_numpy(zero_copy_only=False), dtype=np.int64)
        lengths = np.diff(offsets)
        if column.null_count:
            lengths = np.where(np.asarray(column.is_null().to_numpy(zero_copy_only=False)), 0, lengths)
        owner_table_row = np.repeat(np.arange(len(column)), lengths)
        # Each table row's index row (-1 for rows of items the index does not hold: none, the table is trimmed).
        index_row_of = np.full(len(column), -1, np.int64)
        index_row_of[table_rows[described]] = np.flatnonzero(described)
        owners = index_row_of[owner_table_row]
        keep = owners >= 0
        return dictionary, codes[keep], owners[keep]
