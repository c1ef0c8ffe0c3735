"""The configuration: one frozen, typed section per pipeline step, validated when loaded, and the reference
generated from them.

The modules, in the order a config is built:

- ``base``: the strict ``_Section`` every section derives from, ``ConfigError``, the seed range;
- ``data`` (``data``, ``split``), ``towers``, ``model`` (with ``model.loss`` and its samplers), ``train``
  (with ``train.parameter_server``), ``index`` (with the FAISS check), ``evaluation`` (with the baselines),
  ``export``: one module per section;
- ``run``: ``Config``, the whole job, its cross-section checks, and the message that names each bad key;
- ``warm_start``: the checks of ``train.warm_start`` against its parent run;
- ``loading``: YAML reading, ``--set`` overrides, ``load_config``, ``save_config``.

``reference`` writes docs/configuration.md from those models (``python -m retrieval.config.reference --write
docs/configuration.md``); it is not imported here, so loading a config does not load it.

Every public name of those modules is re-exported here (``from retrieval.config import Config, load_config``);
tests/project/test_layering.py checks that none is missing.
"""

from retrieval.config.base import (
    SEED_MAX,
    ConfigError,
    Seed,
)
from retrieval.config.data import (
    ColumnsConfig,
    DataConfig,
    SplitConfig,
    StreamConfig,
    SyntheticConfig,
    TableConfig,
    TableFormat,
)
from retrieval.config.evaluation import (
    MAX_EVALUATION_K,
    ALSConfig,
    BaselinesConfig,
    EvaluationConfig,
)
from retrieval.config.export import (
    ExportConfig,
)
from retrieval.config.index import (
    EXACT_MAX_FLOATS,
    IndexConfig,
    faiss_index_problem,
)
from retrieval.config.loading import (
    apply_overrides,
    load_config,
    parse_override,
    read_yaml,
    save_config,
    with_absolute_data_paths,
)
from retrieval.config.model import (
    CORPUS_NEGATIVES,
    MIN_TEMPERATURE,
    KernelSamplerConfig,
    LossConfig,
    ModelConfig,
    StreamingFrequencyConfig,
)
from retrieval.config.run import (
    Config,
    RunConfig,
)
from retrieval.config.towers import (
    CategoricalFeature,
    FeatureConfig,
    HistoryConfig,
    IdFeature,
    MLPConfig,
    MultiCategoricalFeature,
    NumericFeature,
    TextConfig,
    TextFeature,
    TimestampFeature,
    TowerConfig,
    TowersConfig,
    TransformerConfig,
)
from retrieval.config.train import (
    STEPS_PER_CALL_ON_ONE_DEVICE,
    ParameterServerConfig,
    TrainConfig,
)
from retrieval.config.warm_start import (
    WARM_START_SHAPE_KEYS,
    warm_start_conflicts,
    warm_start_parent,
)

__all__ = [
    "ALSConfig",
    "BaselinesConfig",
    "CORPUS_NEGATIVES",
    "CategoricalFeature",
    "ColumnsConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EXACT_MAX_FLOATS",
    "EvaluationConfig",
    "ExportConfig",
    "FeatureConfig",
    "HistoryConfig",
    "IdFeature",
    "IndexConfig",
    "KernelSamplerConfig",
    "LossConfig",
    "MAX_EVALUATION_K",
    "MIN_TEMPERATURE",
    "MLPConfig",
    "ModelConfig",
    "MultiCategoricalFeature",
    "NumericFeature",
    "ParameterServerConfig",
    "RunConfig",
    "SEED_MAX",
    "STEPS_PER_CALL_ON_ONE_DEVICE",
    "Seed",
    "SplitConfig",
    "StreamConfig",
    "StreamingFrequencyConfig",
    "SyntheticConfig",
    "TableConfig",
    "TableFormat",
    "TextConfig",
    "TextFeature",
    "TimestampFeature",
    "TowerConfig",
    "TowersConfig",
    "TrainConfig",
    "TransformerConfig",
    "WARM_START_SHAPE_KEYS",
    "apply_overrides",
    "faiss_index_problem",
    "load_config",
    "parse_override",
    "read_yaml",
    "save_config",
    "warm_start_conflicts",
    "warm_start_parent",
    "with_absolute_data_paths",
]
