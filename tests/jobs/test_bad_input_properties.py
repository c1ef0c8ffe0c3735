"""Bad input, tried systematically: a clear error or a documented result, never a crash.

Property-based (hypothesis), by classes of input rather than listed cases:

- both click-log readers, ``read_clicks`` (whole files) and the out-of-core
  ``ClickShards`` (record batches), over CSV, TSV and Parquet: valid logs load
  to the same rows; one bad cell of any class (non-finite, beyond int64 or
  float32, negative, unreadable, blank, nested, boolean) stops both with a
  DataError naming the file, the cell's line (Parquet: row) and its column;
  a missing column names the file and the column; arbitrary bytes and cells
  load or fail with a DataError naming the file;
- the ``uid iid iid ...`` (user-items) reader: round trip and arbitrary text;
- the config: arbitrary dicts validate or name the key; every float field
  refuses non-finite values and values float32 cannot hold, every seed field
  values outside numpy's range, any ``--set`` value that is not YAML, and any
  FAISS factory FAISS cannot build (FAISS itself is the oracle);
- the job: a split that leaves no test user to evaluate stops before training.
"""

from __future__ import annotations

import datetime as dt
import string
import typing
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from retrieval.config import (
    SEED_MAX,
    ColumnsConfig,
    Config,
    ConfigError,
    EvaluationConfig,
    SplitConfig,
    TableConfig,
    load_config,
)
from retrieval.data import ITEM, TIME, USER, WEIGHT, DataError, read_clicks
from retrieval.data.streaming import ClickShards, plan_split

COLUMNS = ColumnsConfig(user="user", item="item", timestamp="ts", weight="w")
NAMES = ["user", "item", "ts", "w"]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
FLOAT32_MAX = float(np.finfo(np.float32).max)
SEPARATORS = {"csv": ",", "tsv": "\t"}

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
    assert weights.dtype == np.float32 and np.all(np.isfinite(weights)) and np.all(weights >= 0)
    assert frame[TIME].dtype == np.int64


# --- Writing a log and reading it with both readers. ---


