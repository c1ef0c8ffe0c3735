"""Training: tf.data input, optimiser, seeded fit with progress and logs."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import tensorflow as tf

from retrieval.config import TrainConfig
from retrieval.data import ITEM, USER, WEIGHT
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
    """Batches of ``{"user_id", "item_id", "weight"}`` from a click frame.

    The whole log is shuffled (buffer = its length) with a fixed seed and
    reshuffled every epoch, so in-batch negatives differ between epochs but
    two runs with the same seed see the same batches.
    """
    if clicks.empty:
        raise ValueError("cannot train on an empty click log")
    columns = {
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
) -> dict[str, list[float]]:
    """Train ``model`` on the training clicks; return the Keras history.

    Args:
      model: a built two-tower model.
      train: training click frame (canonical columns).
      config: optimiser, epochs, batch size, seed.
      log_dir: if given, per-epoch loss goes to ``train_log.csv`` there.
    """
    seed_everything(config.seed)
    model.compile(optimizer=_OPTIMIZERS[config.optimizer](learning_rate=config.learning_rate))
    callbacks = []
    if log_dir is not None:
        callbacks.append(tf.keras.callbacks.CSVLogger(str(Path(log_dir) / "train_log.csv")))
    history = model.fit(
        click_dataset(train, config.batch_size, seed=config.seed),
        epochs=config.epochs,
        verbose=_verbosity(config.verbose),
        callbacks=callbacks,
    )
    return {key: [float(v) for v in values] for key, values in history.history.items()}


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
