"""The click-log interface and its two backends: shards on disk and one table in memory.

A ``ClickLog`` is what every stage of the job reads (``retrieval.data.streaming``
makes its passes over one, ``retrieval.training.StreamedClicks`` trains on one):
``files`` (the parts, each read in log order), ``columns`` and ``scan``/``batches``
yielding ``ClickBatch`` es of canonical columns (user and item id strings, int64
timestamps, float32 weights) with row keys increasing in log order.

- ``ClickShards`` opens a file, a directory or a glob of Parquet/CSV shards and
  reads them in record batches with pyarrow, every value checked by the rules
  the in-memory loader applies (``retrieval.data.values``), errors naming file,
  line or row, and column.
- ``ClickTable`` holds a canonical click frame (a generated log, MovieLens, a
  file read whole) as one Arrow table: a log of one part whose passes cost no I/O.
"""

from __future__ import annotations

import glob
import io
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from retrieval.common.errors import nearest_name
from retrieval.config import ColumnsConfig, TableConfig
from retrieval.data.schema import (
    FORMAT_BY_EXTENSION,
    ITEM,
    SHARD_FORMATS,
    TIME,
    USER,
    WEIGHT,
    DataError,
    compression_of,
    compression_of_bytes,
    format_suffix,
    open_data,
    read_data,
)
from retrieval.data.values import FLOAT32_MAX, BadValues, click_weights, id_strings, timestamp_seconds

# A click's row key is its shard's place in the sorted shard list times 2**ROW_KEY_BITS plus its
# 0-based row in the shard: increasing in log order (the in-memory frame's row order) without a
# pass to count each shard's rows first. 2**40 rows a shard, 2**23 shards.
ROW_KEY_BITS = 40
_SHARD_FORMATS = {extension: fmt for extension, fmt in FORMAT_BY_EXTENSION.items() if fmt in SHARD_FORMATS}
_SEPARATORS = {"csv": ",", "tsv": "\t"}


class ClickLog(Protocol):
    """A click log read part by part (``ClickShards``, ``ClickTable``).

    Attributes:
      files: the parts, in log order (shard paths, or ``ClickTable.PART`` alone).
      columns: the canonical batch's sources; ``columns.timestamp`` is None when the log has no time.
      reads_own_shards: each worker of a multi-worker run can read parts of its own
        (``StreamedClicks.worker_epoch``); False: every worker reads the whole log.
    """

    @property
    def files(self) -> tuple[str, ...]: ...

    @property
    def columns(self) -> ColumnsConfig: ...

    @property
    def reads_own_shards(self) -> bool: ...

    def batches(self, file: str) -> Iterator[ClickBatch]:
        """Canonical click batches of one part, in log order, with their row keys (``ROW_KEY_BITS``)."""
        ...

    def scan(self, files: Sequence[str] | None = None) -> Iterator[ClickBatch]:
        """Canonical click batches of every part (or of ``files``), part by part."""
        ...


