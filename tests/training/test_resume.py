"""Checkpoint and resume: a training job killed with SIGKILL mid-epoch, started again with the
same command, resumes from its last checkpoint and ends exactly where an uninterrupted run ends.

The model has every kind of training state a resume must carry: Adam slots, a streaming log-Q
estimator (tf.Variables), a unigram corpus sampler (a tf.random.Generator), the data position,
and the early-stopping selection (done before the kill, so the resume must not repeat it).
The killed run is tried at every ``train.verbose``, killed in the first epoch and in a later one;
its outputs, ``train_log.csv`` byte for byte, must equal an uninterrupted run's.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

import retrieval  # noqa: F401
from retrieval.bundle.saved_models import model_path
from retrieval.config import ColumnsConfig, ModelConfig, TableConfig, TrainConfig, load_config
from retrieval.data import click_keys, epoch_order, load_dataset
from retrieval.data.streaming import ClickShards, SplitPlan
from retrieval.features import FeatureStatistics
from retrieval.jobs import train_evaluate_export
from retrieval.model import build_model
from retrieval.training import (
    FrameClicks,
    StreamedClicks,
    TrainingCheckpoint,
    fit,
    seed_everything,
    steps_per_epoch,
)
from retrieval.training.checkpoint_directory import UnfinishedRunError, training_checkpoints

ROOT = Path(__file__).resolve().parents[2]
NAME = "resumed"
CONFIG = """\
data:
  source: synthetic
  synthetic: {n_users: 200, n_items: 100, mean_clicks_per_user: 20, seed: 0}
split: {kind: temporal, test_fraction: 0.2}
model:
  embedding_dim: 16
  loss:
    kind: softmax
    negatives: mixed
    mixed_corpus: unigram
    num_negatives: 8
    log_q_source: streaming
    streaming: {num_buckets: 1024}
train:
  epochs: 3
  batch_size: 32
  seed: 7
  verbose: 0
  validation_fraction: 0.1
  early_stopping_patience: 3
  checkpoint_every_steps: 5
index: {factory: Flat}
evaluation: {ks: [10, 20], plots: false, baselines: {rankers: []}}
export: {topk_model: false}
"""

pytestmark = pytest.mark.slow


def _latest_step(checkpoints: Path) -> int | None:
    state = checkpoints / "checkpoint"  # tf.train.CheckpointManager's index, rewritten atomically
    if not state.exists():
        return None
    match = re.search(r'^model_checkpoint_path: "ckpt-(\d+)"', state.read_text(), re.M)
    return int(match.group(1)) if match else None


def _best_epoch(checkpoints: Path, step: int) -> float | None:
    try:
        return json.loads((checkpoints / f"state-{step}.json").read_text())["selection"]["best_epoch"][0]
    except FileNotFoundError:  # no longer among the two kept
        return None


def _epoch_losses(run: Path) -> dict[int, float]:
    """Step -> value of every ``epoch_loss`` scalar in the run's TensorBoard train logs."""
    losses = {}
    for events in sorted((run / "tensorboard" / "train").glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(events)):
            for value in event.summary.value:
                if value.tag == "epoch_loss":
                    losses[event.step] = float(tf.make_ndarray(value.tensor))
    return losses


def _doc_embeddings(run: Path) -> np.ndarray:
    items = pd.read_parquet(run / "item_ids.parquet").sort_values("row")["item_id"].tolist()
    serve = tf.saved_model.load(str(model_path(run, "doc_model"))).signatures["serving_default"]
    return serve(item_id=tf.constant(items))["embedding"].numpy()


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "tiny.yaml"
    path.write_text(CONFIG)
    return path


@pytest.fixture(scope="module")
def reference(config_file, tmp_path_factory) -> Path:
    """An uninterrupted in-process run (no checkpoints, train.verbose=0): what every resumed run must equal."""
    out = tmp_path_factory.mktemp("reference")
    return train_evaluate_export(
        load_config(config_file, [f"run.output_dir={out}", f"run.name={NAME}", "train.checkpoint_every_steps=0",
                                  "train.checkpoint_every_seconds=0"])
    ).directory


# Every train.verbose, since the logs must not depend on it, and kills in the first epoch of the final
# run (nothing logged yet: the resumed run starts train_log.csv afresh) and in a later one.
KILLS = [(0, "later epoch"), (1, "first epoch"), (2, "first epoch")]


