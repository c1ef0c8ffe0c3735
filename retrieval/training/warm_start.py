"""Warm starts: a run trained on from a finished run's weights, its vocabularies grown by id.

A finished run keeps what a later run needs to train on from it in ``<run>/warm_start/``
(``save_training_state``, written by the job after training): every model variable, the
optimizer's slots, the vocabulary of every lookup that indexes an embedding table's rows, the
training statistics (users, items and their click counts) and the feature towers' numeric
statistics. ``ParentState.read`` reads it back; the job then

1. grows the statistics (``grown_statistics``, ``grown_tower_statistics``): every vocabulary is
   the parent's ids plus the new log's, so a vocabulary never shrinks; the static log-Q counts
   are the parent's plus the new clicks'; numeric features keep the parent's normalisation (the
   trained layers read inputs scaled that way);
2. builds the model as from scratch (new rows get the model's own initialisation: random rows
   for ids, the popularity prior for the item bias) and ``restore_weights`` overwrites every
   variable with the parent's, a table's rows gathered by id (``row_map``), the streaming
   log-Q estimate's buckets moved to the items' new tower indices (``move_estimate``);
3. with ``train.warm_start_optimizer: carry``, ``carry_optimizer`` fills the new optimizer's
   slots the same way (new rows at zero, as a fresh slot starts) and its step counter.

Variables are matched by position in ``model.variables``: the parent's config must build the same
variables in the same order (``retrieval.config.warm_start_conflicts`` checks the keys that decide
it; ``restore_weights`` checks every shape and names the first that differs).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import tensorflow as tf

from retrieval.config import ConfigError
from retrieval.features import FeatureStatistics, ItemPopularity, TowerStatistics, Vocabulary
from retrieval.features.tower_statistics import NumericStatistics, TimestampStatistics
from retrieval.samplers import StreamingFrequency

log = logging.getLogger("retrieval")

STATE_DIR = "warm_start"
_ARRAYS = "arrays"  # one .npy file an array: written one at a time, never all held at once
_INFO = "state.json"
# The optimizers' per-variable slot lists (tf-keras optimizers index them by ``_index_dict``).
_SLOT_LISTS = ("_momentums", "_velocities", "_velocity_hats", "_accumulators")


def _table_lookups(model: tf.keras.Model) -> dict[int, tf.keras.layers.StringLookup]:
    """id(embedding table variable) -> the string lookup whose output indexes its rows.

    A table ``<name>_embedding`` (or ``item_bias``) is indexed by ``<name>_lookup`` (``item_bias_lookup``)
    among the layers of the same Keras model: the naming of ``IdEmbedding``, the feature towers'
    categorical embeddings and the item bias.
    """
    tables: dict[int, tf.keras.layers.StringLookup] = {}
    models = [module for module in model.submodules if isinstance(module, tf.keras.Model)]
    for keras_model in models:
        layers = {layer.name: layer for layer in keras_model.layers}
        for layer in keras_model.layers:
            if not isinstance(layer, tf.keras.layers.Embedding):
                continue
            lookup = layers.get(layer.name.removesuffix("_embedding") + "_lookup")
            if isinstance(lookup, tf.keras.layers.StringLookup):
                tables[id(layer.embeddings)] = lookup
    return tables


def _vocabulary(lookup: tf.keras.layers.StringLookup) -> list[str]:
    return [str(token) for token in lookup.get_vocabulary(include_special_tokens=False)]


def _slots(optimizer: tf.keras.optimizers.Optimizer, variable: tf.Variable) -> dict[str, tf.Variable]:
    """The optimizer's slot variables of ``variable``: slot list name -> variable."""
    index = optimizer._index_dict.get(optimizer._var_key(variable))
    if index is None:
        return {}
    return {name: getattr(optimizer, name)[index] for name in _SLOT_LISTS if getattr(optimizer, name, None)}


