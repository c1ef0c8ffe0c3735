"""Baseline rankers, scored on the same users, masks and catalogue as the model.

Each baseline is ``rank(train, catalogue_ids, eval_set, depth, config) -> ranked``,
``ranked`` being [num_users, depth] catalogue rows aligned with
``eval_set.user_ids``, best first, -1 where the catalogue ran out. Every one
ranks the FULL catalogue (items without training clicks included) and drops
``eval_set.exclude`` exactly as the model's ranking does, so the columns of a
results table differ only in the scorer.

- ``popularity``: the most clicked training items the user has not clicked.
- ``als``: implicit-feedback matrix factorisation, "Collaborative Filtering for
  Implicit Feedback Datasets" (Hu, Koren & Volinsky, ICDM 2008), fitted with
  the conjugate-gradient solver of Takács et al. (RecSys 2011) as implemented by
  ``implicit.cpu.als.AlternatingLeastSquares``. The user-item matrix holds each
  pair's number of training clicks, times ``alpha``, as its confidence. Items
  without training clicks get a zero factor (as the two-tower model's
  out-of-vocabulary row), and so do test users without training clicks.
- ``ease``: EASE, "Embarrassingly Shallow Autoencoders for Sparse Data" (Steck,
  WWW 2019): an item-item weight matrix in closed form, a strong reference on
  dense logs. It inverts a dense [items, items] Gram matrix, so it is for
  catalogues of tens of thousands of items at most; it is not in ``BASELINES``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from retrieval.common.arrays import drop_members
from retrieval.config import ALSConfig, BaselinesConfig
from retrieval.data import ITEM, USER
from retrieval.evaluation.protocol import EvalSet, index_ranking, item_click_counts, pad_columns
from retrieval.index import ItemIndex


def popularity_ranking(
    train: pd.DataFrame,
    catalogue_ids: Sequence[str],
    eval_set: EvalSet,
    depth: int,
    config: BaselinesConfig | None = None,
) -> np.ndarray:
    """The most-clicked training items each user has not clicked (ties: catalogue order).

    Returns:
      [num_users, depth] catalogue rows. ``config`` is unused (uniform signature).
    """
    return popularity_ranking_from_counts(item_click_counts(train, catalogue_ids), eval_set, depth)


def popularity_ranking_from_counts(counts: np.ndarray, eval_set: EvalSet, depth: int) -> np.ndarray:
    """``popularity_ranking`` from [num_items] training clicks per catalogue row (no click frame needed).

    Returns:
      [num_users, depth] catalogue rows.
    """
    global_order = np.lexsort((np.arange(len(counts)), -counts))
    extra = max((len(e) for e in eval_set.exclude), default=0)
    head = global_order[: depth + extra]
    rows = np.broadcast_to(head, (len(eval_set.user_ids), len(head)))
    rows, _ = drop_members(rows, np.zeros(rows.shape, np.float32), eval_set.exclude)
    return pad_columns(rows[:, :depth], depth)


@dataclass(frozen=True)
class ALSFactors:
    """A fitted ALS model.

    Attributes:
      user_ids: [num_train_users] ids, row order of ``user_factors``.
      user_factors: [num_train_users, factors] float32.
      item_factors: [num_items, factors] float32, catalogue row order; zero for
        items without training clicks.
    """

    user_ids: pd.Index
    user_factors: np.ndarray
    item_factors: np.ndarray

    def users(self, user_ids: Sequence[str] | np.ndarray) -> np.ndarray:
        """Factors of ``user_ids`` [len(user_ids), factors]; zero rows for unknown users."""
        rows = self.user_ids.get_indexer(pd.Index(user_ids, dtype=object))
        factors = np.zeros((len(rows), self.user_factors.shape[1]), dtype=np.float32)
        known = rows >= 0
        factors[known] = self.user_factors[rows[known]]
        return factors


def fit_als(train: pd.DataFrame, catalogue_ids: Sequence[str], config: ALSConfig) -> ALSFactors:
    """Fit implicit ALS on the training clicks over the whole catalogue.

    Args:
      train: canonical training clicks (weights are not used: confidence counts clicks).
      catalogue_ids: [num_items] item ids; matrix columns follow this order.
      config: factors, regularisation, alpha, iterations, seed, threads.
    """
    item_rows = pd.Index(catalogue_ids, dtype=object).get_indexer(train[ITEM])
    if (item_rows < 0).any():
        missing = train[ITEM].to_numpy()[item_rows < 0][0]
        raise ValueError(f"training item {missing!r} is missing from the catalogue")
    user_codes, user_ids = pd.factorize(train[USER], sort=True)
    return fit_als_pairs(user_codes, item_rows, pd.Index(user_ids, dtype=object), len(catalogue_ids), config)


def fit_als_pairs(
    user_rows: np.ndarray, item_rows: np.ndarray, user_ids: pd.Index, num_items: int, config: ALSConfig
) -> ALSFactors:
    """Fit implicit ALS on training clicks given as (user row, catalogue row) pairs, one per click.

    What ``fit_als`` does once it has coded a click frame, and what the
    out-of-core job calls with pairs coded while streaming the shards
    (``retrieval.data.streaming.scan_pairs``): the sparse matrix is the only
    copy of the log, 12 bytes a distinct pair.

    Args:
      user_rows, item_rows: [num_clicks] int rows of ``user_ids`` and of the catalogue.
      user_ids: the users, in row order.
      num_items: catalogue size (matrix columns).
    """
    # Imported here: implicit (and its BLAS probing) is only needed when ALS is asked for.
    from implicit.cpu.als import AlternatingLeastSquares
    from scipy.sparse import csr_matrix
    from threadpoolctl import threadpool_limits

    clicks = csr_matrix(
        (np.ones(len(user_rows), np.float32), (user_rows, item_rows)), shape=(len(user_ids), num_items)
    )
    clicks.sum_duplicates()  # a pair clicked n times has confidence alpha * n
    # implicit parallelises over users/items itself; a multi-threaded BLAS underneath
    # oversubscribes the cores (implicit warns and can run ~10x slower), so BLAS gets one.
    with threadpool_limits(limits=1, user_api="blas"):
        model = AlternatingLeastSquares(
            factors=config.factors_for(len(user_rows)),
            regularization=config.regularization,
            alpha=config.alpha,
            iterations=config.iterations,
            random_state=config.seed,
            num_threads=config.num_threads,
        )
        model.fit(clicks, show_progress=False)
    item_factors = np.array(model.item_factors, dtype=np.float32)
    item_factors[np.asarray(clicks.sum(axis=0)).ravel() == 0] = 0.0
    return ALSFactors(user_ids, np.array(model.user_factors, dtype=np.float32), item_factors)


def als_ranking(
    train: pd.DataFrame,
    catalogue_ids: Sequence[str],
    eval_set: EvalSet,
    depth: int,
    config: BaselinesConfig | None = None,
    batch_size: int = 4096,
) -> np.ndarray:
    """Top-``depth`` rows by ALS score (dot product of factors), masked like the model.

    The item factors go into an exact FAISS inner-product index and are ranked by
    ``index_ranking``, the function that ranks the model.
    """
    config = config or BaselinesConfig()
    return als_factors_ranking(fit_als(train, catalogue_ids, config.als), catalogue_ids, eval_set, depth, batch_size)


def als_factors_ranking(
    factors: ALSFactors, catalogue_ids: Sequence[str], eval_set: EvalSet, depth: int, batch_size: int = 4096
) -> np.ndarray:
    """Top-``depth`` rows of fitted ALS factors, ranked by ``index_ranking`` as the model is."""
    index = ItemIndex.build(list(catalogue_ids), factors.item_factors, "Flat")
    return index_ranking(index, factors.users(eval_set.user_ids), eval_set, depth, batch_size)


def ease_weights(train: pd.DataFrame, catalogue_ids: Sequence[str], l2: float) -> np.ndarray:
    """EASE's item-item weights B = I - P / diag(P), P = (X'X + l2 I)^-1, diagonal zero.

    ``X`` is the [users, items] 0/1 matrix of training clicks (a pair clicked
    several times counts once). B minimises ||X - XB||^2 + l2 ||B||^2 under
    diag(B) = 0; a user's scores are x_u B.

    Args:
      train: clicks with USER and ITEM columns, every ITEM in ``catalogue_ids``.
      catalogue_ids: [num_items] item ids, the rows and columns of B.
      l2: ridge strength (> 0).

    Returns:
      [num_items, num_items] float32 B.
    """
    return _ease_fit(train, catalogue_ids, l2)[0]


def _ease_fit(train: pd.DataFrame, catalogue_ids: Sequence[str], l2: float):
    """(B, X as sparse [users, items] 0/1, user ids in X's row order)."""
    from scipy.sparse import csr_matrix

    if l2 <= 0:
        raise ValueError(f"ease: l2 must be > 0 (X'X alone may be singular), got {l2}")
    item_rows = pd.Index(catalogue_ids, dtype=object).get_indexer(train[ITEM].astype(str))
    if (item_rows < 0).any():
        raise ValueError(f"ease: {int((item_rows < 0).sum())} training clicks name items outside the catalogue")
    user_codes, user_ids = pd.factorize(train[USER].astype(str))
    clicks = csr_matrix(
        (np.ones(len(train), np.float32), (user_codes, item_rows)), shape=(len(user_ids), len(catalogue_ids))
    )
    clicks.data[:] = 1.0  # repeats count once (csr_matrix summed them)
    # Only the Gram matrix is dense: [items, items].
    gram = (clicks.T @ clicks).toarray()
    gram[np.diag_indices_from(gram)] += l2
    precision = np.linalg.inv(gram)
    weights = -precision / np.diag(precision)
    np.fill_diagonal(weights, 0.0)
    return weights, clicks, pd.Index(user_ids, dtype=object)


def ease_ranking(
    train: pd.DataFrame,
    catalogue_ids: Sequence[str],
    eval_set: EvalSet,
    depth: int,
    config: BaselinesConfig | None = None,
    *,
    l2: float = 500.0,
    batch_size: int = 4096,
) -> np.ndarray:
    """Top-``depth`` rows by EASE score x_u B, masked and ranked by ``index_ranking`` as the model is.

    The exact index holds the columns of B (``ease_weights``) and the query is
    the user's 0/1 click row, so the inner product is the EASE score. Evaluated
    users without training clicks get a zero query. ``config`` is unused
    (uniform signature).

    Returns:
      [num_users, depth] catalogue rows, -1 where the catalogue ran out.
    """
    weights, clicks, user_ids = _ease_fit(train, catalogue_ids, l2)
    rows = user_ids.get_indexer(pd.Index(eval_set.user_ids, dtype=object))
    queries = clicks[np.maximum(rows, 0)].toarray()
    queries[rows < 0] = 0.0  # evaluated users without training clicks
    index = ItemIndex.build(list(catalogue_ids), np.ascontiguousarray(weights.T), "Flat")
    return index_ranking(index, queries, eval_set, depth, batch_size)


def als_skip_reason(train_clicks: int, config: ALSConfig) -> str | None:
    """Why ALS is not fitted on a training part of ``train_clicks`` clicks, or None when it is."""
    if config.max_train_clicks is not None and train_clicks > config.max_train_clicks:
        return (
            f"the training part holds {train_clicks:,} clicks, more than evaluation.baselines.als."
            f"max_train_clicks={config.max_train_clicks:,} (raise it to fit ALS: its sparse matrix takes "
            "~12 bytes a distinct (user, item) pair)"
        )
    return None


Baseline = Callable[[pd.DataFrame, Sequence[str], EvalSet, int, BaselinesConfig], np.ndarray]

BASELINES: dict[str, Baseline] = {
    "popularity": popularity_ranking,
    "als": als_ranking,
}


def baseline_ranking(
    name: str,
    train: pd.DataFrame,
    catalogue_ids: Sequence[str],
    eval_set: EvalSet,
    depth: int,
    config: BaselinesConfig,
) -> np.ndarray:
    """Rank with the baseline called ``name`` (a key of ``BASELINES``). [num_users, depth]."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; valid: {', '.join(BASELINES)}")
    return BASELINES[name](train, catalogue_ids, eval_set, depth, config)
