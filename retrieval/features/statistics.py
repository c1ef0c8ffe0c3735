"""Feature statistics computed from the *training* part of the log only.

Vocabularies and popularity counts must never see test clicks (that would
leak the future into the model and into the log-Q correction), so everything
here is built from the training frame that ``retrieval.data.split_clicks``
returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from retrieval.data import ITEM, USER, WEIGHT


@dataclass(frozen=True)
class Vocabulary:
    """Sorted unique string ids seen in training.

    Towers map an id to ``position + 1``; index 0 is the single out-of-vocabulary
    bucket shared by every id never seen in training.
    """

    ids: tuple[str, ...]

    @classmethod
    def from_series(cls, values: pd.Series, min_count: int = 1) -> Vocabulary:
        """Sorted unique values of ``values`` seen at least ``min_count`` times."""
        values = values.astype(str)
        if min_count <= 1:
            return cls(tuple(sorted(pd.unique(values))))
        counts = values.value_counts()
        return cls(tuple(sorted(counts.index[counts.to_numpy() >= min_count])))

    def __len__(self) -> int:
        return len(self.ids)

    def lookup(self, values) -> np.ndarray:
        """Map ids to tower indices (0 = out of vocabulary). Shape [n] int64."""
        positions = pd.Index(self.ids).get_indexer(pd.Index(np.asarray(values, dtype=object)))
        return (positions + 1).astype(np.int64)  # -1 (unknown) + 1 == 0, the OOV slot


@dataclass(frozen=True)
class ItemPopularity:
    """Training click counts per vocabulary item, aligned with tower indices.

    ``counts[0]`` is the OOV slot and is always 0.
    """

    vocabulary: Vocabulary
    counts: np.ndarray  # [len(vocabulary) + 1] float64

    @classmethod
    def from_clicks(cls, train: pd.DataFrame, vocabulary: Vocabulary) -> ItemPopularity:
        """Count training clicks per item. Weights are ignored: Q is how often an
        item *appears* as a positive, which is what in-batch sampling draws."""
        counts = np.bincount(vocabulary.lookup(train[ITEM]), minlength=len(vocabulary) + 1)
        counts = counts.astype(np.float64)
        counts[0] = 0.0
        return cls(vocabulary, counts)

    @property
    def probability(self) -> np.ndarray:
        """Q(item) = count / total clicks. Shape [len(vocabulary) + 1]."""
        return self.counts / self.counts.sum()

    def ranked_item_ids(self, limit: int | None = None) -> list[str]:
        """Vocabulary item ids, most clicked first (ties broken by id)."""
        order = np.lexsort((np.arange(len(self.counts) - 1), -self.counts[1:]))
        ids = [self.vocabulary.ids[i] for i in order]
        return ids if limit is None else ids[:limit]


@dataclass(frozen=True)
class FeatureStatistics:
    """Everything the towers and the loss need to know about the training data."""

    users: Vocabulary
    items: Vocabulary
    item_popularity: ItemPopularity
    has_weights: bool

    @classmethod
    def from_training_clicks(cls, train: pd.DataFrame) -> FeatureStatistics:
        if train.empty:
            raise ValueError("cannot build feature statistics from an empty training log")
        users = Vocabulary.from_series(train[USER])
        items = Vocabulary.from_series(train[ITEM])
        weights = train[WEIGHT] if WEIGHT in train else None
        has_weights = weights is not None and not bool(np.all(weights.to_numpy() == 1.0))
        return cls(users, items, ItemPopularity.from_clicks(train, items), has_weights)

    @classmethod
    def from_counts(
        cls, user_ids, item_ids, item_counts, has_weights: bool
    ) -> FeatureStatistics:
        """The statistics of ``from_training_clicks`` from per-id counts, without a click frame.

        For logs streamed out of core (``retrieval.data.streaming.scan_counts``).

        Args:
          user_ids: [num_users] distinct training user ids, any order.
          item_ids: [num_items] distinct training item ids, any order.
          item_counts: [num_items] training clicks of each item (repeats included).
          has_weights: some training click has a weight other than 1.
        """
        item_ids = np.asarray(item_ids, dtype=object).astype(str).astype(object)
        item_counts = np.asarray(item_counts)
        if len(item_ids) == 0 or len(user_ids) == 0:
            raise ValueError("cannot build feature statistics from an empty training log")
        if item_counts.shape != item_ids.shape:
            raise ValueError(f"item_counts has shape {item_counts.shape}, item_ids {item_ids.shape}")
        if len(set(item_ids)) != len(item_ids):
            raise ValueError("item_ids must be distinct")
        order = sorted(range(len(item_ids)), key=item_ids.__getitem__)
        items = Vocabulary(tuple(item_ids[order]))
        counts = np.zeros(len(items) + 1, dtype=np.float64)
        counts[1:] = item_counts[order]
        users = Vocabulary(tuple(sorted(str(u) for u in user_ids)))
        return cls(users, items, ItemPopularity(items, counts), bool(has_weights))
