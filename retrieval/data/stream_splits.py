"""Streamed splits: which click of a shard is train, test or neither, decided one record batch at a time.

``plan_split`` (pass 1 over the shards) makes the ``SplitPlan`` of ``split.kind``
(temporal: the exact cut the in-memory split takes; random: the seeded hash of
``splits.hashed_test_mask``; leave_last_k: each user's last ``k`` clicks, found
by sorting every click coded as int numbers and kept as their row keys; none: a
given test file), after ``data.duplicates: first`` when asked (``first_clicks``,
one more pass: the row keys of each (user, item) pair's first click);
``plan_validation`` carves a validation part from a plan's training side
(``CarvedPlan``), for early stopping and for ``split.evaluate_on: validation``;
``plan_hold_out`` drops the training clicks of the items ``split.hold_out_items``
draws (``HeldOutPlan``). Each holds out the rows the in-memory split holds out:
the rules are shared with ``retrieval.data.splits`` and ``loaders.apply_duplicates``,
and a click's row key (``shards.ROW_KEY_BITS``) orders clicks as the frame's rows.
``retrieval.data.streaming`` makes its passes with them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from retrieval.config import SplitConfig
from retrieval.data.loaders import first_click_mask
from retrieval.data.schema import DataError
from retrieval.data.shards import ClickBatch, ClickLog, ClickTable, as_strings
from retrieval.data.splits import (
    draw_held_out_items,
    hashed_test_mask,
    last_k_mask,
    nested_seed,
    timestamp_cut,
    validation_carve,
)


@dataclass(frozen=True, eq=False)  # eq=False: array fields
class SplitPlan:
    """Which clicks are test, decidable from a single batch.

    Attributes:
      kind: ``"temporal"``, ``"random"``, ``"leave_last_k"`` or ``"none"`` (no
        click of the shards is test: the test log is given as a file,
        ``StreamCounts.with_test``).
      cut: temporal: clicks with a timestamp above it are test.
      test_fraction, seed: random: a click is test when its seeded hash falls
        below ``test_fraction``.
      rows: clicks in the log (after ``kept_keys``).
      time_range: (first, last) timestamp, or None without timestamps.
      test_keys: leave_last_k: [test clicks] int64, the increasing row keys of the test clicks.
      kept_keys: ``data.duplicates: first``: [distinct pairs] int64, the increasing row keys of
        each pair's first click (every other click is on neither side); None = every click.
    """

    kind: str
    rows: int
    cut: int | None = None
    test_fraction: float = 0.0
    seed: int = 0
    time_range: tuple[int, int] | None = None
    test_keys: np.ndarray | None = None
    kept_keys: np.ndarray | None = None

    def drops(self, batch: ClickBatch) -> np.ndarray:
        """[len(batch)] bool: clicks on neither side (repeated pairs under ``data.duplicates: first``)."""
        if self.kept_keys is None:
            return np.zeros(len(batch), bool)
        return ~_has_key(self.kept_keys, _row_keys(batch))

    def is_test(self, batch: ClickBatch) -> np.ndarray:
        """[len(batch)] bool: the batch's test clicks."""
        if self.kind == "none":
            return np.zeros(len(batch), bool)
        if self.kind == "temporal":
            if batch.timestamps is None or self.cut is None:
                raise DataError("a temporal split needs the batch's timestamps and the plan's cut")
            return batch.timestamps > self.cut
        if self.kind == "leave_last_k":
            if self.test_keys is None:
                raise DataError("a leave_last_k split needs the plan's test keys")
            return _has_key(self.test_keys, _row_keys(batch))
        return random_test_mask(batch, self.test_fraction, self.seed)


def random_test_mask(batch: ClickBatch, fraction: float, seed: int) -> np.ndarray:
    """Test clicks of a random split: ``splits.hashed_test_mask`` of the batch's clicks, so a
    click gets the side it gets in memory."""
    return hashed_test_mask(as_strings(batch.users), as_strings(batch.items), batch.timestamps, fraction, seed)


