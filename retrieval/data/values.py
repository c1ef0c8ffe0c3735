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
- **numeric features** (``feature_numbers``): numbers finite as float32, like
  weights, or missing (an empty cell, a null; NaN once read). Any sign.
  ``finite_feature_value`` is the same rule for one value a query sends, where
  missing is only ``None`` (a NaN sent as a number is refused).

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import math
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
        # A parquet integer id column with nulls is stored as float: 7.0 must read "7". Cell by cell, so
        # a cell reads the same whichever batch of a streamed shard it falls in.
        whole = values.notna() & (values == np.floor(values)) & (values.abs() < 2.0**63)
        text = values.astype(object)
        text[whole] = values[whole].astype(np.int64).astype(str)
        values = text
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
    numbers, values = _numbers(values, "weight")
    _raise_non_finite(numbers, np.zeros(len(numbers), bool), values, "weight")
    negative = numbers < 0
    if negative.any():
        raise BadValues("negative weight {value!r}; weights must be >= 0", negative, values)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # underflow to 0 of tiny weights is fine
        return numbers.astype(np.float32)


def _numbers(values: pd.Series, what: str) -> tuple[np.ndarray, pd.Series]:
    """(float64 [num_cells], NaN where a cell is missing or not a number; the cells as shown in messages)."""
    if pd.api.types.is_bool_dtype(values):
        raise BadValues(f"{what} {{value!r}} is a boolean, not a number", np.ones(len(values), bool), values)
    if pd.api.types.is_numeric_dtype(values):
        return values.to_numpy(dtype=np.float64, na_value=np.nan), values
    shown = _stripped_text(values)
    return pd.to_numeric(shown, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan), shown


def _raise_non_finite(numbers: np.ndarray, missing: np.ndarray, shown: pd.Series, what: str) -> None:
    """The finite-in-float32 rule: every number that is not ``missing`` is finite and fits float32.

    float32 is the dtype weights and numeric features are trained in: ``1e39``
    would become ``inf`` there and train the model to NaN.
    """
    bad = ~np.isfinite(numbers) & ~missing
    if bad.any():
        raise BadValues(f"{what} {{value!r}} is not a finite number", bad, shown)
    too_large = np.abs(numbers) > FLOAT32_MAX
    if too_large.any():
        raise BadValues(
            f"{what} {{value!r}} overflows float32 ({what}s are float32: at most {FLOAT32_MAX:.7g} in magnitude)",
            too_large,
            shown,
        )


def feature_numbers(values: pd.Series, what: str = "numeric feature value", dtype: str = "float32") -> np.ndarray:
    """The values of one numeric feature column.

    Args:
        values: [num_cells] numbers, or text holding numbers; missing cells
            (None, NaN, empty text) stay missing.
        what: what a value is called in the message.
        dtype: "float32" (numeric features) or "float64" (timestamps, whose
            values must only be finite).

    Returns:
        [num_cells] ``dtype``, NaN where missing, every other value finite.

    Raises:
        BadValues: a cell is a boolean, text that is not a number (text
            spelling "nan" included: a missing cell is empty), infinite or, in
            float32, beyond about 3.4e38 in magnitude.
    """
    if values.dtype == object:
        flags = np.fromiter((isinstance(v, (bool, np.bool_)) for v in values.to_numpy()), bool, len(values))
        if flags.any():
            raise BadValues(f"{what} {{value!r}} is a boolean, not a number", flags, values)
    numbers, shown = _numbers(values, what)
    # Missing: a NaN or null cell (how a table stores an empty one) or empty text; text spelling
    # "nan" is not missing, and is refused below like any other text that is not a number.
    if pd.api.types.is_numeric_dtype(values):
        missing = np.isnan(numbers)
    else:  # object or string cells
        missing = pd.isna(values).to_numpy() | (shown == "").to_numpy()
    unreadable = np.isnan(numbers) & ~missing
    if unreadable.any():
        raise BadValues(f"{what} {{value!r}} is not a number (a missing value is an empty cell)", unreadable, shown)
    if dtype == "float64":
        infinite = np.isinf(numbers)
        if infinite.any():
            raise BadValues(f"{what} {{value!r}} is not a finite number", infinite, shown)
        return numbers
    _raise_non_finite(numbers, missing, shown, what)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # tiny values underflow to 0, as float32 computes them
        return numbers.astype(np.float32)


def finite_feature_value(value: Any, dtype: str = "float32") -> str | None:
    """What one numeric feature value a query sends must be, when it is not; None when it is fine.

    ``None`` is a missing value; an int or a float must be finite in ``dtype``
    ("float32" for numeric features, "float64" for timestamps). A NaN is
    refused rather than read as missing: a client sends null for that.
    The answer completes "feature 'age' ...", e.g. "must be a number or null".
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "must be a number or null"
    limit = FLOAT32_MAX if dtype == "float32" else float(np.finfo(np.float64).max)
    try:
        number = float(value)
    except OverflowError:  # an int of hundreds of digits
        number = math.inf
    if math.isnan(number):
        return "must be a finite number or null (null is a missing value; NaN is refused)"
    if not abs(number) <= limit:
        return f"must be a finite number in {dtype} (at most {limit:.7g} in magnitude) or null"
    return None
