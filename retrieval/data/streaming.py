"""Click logs larger than memory: Parquet or CSV shards streamed in record batches.

The in-memory path (``loaders.read_clicks`` -> ``splits.split_clicks``) holds
the whole log as a pandas frame. This module never does: it reads the shards
with ``pyarrow.dataset`` (only the needed columns, ``read_batch_size`` rows at
a time) and makes a few passes over them:

1. ``plan_split``: the time range and, for a temporal split, the cut. The cut
   is the *exact* quantile ``temporal_cut`` takes in memory, so it needs every
   timestamp once: 8 bytes a click (160 MB at 20M clicks), freed after the
   pass. A histogram would be smaller but could move the cut by a bucket, and
   then the streamed split would not be the in-memory split.
2. ``scan_counts``: training click counts per user and per item (from which
   ``FeatureStatistics.from_counts`` builds the vocabularies and popularity),
   the test users and items, and the row counts of each side. Counting is done
   by Arrow (a ``group_by`` per batch, merged every few batches), so memory
   grows with the number of distinct ids, not of clicks.
3. ``collect_users``: the clicks of a sample of test users (test part for
   evaluation, training part for masking and activity), as small frames.

``train_batches`` then yields the training side of the split, shuffled through
a bounded buffer (``retrieval.training.StreamedClicks`` turns it into ``tf.data`` epochs).

Splits: ``temporal`` (clicks after the cut are test; ties at the cut go to
train, as in memory) and ``random`` by a seeded hash of (user, item,
timestamp): each click is test with probability ``test_fraction``,
independently of the others and of the shard it is in: the rows the in-memory
split holds out (``splits.hashed_test_mask``). ``leave_last_k`` needs every
user's clicks in time order and is not supported here.

Importing this module does not import TensorFlow, like the rest of ``retrieval.data``.
"""

from __future__ import annotations

import glob
import itertools
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from retrieval.arrays import seeded_subset
from retrieval.config import ColumnsConfig, SplitConfig, TableConfig
from retrieval.data.schema import ITEM, TIME, USER, WEIGHT, DataError
from retrieval.data.splits import hashed_test_mask, nested_seed, timestamp_cut
from retrieval.data.values import FLOAT32_MAX, BadValues, click_weights, id_strings, timestamp_seconds

