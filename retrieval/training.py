"""Training: tf.data input, optimiser, seeded fit with progress and logs."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import tensorflow as tf

from retrieval.config import SplitConfig, TrainConfig
from retrieval.data import ITEM, TIME, USER, WEIGHT, split_clicks
from retrieval.features import feature_arrays
from retrieval.model import TwoTowerModel

_OPTIMIZERS = {
    "adam": tf.keras.optimizers.Adam,
    "adagrad": tf.keras.optimizers.Adagrad,
    "sgd": tf.keras.optimizers.SGD,
}


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and TensorFlow and make TF ops deterministic."""
    tf.keras.utils.set_random_seed(seed)
    tf.config.experimental.enable_op_determinism()


def click_dataset(clicks: pd.DataFrame, batch_size: int, *, seed: int, shuffle: bool = True) -> tf.data.Dataset:
    """Batches of ``{"user_id", "item_id", "weight", <every other column>}`` from a click frame.

    ``clicks`` is a click log or the training examples of feature towers
    (``retrieval.features.training_examples``): other columns become batch
    features as ``feature_arrays`` converts them (strings, numbers, tuples of
    strings -> [batch, width]).

    The whole log is shuffled (buffer = its length) with a fixed seed and
    reshuffled every epoch, so in-batch negatives differ between epochs but
    two runs with the same seed see the same batches.
    """
    if clicks.empty:
        raise ValueError("cannot train on an empty click log")
    columns = {
        **feature_arrays(clicks, [name for name in clicks.columns if name not in (USER, ITEM, WEIGHT)]),
        USER: clicks[USER].astype(str).to_numpy(dtype=object),
        ITEM: clicks[ITEM].astype(str).to_numpy(dtype=object),
        WEIGHT: (clicks[WEIGHT] if WEIGHT in clicks else pd.Series(1.0, index=clicks.index))
        .to_numpy(dtype=np.float32),
    }
    dataset = tf.data.Dataset.from_tensor_slices(columns)
    if shuffle:
        dataset = dataset.shuffle(len(clicks), seed=seed, reshuffle_each_iteration=True)
    return dataset.batch(batch_size).prefetch(tf.data.AUTOTUNE)


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
) -> dict[str, list[float]]:
    """Train ``model`` on the training clicks; return the Keras history.

    With ``config.validation_fraction > 0`` the number of epochs is chosen by
    early stopping on a validation part carved from ``train`` the way ``split``
    carves the test part (``validation_split``); see ``select_epochs``.

    Args:
      model: a built two-tower model.
      train: training click frame (canonical columns), or training examples
        holding every tower input (``retrieval.features.training_examples``).
      config: optimiser, epochs, batch size, seed.
      log_dir: if given, per-epoch loss goes to ``train_log.csv`` there, and loss and
        the model's metrics to TensorBoard event files under ``tensorboard/train``.
      split: how the test part was split (the validation part is carved alike);
        None = temporal when the clicks have timestamps, else random.
    """
    seed_everything(config.seed)
    callbacks = []
    if log_dir is not None:
        callbacks.append(tf.keras.callbacks.CSVLogger(str(Path(log_dir) / "train_log.csv")))
        # No graph and no profiler: the run directory stays small and fit is not slowed.
        callbacks.append(
            tf.keras.callbacks.TensorBoard(
                log_dir=str(Path(log_dir) / "tensorboard"), write_graph=False, profile_batch=0, update_freq="epoch"
            )
        )
    epochs, selection = config.epochs, {}
    if config.validation_fraction > 0:
        # Without a refit the selection run is the training run: it gets the logs.
        epochs, selection = select_epochs(model, train, config, split, [] if config.refit else callbacks)
        if not config.refit:
            return selection
    model.compile(optimizer=_OPTIMIZERS[config.optimizer](learning_rate=config.learning_rate))
    history = model.fit(
        click_dataset(train, config.batch_size, seed=config.seed),
        epochs=epochs,
        verbose=_verbosity(config.verbose),
        callbacks=callbacks,
    )
    return {**selection, **{key: [float(v) for v in values] for key, values in history.history.items()}}


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
        self._masks = None

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
        click_dataset(fit_part, config.batch_size, seed=config.seed),
        epochs=config.epochs,
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