@dataclass(frozen=True)
class ClickShards:
    """The shards of one click log and how to read them.

    Attributes:
      files: shard paths, sorted.
      format: ``"parquet"``, ``"csv"`` or ``"tsv"`` (one format for all shards).
      columns: names of the user, item, timestamp and weight columns.
      read_batch_size: rows per record batch.
      separator, header, encoding: text shards only, as in ``TableConfig``.
    """

    files: tuple[str, ...]
    format: str
    columns: ColumnsConfig
    read_batch_size: int = 65_536
    separator: str | None = None
    header: bool = True
    encoding: str = "utf-8"

    @classmethod
    def open(cls, table: TableConfig, columns: ColumnsConfig, read_batch_size: int = 65_536) -> ClickShards:
        """List the shards ``table.path`` names and check each one's columns.

        ``table.path`` is a file, a directory (every ``.parquet``/``.pq``/
        ``.csv``/``.tsv``/``.txt`` file in it, hidden files skipped) or a glob
        (``logs/*.parquet``, ``logs/**/*.csv``).

        Raises:
          DataError: nothing matches; the shards mix formats; a format cannot be
            streamed; a shard lacks a column (the message names the shard).
        """
        files = list_shard_files(table.path)
        formats: dict[str, str] = {}
        for file in files:
            fmt = table.format if table.format != "auto" else _SHARD_FORMATS.get(format_suffix(file))
            if fmt is None:
                raise DataError(
                    f"cannot tell the shard format from the extension {Path(file).suffix!r}; set the "
                    f"table's format to one of {', '.join(SHARD_FORMATS)}",
                    file=file,
                )
            formats.setdefault(fmt, file)
        if len(formats) > 1:
            examples = ", ".join(f"{fmt} ({file})" for fmt, file in formats.items())
            raise DataError(f"the shards mix formats: {examples}; one click log has one format", file=table.path)
        (fmt,) = formats
        if fmt not in SHARD_FORMATS:
            raise DataError(
                f"format {fmt!r} cannot be streamed out of core; use {', '.join(SHARD_FORMATS)} shards",
                file=table.path,
            )
        if fmt != "parquet" and table.separator is not None and len(table.separator) != 1:
            raise DataError(
                f"separator {table.separator!r} is not one character: csv and tsv shards are split on one "
                "character (Arrow); rewrite the shards, or read the log whole (data.out_of_core: false)",
                file=table.path,
            )
        shards = cls(
            tuple(files),
            fmt,
            columns,
            read_batch_size,
            table.separator,
            table.header,
            table.encoding,
        )
        for file in files:
            shards._check_columns(file)
        return shards

    @property
    def reads_own_shards(self) -> bool:
        return True

    @property
    def wanted(self) -> list[str]:
        """The columns read from each shard."""
        c = self.columns
        return [name for name in (c.user, c.item, c.timestamp, c.weight) if name]

    @property
    def text(self) -> TextLayout:
        """How a text shard is laid out (Parquet shards have no use for it)."""
        return TextLayout(self.separator or _SEPARATORS.get(self.format, ","), self.header, self.encoding)

    def _check_columns(self, file: str) -> None:
        try:
            found = pq.read_schema(file).names if self.format == "parquet" else self.text.start(file)[1]
        except DataError:
            raise
        except Exception as error:  # pyarrow raises several unrelated types for bad files
            codec = compression_of(file)
            why = compressed_parquet(file) if self.format == "parquet" else None
            if why is None and codec is not None:
                why = f"cannot decompress the {codec}-compressed file: {error}"
            raise DataError(f"not a readable {self.format} shard: {why or error}", file=file) from None
        text = None if self.format == "parquet" else self.text
        require_columns(self.wanted, found, file, text=text, keys=column_keys(self.columns))

    def _dataset(self, file: str) -> pads.Dataset:
        if self.format == "parquet":
            return pads.dataset(file, format="parquet")
        # Every column is read as text, so the cells are parsed by the rules read_clicks applies
        # (retrieval.data.values), not by Arrow's per-block type inference.
        return pads.dataset(file, format=self.text.arrow_format(file, self.wanted))

    def _record_batches(self, file: str) -> Iterator[pa.RecordBatch]:
        if self.format != "parquet":
            return self.text.record_batches(file, self.wanted, self.read_batch_size)
        return iter(self._dataset(file).to_batches(columns=self.wanted, batch_size=self.read_batch_size))

    def batches(self, file: str) -> Iterator[ClickBatch]:
        """Canonical click batches of one shard (one of ``files``), in file order."""
        text = self.format != "parquet"
        line_of = (lambda row: self.text.line_of_row(file, row)) if text else None
        first_key = self.files.index(file) << ROW_KEY_BITS
        try:
            scanner = self._record_batches(file)
            first_row = 1
            for batch in scanner:
                if batch.num_rows == 0:
                    continue
                keys = np.arange(first_key + first_row - 1, first_key + first_row - 1 + batch.num_rows)
                yield _canonical(batch, self.columns, file, first_row, line_of, keys)
                first_row += batch.num_rows
        except DataError:
            raise
        except (pa.ArrowInvalid, pa.ArrowTypeError, OSError, UnicodeDecodeError) as error:
            if not Path(file).is_file():  # Arrow's message does not say so plainly
                raise DataError("the shard is missing: deleted or moved since the run listed it", file=file) from None
            if not text:
                raise DataError(f"cannot read the {self.format} shard: {error}", file=file) from None
            raise self.text.read_error(file, error, f"the {self.format} shard") from None

    def scan(self, files: Sequence[str] | None = None) -> Iterator[ClickBatch]:
        """Canonical click batches of every shard (or of ``files``), shard by shard."""
        for file in self.files if files is None else files:
            yield from self.batches(file)