@pytest.fixture(scope="module", params=KILLS, ids=[f"verbose{v}-{where.split()[0]}" for v, where in KILLS])
def runs(request, config_file, reference, tmp_path_factory):
    """A subprocess run with ``train.verbose`` killed by SIGKILL where ``KILLS`` says, then resumed."""
    verbose, where = request.param
    tmp = tmp_path_factory.mktemp(f"resume-verbose{verbose}")
    out = tmp / "killed"
    command = [sys.executable, "-m", "pipelines.train", "--config", str(config_file),
               "--set", f"run.output_dir={out}", "--set", f"run.name={NAME}", "--set", f"train.verbose={verbose}"]
    checkpoints = out / f".{NAME}.checkpoints"
    # Steps per epoch of the final (refit) run: every training click, batches of 32.
    config = load_config(config_file)
    steps = steps_per_epoch(len(load_dataset(config.data, config.split).train), config.train.batch_size)
    killed_log = tmp / "killed.log"  # a file, not a pipe: a full pipe would stall the child
    with open(killed_log, "w") as log_file:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
    killed_at, deadline = None, time.monotonic() + 300
    try:
        while process.poll() is None and time.monotonic() < deadline:
            step = _latest_step(checkpoints)
            # Mid-epoch (the resume has to skip into a reshuffled epoch) and, for a later epoch, past
            # the first if early stopping chose more than one (each checkpoint's state file holds
            # the selection).
            if step and step % steps and (
                step < steps if where == "first epoch" else step > steps or _best_epoch(checkpoints, step) == 1
            ):
                os.kill(process.pid, signal.SIGKILL)
                killed_at = step
                break
            time.sleep(0.02)
    finally:
        if process.poll() is None and killed_at is None:
            process.kill()
        process.wait()  # reaped: its pid is no longer a live process
    assert killed_at is not None, (
        f"the run ended (rc {process.returncode}) before a mid-epoch checkpoint:\n"
        + killed_log.read_text()[-3000:]
    )
    left_behind = sorted(p.name for p in out.iterdir())

    resumed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return {
        "reference": reference,
        "out": out,
        "steps": steps,
        "where": where,
        "killed_at": killed_at,
        "left_behind": left_behind,
        "log": resumed.stderr,
    }


def test_kill_leaves_no_run_directory_and_the_rerun_resumes_mid_epoch(runs):
    assert runs["left_behind"][0] == f".{NAME}.checkpoints"
    assert NAME not in runs["left_behind"]  # the run directory appears only complete
    match = re.search(r"resuming from step (\d+) \(epoch (\d+)/\d+, batch (\d+)/(\d+)\)", runs["log"])
    assert match, runs["log"][-3000:]
    step, epoch, batch, steps = map(int, match.groups())
    # The newest checkpoint at the kill (a later one may have been written before the signal landed).
    assert step >= runs["killed_at"] and step % runs["steps"]
    assert (epoch - 1, batch, steps) == (step // runs["steps"], step % runs["steps"], runs["steps"])
    assert (epoch == 1) == (runs["where"] == "first epoch")  # the kill landed where the case says
    assert "early-stopping selection was done before the checkpoint" in runs["log"]
    # Complete, and nothing hidden left: checkpoints deleted, the killed run's scratch directory too.
    assert sorted(p.name for p in runs["out"].iterdir()) == [NAME]


def test_resumed_run_equals_uninterrupted_run_exactly(runs):
    """Same ops in the same order on the same bits: the resumed run must match bit for bit."""
    resumed, reference = runs["out"] / NAME, runs["reference"]
    metrics = json.loads((resumed / "metrics.json").read_text())
    expected = json.loads((reference / "metrics.json").read_text())
    assert metrics["model"] == expected["model"]
    assert metrics["final_train_loss"] == expected["final_train_loss"]
    # Every epoch's logged loss, the ones before the kill included, as CSVLogger writes them.
    assert (resumed / "train_log.csv").read_bytes() == (reference / "train_log.csv").read_bytes()
    np.testing.assert_array_equal(_doc_embeddings(resumed), _doc_embeddings(reference))
    # TensorBoard: the epochs before the kill are logged again by the resumed run.
    losses = _epoch_losses(reference)
    assert len(losses) >= 2 and _epoch_losses(resumed) == losses


def test_resume_refuses_a_changed_config_or_a_second_process(config_file, tmp_path):
    """Checkpoints of an unfinished run written under one config are not resumed under another."""

    def config(*overrides):
        base = [f"run.output_dir={tmp_path}", f"run.name={NAME}"]
        return load_config(config_file, [*base, *overrides])

    def killed(cleanup):  # what a killed job leaves: lock released, checkpoints kept
        cleanup.__exit__(RuntimeError, RuntimeError("killed"), None)

    cleanup = ExitStack()
    directory = training_checkpoints(config(), NAME, cleanup)
    assert directory == tmp_path / f".{NAME}.checkpoints"
    (directory / "checkpoint").write_text('model_checkpoint_path: "ckpt-5"\n')  # as if one was saved
    with pytest.raises(UnfinishedRunError, match="is locked"), ExitStack() as second:
        training_checkpoints(config(), NAME, second)
    killed(cleanup)
    changed = config("train.epochs=4")
    with pytest.raises(UnfinishedRunError, match=r"another config \(differs at train.epochs\)"), ExitStack() as other:
        training_checkpoints(changed, NAME, other)
    cleanup = ExitStack()  # keys that do not change what is trained may differ
    allowed = config("train.verbose=2", "train.checkpoint_every_steps=7", "evaluation.ks=[5]")
    assert training_checkpoints(allowed, NAME, cleanup) == directory
    killed(cleanup)
    assert (directory / "checkpoint").exists()
    with ExitStack() as cleanup:  # resume=false starts over; a job that succeeds deletes them
        training_checkpoints(config("train.resume=false"), NAME, cleanup)
        assert not (directory / "checkpoint").exists()
    assert not directory.exists()


class Killed(Exception):
    """Stands for the kill of the in-process test (the subprocess one is a real SIGKILL)."""


def _clicks(seed=0, users=40, items=30, clicks=500):
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"user_id": [f"u{u}" for u in rng.integers(0, users, clicks)],
                         "item_id": [f"i{i}" for i in np.minimum(rng.zipf(1.3, clicks), items)]})


