"""Read click logs and feature tables into canonical frames.

Text files (CSV, TSV, MovieLens) are decoded by us and parsed by pandas with
every cell as a string (``dtype=str, keep_default_na=False,
skip_blank_lines=False``): nothing is guessed, and data row ``i`` stays on line
``i + 1`` (``i + 2`` with a header), so every error can name its line. Lines
that are entirely blank are skipped. A quoted field that spans several lines
shifts the line numbers after it; click logs do not have such fields.
"""

from __future__ import annotations

import io
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

import numpy as np
import pandas as pd

from retrieval.config import ColumnsConfig, TableConfig
from retrieval.data.schema import (
    FORMAT_BY_EXTENSION,
    ITEM,
    SHARD_FORMATS,
    TABLE_FORMATS,
    TIME,
    USER,
    WEIGHT,
    DataError,
    format_suffix,
    read_data,
)
from retrieval.data.shards import (
    ClickShards,
    TextLayout,
    column_keys,
    compressed_parquet,
    decode_text,
    read_text_table,
    require_columns,
)
from retrieval.data.values import BadValues, click_weights, feature_numbers, id_strings, timestamp_seconds

Duplicates = Literal["keep", "first"]
T = TypeVar("T")

_DEFAULT_SEPARATOR = {"csv": ",", "tsv": "\t", "movielens-100k": "\t", "movielens-1m": "::"}
_MOVIELENS_FIELDS = ["user_id", "item_id", "rating", "timestamp"]
# MovieLens files name their own columns; the rating is the click weight.
_MOVIELENS_COLUMNS = ColumnsConfig(user="user_id", item="item_id", timestamp="timestamp", weight="rating")
_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
# Spelled non-finite numbers: a column of numbers holding one of them is a numeric column (whose
# rule then refuses the cell at its line), not a text column.
_NON_FINITE = r"(?i:[+-]?(?:inf|infinity|nan))"


def read_clicks(table: TableConfig, columns: ColumnsConfig, *, duplicates: Duplicates = "keep") -> pd.DataFrame:
    """Read a click log into the canonical frame.

    Args:
        table: The file and how to parse it. ``format="auto"`` picks the format
            from the extension: ``.csv``; ``.tsv``/``.txt`` (tab); ``.parquet``;
            ``.dat`` (MovieLens 1M ``user::item::rating::timestamp``); ``.data``
            (MovieLens 100K ``u.data``). MovieLens formats have no header and
            name their own columns, so ``columns`` is ignored for them and the
            rating becomes the weight. Without a header, columns are named by
            position: ``"0"``, ``"1"``, ... ``format="user-items"`` (never
            chosen by ``auto``) reads the benchmark format of LightGCN/NGCF's
            ``train.txt``/``test.txt``: ``uid iid iid ...``, one user a line,
            split on any whitespace (or on ``separator`` when set), no header;
            ``columns`` and ``header`` are ignored and there is no timestamp.
            ``format="sequences"`` is the same lines with the items in time
            order (SASRec/BERT4Rec releases): each click's timestamp is its
            0-based place on the line; a ``.parquet`` file in this format has
            one row per user, ``columns.user`` and a list of item ids in time
            order in ``columns.item``.
        columns: Names of the user, item, timestamp and weight columns in the file.
        duplicates: Repeated (user, item) clicks. ``"keep"`` keeps every click
            (each is a training example, so re-consumed items weigh more);
            ``"first"`` keeps only the earliest click of each pair (by
            timestamp, ties and logs without time broken by file order).

    Returns:
        Columns ``user_id`` (str), ``item_id`` (str), ``timestamp`` (int64
        seconds since the epoch, UTC; only when ``columns.timestamp`` is set)
        and ``weight`` (float32; 1.0 without a weight column), in file order
        with a fresh index. Ids are stripped of surrounding spaces.
        Timestamps may be integer (or decimal, floored) seconds since the
        epoch or ISO-8601 strings; ISO times without an offset are UTC.

    Raises:
        DataError: The file is missing, undecodable, empty, lacks a column or
            holds a bad value; the message names file, line (or parquet row)
            and column.
    """
    fmt = resolve_format(table)
    if fmt == "sequences" and format_suffix(table.path) in (".parquet", ".pq"):
        return apply_duplicates(_read_parquet_sequences(table, columns), duplicates)
    if fmt in ("user-items", "sequences"):
        return apply_duplicates(_read_user_items(table, ordered=fmt == "sequences"), duplicates)
    if fmt in SHARD_FORMATS and _arrow_reads(table, fmt):
        _check_file(table)
        batches = [batch.frame() for batch in ClickShards.open(table, columns).scan()]
        if not batches or not sum(len(batch) for batch in batches):
            raise DataError("no data rows", file=table.path)
        return apply_duplicates(pd.concat(batches, ignore_index=True), duplicates)
    raw = _read_raw(table, fmt)
    if fmt.startswith("movielens"):
        columns = _MOVIELENS_COLUMNS
    wanted = [c for c in (columns.user, columns.item, columns.timestamp, columns.weight) if c]
    _require_columns(raw, wanted, table, fmt, None if fmt.startswith("movielens") else column_keys(columns))
    clicks = pd.DataFrame({USER: _ids(raw, columns.user, "user"), ITEM: _ids(raw, columns.item, "item")})
    if columns.timestamp is not None:
        clicks[TIME] = _timestamps(raw, columns.timestamp)
    if columns.weight is not None:
        clicks[WEIGHT] = _weights(raw, columns.weight)
    else:
        clicks[WEIGHT] = np.ones(len(clicks), dtype=np.float32)
    return apply_duplicates(clicks, duplicates)


