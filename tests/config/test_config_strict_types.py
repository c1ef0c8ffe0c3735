"""No value converts silently to a config field's type, whichever way it is typed: a dict, a config
file, ``--set section.key=value``, and the HTTP body's ``k``.

The deliberate conversions are an integer where a number goes (``learning_rate: 1``), a YAML list
where a tuple goes, and YAML 1.2 floats (``1e-3`` is a number, though PyYAML alone reads it as text).
Everything else is refused with the dotted key and both types: a boolean is never an integer or a
number (``epochs: true`` trained one epoch), an integer never a boolean, a number never a string
(quote ``run.name: '2024'``), a string never a number (``epochs: "3"``), a float never an integer.
The fields are found through the pydantic model, so a new field is covered when it is added.
"""

import typing
from types import UnionType
from typing import Any, Literal

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_bad_input_properties import LEAVES, _with
from test_service import ROOT, call, world  # noqa: F401  (the module fixture: two small bundles)

from retrieval.config import Config, ConfigError, load_config
from retrieval.serving.http import MAX_K, create_app

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _members(annotation: Any) -> list[Any]:
    """The types a field takes: Optional, unions and Annotated unwrapped; a Literal stays whole."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, UnionType):
        return [m for member in typing.get_args(annotation) for m in _members(member)]
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    return [annotation]


def _keys(kind: Any) -> list[str]:
    return [key for key, annotation in LEAVES if kind in _members(annotation)]


INT_KEYS, FLOAT_KEYS, BOOL_KEYS, STR_KEYS = _keys(int), _keys(float), _keys(bool), _keys(str)
def _literal_of_ints(member: Any) -> bool:
    return typing.get_origin(member) is Literal and any(type(v) is int for v in typing.get_args(member))


LITERAL_INT_KEYS = [key for key, annotation in LEAVES if any(map(_literal_of_ints, _members(annotation)))]
INT_TUPLE_KEYS = [key for key, annotation in LEAVES if annotation == tuple[int, ...]]
NOT_BOOL_KEYS = INT_KEYS + FLOAT_KEYS + STR_KEYS + LITERAL_INT_KEYS


def test_the_config_has_the_fields_the_properties_range_over():
    assert {"train.epochs", "split.k", "train.checkpoint_every_steps", "train.seed"} <= set(INT_KEYS)
    assert {"train.learning_rate", "split.test_fraction", "model.temperature"} <= set(FLOAT_KEYS)
    assert {"data.out_of_core", "train.resume", "data.clicks.header", "model.normalize"} <= set(BOOL_KEYS)
    assert {"run.name", "index.factory", "data.columns.user", "data.clicks.path"} <= set(STR_KEYS)
    assert LITERAL_INT_KEYS == ["train.verbose"]
    assert {"evaluation.ks", "evaluation.activity_edges"} <= set(INT_TUPLE_KEYS)


def _refused(raw: dict[str, Any], key: str) -> str:
    """The message line of ``key`` in the ConfigError ``raw`` raises."""
    with pytest.raises(ConfigError) as error:
        Config.from_dict(raw)
    lines = [line for line in str(error.value).splitlines() if line.startswith(f"  {key}: ")]
    assert lines, str(error.value)
    return lines[0]


@SETTINGS
@given(key=st.sampled_from(NOT_BOOL_KEYS), flag=st.booleans())
@example(key="train.epochs", flag=True)
@example(key="train.verbose", flag=True)
def test_a_boolean_is_refused_wherever_a_number_or_a_string_goes(key, flag):
    line = _refused(_with(key, flag), key)
    assert f"got a boolean ({'true' if flag else 'false'})" in line


def test_the_message_says_what_the_key_takes():
    assert _refused(_with("train.epochs", True), "train.epochs") == (
        "  train.epochs: expected an integer, got a boolean (true)")
    assert "expected one of 'auto', 0, 1, 2, got a boolean (true)" in _refused(_with("train.verbose", True),
                                                                               "train.verbose")


@SETTINGS
@given(key=st.sampled_from(INT_TUPLE_KEYS), flag=st.booleans(), position=st.integers(0, 2))
def test_a_boolean_in_a_list_of_integers_is_refused_at_its_position(key, flag, position):
    values: list[Any] = [1, 2, 3]
    values[position] = flag
    assert "expected an integer, got a boolean" in _refused(_with(key, values), f"{key}.{position}")


@SETTINGS
@given(key=st.sampled_from(INT_KEYS),
       value=st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(1, 99).map(str)))
@example(key="train.epochs", value=3.0)
@example(key="train.epochs", value="3")
def test_a_float_or_a_string_is_refused_where_an_integer_goes(key, value):
    assert "expected an integer, got a " in _refused(_with(key, value), key)


@SETTINGS
@given(key=st.sampled_from(BOOL_KEYS),
       value=st.one_of(st.integers(0, 1), st.floats(0, 1), st.sampled_from(["true", "yes", "on", "1", "false", "0"])))
@example(key="data.out_of_core", value=1)
@example(key="train.resume", value="false")
def test_only_a_boolean_is_a_boolean(key, value):
    assert "expected a boolean (true or false), got " in _refused(_with(key, value), key)


@SETTINGS
@given(key=st.sampled_from(STR_KEYS), value=st.one_of(st.integers(), st.floats(allow_nan=False)))
@example(key="run.name", value=2024)
def test_a_number_is_refused_where_text_goes_with_a_hint_to_quote_it(key, value):
    line = _refused(_with(key, value), key)
    assert "expected a string, got " in line and "quote it" in line


@SETTINGS
@given(key=st.sampled_from(FLOAT_KEYS), value=st.sampled_from(["0.1", "1e-1", "0.5"]))
def test_text_is_refused_where_a_number_goes(key, value):
    assert "got a string" in _refused(_with(key, value), key)


@SETTINGS
@given(key=st.sampled_from(FLOAT_KEYS), value=st.integers(0, 3))
def test_an_integer_where_a_number_goes_is_that_number(key, value):
    try:
        config = Config.from_dict(_with(key, value))
    except ConfigError as error:  # out of the key's range (a fraction below 1, a temperature's minimum ...)
        assert "expected a number" not in str(error) and "got an integer" not in str(error)
        return
    node: Any = config
    for part in key.split("."):
        node = getattr(node, part)
    assert type(node) is float and node == value


def _overrides(raw: dict[str, Any], prefix: str = "") -> list[str]:
    """``raw`` as ``--set`` arguments, each value written as YAML."""
    out = []
    for name, value in raw.items():
        if isinstance(value, dict):
            out += _overrides(value, f"{prefix}{name}.")
        else:
            text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
            out.append(f"{prefix}{name}={text}")
    return out


@SETTINGS
@given(key=st.sampled_from(NOT_BOOL_KEYS + INT_TUPLE_KEYS), flag=st.booleans(), by_file=st.booleans())
@example(key="train.epochs", flag=True, by_file=True)
@example(key="train.epochs", flag=True, by_file=False)
def test_a_config_file_and_set_refuse_a_boolean_by_its_dotted_key(tmp_path_factory, key, flag, by_file):
    raw = _with(key, [1, flag] if key in INT_TUPLE_KEYS else flag)
    shown = f"{key}.1" if key in INT_TUPLE_KEYS else key
    path = tmp_path_factory.mktemp("config") / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=rf"\n  {shown}: .*, got a boolean \({str(flag).lower()}\)"):
        load_config(path) if by_file else load_config(None, _overrides(raw))


# (towers.* are left out: setting one key of a tower replaces the default tower, features and all;
# train.replay_fraction too: it replays a parent's clicks, so it needs train.warm_start, a finished run;
# and the synthetic log's changes between periods, which need data.synthetic.periods > 1.)
_NEED_ANOTHER_KEY = {"train.replay_fraction", "data.synthetic.new_items_per_period",
                     "data.synthetic.retired_items_per_period", "data.synthetic.popularity_drift",
                     "data.synthetic.taste_drift"}


@SETTINGS
@given(key=st.sampled_from([key for key in FLOAT_KEYS
                            if not key.startswith("towers.") and key not in _NEED_ANOTHER_KEY]),
       text=st.sampled_from(["1e-1", "1E-1", "+1e-1", "1.0e-1", "10e-2"]),
       by_file=st.booleans())
def test_yaml_1_2_floats_are_numbers_in_a_file_and_in_set(tmp_path_factory, key, text, by_file):
    path = tmp_path_factory.mktemp("config") / "floats.yaml"
    path.write_text(yaml.safe_dump(_with(key, "PLACEHOLDER")).replace("PLACEHOLDER", text))
    overrides = [line for line in _overrides(_with(key, 0)) if not line.startswith(key + "=")] + [f"{key}={text}"]
    config = load_config(path) if by_file else load_config(None, overrides)
    node: Any = config
    for part in key.split("."):
        node = getattr(node, part)
    assert node == pytest.approx(0.1)


def test_every_shipped_config_still_loads_and_round_trips():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        if path.name == "tune_space.yaml":
            continue
        config = load_config(path)
        assert Config.from_dict(config.to_dict()) == config, path.name


# --- the HTTP body ---


@pytest.fixture(scope="module")
def app(world):  # noqa: F811
    return create_app(world["bundle-a"])


@SETTINGS
@given(k=st.one_of(st.booleans(), st.floats(1, 10), st.integers(1, 10).map(str), st.just(None)))
@example(k=True)
@example(k=10.0)
@example(k="10")
def test_k_is_a_strict_integer_over_http(app, k):
    response = call(app, "POST", "/recommend", json={"query": {"user_id": "user07"}, "k": k})
    assert response.status_code == 422 and response.json()["error"].startswith("k: "), response.text


@SETTINGS
@given(k=st.integers(1, MAX_K))
def test_an_integer_k_is_served(app, world, k):  # noqa: F811
    response = call(app, "POST", "/recommend", json={"query": {"user_id": "user07"}, "k": k})
    assert response.status_code == 200 and len(response.json()["item_ids"]) == min(k, len(world["item_ids"]))
