"""Training: tf.data input, optimiser, seeded fit with progress and logs."""

from __future__ import annotations

import csv
import functools
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import faiss
import numpy as np
import pandas as pd
import tensorflow as tf

from retrieval.config import SplitConfig, TrainConfig
from retrieval.data import ITEM, TIME, USER, WEIGHT, split_clicks
from retrieval.features import feature_arrays
from retrieval.model import TwoTowerModel
from retrieval.towers import IdDropout

log = logging.getLogger("retrieval")



class LazyAdam(tf.keras.optimizers.Adam):
    """Adam that, for a sparse gradient, updates only the rows it touches (moments and weights).

    Keras Adam applies the moment decay to the whole table at every step (its
    docstring says so), which costs a pass over every row of a 1M-item
    embedding per step whatever the batch. This is the "lazy" variant of
    TensorFlow Addons' ``LazyAdam`` (and of TF1's ``LazyAdamOptimizer``): rows
    absent from the batch keep their moments and weights. Dense gradients get
    plain Adam. Duplicate indices are summed by the base optimizer
    (``_deduplicate_sparse_grad``) before ``update_step``.
    """

    def update_step(self, gradient, variable):
        if not isinstance(gradient, tf.IndexedSlices) or self.amsgrad:
            return super().update_step(gradient, variable)
        dtype = variable.dtype
        step = tf.cast(self.iterations + 1, dtype)
        beta_1, beta_2 = tf.cast(self.beta_1, dtype), tf.cast(self.beta_2, dtype)
        alpha = tf.cast(self.learning_rate, dtype) * tf.sqrt(1 - tf.pow(beta_2, step)) / (1 - tf.pow(beta_1, step))
        index = self._index_dict[self._var_key(variable)]
        m, v = self._momentums[index], self._velocities[index]
        rows, values = gradient.indices, gradient.values
        m_rows = beta_1 * tf.gather(m, rows) + (1 - beta_1) * values
        v_rows = beta_2 * tf.gather(v, rows) + (1 - beta_2) * tf.square(values)
        m.scatter_update(tf.IndexedSlices(m_rows, rows))
        v.scatter_update(tf.IndexedSlices(v_rows, rows))
        variable.scatter_sub(tf.IndexedSlices(alpha * m_rows / (tf.sqrt(v_rows) + self.epsilon), rows))


