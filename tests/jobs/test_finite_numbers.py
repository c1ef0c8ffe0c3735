"""Numbers are finite everywhere a model computes with them, or refused with a clear error.

- Feature tables: a numeric value is finite in float32 (the click weights' rule) or missing (an
  empty cell); anything else fails when the table is read, naming its file, line (or row) and column.
- Queries: a numeric feature is a number finite in its input's dtype or null (missing); NaN, inf, 1e39
  and integers of hundreds of digits are a 422 naming the feature over HTTP, a ValueError in Python. A
  query whose embedding comes out non-finite is an error too, never an empty answer.
- Training: the first step with a non-finite loss stops the run, naming the step and what to change,
  and leaves no checkpoint a next run would offer to resume.
"""

import json
import logging
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_service import DIM, _fixed_id_tower, call

import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow)
from retrieval.bundle.writer import write_bundle
from retrieval.config import IndexConfig, TableConfig, load_config
from retrieval.data import DataError, read_feature_table
from retrieval.data.synthetic import generate_clicks
from retrieval.data.values import FLOAT32_MAX
from retrieval.features import FeatureStatistics, TowerTables
from retrieval.index import build_index
from retrieval.jobs import train_evaluate_export
from retrieval.model import build_model
from retrieval.serving import Bundle
from retrieval.serving.http import create_app
from retrieval.training import TrainingCheckpoint, TrainingDiverged, fit, make_optimizer

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Numbers no float32 feature can hold, as JSON (Python's json reads Infinity and NaN) spells them ...
NON_FINITE_JSON = st.one_of(
    st.sampled_from(["Infinity", "-Infinity", "NaN", "1e39", "-1e39", "1e308", "3.5e38"]),
    st.floats(FLOAT32_MAX * 1.0001, 1e308).map(repr),
    st.floats(-1e308, -FLOAT32_MAX * 1.0001).map(repr),
    st.integers(39, 400).map(lambda digits: "9" * digits),  # an integer beyond float32 (401 digits: beyond float64)
)
# ... and as a CSV cell may.
NON_FINITE_TEXT = st.one_of(NON_FINITE_JSON, st.sampled_from(["inf", "-inf", "+inf", "INF", "nan", "-nan"]))
FINITE = st.floats(-FLOAT32_MAX, FLOAT32_MAX, width=32)


# --- feature tables, when read ---


def _item_table(tmp_path: Path, fmt: str, prices: list, name: str = "items") -> TableConfig:
    frame = pd.DataFrame({"item_id": [f"i{i}" for i in range(len(prices))], "price": prices})
    path = tmp_path / f"{name}.{fmt}"
    if fmt == "csv":
        path.write_text("item_id,price\n" + "".join(f"{i},{p}\n" for i, p in zip(frame.item_id, prices)))
    else:
        frame.assign(price=frame.price.astype(np.float64)).to_parquet(path)
    return TableConfig(path=str(path))


@SETTINGS
@given(bad=NON_FINITE_TEXT, row=st.integers(0, 4), others=st.lists(FINITE, min_size=5, max_size=5))
@example(bad="inf", row=0, others=[1.0] * 5)
@example(bad="1e39", row=2, others=[0.5] * 5)
def test_a_csv_number_float32_cannot_hold_is_refused_at_its_line(tmp_path_factory, bad, row, others):
    prices = [repr(float(v)) for v in others]
    prices[row] = bad
    table = _item_table(tmp_path_factory.mktemp("csv"), "csv", prices)
    with pytest.raises(DataError) as error:
        read_feature_table(table, "item_id")
    assert str(error.value).startswith(f"{table.path}, line {row + 2}, column 'price': number ")
    assert error.value.line == row + 2 and error.value.column == "price"


@SETTINGS
@given(bad=st.sampled_from([math.inf, -math.inf, 1e39, -1e308, 3.5e38]), row=st.integers(0, 4))
def test_a_parquet_number_float32_cannot_hold_is_refused_at_its_row(tmp_path_factory, bad, row):
    prices = [1.0, 2.0, float("nan"), 4.0, 5.0]  # NaN: a null, a missing value, is fine
    prices[row] = bad
    table = _item_table(tmp_path_factory.mktemp("pq"), "parquet", prices)
    with pytest.raises(DataError, match=rf"^{table.path}, row {row + 1}, column 'price': number "):
        read_feature_table(table, "item_id")


@SETTINGS
@given(values=st.lists(st.one_of(FINITE, st.none()), min_size=1, max_size=6))
def test_finite_numbers_and_empty_cells_load_as_float32_values_and_nan(tmp_path_factory, values):
    cells = ["" if v is None else repr(float(v)) for v in values]
    if all(v is None for v in values):
        cells[0] = "1.5"
        values = [1.5, *values[1:]]
    table = _item_table(tmp_path_factory.mktemp("ok"), "csv", cells)
    prices = read_feature_table(table, "item_id")["price"].to_numpy()
    expected = np.array([np.nan if v is None else v for v in values], dtype=np.float64)
    assert np.array_equal(prices.astype(np.float32), expected.astype(np.float32), equal_nan=True)


NUMERIC_TOWERS = load_config(None, [
    "towers.doc.features=[{name: item_id, kind: id}, {name: price, kind: numeric}]",
]).towers


@pytest.mark.parametrize("bad", [math.inf, -math.inf, 1e39, "inf", "1e39", "nan", True])
def test_a_joined_value_float32_cannot_hold_names_the_feature(bad):
    clicks, _, _ = generate_clicks(load_config(None, ["data.synthetic.n_users=20", "data.synthetic.n_items=8"])
                                   .data.synthetic)
    items = pd.DataFrame({"item_id": sorted(clicks.item_id.unique())})
    items["price"] = pd.Series([bad] + [1.0] * (len(items) - 1), dtype=object)
    with pytest.raises(DataError, match=r"towers.doc: feature 'price' \(numeric\) reads column 'price': "):
        TowerTables(NUMERIC_TOWERS, clicks, None, items).catalogue()


# --- queries, at serving ---

SCALE = 1e30  # the test tower's weight on `age`: an age above ~3e8 overflows float32 inside the tower


def _age_tower(ids: list[str], vectors: np.ndarray) -> tf.keras.Model:
    """user_id + age -> id embedding + age * SCALE in every coordinate (a missing age counts 0)."""
    ids_only = _fixed_id_tower("user_id", ids, vectors)
    inputs = {"user_id": tf.keras.Input(shape=(), dtype=tf.string, name="user_id"),
              "age": tf.keras.Input(shape=(), dtype=tf.float32, name="age")}
    age = tf.keras.layers.Lambda(
        lambda a: tf.tile(tf.expand_dims(tf.where(tf.math.is_nan(a), 0.0, a) * SCALE, 1), [1, DIM])
    )(inputs["age"])
    return tf.keras.Model(inputs, tf.keras.layers.Add()([ids_only(inputs["user_id"]), age]))


@pytest.fixture(scope="module")
def age_bundle(tmp_path_factory):
    """A bundle whose query tower reads user_id and a numeric feature `age`, and its app."""
    rng = np.random.default_rng(0)
    item_ids, user_ids = [f"item{i}" for i in range(30)], [f"user{u}" for u in range(5)]
    items = rng.normal(size=(30, DIM)).astype(np.float32)
    users = rng.normal(size=(5, DIM)).astype(np.float32)
    index = build_index(item_ids, items, IndexConfig(), users, "test users")
    directory = tmp_path_factory.mktemp("bundle") / "age"
    directory.mkdir()
    write_bundle(directory, query_tower=_age_tower(user_ids, users), index=index,
                 doc_tower=_fixed_id_tower("item_id", item_ids, items),
                 manifest={"run": "age", "popular_item_ids": item_ids[:5]})
    bundle = Bundle.load(directory)
    assert sorted(bundle.query_features) == ["age", "user_id"]
    return bundle, create_app(bundle)


def _post(app, body: str):
    return call(app, "POST", "/recommend", content=body.encode(), headers={"content-type": "application/json"})


@SETTINGS
@given(number=NON_FINITE_JSON)
@example(number="1e308")
@example(number="Infinity")
@example(number="9" * 401)
def test_a_query_number_float32_cannot_hold_is_a_422_naming_the_feature(age_bundle, number):
    bundle, app = age_bundle
    response = _post(app, f'{{"query": {{"user_id": "user1", "age": {number}}}, "k": 3}}')
    assert response.status_code == 422, response.text
    assert "feature 'age' must be a finite number" in response.json()["error"]
    with pytest.raises(ValueError, match="feature 'age' must be a finite number"):
        bundle.recommend({"user_id": "user1", "age": json.loads(number)}, k=3)


@SETTINGS
@given(age=st.one_of(FINITE, st.integers(-(2**63), 2**63), st.none()))
@example(age=None)
@example(age=1e20)
def test_a_finite_query_number_gets_items_or_a_clear_error_never_an_empty_answer(age_bundle, age):
    _, app = age_bundle
    response = call(app, "POST", "/recommend", json={"query": {"user_id": "user1", "age": age}, "k": 3})
    if response.status_code == 200:
        assert len(response.json()["item_ids"]) == 3
    else:  # the tower (or the scores) overflowed on a finite age far outside anything it was made for
        assert response.status_code == 422
        error = response.json()["error"]
        assert ("query 0: the query tower's embedding is not finite" in error
                or "embedding 0: its scores overflow float32" in error), error
        assert abs(float(age)) * SCALE > 1e35


def test_a_nan_embedding_handed_to_the_search_is_an_error(age_bundle):
    bundle, _ = age_bundle
    embeddings = np.ones((3, DIM), np.float32)
    embeddings[1, 4] = np.nan
    with pytest.raises(ValueError, match="embedding 1: the query tower's embedding is not finite"):
        bundle.recommend_embedded(embeddings, np.ones(3, bool), k=3)


# --- training ---

DIVERGING = [  # plain SGD at a learning rate that sends the weights past float32 within two steps
    "data.synthetic.n_users=60", "data.synthetic.n_items=40", "data.synthetic.mean_clicks_per_user=10",
    "model.embedding_dim=8", "model.normalize=false", "train.optimizer=sgd", "train.learning_rate=1e30",
    "train.epochs=2", "train.batch_size=32", "train.verbose=0", "train.checkpoint_every_steps=1",
    "train.validation_fraction=0",
    "evaluation.baselines.rankers=[]", "evaluation.plots=false", "export.topk_model=false",
]


def _restored(config, clicks, directory):
    """The state of the newest checkpoint in ``directory``, restored into a fresh model whose weights must be finite."""
    model = build_model(config.model, FeatureStatistics.from_training_clicks(clicks))
    optimizer = make_optimizer(config.train)
    optimizer.build(model.trainable_variables)
    state = TrainingCheckpoint(directory, model, optimizer, every_steps=1).restore()
    assert all(bool(tf.reduce_all(tf.math.is_finite(v))) for v in model.trainable_variables)
    return state


@pytest.mark.slow
def test_a_diverging_fit_stops_at_the_step_and_never_checkpoints_it(tmp_path):
    config = load_config(None, DIVERGING)
    clicks, _, _ = generate_clicks(config.data.synthetic)
    model = build_model(config.model, FeatureStatistics.from_training_clicks(clicks))
    diverged = r"training diverged at step 2 \(epoch 1/2, batch 2\): loss nan"
    with pytest.raises(TrainingDiverged, match=diverged) as error:
        fit(model, clicks, config.train, checkpoint_dir=tmp_path, say=lambda line: None)
    assert "lower train.learning_rate (now 1e+30), or check the numeric feature values" in str(error.value)
    restored = _restored(config, clicks, tmp_path)
    assert restored is not None and restored.steps == 1  # the step before it had a finite loss and stays
    assert all(math.isfinite(value) for value in restored.epoch_sums.values())


@pytest.mark.slow
def test_weights_overflowed_by_a_finite_loss_step_are_not_saved(tmp_path, monkeypatch):
    """A step can overflow the weights while its own loss is still finite: the save refuses them."""
    config = load_config(None, [*DIVERGING[:5], "train.checkpoint_every_steps=1", "train.verbose=0", "train.epochs=2",
                                "train.batch_size=32", "train.validation_fraction=0"])
    clicks, _, _ = generate_clicks(config.data.synthetic)
    model = build_model(config.model, FeatureStatistics.from_training_clicks(clicks))
    train_step = type(model).train_step

    def overflow_at_step_4(self, batch):
        logs = train_step(self, batch)
        variable = self.trainable_variables[0]
        variable.assign(tf.where(self.optimizer.iterations >= 4, variable + np.float32(np.inf), variable))
        return logs

    monkeypatch.setattr(type(model), "train_step", overflow_at_step_4)
    with pytest.raises(TrainingDiverged, match=r"at step 4 \(epoch 1/2, batch 4\): the weights of .* are no longer "):
        fit(model, clicks, config.train, checkpoint_dir=tmp_path, say=lambda line: None)
    assert _restored(config, clicks, tmp_path).steps == 3


@pytest.mark.slow
def test_a_diverging_job_says_why_and_leaves_nothing_to_resume(tmp_path, caplog):
    config = load_config(None, [*DIVERGING, "run.name=diverged", f"run.output_dir={tmp_path}"])
    with caplog.at_level(logging.INFO, logger="retrieval"), pytest.raises(TrainingDiverged, match="step"):
        train_evaluate_export(config)
    assert not (tmp_path / ".diverged.checkpoints").exists()
    assert not (tmp_path / "diverged").exists()
    assert "run the same command again to resume" not in caplog.text
    assert "the loss diverged" in caplog.text
    # Started again with the same config, it diverges again (nothing resumed), and says so the same way.
    with caplog.at_level(logging.INFO, logger="retrieval"), pytest.raises(TrainingDiverged):
        train_evaluate_export(config)
    assert "resuming" not in caplog.text
