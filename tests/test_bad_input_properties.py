"""Bad input, tried systematically: a clear error or a documented result, never a crash.

Property-based (hypothesis): arbitrary bytes and cells in a click log either
load into the canonical frame or raise DataError naming the file; arbitrary
config dicts either validate or raise ConfigError.
"""

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retrieval.config import ColumnsConfig, Config, ConfigError, EvaluationConfig, TableConfig
from retrieval.data import ITEM, TIME, USER, WEIGHT, DataError, read_clicks

COLUMNS = ColumnsConfig(user="user", item="item", timestamp="ts", weight="w")
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

cell = st.one_of(
    st.text(max_size=6),
    st.sampled_from(["", " ", "nan", "NaN", "inf", "-inf", "-1", "1e309", "99999999999999999999", "é", "\x00", '"']),
    st.integers(-(2**63), 2**63 - 1).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
)


def _check_canonical(frame: pd.DataFrame) -> None:
    assert list(frame.columns[:2]) == [USER, ITEM]
    assert len(frame) > 0
    assert all(isinstance(v, str) and v.strip() for v in frame[USER])
    assert all(isinstance(v, str) and v.strip() for v in frame[ITEM])
    weights = frame[WEIGHT].to_numpy()
    assert np.all(np.isfinite(weights)) and np.all(weights >= 0)
    assert frame[TIME].dtype == np.int64


@SETTINGS
@given(rows=st.lists(st.tuples(cell, cell, cell, cell), max_size=6))
def test_any_cells_load_or_fail_with_a_located_data_error(tmp_path_factory, rows):
    path = tmp_path_factory.mktemp("log") / "clicks.csv"
    frame = pd.DataFrame(rows, columns=["user", "item", "ts", "w"], dtype=object)
    path.write_text(frame.to_csv(index=False), encoding="utf-8")
    try:
        loaded = read_clicks(TableConfig(path=str(path)), COLUMNS)
    except DataError as error:
        assert "clicks.csv" in str(error)
        return
    _check_canonical(loaded)


@SETTINGS
@given(payload=st.binary(max_size=200))
def test_arbitrary_bytes_never_crash_the_loader(tmp_path_factory, payload):
    path = tmp_path_factory.mktemp("log") / "clicks.csv"
    path.write_bytes(b"user,item,ts,w\n" + payload)
    try:
        loaded = read_clicks(TableConfig(path=str(path)), COLUMNS)
    except DataError as error:
        assert "clicks.csv" in str(error)
        return
    _check_canonical(loaded)


def test_mixed_encodings_name_the_line(tmp_path):
    path = tmp_path / "clicks.csv"
    path.write_bytes("user,item,ts,w\nu1,caf\u00e9,1,1\n".encode() + "u2,caf\u00e9,2,1\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"clicks\.csv, line 3.*encoding"):
        read_clicks(TableConfig(path=str(path)), COLUMNS)


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "-2"])
def test_non_finite_or_negative_weights_are_rejected(tmp_path, bad):
    path = tmp_path / "clicks.csv"
    path.write_text(f"user,item,ts,w\nu1,i1,1,1\nu2,i2,2,{bad}\n")
    with pytest.raises(DataError, match=r"line 3, column 'w'"):
        read_clicks(TableConfig(path=str(path)), COLUMNS)


def test_one_row_log_loads(tmp_path):
    path = tmp_path / "clicks.csv"
    path.write_text("user,item,ts,w\nu1,i1,1,1\n")
    assert read_clicks(TableConfig(path=str(path)), COLUMNS)[[USER, ITEM]].values.tolist() == [["u1", "i1"]]


def test_header_only_log_is_an_empty_log_error(tmp_path):
    path = tmp_path / "clicks.csv"
    path.write_text("user,item,ts,w\n")
    with pytest.raises(DataError, match="clicks.csv"):
        read_clicks(TableConfig(path=str(path)), COLUMNS)


def test_a_test_set_of_only_unseen_ids_evaluates_to_zero_users():
    from retrieval.evaluation import build_eval_set, popularity_ranking, ranking_metrics

    train = pd.DataFrame({USER: ["u1", "u2"], ITEM: ["a", "b"]})
    test = pd.DataFrame({USER: ["new1", "new2"], ITEM: ["a", "c"]})
    eval_set = build_eval_set(train, test, ["a", "b", "c"], EvaluationConfig())
    assert eval_set.counts["test_users_unseen_in_training"] == 2
    assert len(eval_set.user_ids) == 0
    metrics = ranking_metrics(popularity_ranking(train, ["a", "b", "c"], eval_set, 2), eval_set.relevant, [2])
    assert metrics["users"] == 0


config_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=5)),
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)
sections = st.sampled_from(["data", "split", "model", "train", "index", "evaluation", "run", "bogus"])
keys = st.sampled_from(["epochs", "batch_size", "kind", "temperature", "ks", "name", "source", "factory", "zzz"])


@settings(max_examples=150, deadline=None)
@given(raw=st.dictionaries(sections, st.dictionaries(keys, config_value, max_size=3), max_size=3))
def test_arbitrary_configs_validate_or_name_the_bad_key(raw):
    try:
        config = Config.from_dict(raw)
    except ConfigError as error:
        message = str(error)
        assert "invalid configuration" in message
        assert any(f"{section}." in message or section in message for section in raw)
        return
    assert Config.from_dict(config.to_dict()) == config