# Which apply sparse (IndexedSlices) gradients of embedding tables sparsely, i.e. at a cost that
# does not grow with the number of rows: adagrad and lazy_adam do; adam decays both moments of
# every row at every step, and tf-keras sgd always keeps a momentum slot that it scales and adds
# to the whole table (even with momentum 0).
_OPTIMIZERS = {
    "adam": tf.keras.optimizers.Adam,
    "adagrad": tf.keras.optimizers.Adagrad,
    "sgd": tf.keras.optimizers.SGD,
    "lazy_adam": LazyAdam,
}


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and TensorFlow and make TF ops deterministic."""
    tf.keras.utils.set_random_seed(seed)
    tf.config.experimental.enable_op_determinism()


def distribution_strategy(config: TrainConfig) -> tf.distribute.Strategy:
    """The ``tf.distribute`` strategy of ``config.distribute``.

    Build and compile the model under its ``scope()`` (its variables, the
    optimizer's slots and the samplers' state are created there); Keras ``fit``
    then splits each batch of ``config.batch_size`` rows (the *global* batch)
    over the replicas, and the model gathers in-batch negatives across them.

    - ``none``: the default strategy (one device; its scope does nothing);
    - ``mirrored``: ``MirroredStrategy`` over every local GPU, or else every
      logical CPU device (one on a plain machine);
    - ``multi_worker``: ``MultiWorkerMirroredStrategy``, the cluster and this
      process's task read from the ``TF_CONFIG`` environment variable. Create it
      at the start of the program, before other TensorFlow work.

    A process gets one strategy of each kind, reused by later calls: a second
    MirroredStrategy over the same devices reuses the first one's collective
    instance keys, and its all-gathers then fail with a shape mismatch.
    """
    if config.distribute == "none":
        return tf.distribute.get_strategy()
    if config.distribute == "multi_worker" and not os.environ.get("TF_CONFIG"):
        raise ValueError(
            "train.distribute='multi_worker' reads the cluster from the TF_CONFIG environment variable, "
            'which is not set; e.g. TF_CONFIG=\'{"cluster": {"worker": ["host1:12345", "host2:12345"]}, '
            '"task": {"type": "worker", "index": 0}}\' on the first worker'
        )
    return _process_strategy(config.distribute)


@functools.cache
def _process_strategy(kind: str) -> tf.distribute.Strategy:
    if kind == "mirrored":
        devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
        return tf.distribute.MirroredStrategy([device.name for device in devices])
    if kind == "multi_worker":
        return tf.distribute.MultiWorkerMirroredStrategy()
    raise ValueError(f"unknown train.distribute {kind!r}; valid: none, mirrored, multi_worker")


def click_dataset(
    clicks: pd.DataFrame,
    batch_size: int,
    *,
    seed: int,
    shuffle: bool = True,
    epochs: int = 1,
    start_epoch: int = 0,
    skip_batches: int = 0,
) -> tf.data.Dataset:
    """Batches of ``{"user_id", "item_id", "weight", <every other column>}`` from a click frame.

    ``clicks`` is a click log or the training examples of feature towers
    (``retrieval.features.training_examples``): other columns become batch
    features as ``feature_arrays`` converts them (strings, numbers, tuples of
    strings -> [batch, width]).

    The dataset holds epochs ``start_epoch .. start_epoch + epochs - 1`` back
    to back, ``steps_per_epoch(len(clicks), batch_size)`` batches each (the
    last one of an epoch may be smaller), less the first ``skip_batches``.
    Epoch ``e`` visits the whole log in the order
    ``tf.random.experimental.stateless_shuffle(range(n), seed=(seed, e))``:
    in-batch negatives differ between epochs, two runs with the same seed see
    the same batches, and a run resumed at (epoch e, batch b) continues with
    exactly the batches an uninterrupted run trains on there.
    """
    if clicks.empty:
        raise ValueError("cannot train on an empty click log")
    if epochs <= 0 or start_epoch < 0 or skip_batches < 0:
        raise ValueError(
            "need epochs > 0, start_epoch >= 0, skip_batches >= 0; "
            f"got {epochs}, {start_epoch}, {skip_batches}"
        )
    columns = {
        **feature_arrays(clicks, [name for name in clicks.columns if name not in (USER, ITEM, WEIGHT)]),
        USER: clicks[USER].astype(str).to_numpy(dtype=object),
        ITEM: clicks[ITEM].astype(str).to_numpy(dtype=object),
        WEIGHT: (clicks[WEIGHT] if WEIGHT in clicks else pd.Series(1.0, index=clicks.index))
        .to_numpy(dtype=np.float32),
    }
    columns = {name: tf.constant(values) for name, values in columns.items()}
    rows = tf.range(len(clicks), dtype=tf.int64)

    def epoch_rows(epoch):
        epoch_seed = tf.stack([tf.constant(seed, tf.int64), epoch])
        order = tf.random.experimental.stateless_shuffle(rows, seed=epoch_seed)
        return tf.data.Dataset.from_tensor_slices(order if shuffle else rows).batch(batch_size)

    dataset = tf.data.Dataset.range(start_epoch, start_epoch + epochs).flat_map(epoch_rows).skip(skip_batches)
    dataset = dataset.map(
        lambda index: {name: tf.gather(values, index) for name, values in columns.items()},
        num_parallel_calls=tf.data.AUTOTUNE,  # order is kept (deterministic by default)
    )
    return dataset.prefetch(tf.data.AUTOTUNE)


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
    """Batches in one epoch of ``click_dataset`` (the last one may be smaller)."""
    return -(-int(num_examples) // int(batch_size))


def _verbosity(setting) -> int:
    if setting == "auto":
        return 1 if sys.stdout.isatty() else 2
    return int(setting)


def fit(
    model: TwoTowerModel,
    train: pd.DataFrame,
    config: TrainConfig,
    *,
    log_dir: Path | None = None,
    split: SplitConfig | None = None,
    checkpoint_dir: Path | None = None,
    on_epoch_end: Callable[[int, dict], None] | None = None,
) -> dict[str, list[float]]:
    """Train ``model`` on the training clicks; return the Keras history.

    With ``config.validation_fraction > 0`` the number of epochs is chosen by
    early stopping on a validation part carved from ``train`` the way ``split``
    carves the test part (``validation_split``); see ``select_epochs``.

    With ``checkpoint_dir`` and ``config.checkpoint_every_steps`` the training
    state is saved there as it goes (``TrainingCheckpoint``), and a call that
    finds a checkpoint (the same job started again after being killed)
    resumes from it: weights, optimizer slots, sampler state, data position
    and the logs so far, so it ends with the weights an uninterrupted run
    ends with. Only the final training run is checkpointed: an interrupted
    early-stopping selection starts again from the beginning (with
    ``config.refit``; without it the selection run is the training run and is
    not checkpointed).

    Args:
      model: a built two-tower model.
      train: training click frame (canonical columns), or training examples
        holding every tower input (``retrieval.features.training_examples``).
      config: optimiser, epochs, batch size, seed, checkpoint interval.
      log_dir: if given, per-epoch loss goes to ``train_log.csv`` there, and loss and
        the model's metrics to TensorBoard event files under ``tensorboard/train``.
      split: how the test part was split (the validation part is carved alike);
        None = temporal when the clicks have timestamps, else random.
      checkpoint_dir: where to save and look for checkpoints; None = none.
      on_epoch_end: called as ``on_epoch_end(epoch, logs)`` (0-based epoch) after each epoch of the
        early-stopping selection run, ``logs`` holding ``val_recall@<validation_k>``; it may raise to
        stop training (pipelines/tune.py prunes trials this way). Not called without early stopping.
    """
    seed_everything(config.seed)
    optimizer = _OPTIMIZERS[config.optimizer](learning_rate=config.learning_rate)
    checkpoint, resumed = None, False
    if checkpoint_dir is not None and config.checkpoint_every_steps:
        if config.validation_fraction > 0 and not config.refit:
            log.info("train.refit=false: the early-stopping run is the training run and is not checkpointed")
        else:
            model.compile(optimizer=optimizer)
            optimizer.build(model.trainable_variables)  # slots exist before a restore fills them
            checkpoint = TrainingCheckpoint(checkpoint_dir, config.checkpoint_every_steps, model, optimizer)
            resumed = checkpoint.restore()
    callbacks = []
    if log_dir is not None:
        # A resumed run writes the epochs before the checkpoint first, then appends.
        callbacks.append(tf.keras.callbacks.CSVLogger(str(Path(log_dir) / "train_log.csv"), append=resumed))
        # No graph and no profiler: the run directory stays small and fit is not slowed.
        callbacks.append(
            tf.keras.callbacks.TensorBoard(
                log_dir=str(Path(log_dir) / "tensorboard"), write_graph=False, profile_batch=0, update_freq="epoch"
            )
        )
    epochs = config.epochs
    selection: dict[str, list[float]] = {}
    if resumed and checkpoint is not None and checkpoint.selection:
        selection = checkpoint.selection
        epochs = int(selection["best_epoch"][0])
        log.info("early-stopping selection was done before the checkpoint (best epoch %d): not repeated",
                 epochs)
    elif config.validation_fraction > 0:
        if checkpoint is not None:
            log.info("early-stopping selection (not checkpointed: a killed selection starts over) ...")
        # Without a refit the selection run is the training run: it gets the logs.
        hooks = [] if on_epoch_end is None else [tf.keras.callbacks.LambdaCallback(on_epoch_end=on_epoch_end)]
        epochs, selection = select_epochs(model, train, config, split, hooks + ([] if config.refit else callbacks))
        if not config.refit:
            return selection
    model.compile(optimizer=optimizer)
    steps = steps_per_epoch(len(train), config.batch_size)
    if checkpoint is None:
        history = model.fit(
            click_dataset(train, config.batch_size, seed=config.seed, epochs=epochs),
            epochs=epochs,
            steps_per_epoch=steps,
            verbose=_verbosity(config.verbose),
            callbacks=callbacks,
        )
        return {**selection, **{key: [float(v) for v in values] for key, values in history.history.items()}}

    checkpoint.steps_per_epoch = steps
    start = checkpoint.steps_done
    if resumed:
        epoch, batch = divmod(start, steps)
        log.info(
            "resuming from step %d (epoch %d/%d, batch %d/%d) of %s",
            start, epoch + 1, epochs, batch, steps, checkpoint.latest,
        )
        if _has_dropout(model):
            log.warning(
                "the towers use dropout, whose random masks are not checkpointed (TF stateful random ops): "
                "the resumed run is statistically, not bit for bit, the uninterrupted one"
            )
        # Killed in the first epoch, nothing was logged yet: the callbacks write the logs from the
        # start. (A header-only train_log.csv written here would keep the CSVLogger, appending, from
        # writing its own: the file then had an "epoch" header over full rows.)
        if log_dir is not None and checkpoint.history:
            _write_csv_log(Path(log_dir) / "train_log.csv", checkpoint.history)
            _write_epoch_summaries(Path(log_dir) / "tensorboard" / "train", checkpoint.history)
    else:
        checkpoint.selection = selection
        if selection:
            checkpoint.save()  # the state the final run starts from: a resume need not repeat the selection
    _fit_from_step(model, train, config, epochs, steps, start, [checkpoint, *callbacks])
    checkpoint.save()  # the end state: a job killed after training does not train again
    return {**selection, **checkpoint.history}


def _fit_from_step(
    model: TwoTowerModel,
    train: pd.DataFrame,
    config: TrainConfig,
    epochs: int,
    steps: int,
    start: int,
    callbacks: list,
) -> None:
    """Train from global step ``start`` (``steps`` per epoch) to the end of epoch ``epochs``.

    Keras runs whole epochs of ``steps_per_epoch`` steps, so an interrupted
    epoch is finished by a fit of its remaining steps first.
    """
    epoch, batch = divmod(start, steps)
    common = dict(verbose=_verbosity(config.verbose), callbacks=callbacks)
    data = dict(clicks=train, batch_size=config.batch_size, seed=config.seed, start_epoch=epoch)
    if batch and epoch < epochs:
        dataset = click_dataset(**data, skip_batches=batch)
        model.fit(dataset, initial_epoch=epoch, epochs=epoch + 1, steps_per_epoch=steps - batch, **common)
        epoch += 1
        data["start_epoch"] = epoch
    if epoch < epochs:
        dataset = click_dataset(**data, epochs=epochs - epoch)
        model.fit(dataset, initial_epoch=epoch, epochs=epochs, steps_per_epoch=steps, **common)


def _has_dropout(model: tf.keras.Model) -> bool:
    return any(
        isinstance(layer, (tf.keras.layers.Dropout, IdDropout)) and float(layer.rate) > 0
        for layer in model.submodules
        if isinstance(layer, tf.keras.layers.Layer)
    )


def _write_csv_log(path: Path, history: dict[str, list[float]]) -> None:
    """``history``'s epochs as ``tf.keras.callbacks.CSVLogger`` writes them (header, one row per epoch)."""
    keys = sorted(history)
    epochs = len(history[keys[0]]) if keys else 0
    if not epochs:  # the header alone would be "epoch": a CSVLogger appending to it writes none of its own
        raise ValueError(f"history holds no epoch to log, got {history!r}")
    if not any(key.startswith("val_") for key in keys):
        keys += [f"val_{key}" for key in keys]  # CSVLogger's columns for validation logs, "NA" without
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=["epoch", *keys])
        writer.writeheader()
        for epoch in range(epochs):
            row = {key: history[key][epoch] if key in history else "NA" for key in keys}
            writer.writerow({"epoch": epoch, **row})