def save_training_state(
    directory: str | Path,
    model: tf.keras.Model,
    stats: FeatureStatistics,
    optimizer_name: str,
    catalogue: list[str],
    tower_statistics: TowerStatistics | None = None,
) -> None:
    """Write what a warm start from this run reads into ``directory/warm_start/``.

    ``arrays/`` (one ``.npy`` file an array, written as it is read from its variable, so no more
    than one table is copied in memory at a time): ``variable/<i>`` for each of ``model.variables``
    (in order), ``slot/<list>/<i>`` for the optimizer's slots of variable ``i``,
    ``vocabulary/<lookup>`` for each lookup that indexes a table, ``users``, ``items`` and
    ``item_counts`` (the training statistics), ``catalogue`` (the index's item ids in index order,
    which the bundle's seen items are rows of). ``state.json``: the
    variables' names and shapes, which lookup indexes each table and its OOV rows, the optimizer's
    class and step, and the feature towers' numeric statistics.
    """
    folder = Path(directory) / STATE_DIR
    (folder / _ARRAYS).mkdir(parents=True, exist_ok=True)
    tables = _table_lookups(model)
    optimizer = getattr(model, "optimizer", None)
    arrays = _Arrays(folder / _ARRAYS)
    arrays["users"] = np.asarray(stats.users.ids, dtype=str)
    arrays["items"] = np.asarray(stats.items.ids, dtype=str)
    arrays["item_counts"] = np.asarray(stats.item_popularity.counts[1:], dtype=np.float64)
    arrays["catalogue"] = np.asarray(catalogue, dtype=str)
    variables: list[dict[str, Any]] = []
    lookups: dict[str, int] = {}
    for position, variable in enumerate(model.variables):
        arrays[f"variable/{position}"] = variable.numpy()
        lookup = tables.get(id(variable))
        record: dict[str, Any] = {"name": variable.name, "shape": list(variable.shape), "lookup": None}
        if lookup is not None:
            record["lookup"] = lookup.name
            lookups[lookup.name] = int(lookup.num_oov_indices)
            arrays[f"vocabulary/{lookup.name}"] = np.asarray(_vocabulary(lookup), dtype=str)
        if optimizer is not None and variable.trainable:
            for name, slot in _slots(optimizer, variable).items():
                arrays[f"slot/{name}/{position}"] = slot.numpy()
        variables.append(record)
    numeric: dict[str, Any] = {}
    if tower_statistics is not None:
        for name, statistic in tower_statistics.features.items():
            if isinstance(statistic, NumericStatistics | TimestampStatistics):
                numeric[name] = {"kind": type(statistic).__name__, **dataclasses.asdict(statistic)}
    info = {
        "variables": variables,
        "lookups": lookups,
        "optimizer": None if optimizer is None else {
            "name": optimizer_name, "iterations": int(optimizer.iterations.numpy()),
        },
        "numeric_statistics": numeric,
    }
    (folder / _INFO).write_text(json.dumps(info, indent=1))


class _Arrays:
    """Arrays by name, one ``<name>.npy`` file each under ``folder`` ("/" in a name becomes "."): set
    writes the file, get reads it (``np.load``, no pickles)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def _path(self, name: str) -> Path:
        return self.folder / (name.replace("/", ".") + ".npy")

    def __setitem__(self, name: str, array: np.ndarray) -> None:
        np.save(self._path(name), array, allow_pickle=False)

    def __getitem__(self, name: str) -> np.ndarray:
        return np.load(self._path(name), allow_pickle=False)

    def get(self, name: str) -> np.ndarray | None:
        return self[name] if self._path(name).is_file() else None


@dataclass(frozen=True)
class ParentState:
    """A finished run's training state (``save_training_state``), read for a warm start.

    Attributes:
      directory: the parent run directory.
      arrays: the saved arrays by name, each read from its file when asked for.
      info: ``state.json``.
    """

    directory: Path
    arrays: _Arrays
    info: dict[str, Any]

    @classmethod
    def read(cls, directory: str | Path) -> ParentState:
        """The state under ``directory/warm_start/``; a ``ConfigError`` naming ``train.warm_start`` when absent."""
        directory = Path(directory)
        folder = directory / STATE_DIR
        if not (folder / _INFO).is_file() or not (folder / _ARRAYS).is_dir():
            raise ConfigError(
                f"train.warm_start={str(directory)!r} holds no training state ({STATE_DIR}/{_INFO} and {_ARRAYS}): "
                "a run directory written by `retrieval train` keeps it unless export.warm_start_state was false; a "
                "bundle copied without it, or written before warm starts existed, cannot be trained on from"
            )
        return cls(directory, _Arrays(folder / _ARRAYS), json.loads((folder / _INFO).read_text()))

    def vocabulary(self, lookup: str) -> list[str]:
        return self.arrays[f"vocabulary/{lookup}"].tolist()

    @property
    def users(self) -> list[str]:
        return self.arrays["users"].tolist()

    @property
    def items(self) -> list[str]:
        return self.arrays["items"].tolist()

    @property
    def catalogue(self) -> list[str]:
        """The parent index's item ids, in index order."""
        return self.arrays["catalogue"].tolist()


