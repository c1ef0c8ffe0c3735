"""tf.distribute: two replicas with cross-replica in-batch negatives train exactly as one device.

Two logical CPU devices must be set up before TensorFlow initialises its
devices, so the distributed runs happen in a subprocess
(``tests/_distribute_check.py``), which reports measured numbers as JSON; the
assertions are here. The reference is the same model (same seed, same global
batches) trained on one device with the default strategy.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
from pydantic import ValidationError

import retrieval  # noqa: F401
from retrieval.common.replicas import global_batch_size, replica_row_offset
from retrieval.config import TrainConfig
from retrieval.losses import LossInputs, gather_across_replicas
from retrieval.samplers import Negatives
from retrieval.training import distribution_strategy

ROOT = Path(__file__).resolve().parents[2]
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



# --- Out of core under multi_worker: each worker streams its own shards; checkpoints survive a kill. ---

STREAMED = """\
data:
  source: files
  out_of_core: true
  columns: {weight: weight}
  stream: {read_batch_size: 64, shuffle_buffer: 128, max_test_users: 50, seed: 3}
split: {kind: random, test_fraction: 0.1}
model: {embedding_dim: 8, loss: {log_q_source: streaming, streaming: {num_buckets: 256}}}
train:
  epochs: 2
  batch_size: 32
  optimizer: lazy_adam
  verbose: 0
  validation_fraction: 0
  distribute: multi_worker
  checkpoint_every_steps: 3
  checkpoint_every_seconds: 0
index: {factory: Flat}
evaluation: {ks: [10], plots: false, baselines: {rankers: []}}
export: {topk_model: false}
"""
# Uneven: worker 0 reads shards 0, 2, 4 (690 clicks), worker 1 shards 1, 3 (210).
SHARD_ROWS = [260, 120, 200, 90, 230]


@pytest.fixture(scope="module")
def streamed_log(tmp_path_factory) -> dict:
    """A tiny click log as five Parquet shards of uneven sizes, and the job's config file."""
    folder = tmp_path_factory.mktemp("streamed")
    rng = np.random.default_rng(0)
    rows = sum(SHARD_ROWS)
    clicks = pd.DataFrame({
        "user_id": [f"u{u}" for u in rng.integers(0, 60, rows)],
        "item_id": [f"i{i}" for i in np.minimum(rng.zipf(1.3, rows), 80)],
        "timestamp": rng.integers(0, 10_000, rows),
        "weight": (1 + np.arange(rows) / 1024).astype(np.float32),  # exact in float32: tells the clicks apart
    })
    (folder / "shards").mkdir()
    for i, part in enumerate(np.split(np.arange(rows), np.cumsum(SHARD_ROWS)[:-1])):
        clicks.iloc[part].to_parquet(folder / "shards" / f"part-{i}.parquet", index=False)
    (folder / "job.yaml").write_text(STREAMED)
    return {"folder": folder, "config": folder / "job.yaml", "shards": folder / "shards"}


