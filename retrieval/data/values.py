"""Cell rules shared by every click-log reader: what an id, a timestamp and a weight may be.

``loaders.read_clicks`` (whole files) and ``streaming.ClickShards`` (record
batches) both hand each column to these functions as a pandas Series, so a
cell is accepted, converted or refused the same way by both readers. A refused
column raises ``BadValues``; each reader turns it into a ``DataError`` naming
its file, line (or row) and column.

The rules:

- **ids**: single values (strings, integers, UTF-8 bytes), stripped of
  surrounding spaces and never empty. Lists, structs, maps (a Parquet nested
  column would otherwise become ``"[1 2]"``) and booleans are refused.
- **timestamps**: integer seconds since the epoch (kept exactly), decimal
  seconds (floored), ISO-8601 strings (UTC unless they carry an offset) or
  date-time columns. The result must fit ``int64``: a value beyond it is
  refused instead of wrapping round to ``INT64_MIN``.
- **weights**: numbers that are finite *as float32* (the dtype they are
  trained in: ``1e39`` would become ``inf``) and ``>= 0``.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pandas as pd

_EPOCH = pd.Timestamp(0, tz="UTC")
_INTEGER = r"[+-]?[0-9]+"  # ASCII digits only: str.fullmatch's \d would accept "٣", which pandas cannot parse
_DECIMAL = r"[+-]?[0-9]+\.[0-9]*"
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# Floats strictly inside (-2**63, 2**63) floor to an int64; the boundary itself is excluded because
# -9223372036854775809 (out of range) rounds to the float -2**63.
_FLOAT_LIMIT = 2.0**63
FLOAT32_MAX = float(np.finfo(np.float32).max)

TIMESTAMP_HELP = (
    "expected integer seconds since the epoch or an ISO-8601 time such as 2026-01-31T12:00:00Z"
)


class BadValues(ValueError):
    """Some cells of a column cannot be used.

    Attributes:
        bad: [num_cells] bool, True at each refused cell.
        message: why, with ``{value}`` where the first refused cell goes.
        shown: [num_cells] the cells as the user wrote them, for the message.
    """

    def __init__(self, message: str, bad: np.ndarray, shown: pd.Series) -> None:
        super().__init__(message)
        self.message, self.bad, self.shown = message, np.asarray(bad, dtype=bool), shown

    def first(self) -> tuple[int, int, str]:
        """(position of the first refused cell, number refused, the message with its value)."""
        position = int(np.argmax(self.bad))
        value = self.shown.iloc[position]
        if isinstance(value, np.generic):
            value = value.item()  # show 'nan', not 'np.float64(nan)'
        if isinstance(value, np.ndarray):
            value = value.tolist()
        return position, int(self.bad.sum()), self.message.format(value=value)


def _stripped_text(values: pd.Series) -> pd.Series:
    """Stripped strings, "" where missing (``astype(str)`` alone writes "nan" in pandas 2)."""
    return values.astype(str).where(values.notna(), "").str.strip()


def _is_nested(value: Any) -> bool:
    return isinstance(value, (list, tuple, dict, set, frozenset, np.ndarray))


def id_strings(values: pd.Series, what: str) -> pd.Series:
    """The ids of one column as stripped strings.

    Args:
        values: [num_cells] the column as read (any dtype).
        what: ``"user"``, ``"item"`` or ``"id"``, for the message.

    Returns:
        [num_cells] str, same index.

    Raises:
        BadValues: a cell is empty, nested (list, struct, map), a boolean or
            bytes that are not UTF-8.
    """
    if pd.api.types.is_bool_dtype(values):
        raise BadValues(f"{what} ids are booleans ({{value!r}}); ids are strings or integers",
                        np.ones(len(values), bool), values)
    if values.dtype == object and pd.api.types.infer_dtype(values, skipna=True) not in ("string", "empty"):
        cells = values.to_numpy()
        nested = np.fromiter((_is_nested(v) for v in cells), bool, len(cells))
        if nested.any():
            raise BadValues(
                f"{what} id {{value!r}} is a list or struct, not one value; a nested (list/struct/map) "
                "column cannot be an id column",
                nested,
                values,
            )
        flags = np.fromiter((isinstance(v, (bool, np.bool_)) for v in cells), bool, len(cells))
        if flags.any():
            raise BadValues(f"{what} id {{value!r}} is a boolean; ids are strings or integers", flags, values)
        raw = np.fromiter((isinstance(v, bytes) for v in cells), bool, len(cells))
        if raw.any():
            decoded = values.copy()
            undecodable = np.zeros(len(cells), bool)
            for position in np.flatnonzero(raw):
                try:
                    decoded.iloc[position] = cells[position].decode("utf-8")
                except UnicodeDecodeError:
                    undecodable[position] = True
            if undecodable.any():
                raise BadValues(f"{what} id {{value!r}} is bytes that are not UTF-8", undecodable, values)
            values = decoded
    elif pd.api.types.is_float_dtype(values):
        # A parquet integer id column with nulls is stored as float: 7.0 must read "7".
        present = values.dropna()
        if (present == np.floor(present)).all() and (present.abs() < 2.0**63).all():
            values = values.astype("Int64")
    ids = _stripped_text(values)
    empty = (ids == "").to_numpy()
    if empty.any():
        raise BadValues(f"empty {what} id", empty, ids)
    return ids


def timestamp_seconds(values: pd.Series) -> np.ndarray:
    """Seconds since the epoch, UTC, of one column.

    Args:
        values: [num_cells] the column as read: integers, floats, date-times or
            text (integer or decimal seconds, ISO-8601).

    Returns:
        [num_cells] int64.

    Raises:
        BadValues: a cell is missing, unreadable or outside int64.
    """
    if pd.api.types.is_datetime64_any_dtype(values):
        if values.dt.tz is None:
            values = values.dt.tz_localize("UTC")
        seconds = ((values - _EPOCH) // pd.Timedelta(seconds=1)).to_numpy(dtype=np.float64, na_value=np.nan)
        _raise_unreadable(~np.isfinite(seconds), values)
        return seconds.astype(np.int64)
    if pd.api.types.is_integer_dtype(values):
        _raise_unreadable(values.isna().to_numpy(), values)
        if pd.api.types.is_unsigned_integer_dtype(values):
            too_large = values.to_numpy(dtype=np.uint64) > np.uint64(_INT64_MAX)
            if too_large.any():
                raise _out_of_range(too_large, values)
        return values.to_numpy(dtype=np.int64)
    if pd.api.types.is_float_dtype(values):
        floats = values.to_numpy(dtype=np.float64, na_value=np.nan)
        _raise_unreadable(~np.isfinite(floats), values)
        return _floored_int64(floats, values)
    if pd.api.types.is_bool_dtype(values):
        raise BadValues("timestamp {value!r} is a boolean; " + TIMESTAMP_HELP, np.ones(len(values), bool), values)
    return _text_seconds(_stripped_text(values))


def _text_seconds(text: pd.Series) -> np.ndarray:
    """int64 seconds of stripped strings: digits are always epoch seconds (so "20260101" is not a date)."""
    integer = text.str.fullmatch(_INTEGER).to_numpy()
    decimal = ~integer & text.str.fullmatch(_DECIMAL).to_numpy()
    other = ~integer & ~decimal & (text != "").to_numpy()
    seconds = np.full(len(text), np.nan)
    if decimal.any():
        seconds[decimal] = np.floor(text[decimal].astype(np.float64).to_numpy())
    if other.any():
        parsed = pd.to_datetime(text[other], format="ISO8601", utc=True, errors="coerce")
        seconds[other] = ((parsed - _EPOCH) // pd.Timedelta(seconds=1)).to_numpy(dtype=np.float64, na_value=np.nan)
    unreadable = ~integer & ~np.isfinite(seconds)
    _raise_unreadable(unreadable, text)
    result = np.zeros(len(text), np.int64)
    if integer.any():
        numbers = pd.to_numeric(text[integer])
        if numbers.dtype == np.int64:
            result[integer] = numbers.to_numpy()
        else:  # beyond int64 somewhere: Python ints say which, exactly
            exact = [int(t) for t in text[integer]]
            out = np.zeros(len(text), bool)
            out[integer] = [not _INT64_MIN <= n <= _INT64_MAX for n in exact]
            if out.any():
                raise _out_of_range(out, text)
            result[integer] = exact
    rest = ~integer
    floored = np.floor(seconds[rest])
    out = np.zeros(len(text), bool)
    out[rest] = ~((floored > -_FLOAT_LIMIT) & (floored < _FLOAT_LIMIT))
    if out.any():
        raise _out_of_range(out, text)
    result[rest] = floored.astype(np.int64)
    return result


def _raise_unreadable(bad: np.ndarray, shown: pd.Series) -> None:
    if bad.any():
        raise BadValues("cannot read timestamp {value!r}: " + TIMESTAMP_HELP, bad, shown)


def _out_of_range(bad: np.ndarray, shown: pd.Series) -> BadValues:
    return BadValues(
        "timestamp {value!r} is out of range: seconds since the epoch must fit in int64 "
        f"([{_INT64_MIN}, {_INT64_MAX}])",
        bad,
        shown,
    )


def _floored_int64(seconds: np.ndarray, shown: pd.Series) -> np.ndarray:
    floored = np.floor(seconds)
    bad = ~((floored > -_FLOAT_LIMIT) & (floored < _FLOAT_LIMIT))
    if bad.any():
        raise _out_of_range(bad, shown)
    return floored.astype(np.int64)


def click_weights(values: pd.Series) -> np.ndarray:
    """Per-click weights of one column.

    Args:
        values: [num_cells] numbers, or text holding numbers.

    Returns:
        [num_cells] float32, every one finite and >= 0.

    Raises:
        BadValues: a cell is missing, not a number, not finite in float32
            (beyond about 3.4e38) or negative.
    """
    if pd.api.types.is_bool_dtype(values):
        raise BadValues("weight {value!r} is a boolean, not a number", np.ones(len(values), bool), values)
    if pd.api.types.is_numeric_dtype(values):
        numbers = values.to_numpy(dtype=np.float64, na_value=np.nan)
    else:
        values = _stripped_text(values)
        numbers = pd.to_numeric(values, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    bad = ~np.isfinite(numbers)
    if bad.any():
        raise BadValues("weight {value!r} is not a finite number", bad, values)
    too_large = np.abs(numbers) > FLOAT32_MAX
    if too_large.any():
        raise BadValues(
            f"weight {{value!r}} overflows float32 (weights are float32: at most {FLOAT32_MAX:.7g})",
            too_large,
            values,
        )
    negative = numbers < 0
    if negative.any():
        raise BadValues("negative weight {value!r}; weights must be >= 0", negative, values)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # underflow to 0 of tiny weights is fine
        return numbers.astype(np.float32)