_SHARD_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "tsv", ".txt": "tsv"}
_SEPARATORS = {"csv": ",", "tsv": "\t"}
_MERGE_EVERY = 16  # record batches between merges of the partial value counts


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
            fmt = table.format if table.format != "auto" else _SHARD_FORMATS.get(Path(file).suffix.lower())
            if fmt is None:
                raise DataError(
                    f"cannot tell the shard format from the extension {Path(file).suffix!r}; set the "
                    "table's format to parquet, csv or tsv",
                    file=file,
                )
            formats.setdefault(fmt, file)
        if len(formats) > 1:
            examples = ", ".join(f"{fmt} ({file})" for fmt, file in formats.items())
            raise DataError(
                f"the shards mix formats: {examples}; one click log has one format", file=table.path
            )
        (fmt,) = formats
        if fmt not in ("parquet", "csv", "tsv"):
            raise DataError(
                f"format {fmt!r} cannot be streamed out of core; use parquet, csv or tsv shards",
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
    def wanted(self) -> list[str]:
        """The columns read from each shard."""
        c = self.columns
        return [name for name in (c.user, c.item, c.timestamp, c.weight) if name]

    def _text_names(self, file: str) -> list[str]:
        """Column names of a text shard: its header line, or positions ``"0"``, ``"1"``, ..."""
        with open(file, encoding=self.encoding, newline="") as handle:
            first = handle.readline().removeprefix("\ufeff").rstrip("\r\n")
        if not first.strip():
            raise DataError("the shard is empty or starts with a blank line", file=file)
        fields = first.split(self.separator or _SEPARATORS[self.format])
        return [f.strip() for f in fields] if self.header else [str(i) for i in range(len(fields))]

    def _check_columns(self, file: str) -> None:
        try:
            found = pq.read_schema(file).names if self.format == "parquet" else self._text_names(file)
        except DataError:
            raise
        except Exception as error:  # pyarrow raises several unrelated types for bad files
            raise DataError(f"not a readable {self.format} shard: {error}", file=file) from None
        missing = [c for c in self.wanted if c not in found]
        if missing:
            plural = "s" if len(missing) > 1 else ""
            raise DataError(
                f"missing column{plural} {', '.join(map(repr, missing))}; columns found: {found}", file=file
            )

    def _dataset(self, file: str) -> pads.Dataset:
        if self.format == "parquet":
            return pads.dataset(file, format="parquet")
        names = self._text_names(file)
        # Every column is read as text, so the cells are parsed by the rules read_clicks applies
        # (retrieval.data.values), not by Arrow's per-block type inference.
        ids = {name: pa.string() for name in self.wanted}
        fmt = pads.CsvFileFormat(
            parse_options=pacsv.ParseOptions(delimiter=self.separator or _SEPARATORS[self.format]),
            read_options=pacsv.ReadOptions(
                column_names=names, skip_rows=1 if self.header else 0, encoding=self.encoding
            ),
            convert_options=pacsv.ConvertOptions(column_types=ids, strings_can_be_null=False),
        )
        return pads.dataset(file, format=fmt)

    def batches(self, file: str) -> Iterator[ClickBatch]:
        """Canonical click batches of one shard, in file order."""
        text = self.format != "parquet"
        line_of = (lambda row: self._text_line(file, row)) if text else None
        try:
            scanner = self._dataset(file).to_batches(columns=self.wanted, batch_size=self.read_batch_size)
            first_row = 1
            for batch in scanner:
                if batch.num_rows == 0:
                    continue
                yield _canonical(batch, self.columns, file, first_row, line_of)
                first_row += batch.num_rows
        except DataError:
            raise
        except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as error:
            found = re.search(r"CSV parse error: Row #(\d+): Expected (\d+) columns, got (\d+)", str(error))
            if found is None or line_of is None:
                raise DataError(f"cannot read the {self.format} shard: {error}", file=file) from None
            row, expected, saw = map(int, found.groups())  # Arrow's row counts the header, not empty lines
            separator = self.separator or _SEPARATORS[self.format]
            raise DataError(
                f"expected {expected} fields separated by {separator!r}, found {saw}",
                file=file,
                line=line_of(row - int(self.header)),
            ) from None

    def _text_line(self, file: str, data_row: int) -> int:
        """The 1-based line of a text shard's 1-based data row ``data_row``.

        Arrow skips empty lines and does not count them; an error names the line
        a text editor shows, as ``read_clicks`` does, so they are counted here
        (only when an error needs a line).
        """
        number = rows = 0
        with open(file, encoding=self.encoding, errors="replace", newline="") as handle:
            for number, line in enumerate(handle, start=1):
                if (self.header and number == 1) or not line.rstrip("\r\n"):
                    continue
                rows += 1
                if rows == data_row:
                    return number
        return number

    def scan(self, files: Sequence[str] | None = None) -> Iterator[ClickBatch]:
        """Canonical click batches of every shard (or of ``files``), shard by shard."""
        for file in self.files if files is None else files:
            yield from self.batches(file)


def list_shard_files(path: str) -> list[str]:
    """The files ``path`` names: itself, a directory's data files, or a glob's matches (sorted)."""
    target = Path(path)
    if target.is_dir():
        files = [
            str(p)
            for p in sorted(target.iterdir())
            if p.is_file() and not p.name.startswith((".", "_")) and p.suffix.lower() in _SHARD_FORMATS
        ]
    elif glob.has_magic(path):
        files = sorted(p for p in glob.glob(path, recursive=True) if Path(p).is_file())
    else:
        files = [path] if target.is_file() else []
    if not files:
        what = "no files match the pattern" if glob.has_magic(path) else (
            "the directory holds no .parquet/.csv/.tsv shards" if target.is_dir() else "file not found"
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

    def __len__(self) -> int:
        return len(self.users)

    def take(self, mask: np.ndarray) -> ClickBatch:
        keep = pa.array(mask)
        return ClickBatch(
            self.users.filter(keep),
            self.items.filter(keep),
            None if self.timestamps is None else self.timestamps[mask],
            self.weights[mask],
        )

    def frame(self) -> pd.DataFrame:
        """The canonical click frame of this batch (``read_clicks`` columns)."""
        frame = pd.DataFrame({USER: _strings(self.users), ITEM: _strings(self.items)})
        if self.timestamps is not None:
            frame[TIME] = self.timestamps
        frame[WEIGHT] = self.weights
        return frame


def _strings(values: pa.Array) -> np.ndarray:
    return np.asarray(values.to_numpy(zero_copy_only=False), dtype=object)


def _canonical(
    batch: pa.RecordBatch,
    columns: ColumnsConfig,
    file: str,
    first_row: int,
    line_of: Callable[[int], int] | None = None,
) -> ClickBatch:
    """Ids as stripped strings, timestamps as int64 seconds, weights as float32; errors name file and row.

    Cells follow ``retrieval.data.values``, the rules ``read_clicks`` applies:
    each column is handed to them as pandas, except the common cases Arrow
    converts identically and faster (string or integer ids, integer seconds).
    ``first_row`` is the batch's first 1-based data row in the shard;
    ``line_of(row)`` gives a text shard's line of a data row (None: Parquet,
    errors name the row).
    """

    def fail(message: str, bad: np.ndarray, column: str) -> DataError:
        position = first_row + int(np.argmax(bad))
        count = int(bad.sum())
        more = f" ({count} bad rows in this batch)" if count > 1 else ""
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
            more = f" ({count} bad rows in this batch)" if count > 1 else ""
            raise fail(message + more, bad, column) from None

    def ids(column: str, what: str) -> pa.Array:
        values = batch.column(column)
        if pa.types.is_dictionary(values.type):
            values = values.dictionary_decode()
        if pa.types.is_floating(values.type):
            message = f"{what} ids are stored as floats; write them as integers or strings"
            raise fail(message, np.ones(1, bool), column)
        if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)
                or pa.types.is_integer(values.type)):
            # Lists, structs, booleans, bytes, dates...: refused or converted as read_clicks does.
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
    return ClickBatch(ids(columns.user, "user"), ids(columns.item, "item"), timestamps, weights)