def _quiet_checkpoint_saves(record: logging.LogRecord) -> bool:
    """Drops TensorFlow's INFO line of every checkpoint save ("Sharding callback duration")."""
    return not record.getMessage().startswith("Sharding callback duration")


def _write_epoch_summaries(directory: Path, history: dict[str, list[float]]) -> None:
    """``history``'s epochs as the Keras TensorBoard callback logs them (``epoch_<key>`` at step = epoch)."""
    writer = tf.summary.create_file_writer(str(directory))
    with writer.as_default():
        for key, values in history.items():
            for epoch, value in enumerate(values):
                tf.summary.scalar(f"epoch_{key}", value, step=epoch)
    writer.close()


class TrainingCheckpoint(tf.keras.callbacks.Callback):
    """Saves the final training run every ``every_steps`` steps; restores it on a resume.

    ``ckpt-<step>``, a ``tf.train.Checkpoint``, holds every variable training
    changes: the model (towers, loss variables, the sampler with its log-Q
    estimator's variables (``StreamingFrequency``) and a corpus sampler's
    ``tf.random.Generator`` state, the hard-negative miner's step), the
    optimizer with its slots and iteration count, and the global step.
    ``state-<step>.json`` beside it holds the per-epoch logs so far and the
    early-stopping selection's result, and ``miner-<step>.faiss`` the
    hard-negative miner's FAISS index (numpy state). Both are written (and
    renamed into place) before the checkpoint, and ``tf.train.CheckpointManager``
    (the last two kept) points at a checkpoint only once it is completely
    written, so a kill at any moment leaves the previous one usable.

    A save due on an epoch's last step waits for that epoch's logs
    (``on_epoch_end``). The data position is the global step itself: epoch
    ``step // steps_per_epoch``, batch ``step % steps_per_epoch``
    (``click_dataset`` orders each epoch by ``(seed, epoch)`` alone).

    Args:
      directory: the checkpoint directory (created).
      every_steps: save every this many training steps.
      model, optimizer: what is trained; the optimizer must be built.
    """

    def __init__(self, directory: str | Path, every_steps: int, model: TwoTowerModel, optimizer):
        super().__init__()
        if every_steps <= 0:
            raise ValueError(f"every_steps must be positive, got {every_steps}")
        self.directory = Path(directory)
        self.every_steps = int(every_steps)
        self.steps_per_epoch: int | None = None
        self.history: dict[str, list[float]] = {}
        self.selection: dict[str, list[float]] = {}
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        # Steps are counted in Python and written to ``step`` only when saving: reading a variable
        # back each batch (``.numpy()``) forces a host sync per step, which cost more than the step.
        self.steps_done = 0
        self._supports_tf_logs = True  # Keras then passes batch logs as tensors: no per-batch conversion
        self._miner = getattr(model, "miner", None)
        self._checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=self.step)
        self._manager = tf.train.CheckpointManager(self._checkpoint, str(self.directory), max_to_keep=2)
        logging.getLogger("absl").addFilter(_quiet_checkpoint_saves)
        self._saved_step = -1
        self._save_at_epoch_end = False

    @property
    def latest(self) -> str | None:
        """Path prefix of the newest checkpoint, or None."""
        return self._manager.latest_checkpoint

    def restore(self) -> bool:
        """Restore the newest checkpoint, if there is one; return whether there was."""
        path = self._manager.latest_checkpoint
        if path is None:
            return False
        self._checkpoint.restore(path).assert_existing_objects_matched()
        step = self.steps_done = int(self.step.numpy())
        state = json.loads((self.directory / f"state-{step}.json").read_text())
        self.history, self.selection = state["history"], state["selection"]
        if self._miner is not None and state["miner_index"]:
            self._miner.index = faiss.read_index(str(self.directory / f"miner-{step}.faiss"))
        self._saved_step = step
        return True

    def save(self) -> None:
        """Write a checkpoint of the current state (numbered by the step), unless this step has one."""
        step = self.steps_done
        if step == self._saved_step:
            return
        self.step.assign(step)
        self.directory.mkdir(parents=True, exist_ok=True)
        miner_index = self._miner is not None and self._miner.index is not None
        if self._miner is not None and miner_index:
            faiss.write_index(self._miner.index, str(self.directory / f".miner-{step}.tmp"))
            os.replace(self.directory / f".miner-{step}.tmp", self.directory / f"miner-{step}.faiss")
        state = {"history": self.history, "selection": self.selection, "miner_index": miner_index}
        (self.directory / f".state-{step}.tmp").write_text(json.dumps(state))
        os.replace(self.directory / f".state-{step}.tmp", self.directory / f"state-{step}.json")
        self._manager.save(checkpoint_number=step)
        self._saved_step = step
        kept = {path.rsplit("-", 1)[1] for path in self._manager.checkpoints}
        for side in [*self.directory.glob("state-*.json"), *self.directory.glob("miner-*.faiss")]:
            if side.stem.split("-", 1)[1] not in kept:
                side.unlink()

    def on_train_batch_end(self, batch, logs=None):
        self.steps_done += 1
        step = self.steps_done
        if step % self.every_steps == 0:
            if self.steps_per_epoch and step % self.steps_per_epoch == 0:
                self._save_at_epoch_end = True
            else:
                self.save()

    def on_epoch_end(self, epoch, logs=None):
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(float(value))
        if self._save_at_epoch_end:
            self._save_at_epoch_end = False
            self.save()


