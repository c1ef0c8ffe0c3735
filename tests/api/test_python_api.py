"""The Python API (``retrieval.train -> Run``, ``retrieval.open_run``) and custom Keras towers."""

import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import retrieval
from retrieval.config import ConfigError
from retrieval.serving import Bundle, BundleError

SMALL = [
    "data.synthetic.n_users=400",
    "data.synthetic.n_items=200",
    "data.synthetic.mean_clicks_per_user=20",
    "train.epochs=2",
    "train.validation_fraction=0",
    "train.batch_size=256",
    "train.verbose=0",
    "model.embedding_dim=16",
]

pytestmark = pytest.mark.slow


def _small(tmp_path) -> list[str]:
    return [*SMALL, f"run.output_dir={tmp_path}"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return retrieval.train(overrides=_small(tmp_path_factory.mktemp("api")), name="api")


def test_train_returns_the_exported_run_and_its_metrics(run):
    assert run.directory.name == "api" and (run.directory / "manifest.json").is_file()
    assert run.metrics["model"]["recall@20"] > run.metrics["popularity"]["recall@20"]
    assert run.config.model.embedding_dim == 16 and run.config.train.epochs == 2


def test_run_recommend_is_the_bundles_answer(run):
    bundle = Bundle.load(run.directory)
    user = run.bundle.manifest["probe"]["query"]["user_id"]
    for exclude_seen in (True, False):
        ours = run.recommend(user, k=7, exclude_seen=exclude_seen)
        theirs = bundle.recommend({"user_id": user}, k=7, exclude_seen=exclude_seen)
        assert ours.item_ids == theirs.item_ids and np.allclose(ours.scores, theirs.scores)
    assert run.recommend(user, k=7).item_ids != run.recommend(user, k=7, exclude_seen=False).item_ids
    item = run.recommend(user, k=1).item_ids[0]
    assert run.similar_items(item, k=5).item_ids == bundle.similar_items(item, k=5).item_ids
    assert [r.item_ids for r in run.recommend_batch([{"user_id": user}], k=3)] == [run.recommend(user, k=3).item_ids]


def test_open_run_and_evaluate_reproduce_the_job(run):
    opened = retrieval.open_run(run.directory)
    assert opened.metrics == run.metrics
    again = opened.evaluate()
    assert again["model"]["recall@20"] == pytest.approx(run.metrics["model"]["recall@20"], abs=1e-6)


def test_open_run_of_a_directory_that_is_no_bundle(tmp_path):
    with pytest.raises(BundleError, match="manifest.json"):
        retrieval.open_run(tmp_path)


def test_import_retrieval_does_not_import_tensorflow():
    code = "import sys, retrieval; assert 'tensorflow' not in sys.modules; retrieval.train; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "ok"
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        retrieval.trian  # noqa: B018


def _mlp_towers(context):
    """Own towers: a StringLookup + embedding + a dense layer each, over the job's vocabularies."""

    def tower(feature, vocabulary, name):
        ids = tf.keras.Input(shape=(), dtype=tf.string, name=feature)
        rows = tf.keras.layers.StringLookup(vocabulary=list(vocabulary.ids))(ids)
        hidden = tf.keras.layers.Embedding(len(vocabulary) + 1, 32)(rows)
        out = tf.keras.layers.Dense(context.embedding_dim)(tf.keras.layers.Dense(32, activation="relu")(hidden))
        return tf.keras.Model({feature: ids}, tf.keras.layers.UnitNormalization()(out), name=name)

    return tower("user_id", context.users, "my_query"), tower("item_id", context.items, "my_doc")


def test_custom_keras_towers_train_export_and_serve(tmp_path):
    run = retrieval.train(overrides=[*_small(tmp_path), "train.epochs=4"], towers=_mlp_towers, name="custom")
    assert run.metrics["model"]["recall@20"] > run.metrics["popularity"]["recall@20"]
    # The exported query SavedModel is the custom tower: its embedding, through the bundle, ranks the index.
    user = run.bundle.manifest["probe"]["query"]["user_id"]
    query = tf.saved_model.load(str(run.bundle.directory / run.bundle.manifest["files"]["query_model"]))
    embedding = query.signatures["serving_default"](user_id=tf.constant([user]))["embedding"].numpy()
    assert embedding.shape == (1, 16)
    scores = run.bundle.index.vectors(np.arange(len(run.bundle.index.item_ids))) @ embedding[0]
    top = [run.bundle.index.item_ids[i] for i in np.argsort(-scores, kind="stable")[:5]]
    assert run.recommend(user, k=5, exclude_seen=False).item_ids == top


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda context: _mlp_towers(context)[0], r"returns \(query_tower, doc_tower\)"),
        (lambda context: (lambda features: features, _mlp_towers(context)[1]), "must be a functional tf.keras.Model"),
        (lambda context: _mlp_towers(context)[::-1], r"custom query tower reads \['item_id'\]"),
    ],
)
def test_a_bad_tower_factory_is_refused_before_training(tmp_path, factory, message):
    with pytest.raises(ConfigError, match=message):
        retrieval.train(overrides=_small(tmp_path), towers=factory)
    assert not list(tmp_path.iterdir())  # no run directory left behind