def test_epoch_order_is_a_pure_function_of_seed_and_epoch():
    """Epoch e's batches are the log in epoch_order(click_keys, seed, e) order, wherever a dataset starts."""
    clicks = _clicks()
    n, batch = len(clicks), 64
    whole = [b["item_id"].numpy() for b in FrameClicks(clicks, batch, seed=3).epochs(0, 3)]
    assert len(whole) == 3 * steps_per_epoch(n, batch)
    items = clicks["item_id"].to_numpy(dtype=object).astype(bytes)
    keys = click_keys(clicks["user_id"].to_numpy(dtype=object), clicks["item_id"].to_numpy(dtype=object),
                      np.ones(n, np.float32))  # no weight column: every weight 1
    for epoch in range(3):
        order = epoch_order(keys, 3, epoch)
        assert sorted(order) == list(range(n))  # a permutation: every click once per epoch
        got = np.concatenate(whole[epoch * 8 : (epoch + 1) * 8])
        np.testing.assert_array_equal(got, items[order])
    tail = FrameClicks(clicks, batch, seed=3).epochs(1, 1, skip_batches=5)
    resumed = [b["item_id"].numpy() for b in tail]
    assert len(resumed) == 3 and all((a == b).all() for a, b in zip(resumed, whole[13:16]))
    assert not np.array_equal(whole[0], whole[8])  # reshuffled between epochs


def _streamed(clicks: pd.DataFrame, folder: Path, batch_size: int) -> StreamedClicks:
    """``clicks`` as two Parquet shards, every click a training click, streamed."""
    folder.mkdir()
    frame = clicks.assign(timestamp=np.arange(len(clicks)))
    frame.iloc[::2].to_parquet(folder / "part-0.parquet", index=False)
    frame.iloc[1::2].to_parquet(folder / "part-1.parquet", index=False)
    shards = ClickShards.open(TableConfig(path=str(folder)), ColumnsConfig(weight=None))
    plan = SplitPlan("temporal", len(frame), cut=len(frame))  # nothing after the cut: no test click
    return StreamedClicks(shards, plan, batch_size, shuffle_buffer=100, seed=5, train_rows=len(frame))