@dataclass(frozen=True, eq=False)
class ClickTable:
    """A canonical click log held in memory as one Arrow table: a ``ClickLog`` of one part.

    Row ``i`` of the table has row key ``i``, so the plans and passes of
    ``retrieval.data.streaming`` see it as they see a single shard, and a
    shuffle buffer holding every click gives the batches ``FrameClicks`` gives
    the same frame. Its values are trusted: they come from a loader or the
    generator, which checked them.

    Attributes:
      table: ``user_id``, ``item_id`` (string), ``timestamp`` (int64, optional), ``weight`` (float32).
      read_batch_size: rows per batch of ``batches``.
    """

    PART = "<in memory>"
    table: pa.Table
    read_batch_size: int = 65_536
    files: tuple[str, ...] = (PART,)

    @classmethod
    def from_frame(cls, clicks: pd.DataFrame, read_batch_size: int = 65_536) -> ClickTable:
        """From a canonical click frame (``read_clicks``, ``generate_clicks``, ``load_movielens_100k``)."""
        columns = {
            USER: pa.array(clicks[USER].astype(str).to_numpy(dtype=object), pa.string()),
            ITEM: pa.array(clicks[ITEM].astype(str).to_numpy(dtype=object), pa.string()),
        }
        if TIME in clicks:
            columns[TIME] = pa.array(clicks[TIME].to_numpy(np.int64))
        weights = clicks[WEIGHT].to_numpy(np.float32) if WEIGHT in clicks else np.ones(len(clicks), np.float32)
        columns[WEIGHT] = pa.array(weights)
        return cls(pa.table(columns).combine_chunks(), read_batch_size)

    @property
    def columns(self) -> ColumnsConfig:
        has_time = TIME in self.table.column_names
        return ColumnsConfig(user=USER, item=ITEM, timestamp=TIME if has_time else None, weight=WEIGHT)

    @property
    def reads_own_shards(self) -> bool:
        return False  # one part: under multi_worker every worker holds it and takes its share of each batch

    @property
    def rows(self) -> int:
        return self.table.num_rows

    def batches(self, file: str) -> Iterator[ClickBatch]:
        if file != self.PART:
            raise ValueError(f"a ClickTable has one part, {self.PART!r}; got {file!r}")
        has_time = TIME in self.table.column_names
        for start in range(0, self.table.num_rows, self.read_batch_size):
            part = self.table.slice(start, self.read_batch_size)
            yield ClickBatch(
                part.column(USER).combine_chunks(),
                part.column(ITEM).combine_chunks(),
                part.column(TIME).to_numpy() if has_time else None,
                part.column(WEIGHT).to_numpy(),
                np.arange(start, start + part.num_rows, dtype=np.int64),
            )

    def scan(self, files: Sequence[str] | None = None) -> Iterator[ClickBatch]:
        for file in self.files if files is None else files:
            yield from self.batches(file)