def _job(log: dict, name: str, index: int, workers: list[str], *extra: str) -> tuple[list[str], dict]:
    """Worker ``index``'s command and environment for the out-of-core job ``name``: its own
    run.output_dir, the checkpoint_dir shared."""
    settings = [f"data.clicks.path={log['shards']}", f"run.name={name}",
                f"run.output_dir={log['folder'] / name / f'worker{index}'}",
                f"train.checkpoint_dir={log['folder'] / name / 'checkpoints'}"]
    tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
    return ([sys.executable, str(CHECK), "streamed_job", str(log["config"]), *settings, *extra],
            {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_CONFIG": json.dumps(tf_config)})


def _start_job(log: dict, name: str, index: int, workers: list[str], *extra: str) -> subprocess.Popen:
    """Worker ``index`` of job ``name``, its stdout and stderr in ``<folder>/<name>/worker<index>.json``
    and ``.log`` (files: a full pipe would stall the worker, and its peer with it)."""
    command, env = _job(log, name, index, workers, *extra)
    folder = log["folder"] / name
    with open(folder / f"worker{index}.json", "w") as stdout, open(folder / f"worker{index}.log", "w") as stderr:
        return subprocess.Popen(command, cwd=ROOT, stdout=stdout, stderr=stderr, env=env)


def _run_job(log: dict, name: str, *extra: str) -> list[tuple[dict, str]]:
    """Both workers of job ``name``, to the end: each one's JSON line and output."""
    workers = _workers()
    (log["folder"] / name).mkdir(exist_ok=True)
    processes = [_start_job(log, name, index, workers, *extra) for index in range(2)]
    results = []
    for index, process in enumerate(processes):
        try:
            process.wait(timeout=600)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
        output = (log["folder"] / name / f"worker{index}.log").read_text()
        assert process.returncode == 0, output[-4000:]
        stdout = (log["folder"] / name / f"worker{index}.json").read_text()
        results.append((json.loads(stdout.strip().splitlines()[-1]), output))
    return results


def _workers() -> list[str]:
    return [f"localhost:{_free_port()}", f"localhost:{_free_port()}"]


@pytest.fixture(scope="module")
def streamed(streamed_log) -> list[dict]:
    """Two workers run the job uninterrupted (checkpointing as they go), then report what each read."""
    return [result for result, _ in _run_job(streamed_log, "whole")]


def _rows(batches: list) -> list:
    return sorted(tuple(row) for batch in batches for row in batch)


def test_streamed_shards_are_split_between_the_workers(streamed, streamed_log):
    files = [set(worker["files"]) for worker in streamed]
    assert not files[0] & files[1]
    assert files[0] | files[1] == {str(p) for p in sorted(streamed_log["shards"].glob("*.parquet"))}
    for epoch in range(2):
        mine = [_rows(worker["epochs"][epoch]["batches"]) for worker in streamed]
        # Disjoint shares that together are every training click of the epoch, once.
        assert sorted(mine[0] + mine[1]) == sorted(tuple(row) for row in streamed[0]["whole_epochs"][epoch])
        assert len(mine[0]) > 2 * len(mine[1])  # each read its own shards (690 vs 210 clicks, less test)
        assert not set(mine[0]) & set(mine[1])
        # The same number of steps on both (a worker short of batches would hang the other).
        assert [w["epochs"][epoch]["steps"] for w in streamed] == [streamed[0]["steps"]] * 2


def test_streamed_multi_worker_job_completes_with_the_same_model_on_every_worker(streamed):
    first, second = (worker["metrics"] for worker in streamed)
    assert first["data"]["train_clicks"] == second["data"]["train_clicks"] > 700
    assert first["model"] == second["model"] and 0 < first["model"]["recall@10"] <= 1
    assert streamed[0]["train_log"] == streamed[1]["train_log"]
    assert np.isfinite(first["final_train_loss"])


def _latest_step(checkpoints: Path) -> int | None:
    state = checkpoints / "checkpoint"  # tf.train.CheckpointManager's index, rewritten atomically
    match = re.search(r'^model_checkpoint_path: "ckpt-(\d+)"', state.read_text(), re.M) if state.exists() else None
    return int(match.group(1)) if match else None


def test_killed_worker_resumes_from_the_chief_checkpoint_and_ends_as_an_uninterrupted_run(streamed, streamed_log):
    """SIGKILL worker 1 mid-epoch (the second epoch); its peer fails on the lost heartbeats (or is
    killed too); both started again resume from the chief's last checkpoint and end with the
    uninterrupted run's logs and model."""
    steps = streamed[0]["steps"]
    checkpoints = streamed_log["folder"] / "killed" / "checkpoints" / ".killed.checkpoints"
    (streamed_log["folder"] / "killed").mkdir()
    workers = _workers()
    # Saves due by time too: the workers must agree on the step of each.
    extra = ("--no-probe", "train.checkpoint_every_seconds=1")
    processes = [_start_job(streamed_log, "killed", index, workers, *extra) for index in range(2)]
    killed_at, deadline = None, time.monotonic() + 400
    try:
        while killed_at is None and all(p.poll() is None for p in processes) and time.monotonic() < deadline:
            step = _latest_step(checkpoints)
            if step is not None and step > steps + steps // 3 and step % steps:  # well into epoch 2
                processes[1].send_signal(signal.SIGKILL)
                killed_at = step
            time.sleep(0.05)
        processes[1].wait()
        try:
            processes[0].wait(timeout=60)  # the chief sees its peer's heartbeats stop and fails
        except subprocess.TimeoutExpired:
            processes[0].kill()
            processes[0].wait()
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    output = (streamed_log["folder"] / "killed" / "worker0.log").read_text()
    assert killed_at is not None, f"the run ended before a mid-epoch checkpoint of epoch 2:\n{output[-3000:]}"
    assert processes[0].returncode != 0 and processes[1].returncode == -signal.SIGKILL
    assert not (streamed_log["folder"] / "killed" / "worker0" / "killed").exists()  # no run directory

    for result, output in _run_job(streamed_log, "killed", *extra):
        found = re.search(r"resuming from step (\d+) \(epoch 2/2", output)
        assert found and int(found.group(1)) >= killed_at, output[-3000:]
        # Every epoch's loss, the one before the kill included, and the model's metrics.
        assert result["train_log"] == streamed[0]["train_log"]
        assert result["metrics"]["model"] == streamed[0]["metrics"]["model"]
    assert not checkpoints.exists()  # deleted by the chief once its job succeeded