@pytest.mark.parametrize(
    "source, optimizer, per_call",
    [("frame", "lazy_adam", 1), ("stream", "lazy_adam", 1), ("stream", "rowwise_adagrad", 1),
     ("frame", "lazy_adam", 4), ("stream", "lazy_adam", 4)],
)
def test_fit_resumed_in_process_equals_uninterrupted_fit(tmp_path, monkeypatch, source, optimizer, per_call):
    """fit() killed (by an exception) mid-epoch and called again on a fresh model resumes exactly,
    whichever click source it trains on (and with the row-wise optimizer state of the scale configs),
    and with several steps a call (``train.steps_per_execution``), whose calls the resume cuts elsewhere."""
    clicks = _clicks(1)
    stats = FeatureStatistics.from_training_clicks(clicks)
    model_config = ModelConfig(embedding_dim=8, loss=dict(negatives="uniform", num_negatives=4))
    config = TrainConfig(epochs=3, batch_size=32, verbose=0, checkpoint_every_steps=3, validation_fraction=0,
                         optimizer=optimizer, steps_per_execution=per_call)
    # With 4 steps a call the checkpoint (every 3 steps) is asked only at a call's end: steps 3, 6, ...
    killed_at = 23 if per_call == 1 else 24
    if source == "stream":
        clicks = _streamed(clicks, tmp_path / "shards", config.batch_size)
        assert clicks.steps_per_epoch == 16

    def fresh():
        seed_everything(0)
        return build_model(model_config, stats)

    reference = fresh()
    unsaved = config.model_copy(update={"checkpoint_every_steps": 0, "checkpoint_every_seconds": 0})
    expected = fit(reference, clicks, unsaved)

    due = TrainingCheckpoint.due

    def killed_mid_epoch_2(self, state):  # epoch 2, batch 7 (or 8) of 16
        if state.steps == killed_at:
            raise Killed
        return due(self, state)

    checkpoints = tmp_path / "checkpoints"
    with monkeypatch.context() as patch, pytest.raises(Killed):
        patch.setattr(TrainingCheckpoint, "due", killed_mid_epoch_2)
        fit(fresh(), clicks, config, checkpoint_dir=checkpoints)
    assert sorted(p.name for p in checkpoints.glob("ckpt-*.index")) == ["ckpt-18.index", "ckpt-21.index"]

    resumed = fresh()
    history = fit(resumed, clicks, config, checkpoint_dir=checkpoints)
    assert history == expected
    for got, want in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(resumed.sampler._generator.state, reference.sampler._generator.state)


@pytest.mark.parametrize("refit", [True, False], ids=["refit", "no-refit"])
def test_fit_killed_in_the_early_stopping_selection_resumes_it_exactly(tmp_path, monkeypatch, refit):
    """The selection run is checkpointed too: killed mid-epoch, the call again resumes it (its
    validation recalls so far come back with the state; without a refit the best epoch's weights
    come back from ``selection/best``) and ends as the uninterrupted fit does."""
    clicks = _clicks(3)
    stats = FeatureStatistics.from_training_clicks(clicks)
    model_config = ModelConfig(embedding_dim=8, loss=dict(negatives="uniform", num_negatives=4))
    # One step a call, so that a checkpoint can fall due after any step (step 20 below).
    config = TrainConfig(epochs=4, batch_size=32, verbose=0, checkpoint_every_steps=3, validation_fraction=0.2,
                         early_stopping_patience=4, refit=refit, steps_per_execution=1)

    def fresh():
        seed_everything(2)  # a seed whose best epoch is not the last (asserted below)
        return build_model(model_config, stats)

    reference = fresh()
    expected = fit(reference, clicks, config.model_copy(update={"checkpoint_every_steps": 0,
                                                                "checkpoint_every_seconds": 0}))
    # The best epoch is not the last: without a refit the weights come back from selection/best.
    assert len(expected["val_recall@20"]) == 4 and expected["best_epoch"] == [3.0]

    due = TrainingCheckpoint.due

    def killed_after_step_20(self, state):  # in the selection's second epoch
        if state.steps == 20 and self.directory.name == "selection":
            raise Killed
        return due(self, state)

    checkpoints = tmp_path / "checkpoints"
    with monkeypatch.context() as patch, pytest.raises(Killed):
        patch.setattr(TrainingCheckpoint, "due", killed_after_step_20)
        fit(fresh(), clicks, config, checkpoint_dir=checkpoints)
    assert (checkpoints / "selection" / "checkpoint").exists() and not (checkpoints / "checkpoint").exists()

    selection_steps = []

    def watched(self, state):
        if self.directory.name == "selection":
            selection_steps.append(state.steps)
        return due(self, state)

    resumed = fresh()
    with monkeypatch.context() as patch:
        patch.setattr(TrainingCheckpoint, "due", watched)
        history = fit(resumed, clicks, config, checkpoint_dir=checkpoints)
    assert selection_steps[0] == 19  # resumed after the last save (step 18), not started over
    assert history == expected
    for got, want in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(got, want)
