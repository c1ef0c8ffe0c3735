"""Config values that used to be accepted and then fail long after loading are refused at load time.

The classes (every float key, every seed key, any FAISS factory) are covered by
property tests in test_bad_input_properties.py; here the cases the issue
reported, the bounds' reasons, and the command line.
"""

import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval.config import (
    MIN_TEMPERATURE,
    SEED_MAX,
    Config,
    ConfigError,
    EvaluationConfig,
    IndexConfig,
    LossConfig,
    ModelConfig,
    RunConfig,
    SyntheticConfig,
    TrainConfig,
    load_config,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "override,key,reason",
    [
        ("train.learning_rate=.inf", "train.learning_rate", "finite number"),
        ("train.learning_rate=1.0e39", "train.learning_rate", "overflows float32"),
        ("train.learning_rate=1.0e-50", "train.learning_rate", "underflows float32"),  # would train as 0
        ("model.l2_regularization=.nan", "model.l2_regularization", "finite number"),
        ("model.temperature=1.0e-300", "model.temperature", "a number of at least 0.0001"),
        ("train.seed=4294967296", "train.seed", "less than or equal to 4294967295"),
        ("train.seed=-1", "train.seed", "greater than or equal to 0"),
        ("train.epochs=99999999999999999999", "train.epochs", "does not fit in int64"),
    ],
)
def test_values_that_fail_later_are_refused_naming_the_key(override, key, reason):
    with pytest.raises(ConfigError, match=rf"\n  {key}: .*{reason}"):
        load_config(None, [override])