@dataclass(frozen=True)
class TextLayout:
    """How a delimited text file is laid out, and how Arrow reads it with every line counted.

    Arrow skips empty lines and does not count them; every error names the line a
    text editor shows, so lines are counted here (only when an error needs one).
    Leading blank lines are skipped; the header is the first line with text.
    """

    separator: str
    header: bool = True
    encoding: str = "utf-8"

    def start(self, file: str) -> tuple[int, list[str]]:
        """(lines before the data: leading blank lines and the header; the column names: the header's
        fields, or positions ``"0"``, ``"1"``, ... without a header)."""
        skipped = 0
        try:
            with open_text(file, self.encoding) as handle:
                for line in handle:
                    first = line.removeprefix("\ufeff").rstrip("\r\n")
                    if first.strip():
                        break
                    skipped += 1
                else:
                    raise DataError("the file is empty: no data rows", file=file)
        except (UnicodeDecodeError, LookupError):
            decode_text(read_data(file), self.encoding, file)  # raises, naming the line and byte
            raise
        fields = first.split(self.separator)
        if self.header:
            return skipped + 1, [f.strip() for f in fields]
        return skipped, [str(i) for i in range(len(fields))]

    def arrow_options(
        self, file: str, text_columns: Sequence[str] | None = None
    ) -> tuple[pacsv.ReadOptions, pacsv.ParseOptions, pacsv.ConvertOptions]:
        """Arrow's reading of ``file``: ``text_columns`` (None: every column) as strings, never null."""
        skipped, names = self.start(file)
        text = {name: pa.string() for name in (names if text_columns is None else text_columns)}
        return (
            pacsv.ReadOptions(column_names=names, skip_rows=skipped, encoding=self.encoding),
            pacsv.ParseOptions(delimiter=self.separator),
            pacsv.ConvertOptions(column_types=text, strings_can_be_null=False),
        )

    def arrow_format(self, file: str, text_columns: Sequence[str] | None = None) -> pads.CsvFileFormat:
        """``arrow_options`` as a dataset format (plain files: a compressed one reads by ``record_batches``)."""
        read, parse, convert = self.arrow_options(file, text_columns)
        return pads.CsvFileFormat(parse_options=parse, read_options=read, convert_options=convert)

    def record_batches(
        self, file: str, columns: Sequence[str] | None = None, batch_size: int = 65_536
    ) -> Iterator[pa.RecordBatch]:
        """``file``'s rows in batches of at most ``batch_size``, ``columns`` (None: all) as strings; a
        gzip, zstd or bz2 file (by its magic bytes) is decompressed as it streams."""
        codec = compression_of(file)
        if codec is None:
            dataset = pads.dataset(file, format=self.arrow_format(file, columns))
            yield from dataset.to_batches(columns=None if columns is None else list(columns), batch_size=batch_size)
            return
        read, parse, convert = self.arrow_options(file, columns)
        if columns is not None:
            convert.include_columns = list(columns)
        with pa.input_stream(file, compression=codec) as stream:
            for batch in pacsv.open_csv(stream, read_options=read, parse_options=parse, convert_options=convert):
                for start in range(0, batch.num_rows, batch_size):
                    yield batch.slice(start, batch_size)

    def line_of_row(self, file: str, data_row: int) -> int:
        """The 1-based line of the 1-based data row ``data_row``."""
        skipped, _ = self.start(file)
        number = rows = 0
        with open_text(file, self.encoding, errors="replace") as handle:
            for number, line in enumerate(handle, start=1):
                if number <= skipped or not line.rstrip("\r\n"):
                    continue
                rows += 1
                if rows == data_row:
                    return number
        return number

    def data_lines(self, file: str) -> np.ndarray:
        """[data rows] int64: each data row's 1-based line (one pass over the file)."""
        skipped, _ = self.start(file)
        with open_text(file, self.encoding, errors="replace") as handle:
            numbers = [n for n, line in enumerate(handle, start=1) if n > skipped and line.rstrip("\r\n")]
        return np.asarray(numbers, dtype=np.int64)

    def read_error(self, file: str, error: Exception, what: str) -> DataError:
        """The ``DataError`` of an Arrow read that failed: an undecodable byte at its line, a row of
        the wrong width at its line (with the fix for a trailing separator), else Arrow's words."""
        decode_text(read_data(file), self.encoding, file)  # an undecodable byte: raised at its line
        found = re.search(r"CSV parse error: Row #(\d+): Expected (\d+) columns, got (\d+)", str(error))
        if found is None:
            return DataError(f"cannot read {what}: {error}", file=file)
        row, expected, saw = map(int, found.groups())  # Arrow's row counts the header, not empty lines
        line = self.line_of_row(file, row - int(self.header))
        hint = ""
        if saw == expected + 1 and self._line(file, line).rstrip("\r\n").endswith(self.separator):
            hint = f" (a trailing {self.separator!r}: remove it, or name the extra column in the header)"
        return DataError(
            f"expected {expected} fields separated by {self.separator!r}, found {saw}{hint}", file=file, line=line
        )

    def _line(self, file: str, number: int) -> str:
        with open_text(file, self.encoding, errors="replace") as handle:
            for at, line in enumerate(handle, start=1):
                if at == number:
                    return line
        return ""


