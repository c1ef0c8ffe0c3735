"""Running a trained tower over ids or raw feature rows, in batches."""

from __future__ import annotations

import numpy as np
import pandas as pd
import tensorflow as tf

from retrieval.features import feature_arrays


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
