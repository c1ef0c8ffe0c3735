"""Streamed splits: which click of a shard is train, test or neither, decided one record batch at a time.

``plan_split`` (pass 1 over the shards) makes the ``SplitPlan`` of ``split.kind``
(temporal: the exact cut the in-memory split takes; random: the seeded hash of
``splits.hashed_test_mask``; none: a given test file); ``plan_validation``
carves a validation part from a plan's training side (``CarvedPlan``), for early
stopping and for ``split.evaluate_on: validation``. ``retrieval.data.streaming``
makes its passes with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from retrieval.config import SplitConfig
from retrieval.data.schema import DataError
from retrieval.data.shards import ClickBatch, ClickShards, as_strings
from retrieval.data.splits import hashed_test_mask, timestamp_cut, validation_carve


@dataclass(frozen=True)
class SplitPlan:
    """Which clicks are test, decidable from a single batch.

    Attributes:
      kind: ``"temporal"``, ``"random"`` or ``"none"`` (no click of the shards is
        test: the test log is given as a file, ``StreamCounts.with_test``).
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
        if self.kind == "none":
            return np.zeros(len(batch), bool)
        if self.kind == "temporal":
            if batch.timestamps is None or self.cut is None:
                raise DataError("a temporal split needs the batch's timestamps and the plan's cut")
            return batch.timestamps > self.cut
        return random_test_mask(batch, self.test_fraction, self.seed)


def random_test_mask(batch: ClickBatch, fraction: float, seed: int) -> np.ndarray:
    """Test clicks of a random split: ``splits.hashed_test_mask`` of the batch's clicks, so a
    click gets the side it gets in memory."""
    return hashed_test_mask(as_strings(batch.users), as_strings(batch.items), batch.timestamps, fraction, seed)


def plan_split(shards: ClickShards, split: SplitConfig) -> SplitPlan:
    """Pass 1: row count, time range and (temporal) the exact cut of ``splits.temporal_cut``.

    Raises:
      DataError: an unsupported split kind, no timestamps for a temporal split,
        an empty log, or a cut that leaves the test part empty.
    """
    if split.kind not in ("temporal", "random", "none"):
        raise DataError(
            f"split.kind {split.kind!r} is not yet supported out of core (temporal, random and none are): "
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
    if split.kind == "none":  # every click of the shards trains; the test log is a file of its own
        return SplitPlan("none", rows, time_range=time_range)
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

    outer: SplitPlan | CarvedPlan
    inner: SplitPlan

    @property
    def kind(self) -> str:
        return self.inner.kind

    @property
    def rows(self) -> int:
        return self.outer.rows

    @property
    def time_range(self) -> tuple[int, int] | None:
        return self.outer.time_range

    @property
    def cut(self) -> int | None:
        """The inner (validation) cut of a temporal carve."""
        return self.inner.cut

    def drops(self, batch: ClickBatch) -> np.ndarray:
        return self.outer.is_test(batch) | self.outer.drops(batch)

    def is_test(self, batch: ClickBatch) -> np.ndarray:
        return ~self.drops(batch) & self.inner.is_test(batch)


def plan_validation(shards: ClickShards, plan: SplitPlan | CarvedPlan, fraction: float,
                    split: SplitConfig | None) -> CarvedPlan:
    """The validation part carved from ``plan``'s training side as ``training.validation_split``
    carves it in memory (``splits.validation_carve``): the latest ``fraction`` of the training
    clicks (the exact cut of ``splits.timestamp_cut``, one more pass) when ``split`` is temporal or
    none and the shards have timestamps, else a random ``fraction`` by the hash of
    ``random_test_mask`` keyed by ``splits.nested_seed(split.seed)`` (independent of the test split's).

    Raises:
      DataError: the cut leaves the validation part empty.
    """
    carve = validation_carve(split, fraction, has_time=shards.columns.timestamp is not None)
    if carve.kind == "random":
        inner = SplitPlan("random", plan.rows, test_fraction=fraction, seed=carve.seed, time_range=plan.time_range)
        return CarvedPlan(plan, inner)
    if carve.kind != "temporal":
        raise ValueError(f"a streamed validation part is carved temporally or at random, not by {carve.kind}")
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


# A split of the log, or of its training side again (early stopping).
Plan = SplitPlan | CarvedPlan
