"""The offline protocol: who is evaluated, on what, against which ranking.

Plain numpy/pandas plus the FAISS index; no TensorFlow. Query embeddings come
in as arrays, so the same code evaluates an in-memory model and an exported
bundle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from retrieval.common.progress import Progress
from retrieval.config import EvaluationConfig
from retrieval.data import ITEM, USER, DataError
from retrieval.index import ItemIndex


@dataclass(frozen=True)
class EvalSet:
    """Test users with their relevant and masked catalogue rows.

    Attributes:
      user_ids: [num_users] evaluated users (string ids).
      relevant: per user, catalogue rows of their (unique) test items.
      exclude: per user, catalogue rows never to rank (their training items);
        empty arrays when masking is off.
      counts: what was dropped and why (reported beside the metrics).
    """

    user_ids: np.ndarray
    relevant: list[np.ndarray]
    exclude: list[np.ndarray]
    counts: dict[str, int] = field(default_factory=dict)


def build_eval_set(
    train: pd.DataFrame, test: pd.DataFrame, catalogue_ids: Sequence[str], config: EvaluationConfig
) -> EvalSet:
    """Group test clicks by user, map items to catalogue rows, apply the masking policy.

    Raises:
      DataError: no test user is left to evaluate (every one was dropped or
        masked); the message counts what removed them and names the settings.
        Metrics over zero users would read 0.0000 and look like a result.
      DataError: a test click names an item missing from the catalogue (a
        bundle re-evaluated on other data); the message says whether
        ``evaluation.unseen_items: drop`` leaves those clicks out.
    """
    row_of = pd.Series(np.arange(len(catalogue_ids)), index=pd.Index(catalogue_ids, dtype=object))
    train_users = set(train[USER])
    train_items = set(train[ITEM])
    test = test[[USER, ITEM]].drop_duplicates()
    counts = {"test_clicks": int(len(test))}
    test_users = int(test[USER].nunique())

    unseen_user = ~test[USER].isin(train_users)
    counts["test_users_unseen_in_training"] = int(test.loc[unseen_user, USER].nunique())
    if config.unseen_users == "drop":
        test = test[~unseen_user]
    unseen_item = ~test[ITEM].isin(train_items)
    counts["test_clicks_on_items_unseen_in_training"] = int(unseen_item.sum())
    if config.unseen_items == "drop":
        test = test[~unseen_item]
    missing = ~test[ITEM].isin(row_of.index)
    if missing.any():
        message = (f"{int(missing.sum())} test clicks name items missing from the catalogue "
                   f"(e.g. {test.loc[missing, ITEM].iloc[0]!r})")
        if not test.loc[missing, ITEM].isin(train_items).any():
            raise DataError(f"{message}, none with training clicks: set evaluation.unseen_items=drop to leave out "
                            "test clicks on items without training clicks")
        raise DataError(f"{message}, some with training clicks: the catalogue (a re-evaluated bundle's index) must "
                        "hold every logged item, so evaluate on the data it was built from (evaluation.unseen_items"
                        "=drop leaves out only items without training clicks)")
    if config.exclude_train_items:
        # A test click on an item the user also clicked in training is a re-click:
        # with masking on it can never be retrieved, so it is not counted as relevant.
        seen = test.merge(train[[USER, ITEM]].drop_duplicates(), on=[USER, ITEM], how="left", indicator=True)
        repeat = (seen["_merge"] == "both").to_numpy()
        counts["test_clicks_repeating_a_training_click"] = int(repeat.sum())
        test = test[~repeat]

    relevant_groups = test.assign(row=row_of.loc[test[ITEM]].to_numpy()).groupby(USER, sort=True)["row"]
    user_ids = np.asarray(list(relevant_groups.groups.keys()), dtype=object)
    relevant = [group.to_numpy(np.int64) for _, group in relevant_groups]
    if config.exclude_train_items:
        train_rows = (
            train[[USER, ITEM]]
            .drop_duplicates()
            .loc[lambda frame: frame[USER].isin(set(user_ids))]
            .assign(row=lambda frame: row_of.loc[frame[ITEM]].to_numpy())
            .groupby(USER)["row"]
            .apply(lambda rows: rows.to_numpy(np.int64))
        )
        exclude = [train_rows.get(user, np.zeros(0, np.int64)) for user in user_ids]
    else:
        exclude = [np.zeros(0, np.int64) for _ in user_ids]
    counts["evaluated_users"] = int(len(user_ids))
    counts["relevant_pairs"] = int(sum(len(r) for r in relevant))
    if not len(user_ids):
        raise DataError(_no_users_message(counts, test_users, config))
    return EvalSet(user_ids, relevant, exclude, counts)


def _no_users_message(counts: dict[str, int], test_users: int, config: EvaluationConfig) -> str:
    """Why no test user is left: every filter that removed some, with the setting behind it."""
    if not counts["test_clicks"]:
        return "no test user can be evaluated: the test part holds no clicks"
    reasons = []
    unseen_users = counts["test_users_unseen_in_training"]
    if config.unseen_users == "drop" and unseen_users:
        reasons.append(
            f"{unseen_users} of the {test_users} test users have no training clicks and are dropped "
            "(evaluation.unseen_users: drop; ID towers cannot represent them)"
        )
    if config.unseen_items == "drop" and counts["test_clicks_on_items_unseen_in_training"]:
        reasons.append(
            f"{counts['test_clicks_on_items_unseen_in_training']} test clicks on items without training "
            "clicks are dropped (evaluation.unseen_items: drop)"
        )
    if counts.get("test_clicks_repeating_a_training_click"):
        reasons.append(
            f"{counts['test_clicks_repeating_a_training_click']} test clicks repeat the user's training "
            "clicks and are masked (evaluation.exclude_train_items: true)"
        )
    return (
        f"no test user can be evaluated ({counts['test_clicks']} distinct test clicks): "
        + "; ".join(reasons)
        + ". Check that the test log shares user and item ids with the training log"
    )


def index_ranking(
    index: ItemIndex,
    query_embeddings: np.ndarray,
    eval_set: EvalSet,
    depth: int,
    batch_size: int = 4096,
    progress: Progress | None = None,
) -> np.ndarray:
    """Top-``depth`` catalogue rows per evaluated user from the FAISS index.

    Args:
      index: the catalogue index.
      query_embeddings: [num_users, dim], aligned with ``eval_set.user_ids``.
      depth: ranked list length.
      progress: told of each batch of users; default: a ``Progress`` on stderr, which shows
        only when the ranking runs longer than its interval (a large catalogue).

    Returns:
      [num_users, depth] int64 rows (-1 where the catalogue ran out).
    """
    if len(query_embeddings) != len(eval_set.user_ids):
        raise ValueError(f"{len(query_embeddings)} query embeddings for {len(eval_set.user_ids)} users")
    # Users with similar numbers of masked items share a batch, so no batch
    # over-fetches for one heavy user.
    order = np.argsort([len(e) for e in eval_set.exclude], kind="stable")
    ranked = np.empty((len(order), depth), dtype=np.int64)
    with progress or Progress(len(order), "rank users", "users") as shown:
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            top = index.search(query_embeddings[batch], depth, exclude=[eval_set.exclude[i] for i in batch])
            ranked[batch] = top.rows
            shown.update(len(batch))
    return ranked


def item_click_counts(train: pd.DataFrame, catalogue_ids: Sequence[str]) -> np.ndarray:
    """Training clicks (repeats included) per catalogue row. [num_items] int64.

    Raises:
      ValueError: a training click names an item missing from the catalogue.
    """
    catalogue = pd.Index(catalogue_ids, dtype=object)
    counts = train[ITEM].value_counts()
    missing = ~counts.index.isin(catalogue)
    if missing.any():
        raise ValueError(
            f"{int(missing.sum())} training items are missing from the catalogue "
            f"(e.g. {counts.index[missing][0]!r}); the catalogue must contain every logged item"
        )
    return counts.reindex(catalogue, fill_value=0).to_numpy(np.int64)


def pad_columns(rows: np.ndarray, depth: int) -> np.ndarray:
    """Right-pad [n, width] rows with -1 to [n, depth] (no-op when already that wide)."""
    if rows.shape[1] >= depth:
        return rows
    return np.pad(rows, ((0, 0), (0, depth - rows.shape[1])), constant_values=-1)
