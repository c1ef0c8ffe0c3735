"""Tower inputs joined onto streamed click batches: feature tables held in memory, clicks streamed.

The in-memory job joins the user and item tables onto every training click at
once (``training_examples``). A log streamed out of core (``data.out_of_core``)
arrives a batch at a time, and joining a batch with ``tower_frame`` would index
the whole table for every batch. ``ExampleJoin`` instead converts each tower's
table-read inputs once per table row, with ``tower_frame`` itself, and a batch
gathers its rows by a hash lookup of its ids: a batch costs O(batch), whatever
the size of the tables. Inputs read from the click itself (its ``user_id``,
``item_id``, ``timestamp`` or ``weight``; a click column wins over a table
column of the same name, as in memory) are converted per batch, by
``tower_frame`` again. A joined batch holds, for every tower input, the values
``training_examples`` gives the same clicks (``tests/features/test_feature_tables.py``).

``ExampleJoin.statistics`` fits the towers' ``TowerStatistics`` without the
joined examples: a table-read feature is fitted on one row per training user
(item), weighted by the user's (item's) training clicks from the streamed counts,
which is what ``TowerStatistics.fit`` sees after the join; a feature of the
click's ``user_id`` or ``item_id`` likewise; a feature of the click's
``timestamp`` or ``weight`` on that column of every training click
(``streaming.scan_train_column``, 8 bytes a click while fitting). Vocabularies
are exactly the in-memory ones; means and variances equal them up to float rounding.

A click's history (``towers.query.history``) is its user's earlier clicks, which
a shuffled batch does not carry: it is looked up in ``ClickHistories``, the
training clicks coded and sorted once (16 bytes a click), with the values
``history_before`` gives the same clicks.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from retrieval.config import TowerConfig, TowersConfig
from retrieval.data import ITEM, TIME, USER, WEIGHT
from retrieval.features.histories import ClickHistories
from retrieval.features.statistics import Vocabulary
from retrieval.features.tables import InputSpec, feature_arrays, tower_frame, tower_inputs, training_examples
from retrieval.features.tower_statistics import TowerStatistics

_MISSING = ""  # the key of the row every id absent from a table joins (loaders refuse empty ids)


class _Side:
    """One tower's inputs: those read from its table, converted once per table row (plus a last
    row of missing values), and those read from each click."""

    def __init__(self, tower: TowerConfig, table: pd.DataFrame | None, key: str, side: str, clicks: list[str]):
        self.key, self.side = key, side
        flat = tower.model_copy(update={"history": None})
        # Unknown columns fail here, with the in-memory message (tower_frame's).
        tower_frame(flat, pd.DataFrame({column: [] for column in clicks}), table, key, side)
        self.per_click = flat.model_copy(update={"features": tuple(f for f in tower.features if f.column in clicks)})
        keyed = flat.model_copy(update={"features": tuple(f for f in tower.features if f.column not in clicks)})
        ids = np.asarray([] if table is None else table[key].astype(str), dtype=object)
        if _MISSING in set(ids):
            raise ValueError(f"the {side} feature table has an empty {key}")
        self.index = pd.Index(ids, dtype=object)
        self.keyed: dict[str, np.ndarray] = {}
        if keyed.features:
            rows = pd.DataFrame({key: np.append(ids, _MISSING)})  # position -1: the missing row
            self.keyed = feature_arrays(tower_frame(keyed, rows, table, key, side))

    def positions(self, ids) -> np.ndarray:
        """Table rows of ``ids``; -1 (the missing row) for ids the table lacks."""
        return self.index.get_indexer(pd.Index(np.asarray(ids, dtype=object)))


class ExampleJoin:
    """Training examples of click batches: every tower input joined onto each click.

    Args:
      towers: the towers.
      users, items: the user and item feature tables keyed by ``user_id`` / ``item_id``
        (``Dataset.users`` / ``Dataset.items``), or None.
      has_time: the click log has timestamps (a ``timestamp`` column in each batch).
      histories: the training clicks' histories; required when the query tower has a history.
    """

    def __init__(self, towers: TowersConfig, users: pd.DataFrame | None, items: pd.DataFrame | None, *,
                 has_time: bool, histories: ClickHistories | None = None):
        self.history = towers.query.history
        if self.history is not None and histories is None:
            raise ValueError("towers.query.history is joined from the training clicks' ClickHistories")
        self.towers, self.users, self.items, self.histories = towers, users, items, histories
        self.click_columns = [USER, ITEM, *([TIME] if has_time else []), WEIGHT]
        self._sides = (
            _Side(towers.query, users, USER, "query", self.click_columns),
            _Side(towers.doc, items, ITEM, "doc", self.click_columns),
        )
        read = {f.column for side in self._sides for f in side.per_click.features}
        # A history ends at its click's time; on a log without time it is the user's other items (ClickHistories).
        self.needs_time = TIME in read or (self.history is not None and has_time)
        self.scanned_columns = sorted(read & {TIME, WEIGHT})  # what ``statistics`` needs of every click

    @property
    def specs(self) -> dict[str, InputSpec]:
        """Every column of a joined batch: the click's ids and weight (and timestamp when a tower
        reads it), then every tower input."""
        specs = {USER: InputSpec(USER, "string"), ITEM: InputSpec(ITEM, "string"), WEIGHT: InputSpec(WEIGHT, "float32")}
        if self.needs_time:
            specs[TIME] = InputSpec(TIME, "int64")
        for tower in (self.towers.query, self.towers.doc):
            specs.update({spec.name: spec for spec in tower_inputs(tower)})
        return specs

    def batch(self, clicks: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Join every tower input onto a batch of clicks.

        Args:
          clicks: ``user_id`` and ``item_id`` [batch] object str, ``weight`` [batch] float32 (and
            ``timestamp`` [batch] int64 when ``needs_time``).

        Returns:
          ``clicks`` plus every tower input, as ``feature_arrays`` gives them ([batch] or [batch, W]).
        """
        out = dict(clicks)
        frame = None
        for side in self._sides:
            positions = side.positions(clicks[side.key])
            out.update({name: values[positions] for name, values in side.keyed.items()})
            if side.per_click.features:
                frame = pd.DataFrame(dict(clicks)) if frame is None else frame
                out.update(feature_arrays(tower_frame(side.per_click, frame, None, side.key, side.side)))
        if self.history is not None and self.histories is not None:
            out[self.history.name] = self._histories_of(clicks[USER], clicks[ITEM], clicks.get(TIME))
        return out

    def _histories_of(self, users, items, times) -> np.ndarray:
        """[batch, length] histories of clicks: the user's items before each click, or on a log
        without time the user's other items."""
        assert self.history is not None and self.histories is not None
        if self.histories.has_time:
            return self.histories.before(users, times, self.history.length)
        return self.histories.others(users, items, self.history.length)

    def examples(self, clicks: pd.DataFrame) -> pd.DataFrame:
        """``training_examples`` of a click frame (the validation clicks): histories from ``histories``,
        the training clicks before each one, not from the frame's own clicks."""
        if self.history is None or self.histories is None:
            return training_examples(clicks, self.users, self.items, self.towers)
        flat = self.towers.model_copy(update={"query": self.towers.query.model_copy(update={"history": None})})
        examples = training_examples(clicks, self.users, self.items, flat)
        times = clicks[TIME].to_numpy() if TIME in clicks else None
        history = self._histories_of(clicks[USER].astype(str).to_numpy(), clicks[ITEM].astype(str).to_numpy(), times)
        examples[self.history.name] = list(map(tuple, history))
        return examples

    def statistics(
        self,
        users: tuple[np.ndarray, np.ndarray],
        items: tuple[np.ndarray, np.ndarray],
        clicks: Mapping[str, np.ndarray],
        item_vocabulary: Vocabulary,
        reference_time: float | None,
    ) -> TowerStatistics:
        """``TowerStatistics`` of the training examples, from per-id counts.

        Args:
          users, items: ``(ids, training clicks of each)`` (``StreamCounts.user_ids, user_counts``...).
          clicks: the ``scanned_columns`` of every training click.
          item_vocabulary: the training items.
          reference_time: the end of training.
        """
        per_id = {USER: users, ITEM: items}
        columns: dict[str, tuple[pd.Series, np.ndarray | None]] = {}
        for side in self._sides:
            ids, counts = per_id[side.key]
            positions = side.positions(ids)
            for name, values in side.keyed.items():
                chosen = values[positions]
                columns[name] = (pd.Series(list(map(tuple, chosen)) if chosen.ndim == 2 else chosen), counts)
            for feature in side.per_click.features:
                if feature.column in per_id:
                    values, weights = per_id[feature.column]
                else:
                    values, weights = clicks[feature.column], None
                one = side.per_click.model_copy(update={"features": (feature,)})
                frame = tower_frame(one, pd.DataFrame({feature.column: values}), None, side.key, side.side)
                columns[feature.name] = (frame[feature.name], weights)
        return TowerStatistics.fit_weighted(self.towers, columns, item_vocabulary, reference_time)