def plan_split(shards: ClickLog, split: SplitConfig, duplicates: str = "keep") -> SplitPlan:
    """Pass 1: row count, time range, and the exact cut of ``splits.temporal_cut`` (temporal) or
    the test clicks of ``splits.last_k_mask`` (leave_last_k), of the clicks ``duplicates`` keeps
    (``"first"``: ``first_clicks``, one pass before).

    leave_last_k codes every click as (user code, timestamp, row key), 20 bytes a click (400 MB
    at 20M clicks) for one sort, freed after the pass; the plan keeps 8 bytes a test click.

    Raises:
      ValueError: an unknown split kind or duplicates policy.
      DataError: no timestamps for a temporal or leave_last_k split, an empty log, or a split
        that leaves the test part empty.
    """
    if split.kind not in ("temporal", "leave_last_k", "random", "none"):
        raise ValueError(f"unknown split.kind {split.kind!r}; valid: temporal, leave_last_k, random, none")
    if duplicates not in ("keep", "first"):
        raise ValueError(f"duplicates must be 'keep' or 'first', got {duplicates!r}")
    if split.kind in ("temporal", "leave_last_k") and shards.columns.timestamp is None:
        raise DataError(
            f"split.kind {split.kind!r} needs timestamps but data.columns.timestamp is None; set it to the "
            "log's time column, or use split.kind: random"
        )
    kept = first_clicks(shards) if duplicates == "first" else None
    deduplicated = SplitPlan("none", 0, kept_keys=kept)  # drops the repeated pairs, nothing else
    coded = _CodedClicks(items=False)
    rows, stamps = 0, []
    first: int | None = None
    last: int | None = None
    for batch in shards.scan():
        if kept is not None:
            batch = batch.take(~deduplicated.drops(batch))
        rows += len(batch)
        if batch.timestamps is not None and len(batch):
            lo, hi = int(batch.timestamps.min()), int(batch.timestamps.max())
            first, last = (lo, hi) if first is None or last is None else (min(first, lo), max(last, hi))
            if split.kind == "temporal":
                stamps.append(batch.timestamps)
        if split.kind == "leave_last_k":
            coded.add(batch)
    if rows == 0:
        raise DataError("no clicks: every shard is empty", file=shards.files[0])
    time_range = None if first is None or last is None else (first, last)
    if split.kind == "none":  # every click of the shards trains; the test log is a file of its own
        return SplitPlan("none", rows, time_range=time_range, kept_keys=kept)
    if split.kind == "random":
        return SplitPlan(
            "random", rows, test_fraction=split.test_fraction, seed=split.seed, time_range=time_range, kept_keys=kept
        )
    if split.kind == "leave_last_k":
        test = coded.last_k_keys(split.k)
        if not len(test):
            raise DataError(
                f"leave_last_k split left the test part empty: no user has more than split.k={split.k} clicks; "
                "lower split.k"
            )
        return SplitPlan("leave_last_k", rows, time_range=time_range, test_keys=test, kept_keys=kept)
    everything = np.concatenate(stamps)
    del stamps
    cut = timestamp_cut(everything, split.test_fraction)
    if not (everything > cut).any():
        raise DataError(
            f"temporal split left the test part empty: no click is later than the cut at {cut} "
            f"(quantile {1 - split.test_fraction:g} of {rows} clicks); the last clicks share one timestamp or "
            "split.test_fraction is too small"
        )
    return SplitPlan("temporal", rows, cut=cut, time_range=time_range, kept_keys=kept)


def first_clicks(shards: ClickLog) -> np.ndarray:
    """The pass of ``data.duplicates: first``: [distinct pairs] int64, the increasing row keys of each
    (user, item) pair's first click by ``loaders.first_click_mask`` (by timestamp, ties and logs
    without time by log order), the rows ``apply_duplicates`` keeps.

    Every click is coded as (user code, item code, timestamp, row key), 24 bytes a click (480 MB at
    20M clicks) for one sort, freed after the pass; the result is 8 bytes a distinct pair.
    """
    coded = _CodedClicks(items=True)
    for batch in shards.scan():
        coded.add(batch)
    users, items, stamps, keys = coded.columns()
    assert items is not None  # coded with items
    # Scanned in log order, so the kept keys are increasing already.
    return keys[first_click_mask(users, items, stamps, keys)]


