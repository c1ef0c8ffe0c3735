"""Config loading: defaults, YAML, overrides, and errors that name the bad key."""

import pytest

from retrieval.config import Config, ConfigError, load_config


def test_defaults_round_trip_through_dict():
    config = Config()
    assert Config.from_dict(config.to_dict()) == config


def test_every_shipped_config_loads():
    for path in ("configs/default.yaml", "configs/ml100k.yaml"):
        config = load_config(path)
        assert config.train.epochs > 0


def test_overrides_are_parsed_as_yaml_and_nested():
    config = load_config("configs/default.yaml", ["train.epochs=3", "evaluation.ks=[5, 10]", "run.name=demo"])
    assert config.train.epochs == 3
    assert config.evaluation.ks == (5, 10)
    assert config.run.name == "demo"


def test_unknown_key_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  epoch: 3\n")
    with pytest.raises(ConfigError, match=r"train\.epoch: unknown key"):
        load_config(path)


def test_wrong_type_names_key_and_value():
    with pytest.raises(ConfigError, match=r"train\.batch_size: .*'many'"):
        load_config(None, ["train.batch_size=many"])


def test_bad_choice_is_named():
    with pytest.raises(ConfigError, match=r"split\.kind"):
        load_config(None, ["split.kind=sideways"])


def test_split_none_requires_a_test_file():
    with pytest.raises(ConfigError, match="data.test_clicks"):
        load_config(None, ["split.kind=none"])


def test_files_source_requires_clicks():
    with pytest.raises(ConfigError, match="data.clicks is required"):
        load_config(None, ["data.source=files"])


def test_malformed_override():
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["train.epochs"])


def test_missing_config_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("configs/nope.yaml")


def test_non_positive_ks_rejected():
    with pytest.raises(ConfigError, match="evaluation.ks"):
        load_config(None, ["evaluation.ks=[0, 10]"])
