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

from retrieval.config import MIN_TEMPERATURE, SEED_MAX, Config, ConfigError, IndexConfig, load_config

ROOT = Path(__file__).resolve().parents[1]


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


def test_click_history_on_a_log_without_timestamps_is_refused_at_load():
    """A user-items log ("uid iid iid ...") has no time column: history failed after loading, with a
    hint (set data.columns.timestamp) that this format ignores."""
    overrides = ["data.source=files", "data.clicks.path=train.txt", "data.clicks.format=user-items",
                 "towers.query.features=[{name: user_id, kind: id}]", "towers.doc.features=[{name: item_id, kind: id}]",
                 "towers.query.history={length: 20, pooling: mean}"]
    with pytest.raises(ConfigError, match=r"towers\.query\.history .*needs timestamps.*'user-items' has none"):
        load_config(None, overrides)
    assert load_config(None, overrides[:-1]).towers.query.history is None