def _all_integers(values: pa.Array) -> bool:
    """True when every cell is text holding an integer in ASCII digits."""
    if not pa.types.is_string(values.type) or values.null_count:
        return False
    return bool(pc.all(pc.match_substring_regex(values, r"^[+-]?[0-9]+$")).as_py())


# --- The split, decided one batch at a time. ---


@dataclass(frozen=True)
class SplitPlan:
    """Which clicks are test, decidable from a single batch.

    Attributes:
      kind: ``"temporal"`` or ``"random"``.
      cut: temporal: clicks with a timestamp above it are test.
      test_fraction, seed: random: a click is test when its seeded hash falls
        below ``test_fraction``.
      rows: clicks in the log.
      time_range: (first, last) timestamp, or None without timestamps.
    """

    kind: str
    rows: int
    cut: int | None = None
    test_fraction: float = 0.0
    seed: int = 0
    time_range: tuple[int, int] | None = None

    def drops(self, batch: ClickBatch) -> np.ndarray:
        """[len(batch)] bool: clicks on neither side (none: every click is train or test)."""
        return np.zeros(len(batch), bool)

    def is_test(self, batch: ClickBatch) -> np.ndarray:
        """[len(batch)] bool: the batch's test clicks."""
        if self.kind == "temporal":
            if batch.timestamps is None or self.cut is None:
                raise DataError("a temporal split needs the batch's timestamps and the plan's cut")
            return batch.timestamps > self.cut
        return random_test_mask(batch, self.test_fraction, self.seed)


def random_test_mask(batch: ClickBatch, fraction: float, seed: int) -> np.ndarray:
    """Test clicks of a random split: ``splits.hashed_test_mask`` of the batch's clicks, so a
    click gets the side it gets in memory."""
    return hashed_test_mask(_strings(batch.users), _strings(batch.items), batch.timestamps, fraction, seed)