def test_bounds_are_the_ones_the_consumers_have():
    np.random.seed(SEED_MAX)  # tf.keras.utils.set_random_seed seeds numpy: this is its largest seed
    with pytest.raises(ValueError):
        np.random.seed(SEED_MAX + 1)
    assert load_config(None, [f"train.seed={SEED_MAX}", f"model.temperature={MIN_TEMPERATURE}"]).train.seed == SEED_MAX
    # 1 / temperature stays far inside float32 at the bound; at 1e-300 it was 0 in float32 and logits inf.
    assert np.isfinite(np.float32(1.0) / np.float32(MIN_TEMPERATURE))
    assert np.float32(1e-300) == 0


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["index.factory=IVF64,Flatt"], r"index\.factory 'IVF64,Flatt' is not a FAISS index.*could not parse"),
        (["model.embedding_dim=64", "index.factory=PQ7"], r"index\.factory 'PQ7' .*model\.embedding_dim=64.*multiple"),
        (["index.factory=HNSW32", "index.search_params=nprobe=8"], r"index\.search_params 'nprobe=8' do not apply"),
        (["index.factory=IVF64,Flat", "index.search_params=nprobe=0"], r"nprobe must be a number >= 1, got '0'"),
        (["index.factory=IVF64,Flat", "index.search_params=nprobe"], r"index\.search_params 'nprobe'"),
    ],
)
def test_faiss_strings_are_checked_at_load_not_after_training(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_valid_faiss_strings_load_quickly_whatever_they_allocate():
    started = time.perf_counter()
    # IVF lists and 24-bit PQ codebooks are allocated when an index is made (4 GB for PQ8x24): the check shrinks them.
    for factory in ["IVF100000000,Flat", "PQ8x24", "OPQ16,IVF1024,PQ16", "HNSW32", "IVF256,PQ8x24"]:
        assert load_config(None, [f"index.factory={factory}"]).index.factory == factory
    assert time.perf_counter() - started < 10
    config = load_config(None, ["index.factory=IVF1024,Flat", "index.search_params=nprobe=32"])
    assert config.index.search_params == "nprobe=32"
    assert IndexConfig(factory="bogus").factory == "bogus"  # alone, the dimension is unknown: checked in Config


@pytest.mark.parametrize("value", ["[1", "{a", "a: b: c", "'open"])
def test_a_set_value_that_is_not_yaml_names_the_key(value):
    override = f"run.name={value}"
    with pytest.raises(ConfigError, match=re.escape(f"override {override!r}: the value of run.name is not valid YAML")):
        load_config(None, [override])


def test_the_command_line_says_which_set_value_is_not_yaml():
    done = subprocess.run(
        [sys.executable, "-m", "pipelines.train", "--set", "train.epochs=[1", "--set", "run.output_dir=/nonexistent"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "error: override 'train.epochs=[1': the value of train.epochs is not valid YAML" in done.stderr


def test_config_round_trip_is_unchanged_by_the_checks():
    config = load_config(ROOT / "configs/default.yaml")
    assert Config.from_dict(config.to_dict()) == config


def test_an_ordered_history_on_a_log_without_timestamps_is_refused_at_load():
    """A user-items log ("uid iid iid ...") has no time column: a transformer (which reads the order)
    is refused when the config loads; pooled histories are the user's other items there."""
    overrides = ["data.source=files", "data.clicks.path=train.txt", "data.clicks.format=user-items",
                 "towers.query.features=[{name: user_id, kind: id}]", "towers.doc.features=[{name: item_id, kind: id}]"]
    with pytest.raises(ConfigError, match=r"'transformer' reads each user's clicks in time order.*'user-items'"):
        load_config(None, [*overrides, "towers.query.history={length: 20, pooling: transformer}"])
    for pooling in ("mean", "attention"):
        config = load_config(None, [*overrides, f"towers.query.history={{length: 20, pooling: {pooling}}}"])
        assert config.towers.query.history is not None and config.towers.query.history.pooling == pooling


# --- unknown keys name the nearest valid one -----------------------------------------------------


def _problem_lines(error: pytest.ExceptionInfo) -> list[str]:
    return [line.strip() for line in str(error.value).splitlines()[1:]]


def test_a_typo_in_a_yaml_file_suggests_the_key(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("train:\n  epoch: 3\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert _problem_lines(error) == ["train.epoch: unknown key; did you mean train.epochs?"]


@pytest.mark.parametrize(
    "override,line",
    [
        ("train.epoch=3", "train.epoch: unknown key; did you mean train.epochs?"),
        ("trian.epochs=3", "trian: unknown key; did you mean train?"),
        ("model.los.kind=sampled_softmax", "model.los: unknown key; did you mean model.loss?"),
        ("model.loss.kind_=sampled_softmax", "model.loss.kind_: unknown key; did you mean model.loss.kind?"),
        ("towers.query.features=[{name: user_id, kind: id, sorce: uid}]",
         "towers.query.features.0.id.sorce: unknown key; did you mean towers.query.features.0.id.source?"),
        ("train.zzz=1", "train.zzz: unknown key"),  # nothing close: no guess
    ],
)
def test_an_unknown_set_key_suggests_the_nearest_key_of_its_section(override, line):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert _problem_lines(error) == [line]


def test_the_command_line_suggests_the_key_on_one_line(capsys):
    from retrieval import cli

    assert cli.main(["train", "--set", "train.epoch=3"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["error: <defaults> + --set train.epoch=3: invalid configuration: "
                     "train.epoch: unknown key; did you mean train.epochs?"]


SECTIONS = [("train", TrainConfig), ("model", ModelConfig), ("model.loss", LossConfig), ("index", IndexConfig),
            ("evaluation", EvaluationConfig), ("data.synthetic", SyntheticConfig), ("run", RunConfig)]


@settings(max_examples=80, deadline=None)
@given(section=st.sampled_from(SECTIONS), data=st.data())
def test_one_wrong_letter_in_any_key_suggests_a_key_of_that_section(section, data):
    """One letter changed in a key of three letters or more is still a 0.67 match to it (difflib), above
    the 0.6 cutoff: there is a suggestion, and it is a key of that same section."""
    prefix, model = section
    key = data.draw(st.sampled_from(sorted(k for k in model.model_fields if len(k) >= 3)))
    at = data.draw(st.integers(0, len(key) - 1))
    typo = key[:at] + data.draw(st.sampled_from("qxz").filter(lambda c: c != key[at])) + key[at + 1:]
    if typo in model.model_fields:
        return
    with pytest.raises(ConfigError) as error:
        load_config(None, [f"{prefix}.{typo}=1"])
    lines = [line for line in _problem_lines(error) if line.startswith(f"{prefix}.{typo}: unknown key")]
    suggested = re.fullmatch(rf"{re.escape(prefix)}\.{re.escape(typo)}: unknown key; did you mean "
                             rf"{re.escape(prefix)}\.(\w+)\?", lines[0])
    assert suggested and suggested.group(1) in model.model_fields, lines


@pytest.mark.parametrize(
    "text,key,first,second",
    [
        # Two top-level blocks: PyYAML would keep the second, quietly undoing the first's epochs.
        ("train:\n  epochs: 5\nmodel:\n  embedding_dim: 8\ntrain:\n  batch_size: 64\n", "train", 1, 5),
        ("train:\n  epochs: 1\n  epochs: 2\n", "epochs", 2, 3),
        ("towers:\n  query:\n    features:\n      - {name: user_id, kind: id, name: uid}\n", "name", 4, 4),
    ],
)
def test_a_key_given_twice_is_refused_naming_it_and_both_lines(tmp_path, text, key, first, second):
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert str(path) in message and f"duplicate key {key!r}" in message
    assert f"set on line {first} and again on line {second}" in message


def test_a_merge_key_may_be_overridden_and_equal_keys_in_sibling_mappings_are_fine():
    from retrieval.config import read_yaml

    text = "base: &b {epochs: 1, seed: 3}\ntrain:\n  <<: *b\n  epochs: 2\nlist: [{x: 1}, {x: 2}]\n"
    assert read_yaml(text) == {"base": {"epochs": 1, "seed": 3}, "train": {"epochs": 2, "seed": 3},
                               "list": [{"x": 1}, {"x": 2}]}


@pytest.mark.parametrize(
    "overrides,reason",
    [
        (["train.validation_part=test", "train.refit=false", "train.validation_fraction=0"],
         "validation_fraction > 0 .*now 0.0"),
        (["train.validation_part=test"], "refit=false .*now True"),
    ],
)
def test_selecting_on_the_test_clicks_without_early_stopping_or_with_a_refit_is_refused(overrides, reason):
    """``train.validation_part: test`` holds nothing out: a refit would repeat the same run, and without early
    stopping there is nothing to select."""
    with pytest.raises(ConfigError, match=rf"train.*validation_part='test'.*{reason}"):
        load_config(None, overrides)
