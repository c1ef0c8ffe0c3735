"""Config loading: defaults, YAML, overrides, and errors that name the bad key."""

from pathlib import Path

import pytest
import yaml

from retrieval.config import Config, ConfigError, load_config, save_config


def test_defaults_round_trip_through_dict():
    config = Config()
    assert Config.from_dict(config.to_dict()) == config


CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# configs/*.yaml that are not a job config (tune_space.yaml is the search space of `make tune`).
NOT_JOB_CONFIGS = {"tune_space.yaml"}


def _holds(written, loaded, where="") -> list[str]:
    """Where the loaded config differs from what the YAML file wrote (defaults fill the rest)."""
    if isinstance(written, dict):
        if not isinstance(loaded, dict):
            return [where]
        return [bad for key, value in written.items() for bad in _holds(value, loaded.get(key), f"{where}.{key}")]
    if isinstance(written, list):
        loaded = list(loaded) if isinstance(loaded, (list, tuple)) else None
        if loaded is None or len(loaded) != len(written):
            return [where]
        return [bad for i, (w, v) in enumerate(zip(written, loaded)) for bad in _holds(w, v, f"{where}[{i}]")]
    return [] if written == loaded else [f"{where}: wrote {written!r}, loaded {loaded!r}"]


@pytest.mark.parametrize(
    "path", sorted(p for p in CONFIGS.glob("*.yaml") if p.name not in NOT_JOB_CONFIGS), ids=lambda p: p.name
)
def test_every_shipped_config_loads_what_it_says_and_round_trips(path):
    config = load_config(path)
    assert not _holds(yaml.safe_load(path.read_text()), config.to_dict())
    assert Config.from_dict(config.to_dict()) == config


def test_holds_sees_a_changed_value():
    assert _holds({"train": {"epochs": 3}}, {"train": {"epochs": 4}}) == [".train.epochs: wrote 3, loaded 4"]
    assert _holds({"f": [{"name": "a"}]}, {"f": ({"name": "a", "kind": "id"},)}) == []


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


def test_a_click_file_without_a_source_reads_as_files(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("data:\n  clicks:\n    path: mydata/clicks.csv\n")
    config = load_config(path)
    assert config.data.source == "files"
    assert config.data.clicks.path == "mydata/clicks.csv"
    # What the run writes to its config.yaml says files, and reads back the same.
    saved = tmp_path / "config.yaml"
    save_config(config, saved)
    assert yaml.safe_load(saved.read_text())["data"]["source"] == "files"
    assert load_config(saved) == config
    assert load_config(None, ["data.clicks.path=a.csv"]).data.source == "files"
    assert load_config(path).data.source != Config().data.source


@pytest.mark.parametrize("source", ["synthetic", "movielens-100k"])
def test_a_click_file_beside_another_source_is_refused_naming_both(tmp_path, source):
    path = tmp_path / "mine.yaml"
    path.write_text(f"data:\n  source: {source}\n  clicks:\n    path: mydata/clicks.csv\n")
    with pytest.raises(ConfigError, match=rf"data.source is '{source}' but data.clicks names a file"):
        load_config(path)
    with pytest.raises(ConfigError, match="data.source.*data.clicks"):
        load_config("configs/default.yaml", ["data.clicks.path=mydata/clicks.csv"])
