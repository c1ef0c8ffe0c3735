"""Early stopping: a validation part carved from the training clicks, recall@k on it after each epoch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import tensorflow as tf

from retrieval.config import SplitConfig
from retrieval.data import ITEM, TIME, USER, split_clicks
from retrieval.data.splits import validation_carve
from retrieval.features import feature_arrays
from retrieval.index.exact_topk import ExactTopK
from retrieval.model import TwoTowerModel
from retrieval.training.sources import ClickSource, FrameClicks


def validation_split(
    train: pd.DataFrame, fraction: float, split: SplitConfig | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Carve ``(fit_part, validation)`` from the training part like ``split`` carved the test part.

    ``temporal`` (the default when there are timestamps) holds out the latest
    ``fraction`` of the training clicks, ``leave_last_k`` each user's last
    ``split.k``, ``random`` a random ``fraction`` (hash keyed by ``nested_seed(split.seed)``);
    ``none`` (a given test log) behaves as temporal, or random without timestamps.
    """
    carve = validation_carve(split, fraction, has_time=TIME in train)
    return split_clicks(train, carve)


@dataclass(frozen=True)
class ValidationData:
    """What early stopping trains on and watches, from either click source.

    Attributes:
      fit_source: the training clicks less the validation part.
      validation: the validation clicks (all, or a sample of users' when streamed),
        each row holding the query tower's inputs.
      fit_clicks: the fit-part clicks of (at least) the validation users: masked
        from their rankings.
    """

    fit_source: ClickSource
    validation: pd.DataFrame
    fit_clicks: pd.DataFrame

    @classmethod
    def from_frame(
        cls, train: pd.DataFrame, fraction: float, batch_size: int, seed: int, split: SplitConfig | None = None
    ) -> ValidationData:
        """``validation_split`` of an in-memory training frame."""
        fit_part, validation = validation_split(train, fraction, split)
        return cls(FrameClicks(fit_part, batch_size, seed=seed), validation, fit_part)


METRICS = ("recall", "ndcg")  # what ValidationRecall can watch (TrainConfig.validation_metric)


