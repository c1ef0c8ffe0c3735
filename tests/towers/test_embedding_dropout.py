"""model.embedding_dropout: inverted dropout on a tower's input encodings in training, nothing at inference."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
from feature_fixtures import ALL_KINDS, small_tables

import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow)
from retrieval.config import ConfigError, ModelConfig, load_config
from retrieval.features import FeatureStatistics, TowerStatistics, TowerTables
from retrieval.model import build_model
from retrieval.towers import build_towers, id_tower


def _stats(users: int = 300, items: int = 50) -> FeatureStatistics:
    rng = np.random.default_rng(0)
    clicks = pd.DataFrame({"user_id": [f"u{u}" for u in range(users)],
                           "item_id": [f"i{i}" for i in rng.integers(items, size=users)]})
    clicks["weight"] = np.float32(1.0)
    return FeatureStatistics.from_training_clicks(clicks)


def test_an_id_towers_embedding_is_dropped_and_rescaled_only_in_training():
    stats = _stats()
    tf.keras.utils.set_random_seed(0)
    tower = id_tower("user_id", stats.users, 16, normalize=False, dropout=0.25)
    users = {"user_id": tf.constant([f"u{u}" for u in range(300)])}
    table = tower(users, training=False).numpy()
    np.testing.assert_array_equal(tower(users, training=False).numpy(), table)
    trained = tower(users, training=True).numpy()
    kept = trained != 0
    # Inverted dropout: each kept value is the embedding over (1 - rate), about a quarter of them are 0.
    np.testing.assert_allclose(trained[kept], table[kept] / 0.75, rtol=1e-6)
    assert 0.22 < 1 - kept.mean() < 0.28


def test_a_feature_tower_drops_its_concatenated_encodings_before_the_mlp():
    clicks, users, items = small_tables(0)
    tables = TowerTables(ALL_KINDS, clicks, users, items)
    stats = TowerStatistics.fit(ALL_KINDS, tables.examples(), tables.reference_time)
    tf.keras.utils.set_random_seed(0)
    query, doc = build_towers(ALL_KINDS, ModelConfig(embedding_dim=8, embedding_dropout=0.5), stats)
    for tower in (query, doc):
        layer = tower.get_layer("input_dropout")
        assert layer.rate == 0.5
        assert tower.layers.index(layer) < tower.layers.index(tower.get_layer("projection"))
    plain, _ = build_towers(ALL_KINDS, ModelConfig(embedding_dim=8), stats)
    assert "input_dropout" not in [layer.name for layer in plain.layers]


def test_the_id_model_reads_the_key_and_serves_without_dropout():
    stats = _stats()
    tf.keras.utils.set_random_seed(0)
    model = build_model(ModelConfig(embedding_dim=8, embedding_dropout=0.3), stats)
    for tower in (model.query_tower, model.doc_tower):
        assert tower.get_layer("embedding_dropout").rate == pytest.approx(0.3)
    users = {"user_id": tf.constant(["u1", "u2", "u3"])}
    np.testing.assert_array_equal(model.query_tower(users, training=False).numpy(),
                                  model.query_tower(users).numpy())


@pytest.mark.parametrize("value", ["1.0", "-0.1"])
def test_a_rate_outside_0_to_1_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"model\.embedding_dropout"):
        load_config(None, [f"model.embedding_dropout={value}"])
