"""Request validation and completion: what a raw query may hold, what a known user's stored rows fill in,
the order of a sent click history, and whether an embedding's norm says the query means something.

``QueryRules`` is built by ``Bundle`` (``retrieval.serving.bundle``) from the query SavedModel's inputs and
the manifest; ``Bundle.check_query``, ``complete_queries``, ``in_served_order`` and ``embed`` delegate here.
Every refusal is a ``RequestError`` (a ValueError) naming the query, the feature and why.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import tensorflow as tf

from retrieval.bundle.user_features import UserFeatures
from retrieval.bundle.user_histories import UserHistories
from retrieval.data.values import finite_feature_value
from retrieval.serving.integrity import BundleError
from retrieval.serving.request_checks import RequestError, check_query_keys, encodes_as_utf8
from retrieval.serving.request_checks import short as _short

# How a sent click history is ordered: the most recent click first (what the query tower reads, and the
# order of a bundle's stored histories), or time order (oldest first, as a sequences file lists a user's items).
HistoryOrder = Literal["newest_first", "oldest_first"]
HISTORY_ORDERS: tuple[HistoryOrder, ...] = ("newest_first", "oldest_first")
# A query embedding's norm may be this factor below the smallest or above the largest the training users'
# queries had at export (the manifest's query_norms): users unseen in training embed a little apart.
QUERY_NORM_MARGIN = 10.0


class QueryRules:
    """What a bundle's queries may hold and how they are completed and checked.

    ``query_features``: the query tower's inputs (the manifest's order); ``input_specs``: name -> TensorSpec
    of the query SavedModel's signature; ``user_input`` / ``history_input``: the query keys of the user id
    and of the click history (None: the tower reads none); ``manifest``: the bundle's (its ``query_norms``:
    the training users' query norms at export; without it only an all-zero embedding is suspect);
    ``embed_signature``: the query SavedModel's serving signature, which ``check_norms`` calls to find the
    feature to blame.
    """

    def __init__(self, query_features: Sequence[str], input_specs: Mapping[str, tf.TensorSpec], user_input: str,
                 history_input: str | None, manifest: Mapping[str, Any],
                 embed_signature: Callable[..., Any]):
        self.query_features = list(query_features)
        self._input_specs = dict(input_specs)
        self._user_input, self._history_input = user_input, history_input
        self._embed = embed_signature
        # What a query may hold: the tower's inputs and the user id (its training items are excluded).
        self._query_keys = list(dict.fromkeys([*self.query_features, self._user_input]))
        self._unread_key_notes = {} if self._history_input is not None else {
            "history": "its query tower reads no click history, so a history would neither shape nor filter "
                       "the answer; send items to keep out in exclude_item_ids",
        }
        self._norm_range = norm_range(manifest.get("query_norms"))
        self._has_query_norms = "query_norms" in manifest

    def check_completed(self, query: Any, position: int) -> Mapping[str, Any]:
        """``query``, already completed from the user tables (``complete_queries``), checked
        (``check_query``), with every input it leaves out as a missing value."""
        if not isinstance(query, Mapping):
            raise RequestError(f"query {position} must be an object of features, got {type(query).__name__}")
        check_query_keys(query, self._query_keys, position, self._unread_key_notes)
        every_input_needed = self.query_features == [self._user_input]  # an ID-only tower
        if not every_input_needed and not any(key in query for key in (*self.query_features, self._user_input)):
            raise RequestError(f"query {position} sends none of this bundle's inputs: send the user id "
                               f"({self._user_input!r}) or any of {self.query_features}")
        filled = None
        for feature in self.query_features:
            spec = self._input_specs[feature]
            if feature not in query:
                if every_input_needed:
                    raise RequestError(self.missing_feature(query, feature, position))
                filled = dict(query) if filled is None else filled
                filled[feature] = [] if spec.shape.rank == 2 else None  # a missing value, as the tower embeds it
                continue
            value = query[feature]
            if _not_unicode(value):
                raise RequestError(f"query {position} feature {feature!r} is not valid Unicode text (a lone "
                                   "surrogate, e.g. from a non-UTF-8 command-line argument or a \\ud800 escape)")
            if spec.dtype != tf.string:
                problem = finite_feature_value(value, spec.dtype.name)
                if problem is not None:
                    raise RequestError(f"query {position} feature {feature!r} {problem}, got {_short(value)}")
            elif spec.shape.rank == 2:
                if not _is_id_list(value):
                    raise RequestError(
                        f"query {position} feature {feature!r} must be a list of strings or integers, "
                        f"got {_short(value)}"
                    )
            elif value is None and len(self.query_features) > 1:
                continue  # a missing feature of a feature tower; an ID tower's only id must be given
            elif isinstance(value, bool) or not isinstance(value, (str, int)):
                raise RequestError(
                    f"query {position} feature {feature!r} must be a string or integer, got {_short(value)}"
                )
        return query if filled is None else filled

    def complete_queries(self, queries: Sequence[Any], user_features: UserFeatures | None,
                         user_histories: UserHistories | None, ids: Callable[[np.ndarray], list[str]]) -> list[Any]:
        """Each query with what it lacks filled from its user's stored rows (one search of each table
        for all of them): the user-table features (``user_features.parquet``) and the click history
        (``user_histories/``: the user's recent training clicks, newest first).

        The user is the query's user-id input (``metadata()["user_input"]``). What the query itself
        sends wins, feature by feature (null included: a missing value, as the tower embeds it; an
        empty history too). A query whose user is not stored, a bundle without the table, a query
        lacking nothing or one that is no object comes back as it is (``check_query`` then treats
        what it lacks as missing, or names its problem). ``ids``: index rows -> item ids.
        """
        completed = list(queries)
        table = user_features
        if table is not None:
            lacking = [position for position, query in enumerate(queries)
                       if isinstance(query, Mapping) and any(feature not in query for feature in table.features)]
            rows = table.rows_of([user_key(queries[position].get(self._user_input)) for position in lacking])
            for position, row in zip(lacking, rows.tolist()):
                if row >= 0:
                    query = queries[position]
                    completed[position] = {**table.values(row, [f for f in table.features if f not in query]),
                                           **query}
        histories, name = user_histories, self._history_input
        if histories is not None and name is not None:
            lacking = [position for position, query in enumerate(completed)
                       if isinstance(query, Mapping) and name not in query]
            found = histories.rows_of_many([user_key(completed[position].get(self._user_input))
                                            for position in lacking])
            for position, history_rows in zip(lacking, found):
                if history_rows is not None:
                    completed[position] = {**completed[position], name: ids(history_rows)}
        return completed

    def sent_history(self, query: Any) -> list[Any] | None:
        """The click history ``query`` sends as a list (None when it sends none, or no list)."""
        name = self._history_input
        if name is None or not isinstance(query, Mapping):
            return None
        history = query.get(name)
        if not isinstance(history, Sequence) or isinstance(history, str | bytes):
            return None
        return list(history)

    def in_served_order(self, queries: Sequence[Any], history_order: HistoryOrder) -> list[Any]:
        """``queries`` with the histories they send newest first, the order the tower reads: reversed
        when ``history_order`` is ``"oldest_first"``.

        Raises:
          RequestError: ``history_order`` is neither ``"newest_first"`` nor ``"oldest_first"``.
        """
        if history_order not in HISTORY_ORDERS:
            raise RequestError(f"history_order must be one of {list(HISTORY_ORDERS)}, got {_short(history_order)}")
        name = self._history_input
        if history_order == "newest_first" or name is None:
            return list(queries)
        sent = [self.sent_history(query) for query in queries]
        return [query if history is None else {**query, name: history[::-1]} for query, history in zip(queries, sent)]

    def missing_feature(self, query: Mapping[str, Any], feature: str, position: int) -> str:
        """Why ``query`` (already completed) lacks ``feature``: one line that says what to send."""
        return f"query {position} lacks the feature {feature!r} (this bundle reads {self.query_features})"

    def carries_a_value(self, query: Mapping[str, Any]) -> bool:
        """Whether any input but the user id holds a value (not None, "", NaN, nor an empty history)."""
        for feature in self.query_features:
            if feature == self._user_input:
                continue
            value = query.get(feature)
            if isinstance(value, Sequence) and not isinstance(value, str | bytes):
                if any(str(v) != "" for v in value):
                    return True
            elif value is not None and value != "" and not (isinstance(value, float) and math.isnan(value)):
                return True
        return False

    def check_norms(self, queries: Sequence[Mapping[str, Any]], embeddings: np.ndarray, *,
                     skip: np.ndarray | None = None) -> None:
        """Raise RequestError for a query whose embedding [dim] is all zero, or whose norm lies outside
        the training range (``norm_range``), when one feature of the query explains it.

        The feature is found by leaving out each feature the query gives (a missing value, as the
        tower embeds it) in one more query-tower call: the one whose absence brings the norm into
        range is named (else the one that brings it closest). An all-zero embedding that no feature
        explains is a query the towers know nothing of (an unknown id, an empty history): it stays,
        and ``recommend_embedded`` answers it with the popular items; so do the rows ``skip`` [n]
        marks (queries with nothing to go on, zeroed on purpose by ``Bundle._embed_checked``).
        """
        low, high = self._norm_range
        norms = np.linalg.norm(embeddings.astype(np.float64), axis=1)
        zero = ~np.any(embeddings != 0, axis=1)
        suspects = np.flatnonzero((zero | (norms < low) | (norms > high)) & ~(skip if skip is not None else False))
        if not len(suspects):
            return
        variants, owners = [], []
        for position in suspects.tolist():
            for feature in self.query_features:
                if _given(queries[position][feature]):
                    left_out: list[str] | None = [] if self._input_specs[feature].shape.rank == 2 else None
                    variants.append({**queries[position], feature: left_out})
                    owners.append((position, feature))
        left_out_norms = np.zeros(0)
        if variants:
            inputs = {feature: input_tensor([query[feature] for query in variants], self._input_specs[feature])
                      for feature in self.query_features}
            left_out_norms = np.linalg.norm(self._embed(**inputs)["embedding"].numpy().astype(np.float64), axis=1)
        for position in suspects.tolist():
            tried = [(feature, norm) for (owner, feature), norm in zip(owners, left_out_norms.tolist())
                     if owner == position and np.isfinite(norm)]
            explains = [feature for feature, norm in tried if norm > 0 and low <= norm <= high]
            if zero[position] and not explains:
                continue  # nothing the towers know: the popular fallback
            culprit: str | None = None
            if explains:
                culprit = explains[0]
            elif tried:  # no single feature brings it into range: the one that brings it closest
                culprit = min(tried, key=lambda pair: _log_distance(pair[1], low, high))[0]
            value = _short(queries[position][culprit]) if culprit is not None else None
            cause = (f"the feature {culprit!r} ({value}) causes it: without it the norm is in range; a value "
                     "far outside what the towers were trained on" if culprit in explains else
                     f"the feature {culprit!r} ({value}) comes closest to explaining it"
                     if culprit is not None else "no feature of the query explains it")
            bounds = (f"outside [{low:.3g}, {high:.3g}] (the training users' query norms at export, widened "
                      f"{QUERY_NORM_MARGIN:g}-fold)" if self._has_query_norms else "all zero")
            raise RequestError(f"query {position}: its embedding's norm is {norms[position]:.3g}, {bounds}, so its "
                               f"nearest items mean nothing; {cause}")


# The types of a list input's elements that need no closer look: plain strings and integers (not bool,
# whose type is its own). A 200-item history is checked by one pass in C instead of 200 isinstance pairs.
_PLAIN_ID_TYPES = frozenset({str, int})


def _is_id_list(value: Any) -> bool:
    """Whether ``value`` is a list input's value: a sequence (not a string) of strings or integers, no bool."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return False
    if set(map(type, value)) <= _PLAIN_ID_TYPES:
        return True
    return not any(isinstance(v, bool) or not isinstance(v, (str, int)) for v in value)


def _not_unicode(value: Any) -> bool:
    """Whether ``value`` (a string or a list of them) holds a string UTF-8 cannot encode (a lone surrogate)."""
    values = value if isinstance(value, list) else [value]
    try:
        # Strings joined encode exactly when each does (Python never pairs two lone surrogates into one
        # character): one check for a whole history, in C.
        joined = "".join(values)
    except TypeError:  # not all strings (an int id): each string on its own
        pass
    else:
        return not joined.isascii() and not encodes_as_utf8(joined)
    return any(isinstance(text, str) and not text.isascii() and not encodes_as_utf8(text) for text in values)


def check_finite(embeddings: np.ndarray, what: str) -> None:
    """Raise ValueError naming the first row of ``embeddings`` [n, dim] holding a NaN or an infinity."""
    finite = np.isfinite(embeddings).all(axis=1)
    if not finite.all():
        position = int(np.argmin(finite))
        raise ValueError(
            f"{what} {position}: the query tower's embedding is not finite (NaN or inf), so it has no "
            f"nearest items; {NON_FINITE_CAUSE}"
        )


NON_FINITE_CAUSE = (
    "a numeric feature value far outside the training range overflows the tower, or the model was trained to NaN"
)


def norm_range(record: Any) -> tuple[float, float]:
    """(lowest, highest) norm a query embedding may have: the manifest's ``query_norms`` widened by
    ``QUERY_NORM_MARGIN``; for a bundle without the record, any norm above 0 (only zero is suspect)."""
    if not isinstance(record, Mapping):
        return float(np.finfo(np.float64).tiny), float("inf")
    try:
        low, high = float(record["min"]), float(record["max"])
    except (KeyError, TypeError, ValueError):
        raise BundleError(f"manifest.json query_norms must hold numbers min and max, got {_short(record)}") from None
    if not (np.isfinite(low) and np.isfinite(high) and 0 <= low <= high):
        raise BundleError(f"manifest.json query_norms must hold 0 <= min <= max, got {_short(record)}")
    return max(low / QUERY_NORM_MARGIN, float(np.finfo(np.float64).tiny)), high * QUERY_NORM_MARGIN


def _given(value: Any) -> bool:
    """True for a query value that says something (not None, NaN, "" or an empty list)."""
    if value is None or (isinstance(value, str) and not value):
        return False
    if isinstance(value, float) and np.isnan(value):
        return False
    return not (isinstance(value, Sequence) and not isinstance(value, str) and not len(value))


def _log_distance(norm: float, low: float, high: float) -> float:
    """How far (in log scale) ``norm`` lies outside [low, high]; 0 inside."""
    if norm <= 0:
        return float("inf")
    return max(np.log(low) - np.log(norm), np.log(norm) - np.log(high), 0.0)


def user_key(user: Any) -> str | None:
    """A user-id value as the id it names (a string or an int), else None (no user)."""
    return str(user) if isinstance(user, str | int) and not isinstance(user, bool) else None


def query_value(query: Any, key: str) -> Any:
    return query.get(key) if isinstance(query, Mapping) else None


def input_tensor(values: Sequence[Any], spec: tf.TensorSpec) -> tf.Tensor:
    """Checked raw values of one input (``QueryRules.check_completed``) -> a tensor matching ``spec``."""
    if spec.dtype != tf.string:
        return tf.constant([np.nan if v is None else float(v) for v in values], dtype=spec.dtype)
    if spec.shape.rank == 2:
        width = spec.shape[1]
        rows = [[str(v) for v in value][:width] for value in values]
        return tf.constant([row + [""] * (width - len(row)) for row in rows], dtype=tf.string, shape=[len(rows), width])
    return tf.constant(["" if v is None else str(v) for v in values], dtype=tf.string)