def read_text_table(file: str, layout: TextLayout) -> tuple[pd.DataFrame, np.ndarray]:
    """A delimited text file whole, every cell a string: ``(frame, line of each row)``.

    Raises:
      DataError: undecodable, empty, or a row of the wrong width (naming its line).
    """
    try:
        batches = list(layout.record_batches(file))
        names = layout.start(file)[1]
        table = pa.Table.from_batches(batches) if batches else pa.table({n: pa.array([], pa.string()) for n in names})
    except DataError:
        raise
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError, UnicodeDecodeError) as error:
        raise layout.read_error(file, error, "the file") from None
    frame = table.to_pandas()
    return frame, layout.data_lines(file)


def list_shard_files(path: str) -> list[str]:
    """The files ``path`` names: itself, a directory's data files, or a glob's matches (sorted)."""
    target = Path(path)
    if target.is_dir():
        files = [
            str(p)
            for p in sorted(target.iterdir())
            if p.is_file() and not p.name.startswith((".", "_")) and format_suffix(str(p)) in _SHARD_FORMATS
        ]
    elif glob.has_magic(path):
        files = sorted(p for p in glob.glob(path, recursive=True) if Path(p).is_file())
    else:
        files = [path] if target.is_file() else []
    if not files:
        what = (
            "no files match the pattern"
            if glob.has_magic(path)
            else ("the directory holds no .parquet/.csv/.tsv shards" if target.is_dir() else "file not found")
        )
        raise DataError(f"no click shards: {what}", file=path)
    return files


@dataclass(frozen=True)
class ClickBatch:
    """One record batch in canonical form (Arrow ids, numpy numbers)."""

    users: pa.Array  # string
    items: pa.Array  # string
    timestamps: np.ndarray | None  # int64 seconds, or None without a time column
    weights: np.ndarray  # float32
    # [n] int64 row keys (ROW_KEY_BITS), increasing in log order: how a plan that names single
    # clicks (leave_last_k, data.duplicates: first) finds them in any batch; None = not from a shard.
    keys: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.users)

    def take(self, mask: np.ndarray) -> ClickBatch:
        keep = pa.array(mask)
        return ClickBatch(
            self.users.filter(keep),
            self.items.filter(keep),
            None if self.timestamps is None else self.timestamps[mask],
            self.weights[mask],
            None if self.keys is None else self.keys[mask],
        )

    def frame(self) -> pd.DataFrame:
        """The canonical click frame of this batch (``read_clicks`` columns)."""
        frame = pd.DataFrame({USER: as_strings(self.users), ITEM: as_strings(self.items)})
        if self.timestamps is not None:
            frame[TIME] = self.timestamps
        frame[WEIGHT] = self.weights
        return frame


# Separators a header may be split on; a header that splits on one of these into the wanted names
# was written with it.
_LIKELY_SEPARATORS = (",", ";", "\t", "|")
PARQUET_MAGIC = b"PAR1"


def column_keys(columns: ColumnsConfig) -> dict[str, str]:
    """Each click-log column the config names -> the ``data.columns.*`` key that names it."""
    named = {"user": columns.user, "item": columns.item, "timestamp": columns.timestamp, "weight": columns.weight}
    return {column: f"data.columns.{key}" for key, column in reversed(named.items()) if column}