def _union(new_ids, parent_ids) -> Vocabulary:
    """Sorted ids of both: the parent's ids are never lost, so a vocabulary cannot shrink."""
    return Vocabulary(tuple(sorted(set(new_ids).union(parent_ids))))


def grown_statistics(stats: FeatureStatistics, parent: ParentState) -> FeatureStatistics:
    """``stats`` (the new training clicks') with the parent's users and items added and the parent's
    item click counts added to the new ones (a static log-Q then counts every click trained on)."""
    users, items = _union(stats.users.ids, parent.users), _union(stats.items.ids, parent.items)
    counts = np.zeros(len(items) + 1, np.float64)
    index = pd.Index(items.ids, dtype=object)
    counts[index.get_indexer(pd.Index(stats.items.ids, dtype=object)) + 1] += stats.item_popularity.counts[1:]
    counts[index.get_indexer(pd.Index(parent.items, dtype=object)) + 1] += parent.arrays["item_counts"]
    return FeatureStatistics(users, items, ItemPopularity(items, counts), stats.has_weights)


def grown_tower_statistics(statistics: TowerStatistics, parent: ParentState) -> TowerStatistics:
    """The feature towers' statistics with each vocabulary grown by the parent's (``<feature>_lookup``),
    the history vocabulary by the parent's items, and the parent's numeric and timestamp
    normalisation kept (the trained layers read inputs scaled that way; a timestamp keeps the new
    reference time, so an age is still measured from the end of training)."""
    features = dict(statistics.features)
    lookups = parent.info["lookups"]
    for name, statistic in statistics.features.items():
        if isinstance(statistic, Vocabulary) and f"{name}_lookup" in lookups:
            features[name] = _union(statistic.ids, parent.vocabulary(f"{name}_lookup"))
        record = parent.info["numeric_statistics"].get(name)
        if record is None:
            continue
        if record["kind"] == "NumericStatistics":
            features[name] = NumericStatistics(record["mean"], record["variance"], record["count"])
        elif isinstance(statistic, TimestampStatistics):
            features[name] = TimestampStatistics(
                statistic.reference, NumericStatistics(**record["age"]), NumericStatistics(**record["log_age"])
            )
    return dataclasses.replace(statistics, features=features, items=_union(statistics.items.ids, parent.items))


def row_map(parent_ids, new_ids, oov_rows: int, key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(parent_rows, new_rows)``: row ``parent_rows[j]`` of a parent table is row ``new_rows[j]`` of the
    new one, for the ``oov_rows`` out-of-vocabulary rows (in place) and every parent id (by id).

    Raises:
      ConfigError: a parent id is missing from the new vocabulary (``key`` names the lookup).
    """
    positions = pd.Index(list(new_ids), dtype=object).get_indexer(pd.Index(list(parent_ids), dtype=object))
    if (positions < 0).any():
        missing = [parent_ids[i] for i in np.flatnonzero(positions < 0)[:3]]
        raise ConfigError(
            f"train.warm_start: the vocabulary of {key} would shrink: {int((positions < 0).sum())} of the parent's "
            f"ids are missing from it (e.g. {missing}); a warm start keeps every id the parent knew"
        )
    oov = np.arange(oov_rows)
    return (np.concatenate([oov, np.arange(len(positions)) + oov_rows]),
            np.concatenate([oov, positions + oov_rows]))


def _remapped(parent: np.ndarray, fresh: np.ndarray, rows: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
    if rows is None:
        return parent
    values = fresh.copy()
    values[rows[1]] = parent[rows[0]]
    return values


def _row_maps(model: tf.keras.Model, parent: ParentState) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """Per variable of ``model`` (in order), its row map from the parent's table (None: not a table
    indexed by a vocabulary, copied whole), after checking each against the parent's record."""
    records = parent.info["variables"]
    variables = model.variables
    if len(records) != len(variables):
        raise ConfigError(
            f"train.warm_start: the model has {len(variables)} variables, the parent's {len(records)}: the towers, "
            "sampler or loss differ (model, towers and model.loss keys must build the same layers)"
        )
    tables = _table_lookups(model)
    maps: list[tuple[np.ndarray, np.ndarray] | None] = []
    for variable, record in zip(variables, records, strict=True):
        shape, parent_shape = list(variable.shape), record["shape"]
        lookup = tables.get(id(variable))
        if lookup is None or record["lookup"] is None:
            if shape != parent_shape:
                raise ConfigError(
                    f"train.warm_start: variable {variable.name} has shape {shape}, the parent's {record['name']} "
                    f"{parent_shape} and no vocabulary indexes its rows: the tower shape differs (model.embedding_dim, "
                    "towers, MLP sizes ...), or it is a sampler's table sized by the catalogue, which a warm start "
                    "cannot grow by id"
                )
            maps.append(None)
            continue
        if shape[1:] != parent_shape[1:]:
            raise ConfigError(
                f"train.warm_start: table {variable.name} has rows of shape {shape[1:]}, the parent's "
                f"{parent_shape[1:]}: the embedding size differs"
            )
        oov = int(lookup.num_oov_indices)
        if oov != parent.info["lookups"][record["lookup"]]:
            raise ConfigError(f"train.warm_start: {lookup.name} has {oov} out-of-vocabulary rows, the parent's "
                              f"{parent.info['lookups'][record['lookup']]} (towers ... oov_buckets)")
        maps.append(row_map(parent.vocabulary(record["lookup"]), _vocabulary(lookup), oov, lookup.name))
    return maps


