"""tf.distribute: two replicas with cross-replica in-batch negatives train exactly as one device.

Two logical CPU devices must be set up before TensorFlow initialises its
devices, so the distributed runs happen in a subprocess
(``tests/_distribute_check.py``), which reports measured numbers as JSON; the
assertions are here. The reference is the same model (same seed, same global
batches) trained on one device with the default strategy.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from pydantic import ValidationError

import retrieval  # noqa: F401
from retrieval.config import TrainConfig
from retrieval.losses import LossInputs, gather_across_replicas
from retrieval.samplers import Negatives, global_batch_size, replica_row_offset
from retrieval.training import distribution_strategy

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "_distribute_check.py"

pytestmark = pytest.mark.slow
EXACT = ["in_batch_static", "in_batch_streaming_top_k", "full_softmax"]


def _start(mode: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(CHECK), mode],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})},
    )


def _result(process: subprocess.Popen) -> dict:
    try:
        stdout, stderr = process.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        process.kill()  # e.g. one worker died and the other waits for it
        stdout, stderr = process.communicate()
    assert process.returncode == 0, stderr[-4000:]
    return json.loads(stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def checks():
    """The subprocess checks, run side by side: MirroredStrategy over two logical CPUs,
    and two MultiWorkerMirroredStrategy workers on localhost (TF_CONFIG)."""
    workers = [f"localhost:{_free_port()}", f"localhost:{_free_port()}"]
    processes = {"mirrored": _start("mirrored")}
    for index in range(2):
        tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        processes[f"worker{index}"] = _start("multi_worker", {"TF_CONFIG": json.dumps(tf_config)})
    return {name: _result(process) for name, process in processes.items()}


@pytest.fixture(scope="module")
def mirrored(checks):
    return checks["mirrored"]


def test_two_logical_cpus_give_two_replicas(mirrored):
    assert mirrored["replicas"] == 2


@pytest.mark.parametrize("name", EXACT)
def test_loss_with_two_replicas_equals_one_device(mirrored, name):
    result = mirrored["exact"][name]
    assert result["initial_weight_difference"] == 0.0
    for batch in result["batches"]:
        # The 15-row batch is split unevenly; every row is on some replica.
        assert sum(batch["replica_rows"]) == batch["rows"] and min(batch["replica_rows"]) >= 7
        np.testing.assert_allclose(batch["loss_two_replicas"], batch["loss_one_device"], rtol=1e-5)
        # Row for row, the replicas' logits and labels are the single-device ones.
        assert batch["logit_difference"] < 1e-5 and batch["labels_equal"]


def test_every_query_scores_the_whole_global_batch(mirrored):
    for batch in mirrored["exact"]["in_batch_static"]["batches"]:
        assert batch["replica_logit_columns"] == [batch["rows"]] * 2
        # Each replica scoring only its own rows (TFRS) is a different, easier loss.
        assert batch["loss_without_gathering"] < batch["loss_one_device"] - 0.1, batch


def test_hard_negatives_are_mined_over_the_global_batch(mirrored):
    batches = mirrored["exact"]["in_batch_streaming_top_k"]["batches"]
    assert all(b["replica_logit_columns"] == [4, 4] for b in batches)  # positive + 3 of 16 / 15
    assert all(b["loss_without_gathering"] < b["loss_one_device"] - 0.1 for b in batches)


@pytest.mark.parametrize("name", EXACT)
def test_sgd_steps_with_two_replicas_match_one_device(mirrored, name):
    """Two SGD steps (the second on an uneven 8/7 split): gradients flow back through
    the all-gather to every replica's doc tower, and the replicas' summed
    gradients are the single-device gradient, regularization included."""
    result = mirrored["exact"][name]
    assert result["weight_change"] > 0.1  # the steps moved the weights
    assert result["trained_weight_difference"] < 1e-5
    for key in ("fit_loss", "fit_regularization_loss", "fit_total_loss"):
        one, two = result[key]
        np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-7, err_msg=key)


def test_regularization_is_counted_once_over_replicas(mirrored):
    one, two = mirrored["exact"]["in_batch_static"]["fit_regularization_loss"]
    assert one > 0.01
    np.testing.assert_allclose(two, one, rtol=1e-5)


def test_streaming_log_q_advances_once_per_global_step(mirrored):
    result = mirrored["exact"]["in_batch_streaming_top_k"]
    one, two = result["streaming_steps"]
    assert one == two > 0
    assert result["streaming_gap_difference"] == 0.0
    # A running mean of the *global* batch sizes (16, 15); one replica's rows would give about 8.
    one, two = result["streaming_draws_per_step"]
    assert one == two and 15 <= two <= 16


def test_mixed_negatives_draw_per_replica_and_train(mirrored):
    losses = mirrored["smoke"]["mixed"]
    assert len(losses) == 1 and np.isfinite(losses[0]) and 0 < losses[0] < 20


def test_mined_hard_negatives_are_not_yet_distributed(mirrored):
    assert "not yet supported" in mirrored["mined_error"]


def test_fit_with_early_stopping_under_mirrored_matches_one_device(mirrored):
    one, two = mirrored["fit"]["none"], mirrored["fit"]["mirrored"]
    assert (one["replicas"], two["replicas"]) == (1, 2)
    for key in ("selection_loss", "loss"):
        np.testing.assert_allclose(two["history"][key], one["history"][key], rtol=1e-4, err_msg=key)
    losses = two["history"]["loss"]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    recall = two["history"]["val_recall@20"]
    np.testing.assert_allclose(recall, one["history"]["val_recall@20"], atol=1e-9)
    assert all(0 < r <= 1 for r in recall)
    assert two["history"]["best_epoch"] == one["history"]["best_epoch"]


@pytest.mark.parametrize("worker", ["worker0", "worker1"])
def test_two_workers_train_exactly_as_one_device(checks, worker):
    """Two processes, one replica each, cluster from TF_CONFIG: Keras shards every
    shuffled global batch over the workers, and both end with the single-device weights."""
    result = checks[worker]
    assert result["is_multi_worker"] and result["replicas"] == 2
    np.testing.assert_allclose(result["loss"], result["loss_one_device"], rtol=1e-5)
    assert result["loss"][-1] < result["loss"][0]
    assert result["weight_difference"] < 1e-5


def test_multi_worker_without_tf_config_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="TF_CONFIG environment variable, which is not set"):
        distribution_strategy(TrainConfig(distribute="multi_worker"))


def test_distribute_config():
    assert TrainConfig().distribute == "none"
    assert distribution_strategy(TrainConfig()) is tf.distribute.get_strategy()
    with pytest.raises(ValidationError, match="distribute"):
        TrainConfig(distribute="tpu")


def test_outside_a_replica_step_nothing_is_gathered():
    queries = tf.random.stateless_normal([5, 3], seed=(1, 2))
    inputs = LossInputs(
        queries=queries,
        positives=queries,
        positive_ids=tf.range(1, 6, dtype=tf.int64),
        negatives=(Negatives(tf.zeros([0], tf.int64), tf.zeros([0]), tf.zeros([5])),),
        negative_embeddings=(tf.zeros([0, 3]),),
        includes_batch_positives=True,
    )
    assert gather_across_replicas(inputs) is inputs
    offset, total = replica_row_offset(5)
    assert (int(offset), int(total), int(global_batch_size(5))) == (0, 5, 5)