def require_columns(
    wanted: Sequence[str],
    found: Sequence[str],
    file: str,
    *,
    text: TextLayout | None,
    keys: dict[str, str] | None = None,
) -> None:
    """A ``DataError`` naming the ``wanted`` columns missing from ``found`` (a text file's header when
    ``text`` is its layout, else Parquet's names), with the likely fix: a header split on another
    separator names ``separator``, a headerless read says columns are positions, and else the config
    key to set (``keys``: column -> key, e.g. ``data.columns.timestamp``), the nearest found name, and
    for a time column, that a log without time sets it to null."""
    missing = [c for c in wanted if c not in found]
    if not missing:
        return
    hint = ""
    if text is not None and not text.header:
        hint = " (the file is read without a header, so columns are named by position: '0', '1', ...)"
    elif text is not None:
        header = text.separator.join(found)
        for separator in _LIKELY_SEPARATORS:
            if separator != text.separator and set(missing) <= {f.strip() for f in header.split(separator)}:
                hint = (
                    f" (the header looks separated by {separator!r}, not {text.separator!r}: "
                    f"set the table's separator: {separator!r})"
                )
                break
    if not hint and keys:
        fixes = []
        for column in missing:
            if column not in keys:
                continue
            near = nearest_name(column, found)
            fix = f"set {keys[column]} to the column that holds it" + (f" (did you mean {near!r}?)" if near else "")
            if keys[column] == "data.columns.timestamp":
                fix += "; a log without time sets data.columns.timestamp: null"
            elif keys[column] == "data.columns.weight":
                fix += "; without weights, data.columns.weight: null"
            fixes.append(f"{column!r}: {fix}" if len(missing) > 1 else fix)
        hint = f"; {'; '.join(fixes)}" if fixes else ""
    plural = "s" if len(missing) > 1 else ""
    names = ", ".join(map(repr, missing))
    raise DataError(f"missing column{plural} {names}; columns found: {list(found)}{hint}", file=file)


def compressed_parquet(file: str) -> str | None:
    """Why a compressed file is no Parquet file (Parquet compresses inside the file), or None."""
    codec = compression_of(file)
    return None if codec is None else (
        f"the file is {codec}-compressed; a Parquet file is compressed inside (by its writer's codec): "
        "decompress it first"
    )


def open_text(file: str, encoding: str, errors: str | None = None) -> io.TextIOWrapper:
    """``file`` as text lines (newlines kept as written), decompressed when it is compressed."""
    return io.TextIOWrapper(open_data(file), encoding=encoding, errors=errors, newline="")


def decode_text(data: bytes, encoding: str, file: str) -> str:
    """``data`` decoded; a bad byte or an unknown encoding is a ``DataError`` naming the line and
    the ``encoding`` key (or, for a Parquet file read as text, the ``format`` key). A UTF-8
    byte-order mark is dropped (else it joins the first column's name)."""
    try:
        text = data.decode(encoding)
    except LookupError:
        message = f"unknown encoding {encoding!r}; set encoding to e.g. utf-8 or latin-1"
        raise DataError(message, file=file) from None
    except UnicodeDecodeError as error:
        codec = compression_of_bytes(data[:10])
        if codec is not None:  # a reader that was handed the compressed bytes: say so, not "set an encoding"
            message = f"the file is {codec}-compressed, not {encoding} text: decompress it first"
            raise DataError(message, file=file) from None
        if data.startswith(PARQUET_MAGIC):
            message = "the file looks like Parquet (it starts with PAR1), not text: set the table's format: parquet"
            raise DataError(message, file=file) from None
        bad = data[error.start : error.start + 1]
        raise DataError(
            f"byte 0x{bad.hex()} is not valid {encoding}; the file uses another encoding: "
            "set the table's encoding key (e.g. encoding: latin-1)",
            file=file,
            line=data.count(b"\n", 0, error.start) + 1,
        ) from None
    return text.removeprefix("\ufeff")


def as_strings(values: pa.Array) -> np.ndarray:
    return np.asarray(values.to_numpy(zero_copy_only=False), dtype=object)