def read_feature_table(table: TableConfig, id_column: str, *, id_key: str | None = None) -> pd.DataFrame:
    """Read an item or user feature table: one row per id.

    Text columns are typed after reading: a column whose non-empty cells are
    all numbers becomes int64 (no empty cells, integers only) or float64
    (empty cells become NaN); other columns stay strings with empty cells as
    NaN. Number-like codes with a leading zero (zip codes such as ``"01002"``)
    keep the column a string so the zero is not lost. Parquet columns keep
    their stored types. Numbers reach the towers as float32, so a float
    column (``inf``, ``nan`` spelled out and integers beyond int64 make one)
    holds only numbers finite in float32, or missing (empty, null) cells.

    Args:
        table: The file and how to parse it (csv, tsv or parquet).
        id_column: Name of the id column in the file.
        id_key: The config key naming it (``data.item_id_column``), for the error of a missing one.

    Returns:
        The table with ``id_column`` first, as stripped strings, then the other
        columns in file order.

    Raises:
        DataError: As ``read_clicks``, and for an empty or repeated id or a
            number that is infinite, NaN or beyond float32.
    """
    fmt = resolve_format(table)
    if fmt not in SHARD_FORMATS:
        raise DataError(
            f"format {fmt!r} is a click-log format; feature tables are {', '.join(SHARD_FORMATS)}",
            file=table.path,
        )
    raw = _read_raw(table, fmt)
    _require_columns(raw, [id_column], table, fmt, None if id_key is None else {id_column: id_key})
    ids = _ids(raw, id_column, "id")
    repeated = ids.duplicated(keep="first").to_numpy()
    if repeated.any():
        position = int(np.argmax(repeated))
        first = int(np.argmax((ids == ids.iloc[position]).to_numpy()))
        where = "line" if raw.is_text else "row"
        raise raw.error(
            f"repeated id {ids.iloc[position]!r} (first on {where} {raw.numbers[first]}); "
            "a feature table needs one row per id",
            position,
            id_column,
        )
    rest = raw.frame.drop(columns=[id_column])
    if raw.is_text:
        rest = rest.apply(_infer_type)
    for column in rest.columns:
        if pd.api.types.is_float_dtype(rest[column]):
            # Numbers reach the towers as float32: infinite ones and ones beyond float32 are refused here,
            # at their line, rather than training the model to NaN (integers always fit).
            _checked(raw, column, lambda values: feature_numbers(values, "number"))
    return pd.concat([ids.rename(id_column), rest], axis=1)


def apply_duplicates(clicks: pd.DataFrame, policy: Duplicates) -> pd.DataFrame:
    """Apply a duplicates policy to a canonical click frame.

    Args:
        clicks: Canonical clicks.
        policy: ``"keep"`` returns ``clicks`` unchanged; ``"first"`` keeps the
            earliest click of each (user, item) pair, by timestamp when there is
            one, ties broken by row order. Kept rows stay in their original order.

    Returns:
        The clicks, index reset.
    """
    if policy == "keep":
        return clicks.reset_index(drop=True)
    if policy != "first":
        raise ValueError(f"duplicates must be 'keep' or 'first', got {policy!r}")
    first = first_click_mask(
        pd.factorize(clicks[USER])[0],
        pd.factorize(clicks[ITEM])[0],
        clicks[TIME].to_numpy() if TIME in clicks else None,
        np.arange(len(clicks)),
    )
    return clicks[first].reset_index(drop=True)