def fit_dataset(
    model: TwoTowerModel,
    dataset: tf.data.Dataset,
    config: TrainConfig,
    *,
    log_dir: Path | None = None,
    progress=None,
) -> dict[str, list[float]]:
    """Train ``model`` on a ready ``tf.data`` dataset of click batches (the out-of-core path).

    The dataset is iterated once per epoch, so it must reshuffle itself
    (``retrieval.data.streaming.click_stream_dataset`` does). No early stopping
    here (``train.validation_fraction`` must be 0).

    The epochs run as a loop over ``tf.function(model.train_step)`` rather than
    ``model.fit``: with large ID tables Keras ``fit`` adds a per-step cost that
    grows with the tables, which this loop does not pay.

    Args:
      model: a built two-tower model.
      dataset: batches ``{"user_id": tf.string [batch], "item_id": tf.string [batch],
        "weight": tf.float32 [batch]}``.
      config: optimiser, epochs, seed; ``verbose`` 0 silences the per-epoch line.
      log_dir: as ``fit``: ``train_log.csv`` (one row per epoch, as CSVLogger writes it) and TensorBoard
        scalars ``epoch_<name>`` under ``tensorboard/train``.
      progress: ``callable(str)`` for progress lines (a clicks/s line every minute
        and one per epoch); None = ``print`` (per epoch only, unless ``verbose`` is 0).

    Returns:
      Per epoch: the mean over its batches of each value ``train_step`` logs
      (``loss``, ``regularization_loss``, ``total_loss``), plus ``epoch_seconds``
      and ``clicks_per_second`` (wall time of the epoch, input included).
    """
    if config.validation_fraction > 0:
        raise ValueError(
            f"train.validation_fraction={config.validation_fraction} (early stopping) is not yet supported "
            "when training on a streamed dataset; set it to 0"
        )
    seed_everything(config.seed)
    model.compile(optimizer=_OPTIMIZERS[config.optimizer](learning_rate=config.learning_rate))
    step = tf.function(model.train_step)
    say = progress if progress is not None else (print if _verbosity(config.verbose) else None)
    writer = None
    if log_dir is not None:
        writer = tf.summary.create_file_writer(str(Path(log_dir) / "tensorboard" / "train"))
    history: dict[str, list[float]] = {}
    for epoch in range(config.epochs):
        started = last = time.perf_counter()
        steps = clicks = 0
        totals: dict[str, float] = {}
        for batch in dataset:
            logs = step(batch)
            steps += 1
            clicks += int(tf.shape(batch[ITEM])[0])
            for key, value in logs.items():
                totals[key] = totals.get(key, 0.0) + float(value)
            now = time.perf_counter()
            if progress is not None and now - last >= 60:
                last = now
                progress(f"epoch {epoch + 1} step {steps}: {clicks / (now - started):,.0f} clicks/s, "
                         f"loss {totals['loss'] / steps:.4f}")
        if steps == 0:
            raise ValueError("the training dataset yielded no batch")
        seconds = time.perf_counter() - started
        epoch_logs = {key: total / steps for key, total in totals.items()}
        epoch_logs.update(epoch_seconds=seconds, clicks_per_second=clicks / max(seconds, 1e-9))
        for key, value in epoch_logs.items():
            history.setdefault(key, []).append(float(value))
        if say is not None:
            say(f"epoch {epoch + 1}/{config.epochs}: {steps} steps, {clicks:,} clicks in {seconds:.0f}s "
                f"({epoch_logs['clicks_per_second']:,.0f} clicks/s), loss {epoch_logs['loss']:.4f}")
        if writer is not None:
            with writer.as_default():
                for key, value in epoch_logs.items():
                    tf.summary.scalar(f"epoch_{key}", value, step=epoch)
    if writer is not None:
        writer.close()
    if log_dir is not None:
        _write_csv_log(Path(log_dir) / "train_log.csv", history)  # the columns Keras's CSVLogger writes in fit()
    return history


