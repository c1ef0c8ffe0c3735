"""Serve top-k for raw queries from an exported bundle.

Loads the query SavedModel with plain ``tf.saved_model.load`` (no project
code needed to run it), the FAISS index and the row -> item-id map::

    bundle = Bundle.load("artifacts/my-run")
    bundle.recommend({"user_id": "196"}, k=10, exclude_item_ids=["242"])
    bundle.similar_items("242", k=10)  # the items nearest item 242's embedding, never 242 itself

or from a shell::

    python -m retrieval.serving --bundle artifacts/my-run --user-id 196 -k 10
    python -m retrieval.serving --bundle artifacts/my-run --similar 242 -k 10
    python -m retrieval.serving --bundle artifacts/my-run --users users.txt|all -k 100 --out recs.parquet

(``retrieval recommend`` takes the same arguments; ``--out`` runs ``retrieval.serving.batch``.)
The command line opens ``--bundle``'s newest catalogue version (``retrieval.bundle.catalogue.current_version``);
``Bundle.load`` opens exactly the directory it is given.

What a user already has is never served by default: the user's training
items (the bundle's ``seen_items/``, ``retrieval.bundle.seen_items``) and the items
of the query's click history; ``exclude_seen=False`` (``--include-seen``)
serves them too.

Over HTTP, ``retrieval serve --bundle artifacts/my-run`` (``retrieval/serving/http/``).

``Bundle`` ranks (the FAISS search, exclusions, filters, the popular fallback) and composes the two
other seams: the load-time checks of its files, parts and probe query (``retrieval/serving/integrity.py``)
and what a query may hold, how it is completed and checked (``retrieval/serving/queries.py``).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import tensorflow as tf

from retrieval.bundle.catalogue import current_version
from retrieval.bundle.display_features import DisplayFeatures
from retrieval.bundle.manifest import Manifest, read_manifest
from retrieval.bundle.seen_items import find_sorted
from retrieval.common.errors import UserError, entry_point
from retrieval.index import ItemIndex
from retrieval.serving.integrity import (
    BundleError,
    Verify,
    changed_files,
    check_files,
    load_display_features,
    load_seen_items,
    load_user_features,
    load_user_histories,
    part,
    probe_problem,
    same_files,
    served_states,
)
from retrieval.serving.item_filters import FilterTable, ItemFilters, parse_filters
from retrieval.serving.queries import (
    HISTORY_ORDERS,
    NON_FINITE_CAUSE,
    HistoryOrder,
    QueryRules,
    check_finite,
    input_tensor,
    query_value,
    user_key,
)
from retrieval.serving.request_checks import (
    RequestError,
    checked_id,
    checked_id_lists,
    checked_ids,
    checked_k,
)
from retrieval.serving.request_checks import short as _short

log = logging.getLogger("retrieval.serving")



@dataclass(frozen=True)
class Recommendations:
    """Top-k for one query, best first.

    ``fallback`` says how the list was made when the model did not know the
    query's id: ``"popular"`` for a query the towers know nothing about (an
    ID-only tower and a user id never seen in training: popularity order, no
    scores); ``"features"`` for an unknown id that a feature tower embedded from
    its other features (scores as usual); else None.
    """

    item_ids: list[str]
    scores: list[float | None]
    fallback: str | None = None


class Bundle:
    """A loaded bundle: query model + index + item ids + manifest.

    ``Bundle.load`` raises BundleError (one line, no file bytes) for any
    bundle it cannot serve: missing or corrupt manifest, SavedModel, index or
    item ids, or parts that do not fit together. Before anything is loaded,
    every file under the manifest's ``files`` must stay inside the bundle and
    match its fingerprint (``verify``: "quick" hashes files up to 64 MiB whole
    and larger ones by size and both ends, "full" every file whole); then the
    query model's output dimension must equal the index's, item ids must be
    unique, and the manifest's probe query must give the items it gave at
    export (``check_probe``). Format 1 bundles (no fingerprints, no probe)
    load with a warning.

    ``manifest_model`` is the typed manifest (``retrieval.bundle.manifest.Manifest``, migrated to
    the current shape), ``manifest`` the same as JSON values.

    Items a catalogue edit removed (the manifest's ``disabled_item_ids``, ``retrieval.bundle.catalogue``)
    keep their index rows and are never served: ``excluded_rows`` excludes them from every answer.
    ``models_from``: a loaded Bundle whose query SavedModel has the same fingerprints (a catalogue
    edit of it) lends its loaded model instead of loading it again (a live edit swaps in quickly).
    """

    def __init__(self, directory: str | Path, *, verify: Verify = "quick", models_from: Bundle | None = None):
        if verify not in ("quick", "full"):
            raise ValueError(f"verify must be 'quick' or 'full', got {verify!r}")
        self.directory = Path(directory)
        self.loaded_at = time.time()
        with part(self.directory, "manifest.json"):
            # Typed and migrated to the current shape (``retrieval.bundle.manifest``); ``manifest`` is its JSON.
            self.manifest_model = read_manifest(self.directory)
            self.manifest: dict[str, Any] = self.manifest_model.to_dict()
            self.query_features: list[str] = list(self.manifest_model.query_features)
            query_model = self.manifest_model.files["query_model"]
        # Taken before the fingerprint check, compared again after the last part is read: the parts
        # in memory are then the files that were checked (``changed_files``).
        self._watch_root, self._watch_files = self.directory, self.manifest["files"]
        self._watched = served_states(self._watch_root, self._watch_files, missing_ok=True)
        check_files(self.directory, self.manifest_model, self.manifest, verify)
        with part(self.directory, f"query SavedModel {query_model!r}"):
            lent = models_from is not None and same_files(models_from.manifest, self.manifest, query_model)
            self._query_model: Any = models_from._query_model if models_from is not None and lent \
                else tf.saved_model.load(str(self.directory / query_model))
            self._embed = self._query_model.signatures["serving_default"]
            # Bundles whose query tower reads id features say which ids it knew (bundle.saved_models.save_tower).
            self._reports_known_ids = "known_ids" in self._embed.structured_outputs
            # name -> TensorSpec: string [batch], float32/float64 [batch] or string [batch, width].
            self._input_specs: dict[str, tf.TensorSpec] = dict(self._embed.structured_input_signature[1])
        missing = [f for f in self.query_features if f not in self._input_specs]
        if missing:
            raise BundleError(
                f"{self.directory}: the query SavedModel does not take the manifest's query features {missing} "
                f"(it takes {sorted(self._input_specs)})"
            )
        with part(self.directory, "index (index.faiss, index.json, item_ids.parquet)"):
            self.index = ItemIndex.load(self.directory)
        if len(self.index.item_ids) != self.index.index.ntotal:
            raise BundleError(
                f"{self.directory}: item_ids.parquet holds {len(self.index.item_ids)} ids for "
                f"{self.index.index.ntotal} vectors in index.faiss"
            )
        # A query model from another run of another dimension would fail every request, not the load.
        query_dim = self._embed.structured_outputs["embedding"].shape[-1]
        if query_dim is not None and query_dim != self.index.dim:
            raise BundleError(
                f"{self.directory}: the query model ({query_model}) embeds into {query_dim} dimensions but "
                f"index.faiss holds {self.index.dim}-dimensional vectors: the bundle's parts do not belong together"
            )
        if self.manifest.get("embedding_dim", self.index.dim) != self.index.dim:
            raise BundleError(
                f"{self.directory}: manifest.json embedding_dim is {_short(self.manifest['embedding_dim'])} but "
                f"index.faiss holds {self.index.dim}-dimensional vectors: the bundle's parts do not belong together"
            )
        self._id_array = np.array([str(item) for item in self.index.item_ids], dtype=object)
        self._row_of = {item: row for row, item in enumerate(self.index.item_ids)}
        self._popular_rows = np.array(
            [self._row_of[item] for item in self.manifest.get("popular_item_ids", []) if item in self._row_of],
            dtype=np.int64,
        )
        unknown = [item for item in self.manifest_model.disabled_item_ids or () if item not in self._row_of]
        if unknown:
            raise BundleError(f"{self.directory}: manifest.json disabled_item_ids names {_short(unknown)}, which "
                              "item_ids.parquet does not hold: the bundle's parts do not belong together")
        # Removed by a catalogue edit: excluded from every answer (sorted distinct rows, int64).
        self._disabled_rows = np.unique(np.array(
            [self._row_of[item] for item in self.manifest_model.disabled_item_ids or ()], dtype=np.int64))
        self._disabled_set = set(self._disabled_rows.tolist())
        self.seen_items = load_seen_items(self.directory, self.manifest_model, len(self.index))
        self._user_input, self._history_input = self.manifest_model.user_input, self.manifest_model.history_input
        self.user_features = load_user_features(self.directory, self.manifest_model, self.query_features)
        self.user_histories = load_user_histories(self.directory, self.manifest_model, len(self.index))
        self.item_display = load_display_features(self.directory, self.manifest_model)
        # What a request's filters are evaluated against: the item table in index-row order.
        self.filter_table = FilterTable(self.item_display, self._id_array)
        # What a query may hold, how it is completed and checked (``retrieval.serving.queries``).
        self._rules = QueryRules(self.query_features, self._input_specs, self._user_input, self._history_input,
                                 self.manifest, self._embed)
        changed = self.changed_files()
        if changed:
            raise BundleError(f"{self.directory}: {', '.join(changed)} changed while the bundle was being loaded: "
                              "load it again once it is written")
        self.check_probe()

    def changed_files(self) -> list[str]:
        """The bundle's files that differ on disk from what this Bundle loaded (sorted; empty when none).

        Each of manifest.json and the served files was stat-ed and hashed at both ends
        (``retrieval.serving.integrity.file_state``: size, modification time, inode, blake2b of the first and last
        ``WATCH_BYTES``) before the fingerprint check; this does it again. Every part is held in
        memory, so a changed file never changes an answer: ``/healthz`` reports it (503) while
        the loaded parts keep serving, and a reload reads the files as they are now.
        """
        return changed_files(self._watched, self._watch_root, self._watch_files)

    def edited(self, manifest: Manifest, index: ItemIndex, item_display: DisplayFeatures | None) -> Bundle:
        """This bundle with a catalogue edit applied in memory (``retrieval.bundle.catalogue.prepare_edit``):
        ``manifest`` (the new version's, as served), ``index`` (this one's rows first, new items
        appended) and the display table (None: this one's). Nothing is read from disk: the models,
        seen items, user tables and histories are this bundle's (an edit keeps every row's item).
        Until ``persisted`` names its files, ``directory`` and ``changed_files`` stay this bundle's
        (the files the edit started from). Raises BundleError when the parts do not fit or the
        manifest's probe query does not give its items through ``index``.
        """
        if index.dim != self.index.dim or len(index) < len(self.index):
            raise BundleError(f"{manifest.run}: an edited index must keep the served rows and dimension "
                              f"({len(self.index)} rows of {self.index.dim})")
        new = copy.copy(self)
        new.manifest_model, new.manifest = manifest, manifest.to_dict()
        new.loaded_at = time.time()
        new.index = index
        appended = [str(item) for item in index.item_ids[len(self.index):]]
        if appended:
            new._id_array = np.concatenate([self._id_array, np.array(appended, dtype=object)])
            new._row_of = {**self._row_of, **{item: len(self.index) + i for i, item in enumerate(appended)}}
        unknown = [item for item in manifest.disabled_item_ids or () if item not in new._row_of]
        if unknown:
            raise BundleError(f"{manifest.run}: disabled_item_ids names {_short(unknown)}, which the index does "
                              "not hold")
        new._disabled_rows = np.unique(np.array([new._row_of[item] for item in manifest.disabled_item_ids or ()],
                                                dtype=np.int64))
        new._disabled_set = set(new._disabled_rows.tolist())
        if item_display is not None:
            new.item_display = item_display
        if appended or item_display is not None:
            new.filter_table = FilterTable(new.item_display, new._id_array)
        new.check_probe()
        return new

    def persisted(self, directory: str | Path, manifest: Manifest) -> Bundle:
        """This (edited) bundle as written to ``directory`` with ``manifest`` (its fingerprints): the
        same parts in memory, ``changed_files`` now watching the written files."""
        new = copy.copy(self)
        new.directory = Path(directory)
        new.manifest_model, new.manifest = manifest, manifest.to_dict()
        new._watch_root, new._watch_files = new.directory, new.manifest["files"]
        new._watched = served_states(new._watch_root, new._watch_files)
        return new

    @classmethod
    def load(cls, directory: str | Path, *, verify: Verify = "quick", models_from: Bundle | None = None) -> Bundle:
        """Load and check a bundle (see the class docstring); ``verify="full"`` hashes every file whole."""
        return cls(directory, verify=verify, models_from=models_from)

    def check_probe(self) -> None:
        """Raise BundleError unless the manifest's probe query gives the items it gave at export.

        The probe (``retrieval.bundle.writer.probe_record``) is one training user's raw query; it runs
        through this bundle's query model and index as a request would. A bundle without a probe passes.
        """
        problem = self.probe_problem()
        if problem:
            raise BundleError(f"{self.directory}: {problem}")

    def probe_problem(self) -> str | None:
        """Why the probe query fails (no server paths: /healthz sends it), or None when it passes."""
        return probe_problem(self.manifest, self.embed, self.index, self._ids)

    @property
    def version(self) -> str:
        """The run name the bundle was exported under (else its directory name)."""
        return str(self.manifest.get("run") or self.directory.name)

    def metadata(self) -> dict[str, Any]:
        """What a client may want to know: version, features, index, recall, versions.

        No config dump and no server paths (the bundle's directory stays private).
        """
        index = self.index.info()
        return {
            "bundle": self.version,
            "created_at": self.manifest.get("created_at"),
            "loaded_at": self.loaded_at,
            "format_version": self.manifest.get("format_version"),
            "query_features": self.query_features,
            "embedding_dim": self.index.dim,
            "num_items": len(self.index),
            # Removed by catalogue edits: in the index, never served.
            "disabled_items": int(len(self._disabled_rows)),
            "metric": index["metric"],
            "normalized": index["normalized"],
            "index": index,
            "fallbacks": ["popular", "features"] if len(self.query_features) > 1 else ["popular"],
            # The features a request may leave out for a user the bundle knows (filled from its table).
            "user_features": None if self.user_features is None else {
                "features": self.user_features.features, "num_users": len(self.user_features),
                "user_input": self._user_input,
            },
            # The catalogue's display features (POST /items); None: ids only.
            "item_features": None if self.item_display is None else self.item_display.features,
            # The display feature that names an item (the page shows it first, GET /items/search reads it).
            "item_title": None if self.item_display is None else self.item_display.title_feature,
            # The raw inputs of the query tower: name -> {"dtype", "shape"} (a page's feature inputs).
            "query_inputs": self.manifest.get("query_inputs"),
            # The query keys of the user id and of the click history (None: the tower reads none).
            "user_input": self._user_input,
            "history_input": self._history_input,
            # A history a request sends is read newest first unless it says history_order: "oldest_first".
            "history_orders": list(HISTORY_ORDERS) if self._history_input is not None else None,
            # Each training user's stored recent clicks, filled into a query that sends no history.
            "user_histories": None if self.user_histories is None else self.user_histories.info(),
            "num_popular_items": int(len(self._popular_rows)),
            # exclude_seen: training items of known users (bundles exported with seen_items/ only) and
            # the items of a query's click history.
            "excludes_seen": self.seen_items is not None,
            "excludes_history": self._history_input is not None,
            "versions": self.manifest.get("versions", {}),
        }

    def check_query(self, query: Any, position: int = 0) -> None:
        """Raise RequestError (a ValueError) naming the problem unless ``query`` is one this bundle can
        embed (``complete_queries`` fills what it lacks for a known user first) and holds no key the
        bundle does not read (``retrieval.serving.request_checks.check_query_keys``: a misspelt feature gets a
        "did you mean"; a ``history`` to a tower that reads none is refused, not ignored).

        Which inputs a query may leave out: an ID-only tower's user id must be sent; any input of
        another tower (user features, the click history) may be left out: it is filled from the
        bundle's stored row of the query's user when there is one (``complete_queries``), else it
        counts as a missing value (string "", number NaN, history empty). A query that sends neither
        the user id nor any input is refused. String inputs take a string or int (None: missing,
        sent as ""); number inputs an int or a float finite in the input's dtype (float32 for
        numeric features: at most about 3.4e38 in magnitude), or None (missing, sent as NaN; a NaN
        itself is refused, as are infinities); list inputs (e.g. a click history) a list of strings
        or ints, truncated or padded to the signature's width.
        """
        self._rules.check_completed(self.complete_queries([query])[0], position)

    def complete_query(self, query: Mapping[str, Any]) -> Mapping[str, Any]:
        """``query`` with what it lacks filled from its user's stored rows (``complete_queries``)."""
        return self.complete_queries([query])[0]

    def complete_queries(self, queries: Sequence[Any]) -> list[Any]:
        """Each query with what it lacks filled from its user's stored rows, the user-table features and
        the click history, what the query sends winning (the rules: ``QueryRules.complete_queries`` in
        ``retrieval/serving/queries.py``)."""
        return self._rules.complete_queries(queries, self.user_features, self.user_histories, self._ids)

    def sends_history(self, queries: Sequence[Any]) -> bool:
        """Whether any of ``queries`` sends a non-empty click history (whose order then matters)."""
        return any(self._rules.sent_history(query) for query in queries)

    def in_served_order(self, queries: Sequence[Any], history_order: HistoryOrder) -> list[Any]:
        """``queries`` with the histories they send newest first, the order the tower reads: reversed
        when ``history_order`` is ``"oldest_first"``.

        Raises:
          RequestError: ``history_order`` is neither ``"newest_first"`` nor ``"oldest_first"``.
        """
        return self._rules.in_served_order(queries, history_order)

    def embed(self, queries: Sequence[Mapping[str, Any]], *,
              history_order: HistoryOrder = "newest_first") -> np.ndarray:
        """Raw query features -> [num_queries, dim] float32 embeddings.

        ``history_order`` says how the histories the queries send are ordered (``in_served_order``).
        A query the towers know nothing about (a user id unknown to the tower, or none, and no other
        input with a value) embeds to zeros: ``recommend_embedded`` answers it with popular items.

        Raises ValueError for a query that ``check_query`` refuses or whose embedding is not finite.
        """
        return self._embed_checked(queries, history_order)[0]

    def _embed_checked(self, queries: Sequence[Mapping[str, Any]],
                       history_order: HistoryOrder = "newest_first") -> tuple[np.ndarray, np.ndarray]:
        """(embeddings [n, dim], known_ids bool [n]: every id feature in the training vocabulary)."""
        # One search of the user tables for the whole batch, after the sent histories are put newest first.
        completed = self.complete_queries(self.in_served_order(queries, history_order))
        queries = [self._rules.check_completed(query, position) for position, query in enumerate(completed)]
        inputs = {
            feature: input_tensor([query[feature] for query in queries], self._input_specs[feature])
            for feature in self.query_features
        }
        outputs = self._embed(**inputs)
        known = outputs["known_ids"].numpy() if self._reports_known_ids else np.ones(len(queries), dtype=bool)
        embeddings = outputs["embedding"].numpy()
        check_finite(embeddings, "query")
        # Nothing to go on: the tower's embedding of all-missing inputs (its biases) would rank items by
        # whatever those give; popularity is the honest answer, as for an unknown id of an ID tower.
        user_known = known if self._user_input in self.query_features else np.zeros(len(queries), dtype=bool)
        empty = np.array([not user_known[i] and not self._rules.carries_a_value(query)
                          for i, query in enumerate(queries)], dtype=bool)
        if empty.any():
            embeddings = embeddings.copy()
            embeddings[empty] = 0.0
        self._rules.check_norms(queries, embeddings, skip=empty)
        return embeddings, known

    def recommend(
        self,
        query: Mapping[str, Any],
        k: int = 10,
        exclude_item_ids: Sequence[str | int] | None = (),
        *,
        exclude_seen: bool = True,
        history_order: HistoryOrder = "newest_first",
        filters: Mapping[str, Any] | ItemFilters | None = None,
    ) -> Recommendations:
        """Top-k item ids for one raw query, never returning ``exclude_item_ids``.

        With ``exclude_seen`` (the default) neither the user's training items nor the items of
        the query's click history are returned either (see ``excluded_rows``). A query of a known
        user may send the user id alone: the bundle fills its stored features and history
        (``complete_queries``). A history the query sends is read newest first; pass
        ``history_order="oldest_first"`` for one in time order (a line of a sequences file).
        ``k`` and ``exclude_item_ids`` follow ``retrieval.serving.request_checks``: k an int >= 1, capped at
        the catalogue size; ids strings or ints (``494`` is item ``"494"``), a list of them or None.
        ``filters`` (``retrieval.serving.item_filters``, e.g. ``{"genre": {"in": ["Comedy"]}, "year":
        {"min": 1990}}``) keeps the answer to the items of the bundle's item table that pass them,
        searched inside the index: k items come back whenever k pass (and are not excluded).

        Raises:
          RequestError: naming the argument, the query feature, the query key or the filter that is wrong.
        """
        excluded = checked_ids(exclude_item_ids, "exclude_item_ids")
        return self.recommend_batch([query], k, [excluded], exclude_seen=exclude_seen,
                                    history_order=history_order, filters=filters)[0]

    def recommend_batch(
        self,
        queries: Sequence[Mapping[str, Any]],
        k: int = 10,
        exclude_item_ids: Sequence[Sequence[str | int]] | None = None,
        *,
        exclude_seen: bool = True,
        history_order: HistoryOrder = "newest_first",
        filters: Mapping[str, Any] | ItemFilters | None = None,
    ) -> list[Recommendations]:
        """Top-k for a batch of raw queries (one FAISS search for all); ``k``, ``exclude_item_ids`` (one
        list per query, or None), ``exclude_seen``, ``history_order`` and ``filters`` (one for every
        query of the batch) as in ``recommend``."""
        k = checked_k(k, len(self.index))
        exclude_item_ids = checked_id_lists(exclude_item_ids, len(queries), "exclude_item_ids")
        allowed = self.allowed_rows(filters)  # a bad filter is refused before the towers run
        if not queries:
            return []
        embeddings, known_ids = self.embed_with_known(queries, history_order=history_order)
        return self.recommend_embedded(
            embeddings, known_ids, k, exclude_item_ids, queries=queries, exclude_seen=exclude_seen,
            allowed=allowed,
        )

    def allowed_rows(self, filters: Mapping[str, Any] | ItemFilters | None) -> np.ndarray | None:
        """The sorted index rows [m] int64 that pass ``filters`` (``retrieval.serving.item_filters``);
        None for no filter. RequestError naming the column, operator or value a filter gets wrong."""
        return self.filter_table.allowed_rows(filters)

    def embed_with_known(self, queries: Sequence[Mapping[str, Any]], *,
                         history_order: HistoryOrder = "newest_first") -> tuple[np.ndarray, np.ndarray]:
        """Checked raw queries -> (embeddings [n, dim] float32, known_ids bool [n]) for recommend_embedded."""
        return self._embed_checked(queries, history_order)

    def recommend_embedded(
        self,
        embeddings: np.ndarray,
        known_ids: np.ndarray,
        k: int = 10,
        exclude_item_ids: Sequence[Sequence[str]] | None = None,
        *,
        queries: Sequence[Mapping[str, Any]] | None = None,
        exclude_seen: bool = True,
        filters: Mapping[str, Any] | ItemFilters | None = None,
        allowed: np.ndarray | None = None,
    ) -> list[Recommendations]:
        """Top-k for query embeddings [n, dim] and known_ids [n] from ``embed_with_known`` (one FAISS search).

        ``recommend_batch`` is embed_with_known + this; a caller answering a large batch embeds it
        once and searches it in slices. A row holding NaN or inf, or whose scores overflow float32,
        is a ValueError naming it (FAISS would drop its results: an empty answer that looks like one).
        ``queries`` [n] are the raw queries the embeddings came
        from: with ``exclude_seen`` their users' training items and history items are excluded
        (``excluded_rows``), so they are needed unless the bundle has nothing of the kind to exclude.
        ``filters`` (one for every row) as in ``recommend``; ``allowed``, the rows they pass
        (``allowed_rows``), when the caller has them already.
        """
        k = checked_k(k, len(self.index))  # capped: nothing is allocated for ranks the catalogue lacks
        exclude_item_ids = checked_id_lists(exclude_item_ids, len(embeddings), "exclude_item_ids")
        if allowed is None:
            allowed = self.allowed_rows(filters)
        check_finite(embeddings, "embedding")  # FAISS drops NaN rows: an empty answer that looks like success
        if queries is not None and len(queries) != len(embeddings):
            raise ValueError(f"queries has {len(queries)} entries for {len(embeddings)} embeddings")
        exclude = self.excluded_rows(len(embeddings), exclude_item_ids, queries, exclude_seen=exclude_seen)
        top = self.index.search(embeddings, k, exclude=exclude, allow=None if allowed is None else
                                [allowed] * len(embeddings))
        # An all-zero embedding is the towers' out-of-vocabulary row: the model
        # knows nothing about this query, so popularity is the honest answer.
        unknown = ~np.any(embeddings != 0, axis=1)
        popular = self._popular_rows if allowed is None else \
            self._popular_rows[np.isin(self._popular_rows, allowed)]  # the popular items that pass, in order
        results = []
        for i in range(len(embeddings)):
            if unknown[i]:
                excluded = set(exclude[i].tolist())
                rows = [r for r in popular if r not in excluded][:k]
                results.append(Recommendations(self._ids(rows), [None] * len(rows), "popular"))
            else:
                rows = top.rows[i][top.rows[i] >= 0]
                scores = top.scores[i][: len(rows)]
                # Scores that overflow to inf - inf are NaN, which FAISS drops: fewer rows than the
                # catalogue has left (``excluded_rows`` are distinct) is that, not a short catalogue.
                available = min(k, len(self.index) - len(exclude[i])) if allowed is None else \
                    min(k, len(allowed) - int(np.isin(exclude[i], allowed).sum()))
                if not np.isfinite(scores).all():
                    raise ValueError(
                        f"embedding {i}: its scores overflow float32 (the embedding is finite but huge); "
                        + NON_FINITE_CAUSE
                    )
                if len(rows) < available:  # never an answer shorter than the catalogue allows
                    raise ValueError(
                        f"embedding {i}: its scores overflow float32 (NaN scores are dropped), or the index cannot "
                        f"skip the excluded items: the search found {len(rows)} of the {available} items it should; "
                        + NON_FINITE_CAUSE
                    )
                fallback = None if known_ids[i] else "features"
                results.append(Recommendations(self._ids(rows), scores.tolist(), fallback))
        return results

    @property
    def row_of(self) -> Mapping[str, int]:
        """Item id -> its index row (removed items included), read only."""
        return MappingProxyType(self._row_of)

    def served_item_ids(self) -> np.ndarray:
        """[n] the ids of the items this bundle serves, in index order: every indexed item but those a
        catalogue edit removed (the manifest's ``disabled_item_ids``)."""
        if not len(self._disabled_rows):
            return self.index.item_ids
        return np.delete(self.index.item_ids, self._disabled_rows)

    def training_items(self, user_id: str) -> list[str] | None:
        """``user_id``'s distinct training items (index order), or None for a user the bundle does
        not know (not a training user, or a bundle exported without ``seen_items/``)."""
        if self.seen_items is None:
            return None
        positions = find_sorted(self.seen_items.user_ids, [user_id])
        if positions[0] < 0:
            return None
        return self._ids(self.seen_items.rows_of(user_id))

    def recent_items(self, user_id: str) -> list[str] | None:
        """``user_id``'s stored recent training clicks, newest first (repeats kept, at most
        ``export.history_clicks``), or None for a user without them or a bundle that stores none."""
        if self.user_histories is None:
            return None
        rows = self.user_histories.rows_of_many([user_id])[0]
        return None if rows is None else self._ids(rows)

    def known_user_ids(self, limit: int) -> list[str]:
        """Up to ``limit`` training user ids (sorted as bytes), e.g. for a page's pick list."""
        if self.seen_items is None:
            return []
        return [user.decode("utf-8") for user in np.asarray(self.seen_items.user_ids[:limit]).tolist()]

    def item_features(self, item_ids: Sequence[str]) -> list[dict[str, Any] | None]:
        """[len(item_ids)] each item's display features (``retrieval.bundle.display_features``), None for an
        item the table does not describe; all None for a bundle without a table."""
        if self.item_display is None:
            return [None] * len(item_ids)
        return self.item_display.values_of(item_ids)

    def explain(self, item_ids: Sequence[str], history: Sequence[str]) -> list[str | None]:
        """For each of ``item_ids``, the item of ``history`` that most explains it ("because you
        clicked X"): the one whose doc-tower embedding has the highest inner product with the item's
        (``ItemIndex.vectors``: exact for Flat, IVF*,Flat and HNSW, the decoded code for PQ and SQ);
        None when ``history`` holds no catalogue item, or the item is not in the catalogue. Ties go
        to the more recent click (``history`` is read newest first).

        Raises:
          BundleError: the index is of a type FAISS cannot read vectors back from.
        """
        known = [item for item in dict.fromkeys(str(item) for item in history) if item in self._row_of]
        asked = [self._row_of.get(item) if isinstance(item, str) else None for item in item_ids]
        rows = [row for row in asked if row is not None]
        if not known or not rows:
            return [None] * len(item_ids)
        try:
            past = self.index.vectors([self._row_of[item] for item in known])
            wanted = self.index.vectors(rows)
        except ValueError as error:
            raise BundleError(f"bundle {self.version!r}: {error}") from None
        best = iter(np.argmax(wanted @ past.T, axis=1).tolist())  # argmax: the first (newest) of ties
        return [None if row is None else known[next(best)] for row in asked]

    def search_items(self, text: str, limit: int) -> list[str]:
        """Up to ``limit`` catalogue item ids whose title contains ``text`` (``DisplayFeatures.search``),
        or, for a bundle without a title column, whose id starts with it; never an item a catalogue
        edit removed."""
        text = text.strip()
        if not text:
            return []
        if self.item_display is None or self.item_display.title_feature is None:
            return [item for item in self._id_array.tolist() if item.startswith(text) and self._served(item)][:limit]
        return [item for item in self.item_display.search(text, limit * 2 + len(self._disabled_rows))
                if self._served(item)][:limit]

    def _served(self, item: str) -> bool:
        """Whether ``item`` is in the catalogue and not removed from it."""
        row = self._row_of.get(item)
        return row is not None and row not in self._disabled_set

    def similar_items(
        self, item_id: str | int, k: int = 10, *, exclude_item_ids: Sequence[str | int] | None = (),
        filters: Mapping[str, Any] | ItemFilters | None = None,
    ) -> Recommendations:
        """The k items nearest ``item_id``'s own embedding, best first; never the item itself nor
        ``exclude_item_ids`` (ids not in the catalogue are ignored).

        The item's vector is its doc-tower embedding as the bundle's index holds it
        (``ItemIndex.vectors``), searched in that index like a query: scores are inner products
        (cosine when the towers normalise). Every catalogue item is indexed, clicked in training
        or not, so every one has neighbours. The vector is exact for Flat, IVF*,Flat and HNSW
        indexes; with a lossy code (PQ, SQ) it is the item's decoded code, so the neighbours are
        approximate as that index's own scores are (and the search is the index's, tuned
        ``nprobe``/``efSearch`` included). An item at the all-zero (out-of-vocabulary) row, which is
        where an ID-only doc tower puts items without training clicks, ties with every item:
        it gets the most popular items, scores None, ``fallback="popular"``, as a query would.

        Ids and ``k`` follow ``retrieval.serving.request_checks`` as in ``recommend``; ``filters`` keep the
        answer to the items that pass them, as in ``recommend`` (the item itself need not pass).

        Raises:
          RequestError: ``item_id`` is not in the bundle's catalogue, or an argument breaks a rule of
            ``retrieval.serving.request_checks`` (k not an int >= 1, a bare string as ``exclude_item_ids``).
          BundleError: the index is of a type FAISS cannot read vectors back from (``ItemIndex.vectors``).
        """
        item = checked_id(item_id, "item_id")
        return self.similar_items_batch([item], k, [checked_ids(exclude_item_ids, "exclude_item_ids")],
                                        filters=filters)[0]

    def similar_items_batch(
        self,
        item_ids: Sequence[str | int],
        k: int = 10,
        exclude_item_ids: Sequence[Sequence[str | int]] | None = None,
        *,
        filters: Mapping[str, Any] | ItemFilters | None = None,
    ) -> list[Recommendations]:
        """``similar_items`` for [n] item ids (one FAISS search); ``exclude_item_ids`` [n] lists or None;
        ``filters`` one for every item."""
        k = checked_k(k, len(self.index))
        item_ids = checked_ids(item_ids, "item_ids")
        exclude_item_ids = checked_id_lists(exclude_item_ids, len(item_ids), "exclude_item_ids")
        allowed = self.allowed_rows(filters)
        rows = []
        for item in item_ids:
            row = self._row_of.get(item)
            if row is None:
                raise RequestError(f"item id {_short(item)} is not in the catalogue of bundle {self.version!r} "
                                   f"({len(self.index)} items)")
            if row in self._disabled_set:
                raise RequestError(f"item id {_short(item)} was removed from the catalogue of bundle "
                                   f"{self.version!r}")
            rows.append(row)
        if not rows:
            return []
        try:
            vectors = self.index.vectors(rows)
        except ValueError as error:  # an index type FAISS cannot read vectors back from
            raise BundleError(f"bundle {self.version!r}: {error}") from None
        # The item is excluded like any other: its own vector is its nearest when the towers normalise,
        # and near the top otherwise.
        excluded = [[item, *extra] for item, extra in zip(item_ids, exclude_item_ids)]
        # known_ids all True: an indexed item is never the "features" fallback of an unseen query id.
        return self.recommend_embedded(vectors, np.ones(len(rows), dtype=bool), k, excluded, exclude_seen=False,
                                       allowed=allowed)

    def excluded_rows(
        self,
        num_queries: int,
        exclude_item_ids: Sequence[Sequence[str]] | None = None,
        queries: Sequence[Mapping[str, Any]] | None = None,
        *,
        exclude_seen: bool = True,
    ) -> list[np.ndarray]:
        """Per query, the sorted distinct index rows never to serve: [num_queries] int64 arrays.

        The items a catalogue edit removed (always), the caller's ``exclude_item_ids`` (ids not in
        the catalogue are ignored) and, with ``exclude_seen``, the items the user already has: the
        training items of the query's user (its user-id input; none for a user unknown to training
        or a bundle without ``seen_items/``) and the items of its click-history input, if the query
        tower reads one.

        Raises:
          ValueError: ``exclude_seen`` without ``queries`` on a bundle that can exclude seen items.
        """
        lists: list[list[np.ndarray]] = [[self._disabled_rows] if len(self._disabled_rows) else []
                                         for _ in range(num_queries)]
        for own, items in zip(lists, exclude_item_ids or ()):
            own.append(self._rows_of_ids(items))
        can_exclude = self.seen_items is not None or self._history_input is not None
        if exclude_seen and can_exclude:
            if queries is None:
                raise ValueError(
                    "exclude_seen needs the raw queries (queries=...) to find their users' items; "
                    "pass them, or exclude_seen=False"
                )
            if self.seen_items is not None:
                ids = [user_key(query_value(query, self._user_input)) for query in queries]
                for own, rows in zip(lists, self.seen_items.rows_of_many(ids)):
                    own.append(rows.astype(np.int64))
            if self._history_input is not None:
                if self.user_histories is not None:  # a history filled from the bundle is the user's too
                    queries = self.complete_queries(queries)
                for own, query in zip(lists, queries):
                    history = query_value(query, self._history_input)
                    if isinstance(history, Sequence) and not isinstance(history, str | bytes):
                        own.append(self._rows_of_ids([str(item) for item in history]))
        return [np.unique(np.concatenate(own)) if own else np.zeros(0, np.int64) for own in lists]

    def _rows_of_ids(self, items: Sequence[str]) -> np.ndarray:
        return np.array([self._row_of[i] for i in items if i in self._row_of], dtype=np.int64)

    def _ids(self, rows) -> list[str]:
        return self._id_array[np.asarray(rows, dtype=np.int64)].tolist()


def recommend_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line of ``python -m retrieval.serving`` and ``retrieval recommend`` (``recommend`` runs it)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Top-k item ids for a raw query (--user-id), or the items most similar to an item "
        "(--similar), from a bundle; with --out, for many users (--users) or items (--similar) into a "
        "Parquet file.",
    )
    parser.add_argument("--bundle", required=True, help="bundle directory, e.g. artifacts/<run>")
    asked = parser.add_mutually_exclusive_group(required=True)
    asked.add_argument("--user-id", action="append", help="query user id (repeatable)")
    asked.add_argument(
        "--similar", action="append", metavar="ITEM_ID",
        help="catalogue item id: its nearest items, never itself (repeatable); with --out: 'all' "
        "(the whole catalogue) or a file of item ids, one a line",
    )
    asked.add_argument(
        "--users", metavar="FILE|all",
        help="with --out: a file of user ids, one a line, or 'all' (every user of the bundle's seen items)",
    )
    parser.add_argument("-k", "--k", type=int, default=10, help="items per query (default: %(default)s)")
    parser.add_argument("--exclude", nargs="*", default=[], help="item ids never to return")
    parser.add_argument(
        "--filters", metavar="JSON", type=filters_argument,
        help='only items of the bundle\'s item table that pass these filters, for every query, e.g. '
        '\'{"genre": {"in": ["Comedy"]}, "year": {"min": 1990, "max": 1999}}\' (docs/operations.md, "Filters")',
    )
    parser.add_argument(
        "--include-seen",
        action="store_true",
        help="also return the user's training items (excluded by default; --user-id and --users only)",
    )
    parser.add_argument(
        "--out", metavar="FILE.parquet",
        help="write --users' recommendations (user_id, rank, item_id, score) or --similar's similar items "
        "(item_id, rank, similar_item_id, score) to this Parquet file",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    parser.add_argument(
        "--block-size", type=int,
        help="with --out: users (items) searched at once and written as one row group (default: 1024)",
    )
    return parser


def filters_argument(text: str) -> ItemFilters | None:
    """``--filters``' JSON text as ``ItemFilters`` (``parse_filters``); argparse reports a bad one naming the flag."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error}): {_short(text)}") from None
    try:
        return parse_filters(value)
    except RequestError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def recommend(args: argparse.Namespace) -> int:
    """Print one JSON line per query of ``recommend_parser``'s ``args``: its top-k ids, scores and fallback;
    with ``--out``, write them for many users or items to a file (``retrieval.serving.batch``)."""
    checked_k(args.k, sys.maxsize, "-k")  # the bundle caps it at its catalogue; refused here before it loads
    if args.similar and args.include_seen:
        raise UserError("--include-seen applies to --user-id queries; --similar has no user whose items to keep")
    if args.out is not None or args.users is not None:
        from retrieval.serving.batch import recommend_to_files  # same stage; imports this module

        return recommend_to_files(args)
    for flag, given in (("--overwrite", args.overwrite), ("--block-size", args.block_size is not None)):
        if given:
            raise UserError(f"{flag} applies to --out, which this command was not given")
    bundle = Bundle.load(current_version(args.bundle))  # its newest catalogue version
    if args.similar:
        similar = bundle.similar_items_batch(args.similar, args.k, [args.exclude] * len(args.similar),
                                             filters=args.filters)
        for item, result in zip(args.similar, similar):
            print(json.dumps({"item_id": item, **asdict(result)}))
        return 0
    queries = [{"user_id": user} for user in args.user_id]
    results = bundle.recommend_batch(
        queries, args.k, [args.exclude] * len(queries), exclude_seen=not args.include_seen, filters=args.filters
    )
    for query, result in zip(queries, results):
        print(json.dumps({"query": query, **asdict(result)}))
    return 0


@entry_point
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m retrieval.serving`` (``retrieval recommend``): a user error is one line and status 2
    (``retrieval.common.errors``)."""
    return recommend(recommend_parser().parse_args(argv))

if __name__ == "__main__":
    sys.exit(main())