def first_click_mask(
    users: np.ndarray, items: np.ndarray, timestamps: np.ndarray | None, rows: np.ndarray
) -> np.ndarray:
    """[n] bool: the first click of each (user, item) pair, by timestamp when there is one, ties
    broken by row order (``duplicates: "first"``, in memory and streamed).

    Args:
        users, items: [n] non-negative int codes of the ids.
        timestamps: [n] int64, or None for a log without time.
        rows: [n] int64, increasing in log order (row numbers, or a shard's row keys).
    """
    # lexsort's last key is the primary one: each pair's clicks end up together, earliest first.
    order = np.lexsort((rows, items, users) if timestamps is None else (rows, timestamps, items, users))
    pair_users, pair_items = users[order], items[order]
    starts = np.ones(len(order), bool)
    starts[1:] = (pair_users[1:] != pair_users[:-1]) | (pair_items[1:] != pair_items[:-1])
    first = np.zeros(len(order), bool)
    first[order[starts]] = True
    return first


def resolve_format(table: TableConfig) -> str:
    """The table's format, from its extension when ``format`` is ``"auto"``."""
    if table.format != "auto":
        return table.format
    suffix = format_suffix(table.path)
    if suffix not in FORMAT_BY_EXTENSION:
        raise DataError(
            f"cannot tell the format from the extension {suffix!r}; set format to one of " + ", ".join(TABLE_FORMATS),
            file=table.path,
        )
    return FORMAT_BY_EXTENSION[suffix]


@dataclass(frozen=True)
class _Raw:
    """A table as read, before any column is interpreted."""

    frame: pd.DataFrame  # the file's columns; text files: unstripped strings
    file: str
    numbers: np.ndarray  # per frame row: its 1-based line (text) or row (parquet)
    is_text: bool

    def error(self, message: str, position: int | None = None, column: str | None = None) -> DataError:
        number = None if position is None else int(self.numbers[position])
        return DataError(
            message,
            file=self.file,
            line=number if self.is_text else None,
            row=None if self.is_text else number,
            column=column,
        )


def _check_file(table: TableConfig) -> Path:
    path = Path(table.path)
    if not path.is_file():
        where = "is a directory, not a file" if path.is_dir() else "file not found"
        raise DataError(f"{where} (resolved to {path.resolve()})", file=table.path)
    return path


def _read_user_items(table: TableConfig, *, ordered: bool = False) -> pd.DataFrame:
    """Canonical clicks from ``uid iid iid ...`` lines: no timestamp, or with ``ordered``
    (``format: sequences``, the items in time order) each click's 0-based place on its line.

    A line holding a user id alone is a user without clicks (it adds none);
    blank lines are skipped. Items keep their order on the line.
    """
    fmt = "sequences" if ordered else "user-items"
    path = _check_file(table)
    text = decode_text(read_data(str(path)), table.encoding, table.path)
    users: list[str] = []
    items: list[str] = []
    positions: list[int] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(text.split("\n"), start=1):
        if table.separator is None:
            fields = line.split()
        else:
            fields = [field.strip() for field in line.rstrip("\r").split(table.separator)]
            if fields == [""]:
                fields = []
        if not fields:
            continue
        if "" in fields:
            position = fields.index("") + 1
            raise DataError(
                f"field {position} is empty (separator {table.separator!r}); the {fmt} format is 'uid iid iid ...'",
                file=table.path,
                line=number,
            )
        if table.separator is None and "," in line:
            raise DataError(
                f"found ',' in {line.strip()[:40]!r}: {fmt} ids are separated by whitespace; for a "
                "comma-separated log set format: csv (or separator: ',')",
                file=table.path,
                line=number,
            )
        user = fields[0]
        if user in first_line:
            raise DataError(
                f"user {user!r} already has a line (line {first_line[user]}); the {fmt} format has one line per user",
                file=table.path,
                line=number,
            )
        first_line[user] = number
        users.extend([user] * (len(fields) - 1))
        items.extend(fields[1:])
        positions.extend(range(len(fields) - 1))
    if not items:
        what = "no lines" if not first_line else "user ids but no item ids"
        raise DataError(f"no clicks: the file holds {what} ('uid iid iid ...' expected)", file=table.path)
    clicks = pd.DataFrame({USER: users, ITEM: items}).astype(str)  # the same string dtype as the other readers
    if ordered:  # positions as seconds: every time-based rule (splits, histories) reads the order
        clicks[TIME] = np.asarray(positions, dtype=np.int64)
    clicks[WEIGHT] = np.ones(len(clicks), dtype=np.float32)
    return clicks