def _write(
    directory: Path, fmt: str, columns: dict[str, Any], blank_before: frozenset[int] = frozenset(),
    field_change: tuple[int, int] | None = None,
) -> Path:
    """A log file: text cells joined by the separator (cells never hold it), or a typed Parquet table.

    Text only: an empty line goes before each 0-based data row in ``blank_before``;
    ``field_change=(row, +1 or -1)`` gives that row one field more, or one less.
    """
    path = directory / f"clicks.{fmt}"
    if fmt == "parquet":
        pq.write_table(pa.table(columns), path)
        return path
    lines = [SEPARATORS[fmt].join(columns)]
    for number, cells in enumerate(zip(*columns.values())):
        cells = list(cells)
        if field_change is not None and field_change[0] == number:
            cells = [*cells, "1"] if field_change[1] > 0 else cells[:-1]
        lines += [""] * (number in blank_before) + [SEPARATORS[fmt].join(cells)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _line(row: int, blank_before: frozenset[int]) -> int:
    """The text line of 0-based data row ``row``: after the header and the empty lines before it."""
    return row + 2 + sum(1 for blank in blank_before if blank <= row)


def _in_memory(path: Path) -> pd.DataFrame:
    return read_clicks(TableConfig(path=str(path)), COLUMNS)


def _streamed(path: Path, batch: int) -> pd.DataFrame:
    """The out-of-core reader as the job drives it: open, pass 1 (which refuses an empty log), then the rows."""
    shards = ClickShards.open(TableConfig(path=str(path)), COLUMNS, read_batch_size=batch)
    plan_split(shards, SplitConfig(kind="random"))
    return pd.concat([b.frame() for b in shards.scan()], ignore_index=True)


def _outcome(read, *args) -> pd.DataFrame | DataError:
    try:
        return read(*args)
    except DataError as error:
        return error


# --- Valid logs: strategies per column kind; Parquet columns are typed, text cells are written as is. ---

# Ids: no separator, quote, line break or control character (documented: click logs have no quoted fields).
id_text = st.text(
    st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp"), blacklist_characters=',\t"'), min_size=1, max_size=5
).filter(str.strip)
int64 = st.integers(-(2**63), 2**63 - 1)
decimal_text = st.tuples(st.integers(-(2**52), 2**52), st.integers(0, 999)).map(lambda p: f"{p[0]}.{p[1]}")
iso_text = st.datetimes(dt.datetime(1800, 1, 1), dt.datetime(2200, 1, 1)).map(lambda t: t.isoformat() + "Z")
weight_float = st.floats(0, FLOAT32_MAX)


@st.composite
def valid_logs(draw, fmt: str) -> dict[str, Any]:
    """Columns of a valid log in ``fmt``: per column one kind, as a file of that format stores it."""
    n = draw(st.integers(1, 12))
    text = fmt != "parquet"

    def column(kind_to_values: dict[str, Any]) -> Any:
        kind = draw(st.sampled_from(sorted(kind_to_values)))
        return kind_to_values[kind]()

    ids = {
        "text": lambda: draw(st.lists(id_text, min_size=n, max_size=n)),
        "int": lambda: draw(st.lists(st.integers(-(10**12), 10**12), min_size=n, max_size=n)),
    }
    columns: dict[str, Any] = {"user": column(ids), "item": column(ids)}
    if text:
        columns = {k: [str(v) for v in values] for k, values in columns.items()}
        columns["ts"] = column({
            "int": lambda: [str(v) for v in draw(st.lists(int64, min_size=n, max_size=n))],
            "decimal": lambda: draw(st.lists(decimal_text, min_size=n, max_size=n)),
            "iso": lambda: draw(st.lists(iso_text, min_size=n, max_size=n)),
        })
        columns["w"] = column({
            "float": lambda: [repr(v) for v in draw(st.lists(weight_float, min_size=n, max_size=n))],
            "int": lambda: [str(v) for v in draw(st.lists(st.integers(0, 10**9), min_size=n, max_size=n))],
        })
    else:
        columns["ts"] = column({
            "int64": lambda: pa.array(draw(st.lists(int64, min_size=n, max_size=n)), pa.int64()),
            "float": lambda: pa.array(
                draw(st.lists(st.floats(-(2.0**62), 2.0**62), min_size=n, max_size=n)), pa.float64()
            ),
            "datetime": lambda: pa.array(
                draw(st.lists(st.datetimes(dt.datetime(1700, 1, 1), dt.datetime(2250, 1, 1)), min_size=n,
                              max_size=n)), pa.timestamp("us"),
            ),
        })
        columns["w"] = column({
            "float64": lambda: pa.array(draw(st.lists(weight_float, min_size=n, max_size=n)), pa.float64()),
            "int": lambda: pa.array(draw(st.lists(st.integers(0, 10**9), min_size=n, max_size=n)), pa.int64()),
        })
    return columns


@pytest.mark.parametrize("fmt", ["csv", "tsv", "parquet"])
@SETTINGS
@given(data=st.data(), batch=st.integers(1, 5))
def test_both_readers_load_valid_logs_to_the_same_rows(tmp_path_factory, fmt, data, batch):
    columns = data.draw(valid_logs(fmt))
    blanks = data.draw(st.frozensets(st.integers(0, len(columns["user"]) - 1)))  # both readers skip empty lines
    path = _write(tmp_path_factory.mktemp("log"), fmt, columns, blanks)
    memory, streamed = _in_memory(path), _streamed(path, batch)
    _check_canonical(memory)
    assert len(memory) == len(columns["user"])
    pd.testing.assert_frame_equal(memory, streamed, check_dtype=False)
    assert streamed[TIME].dtype == np.int64 and streamed[WEIGHT].dtype == np.float32


# --- One bad cell of some class in a valid log. ---

beyond_int64 = st.one_of(st.integers(2**63, 10**30), st.integers(-(10**30), -(2**63) - 1))
bad_text_timestamps = st.one_of(
    st.sampled_from(["", " ", "nan", "inf", "-inf", "1e400", "1e3", "0x10", "yesterday", "2026-13-45", "٣"]),
    beyond_int64.map(str),
    beyond_int64.map(lambda v: f"{v}.5"),
)
bad_text_weights = st.one_of(
    st.sampled_from(["", "nan", "inf", "-inf", "abc", "0x10", "1e39", "-0.5"]),
    st.floats(FLOAT32_MAX * 1.0001, 1.7e308).map(repr),
    st.floats(-1e300, -1e-300).map(repr),
    st.floats(allow_nan=False).filter(lambda v: not 0 <= v <= FLOAT32_MAX).map(repr),
)
bad_floats = st.one_of(
    st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    st.floats(2.0**63, 1e300),
    st.floats(-1e300, -(2.0**63) * 1.0001),
)


# Bad as a float32 weight: not finite, beyond float32 or negative (2**63 is a fine weight, a bad timestamp).
bad_float_weights = st.one_of(
    st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    st.floats(FLOAT32_MAX * 1.0001, 1e300),
    st.floats(-1e300, -1e-10),
)


@st.composite
def one_bad_cell(draw, fmt: str) -> tuple[dict[str, Any], str | None, int]:
    """A valid log with one cell (or, for a stored type no id may have, one column; or, in text,
    one row's number of fields) made bad: (columns, the bad column or None for a row with a field
    more or less, 0-based row of the first bad cell)."""
    columns = draw(valid_logs(fmt))
    n = len(columns["user"])
    row = draw(st.integers(0, n - 1))
    if fmt != "parquet":
        name = draw(st.sampled_from([*NAMES, None]))
        if name is None:
            return columns, None, row
        bad = {
            "user": st.sampled_from(["", " ", "\u3000"]),
            "item": st.sampled_from(["", "  "]),
            "ts": bad_text_timestamps,
            "w": bad_text_weights,
        }[name]
        columns[name] = list(columns[name])
        columns[name][row] = draw(bad)
        return columns, name, row
    kind = draw(st.sampled_from(["null_id", "nested_id", "struct_id", "bool_id", "ts_float", "ts_uint64",
                                 "ts_null", "w_float", "w_null"]))
    if kind.endswith("_id"):
        name = draw(st.sampled_from(["user", "item"]))
        if kind == "null_id":
            values = [str(v) for v in range(n)]
            values[row] = None
            columns[name] = pa.array(values, pa.string())
            return columns, name, row
        columns[name] = {
            "nested_id": lambda: pa.array([[i, i + 1] for i in range(n)]),
            "struct_id": lambda: pa.array([{"id": i} for i in range(n)]),
            "bool_id": lambda: pa.array([i % 2 == 0 for i in range(n)]),
        }[kind]()
        return columns, name, 0
    name = "ts" if kind.startswith("ts") else "w"
    if kind == "ts_uint64":
        values = list(range(n))
        values[row] = draw(st.integers(2**63, 2**64 - 1))
        columns[name] = pa.array(values, pa.uint64())
        return columns, name, row
    values = [1.0] * n
    if kind.endswith("_null"):
        values[row] = None
    else:
        values[row] = draw(bad_floats if name == "ts" else bad_float_weights)
    columns[name] = pa.array(values, pa.float64())
    return columns, name, row


@pytest.mark.parametrize("fmt", ["csv", "tsv", "parquet"])
@SETTINGS
@given(data=st.data(), batch=st.integers(1, 5))
def test_one_bad_cell_stops_both_readers_at_its_line_and_column(tmp_path_factory, fmt, data, batch):
    columns, name, row = data.draw(one_bad_cell(fmt))
    blanks, change = frozenset(), None
    if fmt != "parquet":
        blanks = data.draw(st.frozensets(st.integers(0, len(columns["user"]) - 1)))
        if name is None:
            change = (row, data.draw(st.sampled_from([1, -1])))
    path = _write(tmp_path_factory.mktemp("log"), fmt, columns, blanks, change)
    where = f"row {row + 1}" if fmt == "parquet" else f"line {_line(row, blanks)}"
    for outcome in (_outcome(_in_memory, path), _outcome(_streamed, path, batch)):
        assert isinstance(outcome, DataError), f"{name} row {row}: loaded {outcome}"
        if name is None:  # a field more or less: the line (a missing last cell may be named as that cell)
            assert str(outcome).startswith(f"{path}, {where}"), str(outcome)
        else:
            assert str(outcome).startswith(f"{path}, {where}, column {name!r}: "), str(outcome)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
@SETTINGS
@given(data=st.data())
def test_a_missing_column_is_named_by_both_readers(tmp_path_factory, fmt, data):
    columns = data.draw(valid_logs(fmt))
    missing = data.draw(st.sampled_from(NAMES))
    del columns[missing]
    path = _write(tmp_path_factory.mktemp("log"), fmt, columns)
    for read in (_in_memory, lambda p: _streamed(p, 4)):
        with pytest.raises(DataError, match=rf"clicks\.{fmt}.*missing column '{missing}'"):
            read(path)


# --- Arbitrary cells and bytes. ---


@SETTINGS
@given(rows=st.lists(st.tuples(cell, cell, cell, cell), max_size=6))
def test_any_cells_load_or_fail_with_a_located_data_error(tmp_path_factory, rows):
    path = tmp_path_factory.mktemp("log") / "clicks.csv"
    frame = pd.DataFrame(rows, columns=NAMES, dtype=object)
    path.write_text(frame.to_csv(index=False), encoding="utf-8")
    memory, streamed = _outcome(_in_memory, path), _outcome(_streamed, path, 2)
    for outcome in (memory, streamed):
        if isinstance(outcome, DataError):
            assert str(outcome).startswith(str(path)), str(outcome)
        else:
            _check_canonical(outcome)
    if not isinstance(memory, DataError) and not isinstance(streamed, DataError):
        pd.testing.assert_frame_equal(memory, streamed, check_dtype=False)


@SETTINGS
@given(payload=st.binary(max_size=200))
def test_arbitrary_bytes_never_crash_either_reader(tmp_path_factory, payload):
    path = tmp_path_factory.mktemp("log") / "clicks.csv"
    path.write_bytes(b"user,item,ts,w\n" + payload)
    for outcome in (_outcome(_in_memory, path), _outcome(_streamed, path, 3)):
        if isinstance(outcome, DataError):
            assert "clicks.csv" in str(outcome)
        else:
            _check_canonical(outcome)


@SETTINGS
@given(payload=st.binary(min_size=1, max_size=300))
def test_arbitrary_bytes_as_parquet_fail_with_the_file_named(tmp_path_factory, payload):
    path = tmp_path_factory.mktemp("log") / "clicks.parquet"
    path.write_bytes(payload)
    for read in (_in_memory, lambda p: _streamed(p, 3)):
        with pytest.raises(DataError, match=r"clicks\.parquet"):
            read(path)


def test_mixed_encodings_name_the_line(tmp_path):
    path = tmp_path / "clicks.csv"
    path.write_bytes("user,item,ts,w\nu1,caf\u00e9,1,1\n".encode() + "u2,caf\u00e9,2,1\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"clicks\.csv, line 3.*encoding"):
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


# --- The user-items ("uid iid iid ...") reader. ---

token = st.text(string.ascii_letters + string.digits + "_-.", min_size=1, max_size=4)


@SETTINGS
@given(users=st.dictionaries(token, st.lists(token, max_size=5), min_size=1, max_size=6))
def test_user_items_round_trip(tmp_path_factory, users):
    path = tmp_path_factory.mktemp("log") / "train.txt"
    path.write_text("".join(" ".join([u, *items]) + "\n" for u, items in users.items()))
    pairs = [(u, i) for u, items in users.items() for i in items]
    outcome = _outcome(read_clicks, TableConfig(path=str(path), format="user-items"), ColumnsConfig())
    if not pairs:
        assert isinstance(outcome, DataError) and "no clicks" in str(outcome)
        return
    assert list(zip(outcome[USER], outcome[ITEM])) == pairs
    assert (outcome[WEIGHT] == 1).all() and TIME not in outcome


@SETTINGS
@given(text=st.text(max_size=80))
def test_user_items_arbitrary_text_loads_or_names_the_file(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("log") / "train.txt"
    path.write_text(text, encoding="utf-8")
    outcome = _outcome(read_clicks, TableConfig(path=str(path), format="user-items"), ColumnsConfig())
    if isinstance(outcome, DataError):
        assert str(outcome).startswith(str(path))
    else:
        _check_canonical(outcome.assign(**{TIME: np.zeros(len(outcome), np.int64)}))


# --- Evaluation: a test log nobody can be evaluated on is an error, not metrics over zero users. ---


def test_a_test_set_of_only_unseen_users_is_an_error_naming_why():
    from retrieval.evaluation import build_eval_set

    train = pd.DataFrame({USER: ["u1", "u2"], ITEM: ["a", "b"]})
    test = pd.DataFrame({USER: ["new1", "new2"], ITEM: ["a", "c"]})
    with pytest.raises(DataError, match=r"no test user can be evaluated.*2 of the 2 test users have no training "
                                        r"clicks.*evaluation.unseen_users: drop"):
        build_eval_set(train, test, ["a", "b", "c"], EvaluationConfig())
    kept = build_eval_set(train, test, ["a", "b", "c"], EvaluationConfig(unseen_users="keep"))
    assert sorted(kept.user_ids) == ["new1", "new2"]


def test_a_test_set_of_only_repeated_training_clicks_is_an_error_naming_the_mask():
    from retrieval.evaluation import build_eval_set

    train = pd.DataFrame({USER: ["u1", "u2"], ITEM: ["a", "b"]})
    test = pd.DataFrame({USER: ["u1", "u2"], ITEM: ["a", "b"]})
    with pytest.raises(DataError, match=r"2 test clicks repeat the user's training clicks.*exclude_train_items"):
        build_eval_set(train, test, ["a", "b"], EvaluationConfig())
    assert len(build_eval_set(train, test, ["a", "b"], EvaluationConfig(exclude_train_items=False)).user_ids) == 2


# --- The config. ---

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


def _leaf_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, annotation) of every field of the config reachable through plain sections."""
    leaves = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        members = getattr(annotation, "__args__", (annotation,))
        sections_ = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
        if len(sections_) == 1:
            leaves += _leaf_fields(sections_[0], f"{prefix}{name}.")
        else:
            leaves.append((f"{prefix}{name}", annotation))
    return leaves


LEAVES = _leaf_fields(Config)
FLOAT_KEYS = [key for key, annotation in LEAVES if annotation is float or float in typing.get_args(annotation)]
SEED_KEYS = [key for key, _ in LEAVES if key.rsplit(".", 1)[-1] == "seed"]


def _with(key: str, value: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    node = raw
    *path, leaf = key.split(".")
    for part in path:
        node = node.setdefault(part, {})
    node[leaf] = value
    if key.startswith("data.clicks.") or key.startswith("data.test_clicks."):
        node.setdefault("path", "x.csv")
    return raw


def test_the_config_has_the_fields_the_properties_range_over():
    assert {"train.learning_rate", "model.temperature", "split.test_fraction"} <= set(FLOAT_KEYS)
    assert {"train.seed", "split.seed", "index.seed", "data.stream.seed"} <= set(SEED_KEYS)


@settings(max_examples=120, deadline=None)
@given(
    key=st.sampled_from(FLOAT_KEYS),
    value=st.one_of(
        st.sampled_from([float("inf"), float("-inf"), float("nan")]),
        st.floats(FLOAT32_MAX * 1.0001, 1e308),
        st.floats(-1e308, -FLOAT32_MAX * 1.0001),
        st.floats(5e-324, 1.17e-38).flatmap(lambda v: st.sampled_from([v, -v])),  # computes as 0 in float32
    ),
)
@example(key="train.learning_rate", value=float("inf"))
@example(key="model.temperature", value=float("nan"))
def test_every_float_key_refuses_values_float32_cannot_hold(key, value):
    with pytest.raises(ConfigError, match=rf"\n  {key}: "):
        Config.from_dict(_with(key, value))


@settings(max_examples=80, deadline=None)
@given(key=st.sampled_from(SEED_KEYS), seed=st.one_of(st.integers(max_value=-1), st.integers(min_value=SEED_MAX + 1)))
@example(key="train.seed", seed=2**32)
def test_every_seed_key_refuses_seeds_outside_numpys_range(key, seed):
    with pytest.raises(ConfigError, match=rf"\n  {key}: "):
        Config.from_dict(_with(key, seed))


@settings(max_examples=30, deadline=None)
@given(key=st.sampled_from(SEED_KEYS), seed=st.sampled_from([0, 1, SEED_MAX]))
def test_every_seed_key_takes_seeds_in_numpys_range(key, seed):
    config = Config.from_dict(_with(key, seed))
    np.random.seed(seed)  # the binding limit: tf.keras.utils.set_random_seed calls numpy.random.seed
    assert Config.from_dict(config.to_dict()) == config


@settings(max_examples=80, deadline=None)
@given(
    key=st.sampled_from([key for key, _ in LEAVES]),
    value=st.sampled_from(["[1", "{a", "a: b: c", "'open", "]", "{]", "- [", "@x", "`x", "%x", "a\tb: c"]),
)
def test_a_set_value_that_is_not_yaml_names_the_key(key, value):
    with pytest.raises(ConfigError) as error:
        load_config(None, [f"{key}={value}"])
    assert key in str(error.value)


factory_token = st.sampled_from(
    ["Flat", "IVF16", "IVF4", "HNSW8", "HNSW", "PQ4", "PQ5", "PQ8x4", "OPQ4", "OPQ4_16", "PCA16", "PCAR8", "SQ8",
     "SQ4", "SQfp16", "RFlat", "Refine(Flat)", "IDMap", "LSH", "NSG16", "bogus", "", "IVF", "x", "4"]
)


@settings(max_examples=80, deadline=None)
@given(tokens=st.lists(factory_token, min_size=1, max_size=3), dim=st.sampled_from([8, 16, 30]))
def test_index_factories_validate_exactly_when_faiss_builds_them(tokens, dim):
    import faiss

    factory = ",".join(tokens)
    try:
        faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
        builds = True
    except Exception:
        builds = False
    raw = {"index": {"factory": factory}, "model": {"embedding_dim": dim}}
    if builds:
        assert Config.from_dict(raw).index.factory == factory
    else:
        with pytest.raises(ConfigError, match=r"index\.factory"):
            Config.from_dict(raw)


@settings(max_examples=60, deadline=None)
@given(
    factory=st.sampled_from(["IVF16,Flat", "HNSW8", "IVF16,PQ4", "Flat"]),
    params=st.lists(
        st.tuples(st.sampled_from(["nprobe", "efSearch", "ht", "bogus"]),
                  st.sampled_from(["1", "8", "0", "-1", "x", "nan", ""])),
        min_size=1,
        max_size=2,
    ).map(lambda pairs: ",".join(f"{k}={v}" for k, v in pairs)),
)
def test_search_params_validate_or_name_the_key(factory, params):
    try:
        config = Config.from_dict({"index": {"factory": factory, "search_params": params}})
    except ConfigError as error:
        assert "index.search_params" in str(error)
        return
    # Accepted: every nprobe/efSearch is >= 1 and FAISS applies them to a built index.
    import faiss

    for pair in params.split(","):
        name, _, value = pair.partition("=")
        if name in ("nprobe", "efSearch"):
            assert float(value) >= 1
    index = faiss.index_factory(config.model.embedding_dim, factory, faiss.METRIC_INNER_PRODUCT)
    faiss.ParameterSpace().set_index_parameters(index, params)


# --- The job: an eval set that is known to be empty stops it before training. ---


def _no_training(*args, **kwargs):
    raise AssertionError("training started although no test user can be evaluated")


@pytest.mark.slow  # imports TensorFlow (retrieval.jobs)
def test_the_job_stops_before_training_when_no_test_user_can_be_evaluated(tmp_path, monkeypatch):
    import retrieval.jobs.train as jobs  # the module whose names the test patches

    train, test = tmp_path / "train.csv", tmp_path / "test.csv"
    train.write_text("user_id,item_id,timestamp\n" + "".join(f"u{i % 5},i{i % 7},{i}\n" for i in range(40)))
    test.write_text("user_id,item_id,timestamp\nnew1,i1,100\nnew2,i2,101\n")
    monkeypatch.setattr(jobs, "fit", _no_training)
    config = load_config(None, [
        "data.source=files", f"data.clicks.path={train}", f"data.test_clicks.path={test}", "split.kind=none",
        f"run.output_dir={tmp_path / 'runs'}", "run.name=r", "train.checkpoint_every_steps=0",
        "train.checkpoint_every_seconds=0",
    ])
    with pytest.raises(DataError, match=r"no test user can be evaluated.*2 of the 2 test users have no training"):
        jobs.train_evaluate_export(config)
    assert not (tmp_path / "runs" / "r").exists()


@pytest.mark.slow  # imports TensorFlow (retrieval.jobs)
def test_the_out_of_core_job_stops_before_training_when_no_test_user_can_be_evaluated(tmp_path, monkeypatch):
    import retrieval.jobs.train as jobs  # the module whose names the test patches

    shards = tmp_path / "logs"
    shards.mkdir()
    # The latest 20% of the clicks (the temporal test part) are all by users without earlier clicks.
    rows = [f"u{i % 5},i{i % 7},{i}\n" for i in range(40)] + [f"new{i},i{i % 7},{100 + i}\n" for i in range(10)]
    (shards / "part-0.csv").write_text("user_id,item_id,timestamp\n" + "".join(rows))
    monkeypatch.setattr(jobs, "fit", _no_training)
    config = load_config(None, [
        "data.source=files", f"data.clicks.path={shards}", "data.out_of_core=true", "split.kind=temporal",
        "evaluation.baselines.rankers=[popularity]", f"run.output_dir={tmp_path / 'runs'}", "run.name=r",
    ])
    with pytest.raises(DataError, match=r"no test user can be evaluated.*10 of the 10 test users have no training"):
        jobs.train_evaluate_export(config)