class _OnOuter:
    """What a plan wrapping another (``outer``) keeps of it: its rows, time range, kind and cut."""

    outer: Plan

    @property
    def kind(self) -> str:
        return self.outer.kind

    @property
    def rows(self) -> int:
        return self.outer.rows

    @property
    def time_range(self) -> tuple[int, int] | None:
        return self.outer.time_range

    @property
    def cut(self) -> int | None:
        return self.outer.cut


@dataclass(frozen=True, eq=False)
class CarvedPlan(_OnOuter):
    """The training side of ``outer`` split again by ``inner`` (the early-stopping validation part).

    Its test clicks are ``inner``'s test clicks among ``outer``'s training
    clicks; ``outer``'s test clicks are on neither side (``drops``). Every
    function taking a ``SplitPlan`` takes it.
    """

    outer: Plan
    inner: SplitPlan

    @property
    def kind(self) -> str:
        return self.inner.kind

    @property
    def cut(self) -> int | None:
        """The inner (validation) cut of a temporal carve."""
        return self.inner.cut

    def drops(self, batch: ClickBatch) -> np.ndarray:
        return self.outer.is_test(batch) | self.outer.drops(batch)

    def is_test(self, batch: ClickBatch) -> np.ndarray:
        return ~self.drops(batch) & self.inner.is_test(batch)


def plan_validation(shards: ClickLog, plan: Plan, fraction: float, split: SplitConfig | None) -> CarvedPlan:
    """The validation part carved from ``plan``'s training side as ``training.validation_split``
    carves it in memory (``splits.validation_carve``): the latest ``fraction`` of the training
    clicks (the exact cut of ``splits.timestamp_cut``, one more pass) when ``split`` is temporal or
    none and the shards have timestamps, each user's last ``split.k`` training clicks when it is
    leave_last_k (one more pass, as in ``plan_split``), else a random ``fraction`` by the hash of
    ``random_test_mask`` keyed by ``splits.nested_seed(split.seed)`` (independent of the test split's).

    Raises:
      DataError: the cut leaves the validation part empty.
    """
    carve = validation_carve(split, fraction, has_time=shards.columns.timestamp is not None)
    if carve.kind == "random":
        inner = SplitPlan("random", plan.rows, test_fraction=fraction, seed=carve.seed, time_range=plan.time_range)
        return CarvedPlan(plan, inner)
    if carve.kind == "leave_last_k":
        coded = _CodedClicks(items=False)
        for batch in shards.scan():
            coded.add(batch.take(~plan.is_test(batch) & ~plan.drops(batch)))
        test = coded.last_k_keys(carve.k)
        if not len(test):
            raise DataError(
                f"the validation part (each user's last split.k={carve.k} training clicks) is empty: no user has "
                f"more than {carve.k} training clicks; lower split.k"
            )
        return CarvedPlan(plan, SplitPlan("leave_last_k", coded.rows, time_range=plan.time_range, test_keys=test))
    if carve.kind != "temporal":
        raise ValueError(f"a streamed validation part is carved by time, last k or at random, not by {carve.kind}")
    stamps = []
    for batch in shards.scan():
        if batch.timestamps is None:
            raise DataError("a temporal validation part needs every batch's timestamps", file=shards.files[0])
        stamps.append(batch.timestamps[~plan.is_test(batch) & ~plan.drops(batch)])
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


@dataclass(frozen=True, eq=False)
class HeldOutPlan(_OnOuter):
    """``outer`` less the training clicks of ``items`` (``split.hold_out_items``: cold-start evaluation).

    The held-out items keep their test clicks; their training clicks are on
    neither side (``drops``). Every function taking a ``SplitPlan`` takes it.
    """

    outer: Plan
    items: tuple[str, ...]
    _items: pa.Array = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_items", pa.array(list(self.items), pa.string()))

    def drops(self, batch: ClickBatch) -> np.ndarray:
        held = pc.is_in(batch.items, value_set=self._items).to_numpy(zero_copy_only=False)
        return self.outer.drops(batch) | (held & ~self.outer.is_test(batch))

    def is_test(self, batch: ClickBatch) -> np.ndarray:
        return self.outer.is_test(batch)