def _read_parquet_sequences(table: TableConfig, columns: ColumnsConfig) -> pd.DataFrame:
    """Canonical clicks from a Parquet file of one row per user: ``columns.user`` and, in
    ``columns.item``, a list of item ids in time order (each click's timestamp is its place)."""
    frame = _read_parquet(str(_check_file(table))).frame
    raw = _Raw(frame, table.path, np.arange(1, len(frame) + 1), is_text=False)
    _require_columns(raw, [columns.user, columns.item], table, "parquet")
    lists = frame[columns.item]
    for row, value in enumerate(lists):
        if value is not None and not isinstance(value, (list, tuple, np.ndarray)):
            raise raw.error(
                f"a sequence is a list of item ids, got {type(value).__name__} {str(value)[:40]!r}", row, columns.item
            )
    lengths = np.array([0 if value is None else len(value) for value in lists], dtype=np.int64)
    if not lengths.any():
        raise DataError("no clicks: every sequence is empty", file=table.path, column=columns.item)
    users = _ids(raw, columns.user, "user")
    repeated = users.duplicated(keep="first").to_numpy()
    if repeated.any():
        raise raw.error(
            f"user {users[repeated].iloc[0]!r} already has a row; a sequence file has one row per user",
            int(np.argmax(repeated)),
            columns.user,
        )
    row_of_click = np.repeat(np.arange(len(frame)), lengths)
    items = pd.Series([item for value in lists if value is not None for item in value], dtype=object)
    flat = _Raw(pd.DataFrame({columns.item: items}), table.path, row_of_click + 1, is_text=False)
    clicks = pd.DataFrame({USER: users.to_numpy()[row_of_click], ITEM: _ids(flat, columns.item, "item").to_numpy()})
    clicks[TIME] = np.concatenate([np.arange(n) for n in lengths]).astype(np.int64)
    clicks[WEIGHT] = np.ones(len(clicks), dtype=np.float32)
    return clicks


def _arrow_reads(table: TableConfig, fmt: str) -> bool:
    """Whether Arrow reads the file (``shards``): Parquet, and text split on one character; pandas
    reads the MovieLens formats and text split on a longer separator, which Arrow cannot."""
    return fmt == "parquet" or (fmt in SHARD_FORMATS and len(table.separator or _DEFAULT_SEPARATOR[fmt]) == 1)


def _read_raw(table: TableConfig, fmt: str) -> _Raw:
    path = _check_file(table)
    if fmt == "parquet":
        return _read_parquet(table.path)
    if _arrow_reads(table, fmt):
        frame, numbers = read_text_table(table.path, _text_layout(table, fmt))
        return _without_blank_rows(frame, numbers, table.path)
    text = decode_text(read_data(str(path)), table.encoding, table.path)
    movielens = fmt.startswith("movielens")
    header = table.header and not movielens
    separator = table.separator or _DEFAULT_SEPARATOR[fmt]
    options = {"engine": "c"}
    if len(separator) > 1:
        # pandas reads a multi-character separator as a regex; we mean it literally.
        options = {"engine": "python", "sep": re.escape(separator)}
    else:
        options["sep"] = separator
    # pandas takes the column count from the first line it reads, so leading
    # blank lines are skipped (and counted into the line numbers).
    blank_lines = re.match(r"(?:[ \t]*\r?\n)*", text)
    assert blank_lines is not None  # the pattern matches the empty string, so it matches every text
    skipped = blank_lines.group().count("\n")

    def parse(names: list[str] | None = None) -> pd.DataFrame:
        return pd.read_csv(
            io.StringIO(text),
            header=0 if header else None,
            names=names,
            skiprows=skipped,
            dtype=str,
            keep_default_na=False,
            skip_blank_lines=False,
            # Without this, rows with one field more than the header (a trailing
            # separator) silently turn the first column into the index.
            index_col=False,
            **options,
        )

    extra = "\x00extra field"  # a name no file has
    names: list[str] | None = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", pd.errors.ParserWarning)
            frame = parse()
        if any(issubclass(w.category, pd.errors.ParserWarning) for w in caught):
            # A row has one field more than the header and pandas dropped it: read that field too. A
            # trailing separator (an empty last field) is tolerated; anything else there is an error.
            names = [*(str(c) for c in frame.columns), extra]
            frame = parse(names)
    except pd.errors.EmptyDataError:
        raise DataError("the file is empty: no data rows", file=table.path) from None
    except pd.errors.ParserError as error:
        # pandas counts physical lines as we do; lift the number into the location.
        found = re.search(r"Expected (\d+) fields in line (\d+), saw (\d+)", str(error))
        if found is None:
            raise DataError(f"cannot parse with separator {separator!r}: {error}", file=table.path) from None
        expected, line, saw = map(int, found.groups())
        expected -= names is not None  # the extra name is not one of the file's fields
        raise DataError(
            f"expected {expected} fields separated by {separator!r}, found {saw}", file=table.path, line=line
        ) from None
    frame.columns = [str(c) for c in frame.columns]
    numbers = np.arange(len(frame)) + (2 if header else 1) + skipped
    surplus = np.zeros(len(frame), bool)
    if names is not None:
        surplus = (frame.pop(extra).fillna("").str.strip() != "").to_numpy()
    if surplus.any():
        position = int(np.argmax(surplus))
        raise DataError(
            f"expected {frame.shape[1]} fields separated by {separator!r}, found {frame.shape[1] + 1}",
            file=table.path,
            line=int(numbers[position]),
        )
    # Fields missing at line end read as "" (the python engine: NaN), so a short row is refused by
    # the first column it leaves empty that the log needs.
    raw = _without_blank_rows(frame.fillna(""), numbers, table.path)
    frame, numbers = raw.frame, raw.numbers
    if movielens:
        if frame.shape[1] != len(_MOVIELENS_FIELDS):
            raise DataError(
                f"format {fmt!r} expects 4 fields per line (user, item, rating, timestamp "
                f"separated by {separator!r}), found {frame.shape[1]}; check format and separator",
                file=table.path,
            )
        frame.columns = _MOVIELENS_FIELDS
    return _Raw(frame, table.path, numbers, is_text=True)