def _canonical(
    batch: pa.RecordBatch,
    columns: ColumnsConfig,
    file: str,
    first_row: int,
    line_of: Callable[[int], int] | None = None,
    keys: np.ndarray | None = None,
) -> ClickBatch:
    """Ids as stripped strings, timestamps as int64 seconds, weights as float32; errors name file and row.

    Cells follow ``retrieval.data.values``, the rules ``read_clicks`` applies:
    each column is handed to them as pandas, except the common cases Arrow
    converts identically and faster (string or integer ids, integer seconds).
    ``first_row`` is the batch's first 1-based data row in the shard;
    ``line_of(row)`` gives a text shard's line of a data row (None: Parquet,
    errors name the row); ``keys`` are the rows' keys (``ROW_KEY_BITS``).
    """
    rows = f"data rows {first_row}-{first_row + batch.num_rows - 1}"

    def fail(message: str, bad: np.ndarray, column: str) -> DataError:
        position = first_row + int(np.argmax(bad))
        count = int(bad.sum())
        more = f" ({count} bad rows among {rows})" if count > 1 else ""
        return DataError(
            message + more,
            file=file,
            line=None if line_of is None else line_of(position),
            row=position if line_of is None else None,
            column=column,
        )

    def checked(column: str, convert: Callable[[pd.Series], Any]) -> Any:
        try:
            return convert(batch.column(column).to_pandas())
        except BadValues as error:
            position, count, message = error.first()
            bad = np.zeros(batch.num_rows, bool)
            bad[position] = True
            more = f" ({count} bad rows among {rows})" if count > 1 else ""
            raise fail(message + more, bad, column) from None

    def ids(column: str, what: str) -> pa.Array:
        values = batch.column(column)
        if pa.types.is_dictionary(values.type):
            values = values.dictionary_decode()
        if not (
            pa.types.is_string(values.type) or pa.types.is_large_string(values.type) or pa.types.is_integer(values.type)
        ):
            # Floats, lists, structs, booleans, bytes, dates...: converted or refused by the shared rules.
            return pa.array(checked(column, lambda cells: id_strings(cells, what)).to_numpy(), pa.string())
        values = pc.utf8_trim_whitespace(pc.cast(values, pa.string()))
        empty = pc.fill_null(pc.equal(values, ""), True).to_numpy(zero_copy_only=False)
        if empty.any():
            raise fail(f"empty {what} id", empty, column)
        return values

    timestamps = None
    if columns.timestamp is not None:
        values = batch.column(columns.timestamp)
        timestamps = None
        if pa.types.is_integer(values.type) and values.null_count == 0:
            if pa.types.is_signed_integer(values.type) or pc.max(values).as_py() <= np.iinfo(np.int64).max:
                timestamps = pc.cast(values, pa.int64()).to_numpy(zero_copy_only=False)
        elif _all_integers(values):  # text shards: integer seconds (Arrow alone would also take "0x10")
            try:
                timestamps = pc.cast(values, pa.int64()).to_numpy(zero_copy_only=False)
            except pa.ArrowInvalid:
                pass  # beyond int64: the shared rules name the cell
        if timestamps is None:
            timestamps = checked(columns.timestamp, timestamp_seconds)
    weights = None
    if columns.weight is not None:
        values = batch.column(columns.weight)
        if pa.types.is_string(values.type) and values.null_count == 0:
            # Text shards: Arrow parses the numbers pandas does, to the same doubles, but faster.
            try:
                numbers = pc.cast(values, pa.float64()).to_numpy(zero_copy_only=False)
            except pa.ArrowInvalid:
                numbers = None
            if numbers is not None and bool(np.all((numbers >= 0) & (numbers <= FLOAT32_MAX))):
                weights = numbers.astype(np.float32)
        if weights is None:
            weights = checked(columns.weight, click_weights)
    else:
        weights = np.ones(batch.num_rows, dtype=np.float32)
    return ClickBatch(ids(columns.user, "user"), ids(columns.item, "item"), timestamps, weights, keys)


def _all_integers(values: pa.Array) -> bool:
    """True when every cell is text holding an integer in ASCII digits."""
    if not pa.types.is_string(values.type) or values.null_count:
        return False
    return bool(pc.all(pc.match_substring_regex(values, r"^[+-]?[0-9]+$")).as_py())
