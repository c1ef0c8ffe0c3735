"""Split a canonical click log into training and test parts.

Both parts keep the log's row order and get a fresh index. Which split fits
which question:

- ``temporal``: one global cut in time, as in production (train on the past,
  serve the future); test users without earlier clicks are cold users.
- ``leave_last_k``: each user's last ``k`` clicks; every test user has history.
- ``random``: a seeded random share of clicks (by a hash of each click, so
  in-memory and streamed logs hold out the same rows); leaks the future into
  training, use it only for logs without time.
- ``none``: the test log is given separately.

``split.evaluate_on: validation`` (hyper-parameter tuning) splits the training
part once more with the same split (``split_validation``): the model trains on
the inner training part and is scored on the validation part, and the test part
is never read, so choosing settings does not select on the test set.

This module holds the rules (cuts, hashes, last-k masks, seeds), shared by every
split; ``retrieval.data.stream_splits`` applies them, to a log streamed from
shards or held in memory (``split_clicks`` on a frame is a plan of its rows).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from retrieval.config import SEED_MAX, SplitConfig
from retrieval.data.schema import ITEM, TIME, DataError


def hold_out_items(
    train: pd.DataFrame, test: pd.DataFrame, fraction: float, seed: int
) -> tuple[pd.DataFrame, tuple[str, ...]]:
    """Make a random share of the logged items cold: drop all their training clicks.

    Cold-start evaluation: the held-out items keep their test clicks, so a model
    can only retrieve them from their features (they stay in the catalogue).

    Args:
        train: Canonical training clicks.
        test: Canonical test clicks.
        fraction: Share of the items logged in ``train`` or ``test`` to hold out, in [0, 1).
        seed: Seed of the draw.

    Returns:
        ``(train without the held-out items, held-out item ids sorted)``.

    Raises:
        DataError: Holding out would leave no training click.
    """
    held = draw_held_out_items(pd.unique(pd.concat([train[ITEM], test[ITEM]]).astype(str)), fraction, seed)
    kept = train[~train[ITEM].astype(str).isin(held)].reset_index(drop=True)
    if kept.empty:
        raise DataError(f"split.hold_out_items={fraction} holds out every item with training clicks")
    return kept, tuple(str(item) for item in held)


def draw_held_out_items(items: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """The items ``hold_out_items`` makes cold: ``round(fraction * len(items))`` of them, drawn with
    ``seed`` from the sorted ids, so any source listing the same items draws the same ones.

    Args:
        items: [n] object array of the distinct logged item ids (str), in any order.
        fraction: Share to hold out, in [0, 1).
        seed: Seed of the draw.

    Returns:
        The held-out ids, sorted.
    """
    if not 0 <= fraction < 1:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}")
    items = np.sort(np.asarray(items, dtype=object))
    count = int(round(fraction * len(items)))
    return np.sort(np.random.default_rng(seed).choice(items, count, replace=False)) if count else items[:0]


def temporal_cut(clicks: pd.DataFrame, test_fraction: float) -> int:
    """The timestamp at quantile ``1 - test_fraction``: clicks after it are test.

    The cut is an actual timestamp of the log (numpy's ``"lower"`` quantile),
    so at least one click is always in train.
    """
    if TIME not in clicks:
        raise DataError(
            "split.kind 'temporal' needs timestamps but the log has none: set "
            "data.columns.timestamp to the log's time column, or use split.kind: random"
        )
    return timestamp_cut(clicks[TIME].to_numpy(), test_fraction)


def nested_seed(seed: int) -> int:
    """The hash key of a random split nested in a random split keyed by ``seed``.

    With the outer key the inner split would take the clicks whose hash falls
    between the two fractions, not a random share of the outer training part.
    """
    return (seed + 1) % (SEED_MAX + 1)


def validation_carve(split: SplitConfig | None, fraction: float, has_time: bool) -> SplitConfig:
    """The split that carves a validation ``fraction`` from the training part ``split`` left.

    It cuts as ``split`` did: ``temporal`` and ``none`` (a given test log) at a
    time quantile (by a seeded hash without timestamps), ``leave_last_k`` each
    user's last ``k``, ``random`` by a hash keyed by ``nested_seed(split.seed)``
    (with ``split``'s own key it would take the clicks between the two fractions).
    In memory (``training.validation_split``) and streamed (``plan_validation``) alike.
    """
    kind = split.kind if split is not None else "temporal"
    if kind in ("temporal", "none"):
        kind = "temporal" if has_time else "random"
    seed = split.seed if split is not None else 0
    return SplitConfig(
        kind=kind,
        test_fraction=fraction,
        k=split.k if split is not None else 1,
        seed=nested_seed(seed) if kind == "random" else seed,
    )


def training_split(split: SplitConfig) -> SplitConfig:
    """The split whose training part a model trains on.

    ``split`` itself, or under ``evaluate_on: validation`` its nested copy
    (``split_validation``), so that early stopping's carve nests one level deeper
    again instead of repeating the evaluated split's hash key.
    """
    if split.evaluate_on == "validation" and split.kind == "random":
        return split.model_copy(update={"seed": nested_seed(split.seed)})
    return split


def hashed_test_mask(
    users: np.ndarray, items: np.ndarray, timestamps: np.ndarray | None, fraction: float, seed: int
) -> np.ndarray:
    """The test clicks of a random split: a seeded hash of (user, item, timestamp) below ``fraction``.

    The same click always gets the same side, wherever it is read (a frame in
    memory or any record batch of a shard); a uniform 53-bit number from the
    hash is compared with ``fraction``. Duplicate clicks (same user, item and
    time) go to the same side.

    Args:
      users, items: [n] object arrays of id strings.
      timestamps: [n] int64, or None for a log without time.
    """
    key = f"{seed:016d}"[-16:]
    mixed = pd.util.hash_array(users, hash_key=key, categorize=False)
    mixed = mixed * np.uint64(0x9E3779B97F4A7C15) ^ pd.util.hash_array(items, hash_key=key, categorize=False)
    if timestamps is not None:
        mixed = mixed * np.uint64(0x9E3779B97F4A7C15) ^ pd.util.hash_array(timestamps, hash_key=key)
    mixed = pd.util.hash_array(mixed, hash_key=key)  # final mixing of the combined bits
    return (mixed >> np.uint64(11)).astype(np.float64) / float(1 << 53) < fraction


def timestamp_cut(timestamps: np.ndarray, test_fraction: float) -> int:
    """``temporal_cut`` of an array of every click's timestamp (the out-of-core split uses it too)."""
    return int(np.quantile(timestamps, 1 - test_fraction, method="lower"))


def last_k_mask(users: np.ndarray, timestamps: np.ndarray, rows: np.ndarray, k: int) -> np.ndarray:
    """[n] bool: each user's last ``k`` clicks by timestamp, ties broken by row order, for users with
    more than ``k`` (the rule of ``leave_last_k``, in memory and streamed).

    Args:
        users: [n] non-negative int user codes.
        timestamps: [n] int64.
        rows: [n] int64, increasing in log order (row numbers, or a shard's row keys).
    """
    order = np.lexsort((rows, timestamps, users))  # by user, time, then row
    sorted_users = users[order]
    counts = np.bincount(users)
    # Position from the end inside the user's run of sorted rows.
    run_end = np.cumsum(counts)[sorted_users]
    from_end = run_end - 1 - np.arange(len(order))
    is_test = np.zeros(len(users), dtype=bool)
    is_test[order] = (from_end < k) & (counts[sorted_users] > k)
    return is_test
