"""Config of the feature towers: defaults, round trips, and errors that name the bad key."""

from pathlib import Path

import pytest

from retrieval.config import Config, ConfigError, TowersConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
FEATURE_CONFIGS = [
    "configs/ml100k_features.yaml",
    "configs/ml100k_features_history.yaml",
    "configs/ml100k_features_history_dropout.yaml",
    "configs/synthetic_features.yaml",
]


def _towers(query_features, doc_features=({"name": "item_id", "kind": "id"},), **query):
    return {"towers": {"query": {"features": list(query_features), **query}, "doc": {"features": list(doc_features)}}}


def test_default_towers_are_the_id_only_model():
    towers = Config().towers
    assert towers.is_id_only
    assert [(f.name, f.kind) for f in towers.query.features] == [("user_id", "id")]
    assert [(f.name, f.kind) for f in towers.doc.features] == [("item_id", "id")]
    assert load_config(ROOT / "configs/ml100k.yaml").towers.is_id_only


@pytest.mark.parametrize("path", FEATURE_CONFIGS)
def test_feature_configs_load_and_round_trip(path):
    config = load_config(ROOT / path)
    assert not config.towers.is_id_only
    assert Config.from_dict(config.to_dict()) == config
    kinds = {f.kind for f in config.towers.query.features + config.towers.doc.features}
    assert {"id", "categorical", "numeric", "text"} <= kinds


def test_every_kind_parses_with_its_own_options():
    towers = Config.from_dict(
        _towers(
            [
                {"name": "user_id", "kind": "id", "embedding_dim": 8},
                {"name": "zip", "kind": "categorical", "prefix": 3, "oov_buckets": 2, "min_count": 2},
                {"name": "country", "kind": "categorical", "hash_buckets": 16},
                {"name": "age", "kind": "numeric", "log": True},
                {"name": "signup", "kind": "timestamp", "unit": "days"},
            ],
            [
                {"name": "item_id", "kind": "id"},
                {"name": "genres", "kind": "multi_categorical", "max_values": 4},
                {"name": "tags", "kind": "multi_categorical", "separator": "|", "hash_buckets": 32},
                {"name": "title", "kind": "text", "text": {"trigrams": True, "words": False, "buckets": 100}},
            ],
            history={"length": 5, "pooling": "attention"},
        )
    ).towers
    assert towers.query.input_names == ["user_id", "zip", "country", "age", "signup", "history"]
    assert towers.item_id_feature.name == "item_id"
    assert towers.doc.features[3].text.words is False


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            _towers([{"name": "age", "kind": "numeric", "text": {}}]),
            r"towers\.query\.features\.0\.numeric\.text: unknown key",
        ),
        (_towers([{"name": "age", "kind": "number"}]), r"towers\.query\.features\.0: .*'number'"),
        (
            _towers([{"name": "age", "kind": "categorical", "hash_buckets": 0}]),
            r"features\.0\.categorical\.hash_buckets",
        ),
        (_towers([{"name": "bad name", "kind": "categorical"}]), r"features\.0\.categorical\.name"),
        (_towers([{"name": "t", "kind": "text", "text": {"trigrams": False, "words": False}}]), "trigrams or words"),
        (_towers([{"name": "x", "kind": "id"}, {"name": "x", "kind": "numeric"}]), r"repeated: \['x'\]"),
        (_towers([{"name": "item_id", "kind": "id"}], [{"name": "title", "kind": "text"}]), "reserved"),
        (_towers([], history={"length": 0}), r"towers\.query\.history\.length"),
        (_towers([], history={"length": 3}, mlp={"widths": [0]}), r"mlp\.widths must be positive"),
        (_towers([], [{"name": "title", "kind": "text"}], history={"length": 3}), "share_item_embedding needs"),
        ({"towers": {"query": {"features": []}}}, "at least one feature or a history"),
        ({"towers": {"doc": {"features": [{"name": "item_id", "kind": "id"}], "history": {}}}}, "query-tower feature"),
    ],
)
def test_bad_tower_configs_name_the_key(raw, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_dict(raw)


def test_history_without_sharing_needs_no_doc_id():
    towers = TowersConfig.model_validate(
        {
            "query": {"features": [], "history": {"length": 3, "share_item_embedding": False}},
            "doc": {"features": [{"name": "title", "kind": "text"}]},
        }
    )
    assert towers.item_id_feature is None