def validation_split(
    train: pd.DataFrame, fraction: float, split: SplitConfig | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Carve ``(fit_part, validation)`` from the training part like ``split`` carved the test part.

    ``temporal`` (the default when there are timestamps) holds out the latest
    ``fraction`` of the training clicks, ``leave_last_k`` each user's last
    ``split.k``, ``random`` a random ``fraction``; ``none`` (a given test log)
    behaves as temporal, or random without timestamps.
    """
    kind = split.kind if split is not None else "temporal"
    if kind in ("temporal", "none"):
        kind = "temporal" if TIME in train else "random"
    carve = SplitConfig(
        kind=kind,
        test_fraction=fraction,
        k=split.k if split is not None else 1,
        seed=split.seed if split is not None else 0,
    )
    return split_clicks(train, carve)


class ValidationRecall(tf.keras.callbacks.Callback):
    """Recall@k of held-out clicks after each epoch, with early stopping on it.

    Each validation click is a query (the tower inputs of its own row, as in a
    training batch); it is a hit when its item is in the top k of every item
    the model scores (``TwoTowerModel.item_scores``), the user's clicks in the
    fit part excluded. Clicks repeating a fit-part click are dropped, as in the
    test protocol. The metric is the share of hits (recall over clicks).

    Attributes:
      recalls: the value after each epoch.
      best_epoch: 1-based epoch of the best value; best_weights its weights.
    """

    def __init__(self, validation: pd.DataFrame, fit_part: pd.DataFrame, k: int, patience: int):
        super().__init__()
        pairs = pd.MultiIndex.from_frame(fit_part[[USER, ITEM]].astype(str))
        repeat = pd.MultiIndex.from_frame(validation[[USER, ITEM]].astype(str)).isin(pairs)
        self.validation = validation[~repeat].reset_index(drop=True)
        self.fit_pairs = fit_part[[USER, ITEM]].astype(str).drop_duplicates()
        self.k, self.patience = int(k), int(patience)
        self.recalls: list[float] = []
        self.best_epoch, self.best_weights = 0, None
        self._masks: tuple[np.ndarray, np.ndarray] | None = None

    def _exclusions(self, model: TwoTowerModel) -> tuple[np.ndarray, np.ndarray]:
        """(validation row, tower index) of every fit-part click of each row's user."""
        if self._masks is None:
            rows = self.validation[[USER]].astype(str).reset_index().rename(columns={"index": "row"})
            pairs = rows.merge(self.fit_pairs, on=USER)
            items = model.item_index(tf.constant(pairs[ITEM].to_numpy(dtype=object))).numpy()
            self._masks = (pairs["row"].to_numpy(np.int64), items)
        return self._masks

    def recall(self, model: TwoTowerModel, batch_size: int = 1024) -> float:
        """Recall@k of the validation clicks under ``model`` now."""
        if self.validation.empty:
            return 0.0
        mask_rows, mask_items = self._exclusions(model)
        hits = []
        for start in range(0, len(self.validation), batch_size):
            rows = self.validation.iloc[start : start + batch_size]
            arrays = feature_arrays(rows, model.query_tower.input_names)
            queries = model.query_tower({name: tf.constant(v) for name, v in arrays.items()}, training=False)
            scores = model.item_scores(queries).numpy()
            scores[:, 0] = -np.inf  # the OOV row is no recommendation
            chosen = (mask_rows >= start) & (mask_rows < start + len(rows))
            scores[mask_rows[chosen] - start, mask_items[chosen]] = -np.inf
            target = model.item_index(tf.constant(rows[ITEM].astype(str).to_numpy(dtype=object))).numpy()
            target_scores = scores[np.arange(len(rows)), target]
            rank = np.sum(scores > target_scores[:, None], axis=1)
            hits.append((rank < self.k) & (target > 0) & np.isfinite(target_scores))
        return float(np.mean(np.concatenate(hits)))

    def on_epoch_end(self, epoch, logs=None):
        value = self.recall(self.model)
        self.recalls.append(value)
        if logs is not None:
            logs[f"val_recall@{self.k}"] = value
        if self.best_weights is None or value > self.recalls[self.best_epoch - 1]:
            self.best_epoch, self.best_weights = epoch + 1, self.model.get_weights()
        elif epoch + 1 - self.best_epoch >= self.patience:
            self.model.stop_training = True


def select_epochs(
    model: TwoTowerModel,
    train: pd.DataFrame,
    config: TrainConfig,
    split: SplitConfig | None = None,
    callbacks: list | None = None,
) -> tuple[int, dict[str, list[float]]]:
    """Early stopping: train on the fit part, watch ``ValidationRecall``, pick the best epoch.

    With ``config.refit`` the model is put back to its initial weights (the
    caller retrains on all of ``train`` for the returned number of epochs);
    otherwise it keeps the best epoch's weights.

    Returns:
      ``(best_epoch, history)``, the history holding the selection run's
      ``selection_loss`` and ``val_recall@k`` per epoch and ``best_epoch``.
    """
    fit_part, validation = validation_split(train, config.validation_fraction, split)
    initial = model.get_weights()
    watch = ValidationRecall(validation, fit_part, config.validation_k, config.early_stopping_patience)
    model.compile(optimizer=_OPTIMIZERS[config.optimizer](learning_rate=config.learning_rate))
    history = model.fit(
        click_dataset(fit_part, config.batch_size, seed=config.seed, epochs=config.epochs),
        epochs=config.epochs,
        steps_per_epoch=steps_per_epoch(len(fit_part), config.batch_size),
        verbose=_verbosity(config.verbose),
        callbacks=[watch, *(callbacks or [])],
    )
    model.set_weights(initial if config.refit else watch.best_weights)
    seed_everything(config.seed)
    return watch.best_epoch, {
        "selection_loss": [float(v) for v in history.history["loss"]],
        f"val_recall@{config.validation_k}": watch.recalls,
        "best_epoch": [float(watch.best_epoch)],
        **({} if config.refit else {"loss": [float(v) for v in history.history["loss"]]}),
    }


def embed(tower: tf.keras.Model, feature: str, ids, batch_size: int = 8192) -> np.ndarray:
    """Run a tower over string ids in batches. Returns [len(ids), dim] float32."""
    ids = np.asarray(ids, dtype=object)
    if ids.size == 0:
        return np.zeros((0, tower.output_shape[-1]), dtype=np.float32)
    outputs = [
        tower({feature: tf.constant(ids[start : start + batch_size])}, training=False).numpy()
        for start in range(0, len(ids), batch_size)
    ]
    return np.concatenate(outputs).astype(np.float32, copy=False)


def embed_frame(tower: tf.keras.Model, frame: pd.DataFrame, batch_size: int = 8192) -> np.ndarray:
    """Run a tower over the rows of a frame of raw inputs, in batches.

    Args:
      tower: any tower; it reads the columns named by its inputs
        (``retrieval.features.catalogue_inputs`` / ``query_inputs`` build them).
      frame: one row per query or item.

    Returns:
      [len(frame), dim] float32.
    """
    missing = [name for name in tower.input_names if name not in frame.columns]
    if missing:
        raise ValueError(f"{tower.name} reads {missing}, which the frame lacks (columns: {list(frame.columns)})")
    if frame.empty:
        return np.zeros((0, tower.output_shape[-1]), dtype=np.float32)
    arrays = feature_arrays(frame, tower.input_names)
    outputs = [
        tower({name: tf.constant(values[start : start + batch_size]) for name, values in arrays.items()},
              training=False).numpy()
        for start in range(0, len(frame), batch_size)
    ]
    return np.concatenate(outputs).astype(np.float32, copy=False)
