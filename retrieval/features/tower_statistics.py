"""Statistics the feature towers' preprocessing is built from, fitted on training examples only.

One statistic per feature: a ``Vocabulary`` for id/categorical/multi-valued
features (None when hashed), ``NumericStatistics`` (mean and variance) for
numbers, ``TimestampStatistics`` for times. They are plain numpy/pandas so a
test can recompute them independently; the towers bake them in as constants,
so the exported SavedModels preprocess raw values exactly as training did.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from retrieval.config import FeatureConfig, TowersConfig
from retrieval.data import ITEM
from retrieval.features.statistics import Vocabulary
from retrieval.features.tables import PAD

SECONDS_PER_DAY = 86_400.0
DAYS_PER_YEAR = 365.2425
UNIT_SECONDS = {"seconds": 1.0, "days": SECONDS_PER_DAY}


@dataclass(frozen=True)
class NumericStatistics:
    """Mean and population variance (ddof=0) of the non-missing values.

    ``std`` is 1 when there is no spread (or no value), so normalising never divides by zero.
    """

    mean: float
    variance: float
    count: int

    @classmethod
    def from_values(cls, values, weights=None) -> NumericStatistics:
        """From values, each standing for ``weights`` examples (None = one each; streamed per-id rows
        stand for their training clicks)."""
        values = np.asarray(values, dtype=np.float64)
        present = ~np.isnan(values)
        values = values[present]
        if weights is None:
            if values.size == 0:
                return cls(0.0, 1.0, 0)
            return cls(float(values.mean()), float(values.var()), int(values.size))
        weights = np.asarray(weights, dtype=np.float64)[present]
        total = float(weights.sum())
        if total <= 0:
            return cls(0.0, 1.0, 0)
        mean = float(np.sum(weights * values) / total)
        return cls(mean, float(np.sum(weights * (values - mean) ** 2) / total), int(round(total)))

    @property
    def std(self) -> float:
        return float(np.sqrt(self.variance)) if self.variance > 0 else 1.0


@dataclass(frozen=True)
class TimestampStatistics:
    """A time feature is encoded as its age at ``reference`` (end of training), in days.

    Attributes:
      reference: seconds since the epoch.
      age: statistics of the age in days.
      log_age: statistics of log1p(max(age, 0)).
    """

    reference: float
    age: NumericStatistics
    log_age: NumericStatistics


Statistic = Vocabulary | NumericStatistics | TimestampStatistics | None


def numeric_values(values, log: bool) -> np.ndarray:
    """What a numeric feature normalises: x, or log1p(max(x, 0)). NaN stays NaN."""
    values = np.asarray(values, dtype=np.float64)
    return np.log1p(np.maximum(values, 0.0)) if log else values


def age_days(values, unit: str, reference: float) -> np.ndarray:
    """Age in days at ``reference`` (seconds) of times given in ``unit``; a year means its 1 January."""
    values = np.asarray(values, dtype=np.float64)
    if unit == "years":
        seconds = (values - 1970.0) * (DAYS_PER_YEAR * SECONDS_PER_DAY)
    else:
        seconds = values * UNIT_SECONDS[unit]
    return (reference - seconds) / SECONDS_PER_DAY


def category_values(feature: FeatureConfig, column: pd.Series) -> pd.Series:
    """The strings a categorical feature looks up, one per value (padding dropped), from a tables column.

    The index is the position of each value's row in ``column`` (repeated for multi-valued rows).
    """
    if feature.kind == "multi_categorical":
        if feature.separator is None:
            lists = [list(row) for row in column]
        else:
            lists = [text.split(feature.separator)[: feature.max_values] for text in column]
        rows = np.repeat(np.arange(len(lists)), [len(values) for values in lists])
        values = pd.Series([value for values in lists for value in values], index=rows, dtype=object)
    else:
        values = pd.Series(column.astype(str).to_numpy(dtype=object), index=np.arange(len(column)))
        prefix = getattr(feature, "prefix", None)  # only some kinds have one
        if prefix:
            values = values.str.slice(0, prefix)
    return values[values != PAD]


def fit_statistic(
    feature: FeatureConfig, column: pd.Series, reference: float | None, weights: np.ndarray | None = None
) -> Statistic:
    """The statistic of one feature from its training-examples column (see ``training_examples``).

    ``weights`` ([len(column)] positive integers): row i stands for ``weights[i]`` training
    examples, as if repeated that often (the streamed job fits one row per training user or item,
    weighted by its training clicks); None = one example a row.
    """
    if feature.kind in ("id", "categorical", "multi_categorical"):
        if getattr(feature, "hash_buckets", None) is not None:
            return None
        values = category_values(feature, column)
        min_count = getattr(feature, "min_count", 1)
        if weights is None:
            return Vocabulary.from_series(values, min_count)
        counts = pd.Series(np.asarray(weights)[values.index.to_numpy()], index=values.to_numpy()).groupby(level=0).sum()
        return Vocabulary(tuple(sorted(counts.index[counts.to_numpy() >= max(min_count, 1)])))
    if feature.kind == "numeric":
        return NumericStatistics.from_values(numeric_values(column.to_numpy(), feature.log), weights)
    if feature.kind == "timestamp":
        if reference is None:
            raise ValueError(f"timestamp feature {feature.name!r} needs a log with timestamps (the end of training)")
        age = age_days(column.to_numpy(), feature.unit, reference)
        return TimestampStatistics(
            reference,
            NumericStatistics.from_values(age, weights),
            NumericStatistics.from_values(numeric_values(age, True), weights),
        )
    if feature.kind == "text":
        return None
    raise ValueError(f"unknown feature kind {feature.kind!r}")


@dataclass(frozen=True)
class TowerStatistics:
    """Statistics of every feature of both towers.

    Attributes:
      features: feature name -> statistic (None for hashed features and text).
      items: training item ids, the vocabulary of click histories.
      reference_time: end of training in seconds, or None without timestamps.
    """

    features: Mapping[str, Statistic] = field(default_factory=dict)
    items: Vocabulary = Vocabulary(())
    reference_time: float | None = None

    @classmethod
    def fit(cls, towers: TowersConfig, examples: pd.DataFrame, reference_time: float | None) -> TowerStatistics:
        """Fit on the training examples (``retrieval.features.training_examples``)."""
        if examples.empty:
            raise ValueError("cannot fit feature statistics on an empty training set")
        features = {
            feature.name: fit_statistic(feature, examples[feature.name], reference_time)
            for feature in towers.query.features + towers.doc.features
        }
        return cls(features, Vocabulary.from_series(examples[ITEM]), reference_time)

    @classmethod
    def fit_weighted(
        cls,
        towers: TowersConfig,
        columns: Mapping[str, tuple[pd.Series, np.ndarray | None]],
        items: Vocabulary,
        reference_time: float | None,
    ) -> TowerStatistics:
        """``fit`` from weighted rows instead of one row per training example (the streamed job).

        Args:
          columns: feature name -> (its raw values, the training examples each value stands for,
            or None for one each): e.g. a user feature's value per training user weighted by the
            user's training clicks, which is what ``fit`` sees after the join onto every click.
          items: training item ids (the history vocabulary).
          reference_time: end of training in seconds, or None.
        """
        features: dict[str, Statistic] = {}
        for feature in towers.query.features + towers.doc.features:
            column, weights = columns[feature.name]
            features[feature.name] = fit_statistic(feature, column, reference_time, weights)
        return cls(features, items, reference_time)

    def __getitem__(self, name: str) -> Statistic:
        return self.features[name]
