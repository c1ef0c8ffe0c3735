"""Several training steps a call (``train.steps_per_execution``) train as one step a call does,
and the bare step the step benchmark bounds the loop with computes the same thing compiled or not."""

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

import retrieval  # noqa: F401
from benchmarks.bench_steps import bare_step
from retrieval.config import ConfigError, ModelConfig, TrainConfig, load_config
from retrieval.features import FeatureStatistics
from retrieval.model import build_model
from retrieval.training import fit, seed_everything
from retrieval.training.loop import steps_function
from retrieval.training.optimizers import make_optimizer
from retrieval.training.sources import FrameClicks


def _clicks(seed=0, users=40, items=30, clicks=500):
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"user_id": [f"u{u}" for u in rng.integers(0, users, clicks)],
                         "item_id": [f"i{i}" for i in np.minimum(rng.zipf(1.3, clicks), items)]})


MODEL = ModelConfig(embedding_dim=8, loss=dict(negatives="mixed", num_negatives=6))


def _fit(clicks, per_call: int, **train):
    seed_everything(4)
    model = build_model(MODEL, FeatureStatistics.from_training_clicks(clicks))
    config = TrainConfig(**{"epochs": 2, "batch_size": 48, "verbose": 0, "checkpoint_every_seconds": 0,
                            "validation_fraction": 0, "steps_per_execution": per_call, **train})
    history = fit(model, clicks, config)
    return history, model.get_weights()


def test_several_steps_a_call_train_as_single_steps():
    """2 epochs of 11 steps (the last one short) at 4 steps a call: the losses and weights of a call a
    step, to float32 rounding (the steps run in a graph loop whose kernels may fuse otherwise)."""
    clicks = _clicks()
    single, single_weights = _fit(clicks, 1)
    looped, looped_weights = _fit(clicks, 4)
    assert len(looped["loss"]) == 2
    np.testing.assert_allclose(looped["loss"], single["loss"], rtol=1e-5)
    for got, want in zip(looped_weights, single_weights, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)
    assert not np.allclose(single_weights[0], _fit(clicks, 1, epochs=1)[1][0])  # the second epoch trained