def plan_hold_out(
    shards: ClickLog, plan: Plan, fraction: float, seed: int, test_items: Iterable[str] = ()
) -> HeldOutPlan:
    """``plan`` with the items ``splits.hold_out_items`` holds out made cold: one pass lists the
    items logged on either side (and in ``test_items``, a given test log's), and
    ``splits.draw_held_out_items`` draws from them as it does in memory (memory ~ distinct items).

    Raises:
      DataError: holding out would leave no training click.
    """
    train_items: set[str] = set()
    logged: set[str] = set(map(str, test_items))
    for batch in shards.scan():
        batch = batch.take(~plan.drops(batch))
        is_test = pa.array(plan.is_test(batch))
        train_items.update(as_strings(pc.unique(batch.items.filter(pc.invert(is_test)))))
        logged.update(as_strings(pc.unique(batch.items.filter(is_test))))
    logged |= train_items
    held = draw_held_out_items(np.asarray(list(logged), dtype=object), fraction, seed)
    if train_items <= set(held):
        raise DataError(f"split.hold_out_items={fraction} holds out every item with training clicks")
    return HeldOutPlan(plan, tuple(str(item) for item in held))


class _CodedClicks:
    """The clicks of a pass coded as int numbers (user and item codes in order of first sight,
    int64 timestamp and row key), for one sort at the end; codes cost memory ~ distinct ids."""

    def __init__(self, items: bool) -> None:
        self._codes: tuple[dict[str, int], ...] = ({}, {}) if items else ({},)
        self._parts: list[tuple[np.ndarray, ...]] = []
        self.rows = 0

    def add(self, batch: ClickBatch) -> None:
        if not len(batch):
            return
        ids = [batch.users, batch.items][: len(self._codes)]
        codes = tuple(_code(values, known) for values, known in zip(ids, self._codes, strict=True))
        stamps = () if batch.timestamps is None else (batch.timestamps,)
        self._parts.append((*codes, *stamps, _row_keys(batch)))
        self.rows += len(batch)

    def columns(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray]:
        """``(users, items or None, timestamps or None, keys)``, [rows] each, in pass order."""
        width = len(self._codes) + 2  # codes, timestamps, keys
        if not self._parts:
            empty = np.zeros(0, np.int64)
            return empty, (empty if len(self._codes) == 2 else None), empty, empty
        joined = [np.concatenate(column) for column in zip(*self._parts, strict=True)]
        users, items = joined[0], (joined[1] if len(self._codes) == 2 else None)
        stamps = joined[len(self._codes)] if len(joined) == width else None
        return users, items, stamps, joined[-1]

    def last_k_keys(self, k: int) -> np.ndarray:
        """[test clicks] int64: the increasing row keys of each user's last ``k`` clicks
        (``splits.last_k_mask``), for users with more than ``k``."""
        users, _, stamps, keys = self.columns()
        if stamps is None:
            raise DataError("a leave_last_k split needs every batch's timestamps")
        return keys[last_k_mask(users, stamps, keys, k)]


def _code(values: pa.Array, known: dict[str, int]) -> np.ndarray:
    """[len(values)] int32 codes of string ids, new ids getting the next codes."""
    local, uniques = pd.factorize(as_strings(values))
    mapped = np.fromiter((known.setdefault(u, len(known)) for u in uniques), np.int32, len(uniques))
    return mapped[local]


def _row_keys(batch: ClickBatch) -> np.ndarray:
    if batch.keys is None:
        raise DataError("a plan that names single clicks needs the batch's row keys (batches read from shards)")
    return batch.keys


