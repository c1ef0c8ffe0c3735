"""Load the configured data source and split it: the input of every later stage."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import pandas as pd

from retrieval.config import DataConfig, SplitConfig, TableConfig
from retrieval.data.loaders import apply_duplicates, read_clicks, read_feature_table
from retrieval.data.movielens import load_movielens_100k, locate_movielens_100k
from retrieval.data.schema import ITEM, USER, DataError
from retrieval.data.shards import ClickLog, ClickShards, ClickTable
from retrieval.data.splits import hold_out_items
from retrieval.data.stream_splits import split_clicks, split_validation
from retrieval.data.synthetic import generate_clicks


@dataclass(frozen=True)
class Dataset:
    """A split click log and its catalogues.

    Attributes:
        train: Canonical training clicks.
        test: Canonical test clicks.
        items: The catalogue, one row per item: ``item_id`` then feature
            columns. It holds every item of the item feature table and of the
            log (train and test), so items without training clicks are there
            too; features are NaN where unknown.
        users: One row per user, ``user_id`` then feature columns, likewise
            the union of the user feature table and the log. ``load_dataset``
            always fills it (with ``user_id`` alone when there are no user
            features).
        source: Where the data came from, for logs and reports.
        held_out_items: Items whose training clicks ``split.hold_out_items``
            removed (cold-start evaluation), sorted; empty by default.
        evaluated_on: ``split.evaluate_on``: ``test``, or ``validation`` when
            ``train`` and ``test`` are the inner training and validation parts
            of the training part (the real test part is then dropped).
    """

    train: pd.DataFrame
    test: pd.DataFrame
    items: pd.DataFrame
    users: pd.DataFrame | None
    source: str
    held_out_items: tuple[str, ...] = ()
    evaluated_on: Literal["test", "validation"] = "test"

    def summary(self) -> dict[str, Any]:
        """Counts for logs and run reports (plain ints and strings)."""
        train_items = set(self.train[ITEM])
        summary = split_summary(
            self.source, (set(self.train[USER]), set(self.test[USER])), (train_items, set(self.test[ITEM])),
            (len(self.train), len(self.test)), self.items[ITEM], None if self.users is None else len(self.users),
            len(self.held_out_items), self.evaluated_on,
        )
        summary["test_clicks_on_unseen_items"] = int((~self.test[ITEM].isin(train_items)).sum())
        return summary


def split_summary(
    source: str,
    users: tuple[set[str], set[str]],
    items: tuple[set[str], set[str]],
    clicks: tuple[int, int],
    catalogue_ids: Iterable[str],
    catalogue_users: int | None,
    held_out_items: int,
    evaluated_on: str,
) -> dict[str, Any]:
    """The counts a run reports of its split: ``users``, ``items`` and ``clicks`` are (train, test)."""
    (train_users, test_users), (train_items, test_items) = users, items
    catalogue = set(catalogue_ids)
    return {
        "source": source,
        "train_clicks": clicks[0],
        "test_clicks": clicks[1],
        "train_users": len(train_users),
        "train_items": len(train_items),
        "test_users": len(test_users),
        "test_items": len(test_items),
        "test_users_unseen_in_train": len(test_users - train_users),
        "test_items_unseen_in_train": len(test_items - train_items),
        "catalogue_items": len(catalogue),
        "catalogue_items_without_train_clicks": len(catalogue - train_items),
        "catalogue_users": catalogue_users,
        "held_out_items": held_out_items,
        "evaluated_on": evaluated_on,
    }


def load_dataset(data: DataConfig, split: SplitConfig) -> Dataset:
    """Read ``data.source``, apply ``data.duplicates`` and split.

    - ``synthetic``: ``generate_clicks(data.synthetic)`` with its item and user
      features; file settings are ignored.
    - ``movielens-100k``: the folder from ``locate_movielens_100k(data.movielens_dir)``.
    - ``files``: ``data.clicks`` read with ``data.columns``, plus the optional
      ``data.test_clicks`` (for ``split.kind: none``), ``data.item_features``
      and ``data.user_features`` keyed by ``data.item_id_column`` and
      ``data.user_id_column``.

    The duplicates policy applies to each log before splitting, so a re-click
    in the test period of an item clicked in training is kept.

    With ``split.evaluate_on: validation`` the test part is dropped right after
    the split and the training part is split again (``split_validation``):
    ``train`` and ``test`` are then the inner training and validation parts,
    and the catalogues hold no id seen only in the test part (unless a
    feature table lists it).

    Args:
        data: The data section of the config.
        split: The split section of the config.

    Returns:
        The split dataset with full item and user catalogues.

    Raises:
        DataError: Unreadable or inconsistent input (see ``read_clicks`` and
            ``split_clicks``).
        FileNotFoundError: MovieLens 100K was asked for but not found.
    """
    raw = _read_source(data)
    train, test = split_clicks(apply_duplicates(raw.clicks, data.duplicates), split, raw.test_clicks)
    if split.evaluate_on == "validation":
        # Tuning: the test part goes here, before anything (catalogue, hold-out draw) reads it.
        train, test = split_validation(train, split)
    held_out: tuple[str, ...] = ()
    if split.hold_out_items > 0:
        train, held_out = hold_out_items(train, test, split.hold_out_items, split.seed)
    return Dataset(
        train=train,
        test=test,
        items=catalogue_table(ITEM, raw.item_features, train, test),
        users=catalogue_table(USER, raw.user_features, train, test),
        source=raw.source,
        held_out_items=held_out,
        evaluated_on=split.evaluate_on,
    )


@dataclass(frozen=True)
class LogSource:
    """The configured click log, not yet split, and what comes with it.

    Attributes:
      clicks: the log behind the one interface every stage reads (``ClickLog``): its shards
        (``data.out_of_core``) or the whole log in memory (``ClickTable``).
      test_clicks: ``data.test_clicks`` as a canonical frame (``split.kind: none``; a test log is
        small and read whole), ``data.duplicates`` applied; None when not given.
      item_features, user_features: feature tables keyed ``item_id`` / ``user_id``, or None.
      source: where the clicks came from, for logs and reports.
      in_memory: the whole log is in memory: every stage may hold it (the shuffle buffer, the
        evaluated users).
    """

    clicks: ClickLog
    test_clicks: pd.DataFrame | None
    item_features: pd.DataFrame | None
    user_features: pd.DataFrame | None
    source: str
    in_memory: bool


def open_log(data: DataConfig) -> LogSource:
    """The configured click log behind ``ClickLog``, with its test log and feature tables.

    ``data.out_of_core`` opens the shards of ``data.clicks`` (nothing read yet); every other
    source is read whole (``load_dataset``'s readers) into one ``ClickTable``. ``data.duplicates``
    is left to the split plan (``retrieval.data.streaming.plan_split``), which applies it to the log.
    """
    if data.out_of_core:
        if data.clicks is None:
            raise ValueError("data.out_of_core needs data.clicks (the click shards)")
        shards = ClickShards.open(data.clicks, data.columns, data.stream.read_batch_size)
        items, users = feature_tables(data)
        source = f"files:{data.clicks.path} ({len(shards.files)} {shards.format} shards, out of core)"
        return LogSource(shards, _test_log(data), items, users, source, in_memory=False)
    raw = _read_source(data)
    table = ClickTable.from_frame(raw.clicks, data.stream.read_batch_size)
    return LogSource(table, raw.test_clicks, raw.item_features, raw.user_features, raw.source, in_memory=True)


@dataclass(frozen=True)
class _Source:
    """A source read whole: its clicks as read (duplicates kept), test log (``data.duplicates``
    applied) and feature tables."""

    clicks: pd.DataFrame
    test_clicks: pd.DataFrame | None
    item_features: pd.DataFrame | None
    user_features: pd.DataFrame | None
    source: str


def _read_source(data: DataConfig) -> _Source:
    test_log = item_features = user_features = None
    if data.source == "synthetic":
        clicks, item_features, user_features = generate_clicks(data.synthetic)
        source = f"synthetic(seed={data.synthetic.seed})"
    elif data.source == "movielens-100k":
        folder = locate_movielens_100k(data.movielens_dir)
        clicks, item_features, user_features = load_movielens_100k(folder)
        source = f"movielens-100k:{folder}"
    elif data.source == "files":
        if data.clicks is None:
            raise ValueError("data.clicks is required when data.source is 'files'")
        clicks = read_clicks(data.clicks, data.columns)
        test_log = _test_log(data)
        item_features, user_features = feature_tables(data)
        source = f"files:{data.clicks.path}"
    else:
        raise ValueError(f"unknown data.source {data.source!r}; valid: synthetic, movielens-100k, files")
    return _Source(clicks, test_log, item_features, user_features, source)


def _test_log(data: DataConfig) -> pd.DataFrame | None:
    """``data.test_clicks`` (small: read whole), ``data.duplicates`` applied; None when not given."""
    if data.test_clicks is None:
        return None
    return read_clicks(data.test_clicks, data.columns, duplicates=data.duplicates)


def feature_tables(data: DataConfig) -> tuple[pd.DataFrame | None, pd.DataFrame | None]:
    """``(items, users)``: ``data.item_features`` and ``data.user_features`` with their id columns
    renamed to ``item_id`` and ``user_id``; None where not given."""
    items = None if data.item_features is None else _features(data.item_features, data.item_id_column, ITEM)
    users = None if data.user_features is None else _features(data.user_features, data.user_id_column, USER)
    return items, users


def _features(table: TableConfig, id_column: str, key: str) -> pd.DataFrame:
    """Read a feature table and rename its id column to the canonical ``key``."""
    features = read_feature_table(table, id_column, id_key=f"data.{key.split('_')[0]}_id_column")
    if id_column != key and key in features.columns:
        raise DataError(
            f"the id column is {id_column!r} but the table also has a column {key!r}, the "
            "canonical id name; rename one of them",
            file=table.path,
        )
    return features.rename(columns={id_column: key})


def catalogue_table(key: str, features: pd.DataFrame | None, *logs: pd.DataFrame) -> pd.DataFrame:
    """Feature rows in table order, then ids only seen in the logs (frames with a ``key``
    column), first seen first; features are NaN for those."""
    known = pd.Series([], dtype="str") if features is None else features[key]
    ids = pd.concat([known, *(log[key] for log in logs)], ignore_index=True).drop_duplicates()
    catalogue = pd.DataFrame({key: ids.to_numpy()})
    if features is None:
        return catalogue
    return catalogue.merge(features, on=key, how="left", validate="one_to_one")
