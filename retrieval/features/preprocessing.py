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
    def from_values(cls, values) -> NumericStatistics:
        values = np.asarray(values, dtype=np.float64)
        values = values[~np.isnan(values)]
        if values.size == 0:
            return cls(0.0, 1.0, 0)
        return cls(float(values.mean()), float(values.var()), int(values.size))

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
    """The strings a categorical feature looks up, one per value (padding dropped), from a tables column."""
    if feature.kind == "multi_categorical":
        if feature.separator is None:
            flat = [value for row in column for value in row]
        else:
            flat = [value for text in column for value in text.split(feature.separator)[: feature.max_values]]
        values = pd.Series(flat, dtype=object)
    else:
        values = column.astype(str)
        prefix = getattr(feature, "prefix", None)  # only some kinds have one
        if prefix:
            values = values.str.slice(0, prefix)
    return values[values != PAD]


def fit_statistic(feature: FeatureConfig, column: pd.Series, reference: float | None) -> Statistic:
    """The statistic of one feature from its training-examples column (see ``training_examples``)."""
    if feature.kind in ("id", "categorical", "multi_categorical"):
        if getattr(feature, "hash_buckets", None) is not None:
            return None
        return Vocabulary.from_series(category_values(feature, column), getattr(feature, "min_count", 1))
    if feature.kind == "numeric":
        return NumericStatistics.from_values(numeric_values(column.to_numpy(), feature.log))
    if feature.kind == "timestamp":
        if reference is None:
            raise ValueError(f"timestamp feature {feature.name!r} needs a log with timestamps (the end of training)")
        age = age_days(column.to_numpy(), feature.unit, reference)
        return TimestampStatistics(
            reference, NumericStatistics.from_values(age), NumericStatistics.from_values(numeric_values(age, True))
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

    def __getitem__(self, name: str) -> Statistic:
        return self.features[name]