def plan_split(shards: ClickShards, split: SplitConfig) -> SplitPlan:
    """Pass 1: row count, time range and (temporal) the exact cut of ``splits.temporal_cut``.

    Raises:
      DataError: an unsupported split kind, no timestamps for a temporal split,
        an empty log, or a cut that leaves the test part empty.
    """
    if split.kind not in ("temporal", "random"):
        raise DataError(
            f"split.kind {split.kind!r} is not yet supported out of core (temporal and random are): "
            "it needs every user's clicks in time order"
        )
    if split.kind == "temporal" and shards.columns.timestamp is None:
        raise DataError(
            "split.kind 'temporal' needs timestamps but data.columns.timestamp is None; set it to the "
            "log's time column, or use split.kind: random"
        )
    rows, stamps = 0, []
    first: int | None = None
    last: int | None = None
    for batch in shards.scan():
        rows += len(batch)
        if batch.timestamps is not None:
            lo, hi = int(batch.timestamps.min()), int(batch.timestamps.max())
            first, last = (lo, hi) if first is None or last is None else (min(first, lo), max(last, hi))
            if split.kind == "temporal":
                stamps.append(batch.timestamps)
    if rows == 0:
        raise DataError("no clicks: every shard is empty", file=shards.files[0])
    time_range = None if first is None or last is None else (first, last)
    if split.kind == "random":
        return SplitPlan(
            "random", rows, test_fraction=split.test_fraction, seed=split.seed, time_range=time_range
        )
    everything = np.concatenate(stamps)
    del stamps
    cut = timestamp_cut(everything, split.test_fraction)
    if not (everything > cut).any():
        raise DataError(
            f"temporal split left the test part empty: no click is later than the cut at {cut} "
            f"(quantile {1 - split.test_fraction:g} of {rows} clicks)"
        )
    return SplitPlan("temporal", rows, cut=cut, time_range=time_range)


@dataclass(frozen=True)
class CarvedPlan:
    """The training side of ``outer`` split again by ``inner`` (the early-stopping validation part).

    Its test clicks are ``inner``'s test clicks among ``outer``'s training
    clicks; ``outer``'s test clicks are on neither side (``drops``). Every
    function taking a ``SplitPlan`` takes it.
    """

    outer: SplitPlan
    inner: SplitPlan

    @property
    def kind(self) -> str:
        return self.inner.kind

    def drops(self, batch: ClickBatch) -> np.ndarray:
        return self.outer.is_test(batch) | self.outer.drops(batch)

    def is_test(self, batch: ClickBatch) -> np.ndarray:
        return ~self.drops(batch) & self.inner.is_test(batch)


def plan_validation(shards: ClickShards, plan: SplitPlan, fraction: float, seed: int) -> CarvedPlan:
    """The validation part carved from ``plan``'s training side as ``training.validation_split``
    carves it in memory: with timestamps the latest ``fraction`` of the training clicks (the
    exact cut of ``splits.timestamp_cut``, one more pass), else a random ``fraction`` by the
    hash of ``random_test_mask`` keyed by ``splits.nested_seed(seed)`` (independent of the test split's).

    Raises:
      DataError: the cut leaves the validation part empty.
    """
    if shards.columns.timestamp is None:
        inner = SplitPlan("random", plan.rows, test_fraction=fraction, seed=nested_seed(seed),
                          time_range=plan.time_range)
        return CarvedPlan(plan, inner)
    stamps = []
    for batch in shards.scan():
        if batch.timestamps is None:
            raise DataError("a temporal validation part needs every batch's timestamps", file=shards.files[0])
        stamps.append(batch.timestamps[~plan.is_test(batch)])
    everything = np.concatenate(stamps)
    del stamps
    cut = timestamp_cut(everything, fraction)
    if not (everything > cut).any():
        raise DataError(
            f"the early-stopping validation part is empty: no training click is later than the cut at {cut} "
            f"(quantile {1 - fraction:g} of {len(everything)} training clicks); lower train.validation_fraction "
            "or set it to 0"
        )
    return CarvedPlan(plan, SplitPlan("temporal", len(everything), cut=cut, time_range=plan.time_range))


