"""Features: statistics and raw tower inputs, computed from the *training* part of the log only.

- ``statistics``: id vocabularies and item popularity (log-Q) from training clicks;
- ``tables``: raw tower inputs per training example, catalogue item and query
  (user/item features joined on, click histories without leakage);
- ``tower_statistics``: per-feature vocabularies and normalisation statistics the
  feature towers bake in;
- ``joins``: the same tower inputs joined onto streamed click batches, and their
  statistics from per-id counts (``data.out_of_core``).

Plain numpy/pandas; importing it does not import TensorFlow.
"""

from retrieval.features.joins import ExampleJoin
from retrieval.features.statistics import FeatureStatistics, ItemPopularity, Vocabulary
from retrieval.features.tables import (
    PAD,
    InputSpec,
    TowerTables,
    catalogue_inputs,
    feature_arrays,
    feature_input,
    history_before,
    latest_history,
    query_inputs,
    reference_time,
    tower_frame,
    tower_inputs,
    training_examples,
)
from retrieval.features.tower_statistics import (
    NumericStatistics,
    TimestampStatistics,
    TowerStatistics,
    age_days,
    category_values,
    fit_statistic,
    numeric_values,
)

__all__ = [
    "PAD",
    "ExampleJoin",
    "FeatureStatistics",
    "InputSpec",
    "ItemPopularity",
    "NumericStatistics",
    "TimestampStatistics",
    "TowerStatistics",
    "TowerTables",
    "Vocabulary",
    "age_days",
    "catalogue_inputs",
    "category_values",
    "feature_arrays",
    "feature_input",
    "fit_statistic",
    "history_before",
    "latest_history",
    "numeric_values",
    "query_inputs",
    "reference_time",
    "tower_frame",
    "tower_inputs",
    "training_examples",
]