def test_where_calls_end_changes_no_bit_early_stopping_included():
    """Calls of 3 and of 5 steps give bit-identical histories (validation recall and best epoch
    included) and weights: the early-stopping selection, its refit, and a resume, which cuts calls
    elsewhere, train the same steps."""
    clicks = _clicks(1)
    train = {"epochs": 3, "validation_fraction": 0.2, "early_stopping_patience": 3}
    three, three_weights = _fit(clicks, 3, **train)
    five, five_weights = _fit(clicks, 5, **train)
    assert "val_recall@20" in three and len(three["val_recall@20"]) == 3
    assert three == five
    for got, want in zip(three_weights, five_weights, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_call_stops_where_its_batches_end():
    """``steps_function`` asked for more steps than the iterator holds runs what there is and says so."""
    clicks = _clicks(2, clicks=100)
    seed_everything(0)
    model = build_model(MODEL, FeatureStatistics.from_training_clicks(clicks))
    model.compile(optimizer=make_optimizer(TrainConfig()))
    model.optimizer.build(model.trainable_variables)
    batches = FrameClicks(clicks, 32, seed=0).epoch(0)  # 4 batches: 32, 32, 32, 4
    run = steps_function(model, {"loss": tf.float32, "regularization_loss": tf.float32, "total_loss": tf.float32})
    iterator = iter(batches)
    first = run(iterator, tf.constant(3))
    rest = run(iterator, tf.constant(3))
    assert [len(first["loss"]), len(rest["loss"])] == [3, 1]
    assert len(run(iterator, tf.constant(3))["loss"]) == 0
    assert int(model.optimizer.iterations) == 4
    assert np.all(np.isfinite(first["loss"].numpy()))


@pytest.mark.parametrize("value, error", [(0, "steps_per_execution"), ("two", "steps_per_execution")])
def test_steps_per_execution_must_be_a_positive_integer(value, error):
    with pytest.raises(ConfigError, match=error):
        load_config(None, [f"train.steps_per_execution={value}"])


def test_steps_per_execution_is_one_device_only():
    with pytest.raises(ConfigError, match=r"train\.steps_per_execution=8 .*train\.distribute='mirrored'"):
        load_config(None, ["train.steps_per_execution=8", "train.distribute=mirrored"])


@pytest.mark.parametrize("shared", [0, 7], ids=["in-batch", "shared"])
def test_bare_step_compiled_equals_graph_and_a_numpy_reference(shared):
    """The benchmark's bound: the XLA-compiled bare step computes the graph step's loss and updates,
    and both the loss a numpy softmax cross-entropy gives on the same rows."""
    users, items, dim, batch = 20, 30, 8, 6
    user_rows = tf.constant([1, 4, 4, 9, 20, 3], tf.int32)
    item_rows = tf.constant([2, 7, 30, 11, 2, 5], tf.int32)
    seed = tf.constant([3, 0])
    results = []
    for jit in (False, True):
        tf.random.set_seed(0)
        step, (user_table, item_table) = bare_step(users, items, dim, batch, shared, jit)
        tables = user_table.numpy(), item_table.numpy()
        loss = float(step(user_rows, item_rows, seed))
        results.append((loss, user_table.numpy(), item_table.numpy(), tables))
    (graph_loss, graph_users, graph_items, (users0, items0)), (xla_loss, xla_users, xla_items, _) = results
    np.testing.assert_allclose(xla_loss, graph_loss, rtol=1e-5)
    np.testing.assert_allclose(xla_users, graph_users, atol=1e-6)
    np.testing.assert_allclose(xla_items, graph_items, atol=1e-6)
    assert not np.allclose(graph_users, users0)  # the touched rows moved

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    queries, positives = unit(users0[user_rows.numpy()]), unit(items0[item_rows.numpy()])
    if shared:
        negatives = tf.random.stateless_uniform([shared], seed, minval=1, maxval=items + 1, dtype=tf.int32).numpy()
        logits = np.concatenate([np.sum(queries * positives, 1, keepdims=True),
                                 queries @ unit(items0[negatives]).T], axis=1) / 0.1
        labels = np.zeros(batch, int)
    else:
        logits, labels = queries @ positives.T / 0.1, np.arange(batch)
    logits = logits - logits.max(1, keepdims=True)
    expected = np.mean(np.log(np.exp(logits).sum(1)) - logits[np.arange(batch), labels])
    np.testing.assert_allclose(graph_loss, expected, rtol=1e-5)


class _Iterated:
    """A ``FrameClicks`` seen only through the ``ClickSource`` interface: the loop iterates its ``tf.data`` epochs."""

    reads_own_shards = False

    def __init__(self, frame: FrameClicks):
        self.frame, self.batch_size, self.steps_per_epoch, self.rows = (
            frame, frame.batch_size, frame.steps_per_epoch, frame.rows)

    def epoch(self, epoch, skip_batches=0):
        return self.frame.epoch(epoch, skip_batches)

    def check_epoch(self):
        pass


def test_batches_cut_in_the_graph_loop_are_the_input_pipelines():
    """With several steps a call a frame's batches are cut from its columns inside the graph loop; an
    iterator over its ``tf.data`` epochs trains bit for bit the same model."""
    clicks = _clicks(3)
    config = TrainConfig(epochs=2, batch_size=48, verbose=0, checkpoint_every_seconds=0, validation_fraction=0,
                         steps_per_execution=4)
    results = []
    for source in (clicks, _Iterated(FrameClicks(clicks, config.batch_size, seed=config.seed))):
        seed_everything(4)
        model = build_model(MODEL, FeatureStatistics.from_training_clicks(clicks))
        results.append((fit(model, source, config), model.get_weights()))
    (resident, resident_weights), (iterated, iterated_weights) = results
    assert resident == iterated
    for got, want in zip(resident_weights, iterated_weights, strict=True):
        np.testing.assert_array_equal(got, want)