# A split of the log, or of its training side again (early stopping).
Plan = SplitPlan | CarvedPlan


# --- Pass 2: counts. ---


class _Counter:
    """Occurrences and first position per string id over many batches, merged by Arrow
    (memory ~ distinct ids, not clicks)."""

    def __init__(self) -> None:
        self._parts: list[pa.Table] = []

    def add(self, values: pa.Array, first_position: int) -> None:
        """Count ``values``, the first of them being the log's row ``first_position``."""
        if len(values):
            positions = pa.array(np.arange(first_position, first_position + len(values)))
            rows = pa.table({"id": values, "pos": positions})
            self._parts.append(rows.group_by("id").aggregate([("pos", "min"), ("pos", "count")]))
            if len(self._parts) >= _MERGE_EVERY:
                self._parts = [self._merged()]

    def _merged(self) -> pa.Table:
        if not self._parts:
            return pa.table({"id": pa.array([], pa.string()), "pos_min": pa.array([], pa.int64()),
                             "pos_count": pa.array([], pa.int64())})
        table = pa.concat_tables(self._parts)
        merged = table.group_by("id").aggregate([("pos_min", "min"), ("pos_count", "sum")])
        return merged.rename_columns(["id", "pos_min", "pos_count"])

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids [n] object str, counts [n] int64), ids in order of first appearance."""
        table = self._merged()
        order = np.argsort(table.column("pos_min").to_numpy(), kind="stable")
        ids = _strings(table.column("id").combine_chunks())[order]
        return ids, table.column("pos_count").to_numpy().astype(np.int64)[order]


@dataclass(frozen=True)
class StreamCounts:
    """What pass 2 learns about the two sides of the split.

    Attributes:
      user_ids, user_counts: training clicks per training user.
      item_ids, item_counts: training clicks per training item.
      test_user_ids, test_user_counts: test clicks per test user.
      test_item_ids: items with a test click.
      (Ids are in order of first appearance in the log.)
      train_rows, test_rows: clicks on each side.
      has_weights: some training click has a weight other than 1.
    """

    user_ids: np.ndarray
    user_counts: np.ndarray
    item_ids: np.ndarray
    item_counts: np.ndarray
    test_user_ids: np.ndarray
    test_user_counts: np.ndarray
    test_item_ids: np.ndarray
    train_rows: int
    test_rows: int
    has_weights: bool

    def catalogue(self) -> list[str]:
        """Every logged item, in the in-memory catalogue's order (``Dataset.items`` without
        feature tables): training items by first click, then items only in the test part."""
        train = self.item_ids.tolist()
        known = set(train)
        return train + [i for i in self.test_item_ids.tolist() if i not in known]


def scan_counts(shards: ClickShards, plan: Plan) -> StreamCounts:
    """Pass 2: per-id training counts and the test side's users and items.

    Raises:
      DataError: a side of the split is empty.
    """
    users, items, test_users, test_items = _Counter(), _Counter(), _Counter(), _Counter()
    train_rows = test_rows = 0
    has_weights = False
    for batch in shards.scan():
        batch = batch.take(~plan.drops(batch))
        is_test = plan.is_test(batch)
        train, test = batch.take(~is_test), batch.take(is_test)
        users.add(train.users, train_rows)
        items.add(train.items, train_rows)
        test_users.add(test.users, test_rows)
        test_items.add(test.items, test_rows)
        train_rows += len(train)
        test_rows += len(test)
        has_weights = has_weights or bool(np.any(train.weights != 1.0))
    for name, rows in (("train", train_rows), ("test", test_rows)):
        if rows == 0:
            raise DataError(f"the {name} part of the {plan.kind!r} split is empty")
    user_ids, user_counts = users.result()
    item_ids, item_counts = items.result()
    test_user_ids, test_user_counts = test_users.result()
    return StreamCounts(
        user_ids,
        user_counts,
        item_ids,
        item_counts,
        test_user_ids,
        test_user_counts,
        test_items.result()[0],
        train_rows,
        test_rows,
        has_weights,
    )


def sample_test_users(counts: StreamCounts, max_users: int | None, seed: int) -> np.ndarray:
    """Up to ``max_users`` test users (sorted ids), drawn uniformly with ``seed``; None = all."""
    return seeded_subset(np.sort(counts.test_user_ids), max_users, seed)


def collect_users(
    shards: ClickShards, plan: Plan, user_ids: Sequence[str] | np.ndarray
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Pass 3: ``(train, test)`` canonical click frames of ``user_ids`` only, in log order."""
    wanted = pa.array(list(user_ids), pa.string())
    parts: dict[bool, list[pd.DataFrame]] = {False: [], True: []}
    for batch in shards.scan():
        mine = pc.is_in(batch.users, value_set=wanted).to_numpy(zero_copy_only=False)
        if not mine.any():
            continue
        batch = batch.take(mine & ~plan.drops(batch))
        is_test = plan.is_test(batch)
        for side in (False, True):
            part = batch.take(is_test == side)
            if len(part):
                parts[side].append(part.frame())
    empty = ClickBatch(pa.array([], pa.string()), pa.array([], pa.string()),
                       None if shards.columns.timestamp is None else np.zeros(0, np.int64),
                       np.zeros(0, np.float32)).frame()
    train, test = (pd.concat(parts[side] or [empty], ignore_index=True) for side in (False, True))
    return train, test


