"""Click logs larger than memory: Parquet or CSV shards streamed in record batches.

The in-memory path (``loaders.read_clicks`` -> ``splits.split_clicks``) holds
the whole log as a pandas frame. This module never does: it reads the shards
(``retrieval.data.shards``: only the needed columns, ``read_batch_size`` rows
at a time) and makes a few passes over them:

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
a bounded buffer in the order ``retrieval.data.shuffle.epoch_order`` gives a
frame of the same clicks (``retrieval.training.StreamedClicks`` turns it into
``tf.data`` epochs).

Splits (``retrieval.data.stream_splits``): ``temporal`` (clicks after the cut
are test; ties at the cut go to train, as in memory), ``random`` by a seeded
hash of (user, item, timestamp), each click test with probability
``test_fraction`` whatever shard it is in (the rows the in-memory split holds
out), ``leave_last_k`` (each user's last ``k`` clicks, planned by one sort of
every click coded as int numbers and kept as row keys, 8 bytes a test click),
and ``none`` (a given test file). ``data.duplicates: first`` keeps the row keys
of each (user, item) pair's first click (8 bytes a distinct pair) and
``split.hold_out_items`` the drawn item ids; each holds out or keeps the rows
the in-memory path does. This module re-exports the shard readers and the
plans, so callers stream through it alone.

Importing this module does not import TensorFlow, like the rest of ``retrieval.data``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from retrieval.common.arrays import seeded_subset
from retrieval.data.schema import ITEM, TIME, USER, WEIGHT, DataError
from retrieval.data.shards import ClickBatch, ClickLog, ClickShards, ClickTable, as_strings, list_shard_files
from retrieval.data.shuffle import click_keys, epoch_order
from retrieval.data.stream_splits import (
    CarvedPlan,
    HeldOutPlan,
    Plan,
    SplitPlan,
    first_clicks,
    plan_hold_out,
    plan_split,
    plan_validation,
    random_test_mask,
)

__all__ = [  # the shard readers too: callers stream through this module
    "CarvedPlan",
    "ClickBatch",
    "ClickLog",
    "ClickShards",
    "ClickTable",
    "HeldOutPlan",
    "Plan",
    "SplitPlan",
    "StreamCounts",
    "collect_users",
    "first_clicks",
    "list_shard_files",
    "plan_hold_out",
    "plan_split",
    "plan_validation",
    "random_test_mask",
    "sample_test_users",
    "scan_counts",
    "scan_pairs",
    "scan_train_column",
    "train_batches",
]

_MERGE_EVERY = 16  # record batches between merges of the partial value counts


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
        ids = as_strings(table.column("id").combine_chunks())[order]
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
      last_train_time: the latest training click's timestamp (the end of training), or None
        without timestamps.
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
    last_train_time: int | None = None

    def with_test(self, test: pd.DataFrame) -> StreamCounts:
        """These counts with the test side taken from a given test log (``split.kind: none``).

        Raises:
          DataError: the test log is empty.
        """
        if test.empty:
            raise DataError("the given test log (data.test_clicks) is empty")
        users = test[USER].astype(str)
        first = ~users.duplicated()
        user_counts = users.value_counts(sort=False).reindex(users[first]).to_numpy(np.int64)
        items = test[ITEM].astype(str)
        return dataclasses.replace(
            self,
            test_user_ids=users[first].to_numpy(dtype=object),
            test_user_counts=user_counts,
            test_item_ids=items[~items.duplicated()].to_numpy(dtype=object),
            test_rows=len(test),
        )

    def catalogue(self) -> list[str]:
        """Every logged item, in the in-memory catalogue's order (``Dataset.items`` without
        feature tables): training items by first click, then items only in the test part."""
        train = self.item_ids.tolist()
        known = set(train)
        return train + [i for i in self.test_item_ids.tolist() if i not in known]


def scan_counts(shards: ClickLog, plan: Plan) -> StreamCounts:
    """Pass 2: per-id training counts and the test side's users and items.

    Raises:
      DataError: a side of the split is empty.
    """
    users, items, test_users, test_items = _Counter(), _Counter(), _Counter(), _Counter()
    train_rows = test_rows = 0
    has_weights = False
    last_time: int | None = None
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
        if train.timestamps is not None and len(train):
            latest = int(train.timestamps.max())
            last_time = latest if last_time is None else max(last_time, latest)
    for name, rows in (("train", train_rows), ("test", test_rows)):
        if rows == 0 and not (name == "test" and plan.kind == "none"):
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
        last_time,
    )


def scan_train_column(shards: ClickLog, plan: Plan, column: str) -> np.ndarray:
    """One column of every training click, in log order: ``timestamp`` (int64) or ``weight``
    (float32), 8 (4) bytes a click (feature statistics of a click column, ``ExampleJoin``)."""
    if column not in (TIME, WEIGHT):
        raise ValueError(f"only the timestamp and weight columns are scanned, got {column!r}")
    parts = []
    for batch in shards.scan():
        train = batch.take(~plan.is_test(batch) & ~plan.drops(batch))
        values = train.weights if column == WEIGHT else train.timestamps
        if values is None:
            raise DataError("the click log has no timestamp column (data.columns.timestamp)")
        parts.append(values)
    return np.concatenate(parts) if parts else np.zeros(0, np.float32 if column == WEIGHT else np.int64)


def train_clicks(shards: ClickLog, plan: Plan) -> pd.DataFrame:
    """Every training click of ``plan`` as a frame, in log order: ``user_id``, ``item_id`` (str),
    ``weight`` (float32) and, when the log has one, ``timestamp`` (int64): for a log held in memory,
    the clicks ``train_batches`` shuffles, so that a ``FrameClicks`` of them gives its batches."""
    parts = []
    for batch in shards.scan():
        train = batch.take(~plan.is_test(batch) & ~plan.drops(batch))
        parts.append(pd.DataFrame(_click_columns(train)))
    if not parts:
        return pd.DataFrame({USER: pd.Series(dtype=object), ITEM: pd.Series(dtype=object),
                             WEIGHT: pd.Series(dtype=np.float32)})
    return pd.concat(parts, ignore_index=True)


def scan_pairs(
    shards: ClickLog, plan: Plan, user_ids: pd.Index, item_ids: pd.Index
) -> tuple[np.ndarray, np.ndarray]:
    """Every training click as a (row of ``user_ids``, row of ``item_ids``) pair: the click matrix of
    the ALS baseline, coded while streaming (8 bytes a click; the matrix sums repeated pairs).

    Returns:
      ``(user_rows, item_rows)``, [train clicks] int32 each.

    Raises:
      DataError: a training click's user or item is not in the given ids.
    """
    users, items = [], []
    for batch in shards.scan():
        train = batch.take(~plan.is_test(batch) & ~plan.drops(batch))
        if not len(train):
            continue
        user_rows = user_ids.get_indexer(as_strings(train.users))
        item_rows = item_ids.get_indexer(as_strings(train.items))
        if (user_rows < 0).any() or (item_rows < 0).any():
            raise DataError("a training click's user or item is missing from the streamed vocabularies")
        users.append(user_rows.astype(np.int32))
        items.append(item_rows.astype(np.int32))
    empty = np.zeros(0, np.int32)
    return (np.concatenate(users) if users else empty), (np.concatenate(items) if items else empty)


def sample_test_users(counts: StreamCounts, max_users: int | None, seed: int) -> np.ndarray:
    """Up to ``max_users`` test users (sorted ids), drawn uniformly with ``seed``; None = all."""
    return seeded_subset(np.sort(counts.test_user_ids), max_users, seed)


def collect_users(
    shards: ClickLog, plan: Plan, user_ids: Sequence[str] | np.ndarray
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
    shards: ClickLog,
    plan: Plan,
    batch_size: int,
    *,
    shuffle_buffer: int,
    seed: int,
    epoch: int = 0,
    interleave: int = 4,
    with_time: bool = False,
) -> Iterator[dict[str, np.ndarray]]:
    """Batches ``{"user_id", "item_id", "weight"}`` (and ``"timestamp"`` with ``with_time``) of every
    training click, each exactly once.

    Shuffling in bounded memory: the shard order is permuted (drawn from
    ``(seed, epoch)``), ``interleave`` shards are read at once (a record batch
    from each in turn, so a buffer mixes several time windows or user ranges),
    and rows are gathered into a buffer of at least ``shuffle_buffer`` rows
    that is put in ``shuffle.epoch_order`` (a seeded hash of each click's
    content, timestamp included when the log has one) and cut into batches;
    the rows left over (fewer than a batch) join the next buffer. Every batch
    is full but the last. Each epoch differs and a rerun repeats it. Since the
    order is the one ``FrameClicks`` gives a frame of the same clicks, a
    buffer that holds every training click (``shuffle_buffer >= train_rows``)
    yields exactly the in-memory batches; a smaller one, that order within
    each buffer.

    Yields:
      ``user_id`` [batch] object str, ``item_id`` [batch] object str,
      ``weight`` [batch] float32 (``timestamp`` [batch] int64).
    """
    if batch_size <= 0 or shuffle_buffer <= 0:
        raise ValueError(
            f"batch_size and shuffle_buffer must be positive, got {batch_size}, {shuffle_buffer}"
        )
    rng = np.random.default_rng([seed, epoch])
    files = [shards.files[i] for i in rng.permutation(len(shards.files))]
    if with_time and shards.columns.timestamp is None:
        raise DataError("the click log has no timestamp column (data.columns.timestamp)")
    held: list[dict[str, np.ndarray]] = []
    count = 0
    yielded = [USER, ITEM, WEIGHT, *([TIME] if with_time else [])]

    def drain(final: bool) -> Iterator[dict[str, np.ndarray]]:
        nonlocal held, count
        columns = {name: np.concatenate([part[name] for part in held]) for name in held[0]}
        keys = click_keys(columns[USER], columns[ITEM], columns[WEIGHT], columns.get(TIME))
        order = epoch_order(keys, seed, epoch)
        full = len(order) if final else len(order) - len(order) % batch_size
        for start in range(0, full, batch_size):
            rows = order[start : start + batch_size]
            yield {name: columns[name][rows] for name in yielded}
        rest = order[full:]
        held = [{name: values[rest] for name, values in columns.items()}] if len(rest) else []
        count = len(rest)

    for batch in _interleaved(shards, files, interleave):
        train = batch.take(~plan.is_test(batch) & ~plan.drops(batch))
        if not len(train):
            continue
        # A full buffer is drained only when more rows come: the last one is always drained
        # whole (final), so a buffer holding every training click is ordered as one frame.
        if count >= max(shuffle_buffer, batch_size):
            yield from drain(final=False)
        held.append(_click_columns(train))
        count += len(train)
    if count:
        yield from drain(final=True)


def _click_columns(clicks: ClickBatch) -> dict[str, np.ndarray]:
    """What the shuffle keys and yields of a batch: ids (str), weights and, when the log has them,
    timestamps (in the key even when not yielded: a tower may read them)."""
    columns = {USER: as_strings(clicks.users), ITEM: as_strings(clicks.items), WEIGHT: clicks.weights}
    if clicks.timestamps is not None:
        columns[TIME] = np.asarray(clicks.timestamps)
    return columns


def _interleaved(shards: ClickLog, files: Sequence[str], cycle: int) -> Iterator[ClickBatch]:
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