def _read_parquet(file: str) -> _Raw:
    try:
        frame = pd.read_parquet(file)
    except Exception as error:  # pyarrow raises several unrelated types for bad files
        raise DataError(f"not a readable parquet file: {compressed_parquet(file) or error}", file=file) from None
    if frame.empty:
        raise DataError("no data rows", file=file)
    frame = frame.reset_index(drop=True)
    frame.columns = [str(c) for c in frame.columns]
    return _Raw(frame, file, np.arange(1, len(frame) + 1), is_text=False)


def _without_blank_rows(frame: pd.DataFrame, numbers: np.ndarray, file: str) -> _Raw:
    """The text rows holding a non-blank cell (a row of separators and spaces is no data)."""
    frame.columns = [str(c) for c in frame.columns]
    blank = frame.apply(lambda column: column.str.strip() == "").all(axis=1).to_numpy()
    frame, numbers = frame[~blank].reset_index(drop=True), numbers[~blank]
    if frame.empty:
        raise DataError("no data rows", file=file)
    return _Raw(frame, file, numbers, is_text=True)


def _require_columns(
    raw: _Raw, wanted: list[str], table: TableConfig, fmt: str, keys: dict[str, str] | None = None
) -> None:
    text = _text_layout(table, fmt) if raw.is_text else None
    require_columns(wanted, list(raw.frame.columns), raw.file, text=text, keys=keys)


def _text_layout(table: TableConfig, fmt: str) -> TextLayout:
    """How a text file of format ``fmt`` is split: MovieLens files have no header."""
    header = table.header and not fmt.startswith("movielens")
    return TextLayout(table.separator or _DEFAULT_SEPARATOR[fmt], header, table.encoding)


def _checked(raw: _Raw, column: str, convert: Callable[[pd.Series], T]) -> T:
    """``convert(raw.frame[column])``, its refused cells reported at their line (or row)."""
    try:
        return convert(raw.frame[column])
    except BadValues as error:
        position, count, message = error.first()
        more = f" ({count} bad rows in all)" if count > 1 else ""
        raise raw.error(message + more, position, column) from None


def _ids(raw: _Raw, column: str, what: str) -> pd.Series:
    return _checked(raw, column, lambda values: id_strings(values, what))


def _timestamps(raw: _Raw, column: str) -> np.ndarray:
    return _checked(raw, column, timestamp_seconds)


def _weights(raw: _Raw, column: str) -> np.ndarray:
    return _checked(raw, column, click_weights)


def _infer_type(column: pd.Series) -> pd.Series:
    text = column.str.strip()
    present = (text != "").to_numpy()
    if not present.any():
        return pd.Series(np.nan, index=column.index, dtype=np.float64)
    shown = text[present]
    finite = shown.str.fullmatch(_NUMBER)
    numeric = (finite | shown.str.fullmatch(_NON_FINITE)).all() and finite.any()
    if not numeric or shown.str.match(r"[+-]?0\d").any():
        return text.where(present)
    numbers = pd.to_numeric(text.where(present), errors="coerce")
    if present.all() and shown.str.fullmatch(r"[+-]?\d+").all() and numbers.dtype == np.int64:
        return numbers
    return numbers.astype(np.float64)  # integers beyond int64 too, which float32 may still hold