def restore_weights(model: tf.keras.Model, parent: ParentState) -> int:
    """Set every variable of ``model`` to the parent's, tables row by row by id; return the number of
    table rows that are new (kept at the model's own initialisation)."""
    maps = _row_maps(model, parent)
    new_rows = 0
    for position, (variable, rows) in enumerate(zip(model.variables, maps, strict=True)):
        fresh = variable.numpy()
        variable.assign(_remapped(parent.arrays[f"variable/{position}"], fresh, rows))
        if rows is not None:
            new_rows += len(fresh) - len(rows[0])
    for estimator in (m for m in model.submodules if isinstance(m, StreamingFrequency)):
        move_estimate(estimator, parent.items, list(model._item_ids))
    return new_rows


def move_estimate(estimator: StreamingFrequency, parent_items: list[str], items: list[str]) -> None:
    """Move a streaming estimate from ``parent_items``' tower indices to ``items``' (each id at
    ``position + 1`` of its list): the estimate keys on tower indices, which move when the item
    vocabulary grows. Each parent item's buckets (its last step and gap, under every hash) go to
    the buckets of its new index; every other bucket starts unseen; the step count and the draws per
    step stay. Two items whose new buckets collide keep one's values (as a collision in training
    would share them)."""
    rows = row_map(parent_items, items, 1, "items")
    old_keys = tf.constant(rows[0][1:], tf.int64)
    new_keys = tf.constant(rows[1][1:], tf.int64)
    old_buckets, new_buckets = estimator.buckets(old_keys).numpy(), estimator.buckets(new_keys).numpy()
    gaps, last = estimator.gap.numpy(), estimator.last_step.numpy()
    for h in range(estimator.num_hashes):
        gap = np.full(estimator.num_buckets, estimator.initial_gap, np.float32)
        step = np.full(estimator.num_buckets, -1, np.int64)
        gap[new_buckets[h]] = gaps[h, old_buckets[h]]
        step[new_buckets[h]] = last[h, old_buckets[h]]
        estimator.assign_arrays(h, gap, step)


def carry_optimizer(optimizer: tf.keras.optimizers.Optimizer, model: tf.keras.Model, parent: ParentState,
                    optimizer_name: str) -> None:
    """Fill ``optimizer``'s slots (built for ``model``) with the parent's, remapped by id like the
    weights (new rows at zero, as a fresh slot starts), and carry its step count."""
    record = parent.info.get("optimizer")
    if record is None:
        raise ConfigError("train.warm_start_optimizer=carry: the parent saved no optimizer state; use reset")
    if record["name"] != optimizer_name:
        raise ConfigError(
            f"train.warm_start_optimizer=carry needs the parent's optimizer: train.optimizer is {optimizer_name!r}, "
            f"the parent trained with {record['name']!r} (set train.optimizer={record['name']!r} or "
            "train.warm_start_optimizer=reset)"
        )
    optimizer.build(model.trainable_variables)
    maps = _row_maps(model, parent)
    for position, (variable, rows) in enumerate(zip(model.variables, maps, strict=True)):
        if not variable.trainable:
            continue
        for name, slot in _slots(optimizer, variable).items():
            saved = parent.arrays.get(f"slot/{name}/{position}")
            if saved is None:
                raise ConfigError(f"train.warm_start_optimizer=carry: the parent has no {name} slot of {variable.name}")
            slot.assign(_remapped(saved, np.zeros(slot.shape, saved.dtype), rows))
    optimizer.iterations.assign(record["iterations"])