def _has_key(sorted_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """[len(keys)] bool: which ``keys`` are in ``sorted_keys`` (increasing)."""
    at = np.searchsorted(sorted_keys, keys)
    found = at < len(sorted_keys)
    found[found] = sorted_keys[at[found]] == keys[found]
    return found


# A split of the log, of its training side again (early stopping), or less its held-out items.
Plan = SplitPlan | CarvedPlan | HeldOutPlan


# -- frames: the plans applied to a click frame held in memory -----------------------------


def split_clicks(
    clicks: pd.DataFrame, cfg: SplitConfig, test_clicks: pd.DataFrame | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Split ``clicks`` as ``cfg.kind`` says: ``plan_split`` of the frame's rows (``ClickTable``).

    Args:
        clicks: Canonical clicks.
        cfg: The split: ``temporal`` puts clicks after the timestamp at
            quantile ``1 - test_fraction`` in test (ties at the cut go to
            train); ``leave_last_k`` puts each user's last ``k`` clicks by
            timestamp in test (ties broken by row order), users with ``k`` or
            fewer clicks staying entirely in train; ``random`` puts each click
            in test with probability ``test_fraction`` by a hash of the click
            keyed by ``seed`` (``hashed_test_mask``: the streamed split holds out
            the same rows); ``none`` returns ``clicks`` and ``test_clicks`` as they are.
        test_clicks: The separately given test log; only with ``kind: none``.

    Returns:
        ``(train, test)``, neither empty.

    Raises:
        DataError: A needed timestamp or test log is missing, a test log is
            given to another kind of split, or a part would be empty.
    """
    if cfg.kind == "none":
        if test_clicks is None:
            raise DataError("split.kind 'none' needs a separate test log: set data.test_clicks")
        train, test = clicks.reset_index(drop=True), test_clicks.reset_index(drop=True)
    elif test_clicks is not None:
        raise DataError(
            f"a separate test log was given but split.kind is {cfg.kind!r}: set split.kind: none "
            "to use it, or remove data.test_clicks"
        )
    else:
        # The plan a streamed log gets, made of the frame's rows: one implementation of every split.
        log = ClickTable.from_frame(clicks)
        plan = plan_split(log, cfg)
        is_test = np.concatenate([plan.is_test(batch) for batch in log.scan()])
        n_test = int(is_test.sum())
        if cfg.kind == "random" and not 0 < n_test < len(clicks):
            raise DataError(
                f"random split of {len(clicks)} clicks with split.test_fraction="
                f"{cfg.test_fraction:g} leaves {n_test} test clicks; a part would be empty"
            )
        train, test = clicks[~is_test].reset_index(drop=True), clicks[is_test].reset_index(drop=True)
    for name, part in (("train", train), ("test", test)):
        if part.empty:
            raise DataError(f"the {name} part of the {cfg.kind!r} split is empty")
    return train, test


def split_validation(train: pd.DataFrame, cfg: SplitConfig) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Split the training part of ``split_clicks`` again, as ``cfg`` split the log.

    The nested split of ``split.evaluate_on: validation``: ``temporal`` holds
    out the latest ``test_fraction`` of the training clicks (cut at their own
    quantile, so every validation click is later than every inner training
    click and no later than the outer cut), ``leave_last_k`` each user's last
    ``k`` training clicks, ``random`` a ``test_fraction`` of the training rows
    (hash keyed by ``nested_seed(seed)``). The test part plays no role.

    Args:
        train: The training part of ``split_clicks(clicks, cfg)``.
        cfg: The same split; its ``kind`` must not be ``none`` (a given test
            log has no split to repeat).

    Returns:
        ``(inner train, validation)``: a partition of ``train``'s rows, each in
        ``train``'s order with a fresh index, neither empty.

    Raises:
        ValueError: ``cfg.kind`` is ``none``.
        DataError: The nested split would leave a part empty (the message
            says it is the validation split).
    """
    if cfg.kind == "none":
        raise ValueError(
            "split.evaluate_on: validation cannot split again a split.kind: none log; "
            "data.test_clicks is already the evaluation part"
        )
    if cfg.kind == "random":
        cfg = cfg.model_copy(update={"seed": nested_seed(cfg.seed)})
    try:
        return split_clicks(train, cfg)
    except DataError as error:
        raise DataError(
            f"split.evaluate_on: validation splits the training part ({len(train)} clicks) again, "
            f"and there: {error}"
        ) from None