class ValidationRecall:
    """Recall@k (or NDCG@k) of held-out clicks after each epoch, with early stopping on it.

    An epoch hook of ``retrieval.training.loop.train_epochs``. Each validation
    click is a query (the tower inputs of its own row, as in a training
    batch); it is a hit when its item is in the top k of every item the model
    scores (``TwoTowerModel.item_scores``), the user's clicks in the fit part
    excluded. Clicks repeating a fit-part click are dropped, as in the test
    protocol. Recall is the share of hits (recall over clicks), NDCG@k the mean of
    ``1 / log2(2 + rank)`` over the clicks (rank 0-based; 0 for a miss). Both are
    logged each epoch; ``metric`` says which one picks the best epoch and stops.

    Attributes:
      recalls, ndcgs: the values after each epoch; values: those of ``metric``.
      best_epoch: 1-based epoch of the best value; best_weights its weights
        (kept only with ``keep_weights``: a refit starts from the initial ones).
    """

    def __init__(self, model: TwoTowerModel, validation: pd.DataFrame, fit_part: pd.DataFrame, k: int,
                 patience: int, keep_weights: bool = True, metric: str = "recall"):
        if metric not in METRICS:
            raise ValueError(f"the validation metric must be one of {', '.join(METRICS)}, got {metric!r}")
        pairs = pd.MultiIndex.from_frame(fit_part[[USER, ITEM]].astype(str))
        repeat = pd.MultiIndex.from_frame(validation[[USER, ITEM]].astype(str)).isin(pairs)
        self.model = model
        self.validation = validation[~repeat].reset_index(drop=True)
        self.fit_pairs = fit_part[[USER, ITEM]].astype(str).drop_duplicates()
        self.k, self.patience, self.metric = int(k), int(patience), metric
        self.recalls: list[float] = []
        self.ndcgs: list[float] = []
        self.best_epoch, self.best_weights = 0, None
        self.keep_weights = keep_weights
        self._masks: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def key(self) -> str:
        """The log key of the watched metric (``val_recall@k`` or ``val_ndcg@k``)."""
        return f"val_{self.metric}@{self.k}"

    @property
    def keys(self) -> dict[str, list[float]]:
        """Every logged metric's key and its values so far."""
        return {f"val_recall@{self.k}": self.recalls, f"val_ndcg@{self.k}": self.ndcgs}

    @property
    def values(self) -> list[float]:
        """The watched metric's values so far."""
        return self.ndcgs if self.metric == "ndcg" else self.recalls

    def _exclusions(self) -> tuple[np.ndarray, np.ndarray]:
        """(validation row, tower index) of every fit-part click of each row's user."""
        if self._masks is None:
            rows = self.validation[[USER]].astype(str).reset_index().rename(columns={"index": "row"})
            pairs = rows.merge(self.fit_pairs, on=USER).sort_values("row", kind="stable")  # grouped by row
            items = self.model.item_index(tf.constant(pairs[ITEM].to_numpy(dtype=object))).numpy()
            self._masks = (pairs["row"].to_numpy(np.int64), items)
        return self._masks

    def recall(self, batch_size: int = 1024, max_scores: int = 1 << 25) -> float:
        """Recall@k of the validation clicks under the model now (``measure``'s first value)."""
        return self.measure(batch_size, max_scores)[0]

    def measure(self, batch_size: int = 1024, max_scores: int = 1 << 25) -> tuple[float, float]:
        """``(recall@k, NDCG@k)`` of the validation clicks under the model now.

        The catalogue is embedded once, in batches. A dot-product model's
        clicks are ranked by ``ExactTopK`` (blocked matrix products, the fit-part
        items masked in each block), in bounded memory at a million items; a
        hierarchical softmax scores every item of ``batch_size`` clicks at a
        time, fewer when a ``[batch, items]`` block would pass ``max_scores``
        floats (128 MiB by default).
        """
        if self.validation.empty:
            return 0.0, 0.0
        model = self.model
        mask_rows, mask_items = self._exclusions()
        targets = model.item_index(tf.constant(self.validation[ITEM].astype(str).to_numpy(dtype=object))).numpy()
        if model.servable_by_dot_product:
            search = ExactTopK(model.catalogue_array()[1:])  # row 0 (OOV) is no recommendation
            exclude = np.split(mask_items - 1, np.searchsorted(mask_rows, np.arange(1, len(self.validation))))
        else:
            catalogue = model.catalogue_embeddings()
            batch_size = int(max(1, min(batch_size, max_scores // (model.num_items + 1))))
        ranks = []  # each click's 0-based rank, or k for a miss
        for start in range(0, len(self.validation), batch_size):
            rows = self.validation.iloc[start : start + batch_size]
            target = targets[start : start + len(rows)]
            arrays = feature_arrays(rows, model.query_tower.input_names)
            queries = model.query_tower({name: tf.constant(v) for name, v in arrays.items()}, training=False)
            if model.servable_by_dot_product:
                _, top = search.search(queries.numpy(), self.k, exclude[start : start + len(rows)])
                found = (top == (target - 1)[:, None]) & (target > 0)[:, None]
                ranks.append(np.where(found.any(axis=1), found.argmax(axis=1), self.k))
                continue
            scores = model.item_scores(queries, catalogue)
            chosen = (mask_rows >= start) & (mask_rows < start + len(rows))
            masked = np.concatenate([
                np.stack([np.arange(len(rows)), np.zeros(len(rows), np.int64)], axis=1),
                np.stack([mask_rows[chosen] - start, mask_items[chosen]], axis=1),
            ])
            scores = tf.tensor_scatter_nd_update(
                scores, tf.constant(masked, tf.int64), tf.fill([len(masked)], tf.constant(-np.inf, scores.dtype))
            )
            target_scores = tf.gather(scores, target, axis=1, batch_dims=1)
            rank = tf.math.count_nonzero(scores > target_scores[:, None], axis=1).numpy()
            hit = (rank < self.k) & tf.math.is_finite(target_scores).numpy() & (target > 0)
            ranks.append(np.where(hit, rank, self.k))
        rank = np.concatenate(ranks)
        hit = rank < self.k
        return float(np.mean(hit)), float(np.mean(np.where(hit, 1.0 / np.log2(2.0 + rank), 0.0)))

    def __call__(self, epoch: int, logs: dict) -> bool:
        """Record epoch ``epoch``'s recall and NDCG in ``logs``; True once ``patience`` epochs passed
        without a gain in the watched one."""
        recall, ndcg = self.measure()
        self.recalls.append(recall)
        self.ndcgs.append(ndcg)
        logs.update({key: values[-1] for key, values in self.keys.items()})
        values = self.values
        if self.best_epoch == 0 or values[-1] > values[self.best_epoch - 1]:
            self.best_epoch = epoch + 1
            self.best_weights = self.model.get_weights() if self.keep_weights else None
            return False
        return self.stopped

    @property
    def stopped(self) -> bool:
        """True once ``patience`` epochs passed without a gain."""
        return bool(self.values) and len(self.values) - self.best_epoch >= self.patience

    def resume(self, history: dict[str, list[float]]) -> None:
        """Take up the values of the epochs before a resume (the best epoch's weights are not among them)."""
        recalls, ndcgs = (list(history.get(key, [])) for key in self.keys)
        self.recalls = [float(value) for value in recalls]
        self.ndcgs = [float(value) for value in ndcgs] if len(ndcgs) == len(recalls) else [0.0] * len(recalls)
        values = self.values
        self.best_epoch = int(np.argmax(values)) + 1 if values else 0  # the first maximum, as __call__
        self.best_weights = None