# --- Training input. ---


def train_batches(
    shards: ClickShards,
    plan: Plan,
    batch_size: int,
    *,
    shuffle_buffer: int,
    seed: int,
    epoch: int = 0,
    interleave: int = 4,
) -> Iterator[dict[str, np.ndarray]]:
    """Batches ``{"user_id", "item_id", "weight"}`` of every training click, each exactly once.

    Shuffling in bounded memory: the shard order is permuted, ``interleave``
    shards are read at once (a record batch from each in turn, so a buffer
    mixes several time windows or user ranges), and rows are gathered into a
    buffer of ``shuffle_buffer`` rows that is permuted and cut into batches;
    the rows left over (fewer than a batch) join the next buffer. Every batch
    is full but the last. The permutations are drawn from ``(seed, epoch)``,
    so each epoch differs and a rerun repeats them.

    Yields:
      ``user_id`` [batch] object str, ``item_id`` [batch] object str,
      ``weight`` [batch] float32.
    """
    if batch_size <= 0 or shuffle_buffer <= 0:
        raise ValueError(
            f"batch_size and shuffle_buffer must be positive, got {batch_size}, {shuffle_buffer}"
        )
    rng = np.random.default_rng([seed, epoch])
    files = [shards.files[i] for i in rng.permutation(len(shards.files))]
    held: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    count = 0

    def drain(final: bool) -> Iterator[dict[str, np.ndarray]]:
        nonlocal held, count
        users, items, weights = (np.concatenate(parts) for parts in zip(*held))
        order = rng.permutation(len(users))
        full = len(order) if final else len(order) - len(order) % batch_size
        for start in range(0, full, batch_size):
            rows = order[start : start + batch_size]
            yield {USER: users[rows], ITEM: items[rows], WEIGHT: weights[rows]}
        rest = order[full:]
        held = [(users[rest], items[rest], weights[rest])] if len(rest) else []
        count = len(rest)

    for batch in _interleaved(shards, files, interleave):
        train = batch.take(~plan.is_test(batch) & ~plan.drops(batch))
        if not len(train):
            continue
        held.append((_strings(train.users), _strings(train.items), train.weights))
        count += len(train)
        if count >= max(shuffle_buffer, batch_size):
            yield from drain(final=False)
    if count:
        yield from drain(final=True)


def _interleaved(shards: ClickShards, files: Sequence[str], cycle: int) -> Iterator[ClickBatch]:
    """Record batches of ``cycle`` shards at a time, one from each in turn; a finished shard's
    place goes to the next file."""
    pending = iter(files)
    active = [shards.batches(file) for file in itertools.islice(pending, max(1, cycle))]
    while active:
        for reader in list(active):
            batch = next(reader, None)
            if batch is not None:
                yield batch
                continue
            active.remove(reader)
            file = next(pending, None)
            if file is not None:
                active.append(shards.batches(file))
