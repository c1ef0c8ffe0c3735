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

(``retrieval recommend`` takes the same arguments; ``--out`` runs ``retrieval.batch_recommend``.)

What a user already has is never served by default: the user's training
items (the bundle's ``seen_items/``, ``retrieval.seen_items``) and the items
of the query's click history; ``exclude_seen=False`` (``--include-seen``)
serves them too.

Over HTTP, ``retrieval serve --bundle artifacts/my-run`` (``retrieval/service.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import reprlib
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import tensorflow as tf

from retrieval.data import USER
from retrieval.data.values import finite_feature_value
from retrieval.errors import UserError, entry_point
from retrieval.export import check_fingerprints, read_manifest, served_files
from retrieval.index import INDEX_FILE, INDEX_INFO_FILE, ITEM_IDS_FILE, IndexFilesError, ItemIndex
from retrieval.item_features import ItemFeatures
from retrieval.seen_items import SeenItems, find_sorted
from retrieval.user_features import UserFeatures

log = logging.getLogger("retrieval.serving")

Verify = Literal["quick", "full"]
# Scores of the probe query equal those at export within this (absolute and relative); ids may reorder in ties.
PROBE_TOLERANCE = 1e-5


class BundleError(UserError, ValueError):
    """A bundle that cannot be served: one line naming the directory, the part and why.

    The message never quotes file contents (FAISS and TensorFlow errors echo
    bytes of the file they failed on), so it is safe to print or send back.
    """


class RequestError(UserError, ValueError):
    """A request the bundle cannot answer as asked (an item id not in its catalogue, k below 1):
    one line naming the value. A ValueError, so the HTTP service answers it with a 422."""



def _short(value: Any) -> str:
    """A bounded repr for error messages: a client's deeply nested or huge value is not echoed whole."""
    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxdict, short.maxstring, short.maxother = 2, 4, 4, 40, 40
    return short.repr(value)



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
    """

    def __init__(self, directory: str | Path, *, verify: Verify = "quick"):
        if verify not in ("quick", "full"):
            raise ValueError(f"verify must be 'quick' or 'full', got {verify!r}")
        self.directory = Path(directory)
        self.loaded_at = time.time()
        with _part(self.directory, "manifest.json"):
            self.manifest = read_manifest(self.directory)
            self.query_features: list[str] = [str(f) for f in self.manifest["query_features"]]
            query_model = str(self.manifest["files"]["query_model"])
        self._check_files(verify)
        with _part(self.directory, f"query SavedModel {query_model!r}"):
            self._query_model = tf.saved_model.load(str(self.directory / query_model))
            self._embed = self._query_model.signatures["serving_default"]
            # Bundles whose query tower reads id features say which ids it knew (export.save_tower).
            self._reports_known_ids = "known_ids" in self._embed.structured_outputs
            # name -> TensorSpec: string [batch], float32/float64 [batch] or string [batch, width].
            self._input_specs: dict[str, tf.TensorSpec] = dict(self._embed.structured_input_signature[1])
        missing = [f for f in self.query_features if f not in self._input_specs]
        if missing:
            raise BundleError(
                f"{self.directory}: the query SavedModel does not take the manifest's query features {missing} "
                f"(it takes {sorted(self._input_specs)})"
            )
        with _part(self.directory, "index (index.faiss, index.json, item_ids.parquet)"):
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
        self.seen_items = self._load_seen_items()
        self._user_input, self._history_input = _seen_inputs(self.manifest, self.query_features)
        self.user_features = self._load_user_features()
        self.item_display = self._load_item_features()
        self.check_probe()

    def _load_seen_items(self) -> SeenItems | None:
        """The training users' items (``seen_items/``); None for a bundle exported without them."""
        folder = self.manifest["files"].get("seen_items")
        if folder is None:
            return None
        with _part(self.directory, f"seen items {str(folder)!r}"):
            seen = SeenItems.load(self.directory / str(folder))
        recorded = self.manifest.get("seen_items")
        if recorded is not None and recorded != seen.info():
            raise BundleError(f"{self.directory}: seen items hold {seen.info()}, the manifest says {recorded}")
        return seen

    def _load_user_features(self) -> UserFeatures | None:
        """The known users' raw query features (``user_features.parquet``); None for a bundle without them."""
        name = self.manifest["files"].get("user_features")
        if name is None:
            return None
        with _part(self.directory, f"user features {str(name)!r}"):
            table = UserFeatures.load(self.directory / str(name))
        strangers = [feature for feature in table.features if feature not in self.query_features]
        if strangers:
            raise BundleError(f"{self.directory}: {name} holds {strangers}, which are not query features "
                              f"of this bundle ({self.query_features})")
        recorded = self.manifest.get("user_features")
        if recorded is not None and recorded != table.info():
            raise BundleError(f"{self.directory}: {name} holds {table.info()}, the manifest says {_short(recorded)}")
        return table

    def _load_item_features(self) -> ItemFeatures | None:
        """The catalogue's display features (``item_features.parquet``); None for a bundle without them."""
        name = self.manifest["files"].get("item_features")
        if name is None:
            return None
        with _part(self.directory, f"item features {str(name)!r}"):
            table = ItemFeatures.load(self.directory / str(name))
        recorded = self.manifest.get("item_features")
        if recorded is not None and recorded != table.info():
            raise BundleError(f"{self.directory}: {name} holds {table.info()}, the manifest says {_short(recorded)}")
        return table

    @classmethod
    def load(cls, directory: str | Path, *, verify: Verify = "quick") -> Bundle:
        """Load and check a bundle (see the class docstring); ``verify="full"`` hashes every file whole."""
        return cls(directory, verify=verify)

    def _check_files(self, verify: Verify) -> None:
        """Paths inside the bundle, and (format 2) every served file equal to its fingerprint."""
        with _part(self.directory, "manifest.json files"):
            files = self.manifest["files"]
            if not isinstance(files, dict):
                raise BundleError(f"{self.directory}: manifest.json files must be an object of paths")
        try:
            if self.manifest.get("format_version") == 1:
                served_files(self.directory, files)
                log.warning(
                    "%s: bundle format 1 has no fingerprints or probe query, so its parts cannot be checked "
                    "against the export; re-export it (python -m pipelines.export) to get these checks",
                    self.directory,
                )
                return
            check_fingerprints(self.directory, self.manifest, full=verify == "full")
        except ValueError as error:  # names the file and what is wrong with it
            raise BundleError(f"{self.directory}: {error}") from None
        except Exception as error:  # an unreadable file, or a fingerprint record of the wrong shape
            raise BundleError(f"{self.directory}: the files cannot be checked: {_reason(error)}") from None
        unlisted = [name for name in (INDEX_FILE, ITEM_IDS_FILE, INDEX_INFO_FILE)
                    if name not in self.manifest["fingerprints"]["files"]]
        if unlisted:
            raise BundleError(
                f"{self.directory}: manifest.json files does not list {unlisted}, which the index is loaded from, "
                "so they are not checked: re-export the bundle"
            )

    def check_probe(self) -> None:
        """Raise BundleError unless the manifest's probe query gives the items it gave at export.

        The probe (``retrieval.export.probe_record``) is one training user's raw query; it runs
        through this bundle's query model and index as a request would. A bundle without a probe passes.
        """
        problem = self.probe_problem()
        if problem:
            raise BundleError(f"{self.directory}: {problem}")

    def probe_problem(self) -> str | None:
        """Why the probe query fails (no server paths: /healthz sends it), or None when it passes."""
        probe = self.manifest.get("probe")
        if not probe:
            return None
        who = "query"
        try:
            query = probe["query"]
            who = f"user {_short(query.get('user_id'))}" if "user_id" in query else f"query {_short(query)}"
            top = self.index.search(self.embed([query]), int(probe["k"]))
            rows = top.rows[0][top.rows[0] >= 0]
            same = _same_top_k(list(probe["item_ids"]), list(probe["scores"]), self._ids(rows),
                               top.scores[0][: len(rows)])
        except Exception as error:
            return f"probe query for {who} cannot be run: {error if isinstance(error, ValueError) else _reason(error)}"
        if not same:
            return (f"probe query for {who} returned other items than at export: "
                    "the bundle's parts do not belong together")
        return None

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
            # The query keys of the user id and of the click history (None: the tower reads none).
            "user_input": self._user_input,
            "history_input": self._history_input,
            "num_popular_items": int(len(self._popular_rows)),
            # exclude_seen: training items of known users (bundles exported with seen_items/ only) and
            # the items of a query's click history.
            "excludes_seen": self.seen_items is not None,
            "excludes_history": self._history_input is not None,
            "versions": self.manifest.get("versions", {}),
        }

    def check_query(self, query: Any, position: int = 0) -> None:
        """Raise RequestError (a ValueError) naming the problem unless ``query`` has every query feature
        in its type, those it lacks filled from the bundle's user table for a known user (``complete_queries``).

        String inputs take a string or int (None: missing, sent as ""); number
        inputs an int or a float finite in the input's dtype (float32 for
        numeric features: at most about 3.4e38 in magnitude), or None (missing,
        sent as NaN; a NaN itself is refused, as are infinities); list inputs
        (e.g. a click history) a list of strings or ints, truncated or padded to
        the signature's width.
        """
        self._check_completed(self.complete_queries([query])[0], position)

    def _check_completed(self, query: Any, position: int) -> Mapping[str, Any]:
        """``query``, already completed from the user table (``complete_queries``), checked (``check_query``)."""
        if not isinstance(query, Mapping):
            raise RequestError(f"query {position} must be an object of features, got {type(query).__name__}")
        for feature in self.query_features:
            if feature not in query:
                raise RequestError(self._missing_feature(query, feature, position))
            value, spec = query[feature], self._input_specs[feature]
            if spec.dtype != tf.string:
                problem = finite_feature_value(value, spec.dtype.name)
                if problem is not None:
                    raise RequestError(f"query {position} feature {feature!r} {problem}, got {_short(value)}")
            elif spec.shape.rank == 2:
                if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or any(
                    isinstance(v, bool) or not isinstance(v, (str, int)) for v in value
                ):
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
        return query

    def complete_query(self, query: Mapping[str, Any]) -> Mapping[str, Any]:
        """``query`` with the user-table features it lacks filled from its user's row (``complete_queries``)."""
        return self.complete_queries([query])[0]

    def complete_queries(self, queries: Sequence[Any]) -> list[Any]:
        """Each query with the user-table features it lacks filled from its user's row (one search of
        the table for all of them).

        The user is the query's user-id input (``metadata()["user_features"]["user_input"]``). What the
        query itself sends wins, feature by feature (null included: a missing value, as the tower
        embeds it). A query whose user is not in the table, a bundle without one, a query lacking
        nothing or one that is no object comes back as it is (``check_query`` then names its problem).
        """
        table, completed = self.user_features, list(queries)
        if table is None:
            return completed
        lacking = [position for position, query in enumerate(queries)
                   if isinstance(query, Mapping) and any(feature not in query for feature in table.features)]
        if not lacking:
            return completed
        rows = table.rows_of([_user_key(queries[position].get(self._user_input)) for position in lacking])
        for position, row in zip(lacking, rows.tolist()):
            if row >= 0:
                query = queries[position]
                completed[position] = {**table.values(row, [f for f in table.features if f not in query]), **query}
        return completed

    def _missing_feature(self, query: Mapping[str, Any], feature: str, position: int) -> str:
        """Why ``query`` (already completed) lacks ``feature``: one line that says what to send."""
        lacks = f"query {position} lacks the feature {feature!r}"
        table = self.user_features
        if table is None:
            return f"{lacks} (this bundle reads {self.query_features})"
        if feature not in table.features:
            return (f"{lacks} (this bundle reads {self.query_features}; its user table fills only "
                    f"{table.features} for a known user)")
        user = query.get(self._user_input)
        if self._user_input not in query or user is None:
            return (f"{lacks} and has no {self._user_input!r} to fill it from the bundle's user table: send "
                    f"the user id or the features {table.features}")
        return (f"{lacks}, and user {_short(user)} is not in the bundle's user table ({len(table)} users) to "
                f"fill it from: send the features {table.features} for a user the bundle does not know")

    def embed(self, queries: Sequence[Mapping[str, Any]]) -> np.ndarray:
        """Raw query features -> [num_queries, dim] float32 embeddings.

        Raises ValueError for a query that ``check_query`` refuses or whose embedding is not finite.
        """
        return self._embed_checked(queries)[0]

    def _embed_checked(self, queries: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        """(embeddings [n, dim], known_ids bool [n]: every id feature in the training vocabulary)."""
        completed = self.complete_queries(queries)  # one search of the user table for the whole batch
        queries = [self._check_completed(query, position) for position, query in enumerate(completed)]
        inputs = {
            feature: _input_tensor([query[feature] for query in queries], self._input_specs[feature])
            for feature in self.query_features
        }
        outputs = self._embed(**inputs)
        known = outputs["known_ids"].numpy() if self._reports_known_ids else np.ones(len(queries), dtype=bool)
        embeddings = outputs["embedding"].numpy()
        _check_finite(embeddings, "query")
        return embeddings, known

    def recommend(
        self,
        query: Mapping[str, Any],
        k: int = 10,
        exclude_item_ids: Sequence[str] = (),
        *,
        exclude_seen: bool = True,
    ) -> Recommendations:
        """Top-k item ids for one raw query, never returning ``exclude_item_ids``.

        With ``exclude_seen`` (the default) neither the user's training items nor the items of
        the query's click history are returned either (see ``excluded_rows``).
        """
        return self.recommend_batch([query], k, [exclude_item_ids], exclude_seen=exclude_seen)[0]

    def recommend_batch(
        self,
        queries: Sequence[Mapping[str, Any]],
        k: int = 10,
        exclude_item_ids: Sequence[Sequence[str]] | None = None,
        *,
        exclude_seen: bool = True,
    ) -> list[Recommendations]:
        """Top-k for a batch of raw queries (one FAISS search for all); ``exclude_seen`` as in ``recommend``."""
        if not queries:
            return []
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        if exclude_item_ids is not None and len(exclude_item_ids) != len(queries):
            raise ValueError(f"exclude_item_ids has {len(exclude_item_ids)} lists for {len(queries)} queries")
        embeddings, known_ids = self.embed_with_known(queries)
        return self.recommend_embedded(
            embeddings, known_ids, k, exclude_item_ids, queries=queries, exclude_seen=exclude_seen
        )

    def embed_with_known(self, queries: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        """Checked raw queries -> (embeddings [n, dim] float32, known_ids bool [n]) for recommend_embedded."""
        return self._embed_checked(queries)

    def recommend_embedded(
        self,
        embeddings: np.ndarray,
        known_ids: np.ndarray,
        k: int = 10,
        exclude_item_ids: Sequence[Sequence[str]] | None = None,
        *,
        queries: Sequence[Mapping[str, Any]] | None = None,
        exclude_seen: bool = True,
    ) -> list[Recommendations]:
        """Top-k for query embeddings [n, dim] and known_ids [n] from ``embed_with_known`` (one FAISS search).

        ``recommend_batch`` is embed_with_known + this; a caller answering a large batch embeds it
        once and searches it in slices. A row holding NaN or inf, or whose scores overflow float32,
        is a ValueError naming it (FAISS would drop its results: an empty answer that looks like one).
        once and searches it in slices. ``queries`` [n] are the raw queries the embeddings came
        from: with ``exclude_seen`` their users' training items and history items are excluded
        (``excluded_rows``), so they are needed unless the bundle has nothing of the kind to exclude.
        """
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        if exclude_item_ids is not None and len(exclude_item_ids) != len(embeddings):
            raise ValueError(f"exclude_item_ids has {len(exclude_item_ids)} lists for {len(embeddings)} queries")
        _check_finite(embeddings, "embedding")  # FAISS drops NaN rows: an empty answer that looks like success
        if queries is not None and len(queries) != len(embeddings):
            raise ValueError(f"queries has {len(queries)} entries for {len(embeddings)} embeddings")
        exclude = self.excluded_rows(len(embeddings), exclude_item_ids, queries, exclude_seen=exclude_seen)
        top = self.index.search(embeddings, k, exclude=exclude)
        # An all-zero embedding is the towers' out-of-vocabulary row: the model
        # knows nothing about this query, so popularity is the honest answer.
        unknown = ~np.any(embeddings != 0, axis=1)
        results = []
        for i in range(len(embeddings)):
            if unknown[i]:
                excluded = set(exclude[i].tolist())
                rows = [r for r in self._popular_rows if r not in excluded][:k]
                results.append(Recommendations(self._ids(rows), [None] * len(rows), "popular"))
            else:
                rows = top.rows[i][top.rows[i] >= 0]
                scores = top.scores[i][: len(rows)]
                # Scores that overflow to inf - inf are NaN, which FAISS drops: fewer rows than the
                # catalogue has left (``excluded_rows`` are distinct) is that, not a short catalogue.
                available = min(k, len(self.index) - len(exclude[i]))
                if not np.isfinite(scores).all():
                    raise ValueError(
                        f"embedding {i}: its scores overflow float32 (the embedding is finite but huge); "
                        + _NON_FINITE_CAUSE
                    )
                if len(rows) < available:  # never an answer shorter than the catalogue allows
                    raise ValueError(
                        f"embedding {i}: its scores overflow float32 (NaN scores are dropped), or the index cannot "
                        f"skip the excluded items: the search found {len(rows)} of the {available} items it should; "
                        + _NON_FINITE_CAUSE
                    )
                fallback = None if known_ids[i] else "features"
                results.append(Recommendations(self._ids(rows), scores.tolist(), fallback))
        return results

    def training_items(self, user_id: str) -> list[str] | None:
        """``user_id``'s distinct training items (index order), or None for a user the bundle does
        not know (not a training user, or a bundle exported without ``seen_items/``)."""
        if self.seen_items is None:
            return None
        positions = find_sorted(self.seen_items.user_ids, [user_id])
        if positions[0] < 0:
            return None
        return self._ids(self.seen_items.rows_of(user_id))

    def known_user_ids(self, limit: int) -> list[str]:
        """Up to ``limit`` training user ids (sorted as bytes), e.g. for a page's pick list."""
        if self.seen_items is None:
            return []
        return [user.decode("utf-8") for user in np.asarray(self.seen_items.user_ids[:limit]).tolist()]

    def item_features(self, item_ids: Sequence[str]) -> list[dict[str, Any] | None]:
        """[len(item_ids)] each item's display features (``retrieval.item_features``), None for an
        item the table does not describe; all None for a bundle without a table."""
        if self.item_display is None:
            return [None] * len(item_ids)
        return self.item_display.values_of(item_ids)

    def similar_items(self, item_id: str, k: int = 10, *, exclude_item_ids: Sequence[str] = ()) -> Recommendations:
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

        Raises:
          RequestError: ``item_id`` is not in the bundle's catalogue, or k is not a positive integer.
          BundleError: the index is of a type FAISS cannot read vectors back from (``ItemIndex.vectors``).
        """
        return self.similar_items_batch([item_id], k, [exclude_item_ids])[0]

    def similar_items_batch(
        self,
        item_ids: Sequence[str],
        k: int = 10,
        exclude_item_ids: Sequence[Sequence[str]] | None = None,
    ) -> list[Recommendations]:
        """``similar_items`` for [n] item ids (one FAISS search); ``exclude_item_ids`` [n] lists or None."""
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
            raise RequestError(f"k must be a positive integer (the number of similar items), got {_short(k)}")
        if exclude_item_ids is not None and len(exclude_item_ids) != len(item_ids):
            raise ValueError(f"exclude_item_ids has {len(exclude_item_ids)} lists for {len(item_ids)} item ids")
        rows = []
        for item in item_ids:
            row = self._row_of.get(item) if isinstance(item, str) else None
            if row is None:
                raise RequestError(f"item id {_short(item)} is not in the catalogue of bundle {self.version!r} "
                                   f"({len(self.index)} items)")
            rows.append(row)
        if not rows:
            return []
        try:
            vectors = self.index.vectors(rows)
        except ValueError as error:  # an index type FAISS cannot read vectors back from
            raise BundleError(f"bundle {self.version!r}: {error}") from None
        # The item is excluded like any other: its own vector is its nearest when the towers normalise,
        # and near the top otherwise.
        excluded = [[item, *extra] for item, extra in zip(item_ids, exclude_item_ids or [()] * len(item_ids))]
        # known_ids all True: an indexed item is never the "features" fallback of an unseen query id.
        return self.recommend_embedded(vectors, np.ones(len(rows), dtype=bool), int(k), excluded, exclude_seen=False)

    def excluded_rows(
        self,
        num_queries: int,
        exclude_item_ids: Sequence[Sequence[str]] | None = None,
        queries: Sequence[Mapping[str, Any]] | None = None,
        *,
        exclude_seen: bool = True,
    ) -> list[np.ndarray]:
        """Per query, the sorted distinct index rows never to serve: [num_queries] int64 arrays.

        The caller's ``exclude_item_ids`` (ids not in the catalogue are ignored) and, with
        ``exclude_seen``, the items the user already has: the training items of the query's user
        (its user-id input; none for a user unknown to training or a bundle without
        ``seen_items/``) and the items of its click-history input, if the query tower reads one.

        Raises:
          ValueError: ``exclude_seen`` without ``queries`` on a bundle that can exclude seen items.
        """
        lists: list[list[np.ndarray]] = [[] for _ in range(num_queries)]
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
                ids = [_user_key(_query_value(query, self._user_input)) for query in queries]
                for own, rows in zip(lists, self.seen_items.rows_of_many(ids)):
                    own.append(rows.astype(np.int64))
            if self._history_input is not None:
                for own, query in zip(lists, queries):
                    history = _query_value(query, self._history_input)
                    if isinstance(history, Sequence) and not isinstance(history, str | bytes):
                        own.append(self._rows_of_ids([str(item) for item in history]))
        return [np.unique(np.concatenate(own)) if own else np.zeros(0, np.int64) for own in lists]

    def _rows_of_ids(self, items: Sequence[str]) -> np.ndarray:
        return np.array([self._row_of[i] for i in items if i in self._row_of], dtype=np.int64)

    def _ids(self, rows) -> list[str]:
        return self._id_array[np.asarray(rows, dtype=np.int64)].tolist()


def _same_top_k(expected_ids: Sequence[str], expected_scores: Sequence[float], ids: Sequence[str],
                scores: Sequence[float]) -> bool:
    """True when a top-k list equals the recorded one: scores within ``PROBE_TOLERANCE`` position by
    position, and ids equal up to the order of tied scores (the last tie group may be cut by k, so
    another item of the same score may stand in there)."""
    expected, got = np.asarray(expected_scores, dtype=np.float64), np.asarray(scores, dtype=np.float64)
    if len(ids) != len(expected_ids) or len(expected) != len(expected_ids) or len(got) != len(ids):
        return False
    if not np.allclose(got, expected, rtol=PROBE_TOLERANCE, atol=PROBE_TOLERANCE):
        return False
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or not np.isclose(expected[end], expected[end - 1], rtol=PROBE_TOLERANCE,
                                             atol=PROBE_TOLERANCE):
            if end < len(ids) and set(ids[start:end]) != set(expected_ids[start:end]):
                return False
            start = end
    return True


@contextmanager
def _part(directory: Path, what: str) -> Iterator[None]:
    """Any failure while loading one part of a bundle -> BundleError naming the directory and the part."""
    try:
        yield
    except BundleError:
        raise
    except Exception as error:
        raise BundleError(f"{directory}: {what} cannot be loaded: {_reason(error)}") from error


def _reason(error: Exception) -> str:
    """Why a part failed, without quoting the file (library messages echo its bytes)."""
    if isinstance(error, FileNotFoundError) and "is not a bundle" in str(error):
        return "manifest.json is missing"  # read_manifest's own message
    if isinstance(error, FileNotFoundError | IsADirectoryError | NotADirectoryError | PermissionError):
        name = Path(error.filename).name if getattr(error, "filename", None) else "a file"
        return f"{type(error).__name__} on {name}"
    if isinstance(error, json.JSONDecodeError):
        return f"not valid JSON (line {error.lineno}, column {error.colno})"
    if isinstance(error, KeyError):
        return f"the key {_short(error.args[0] if error.args else None)} is missing"
    if isinstance(error, ValueError) and "bundle format" in str(error):
        return str(error).split(": ", 1)[-1]  # read_manifest's version message
    if isinstance(error, IndexFilesError):
        return str(error)  # names the file and the rows, never its bytes
    return f"missing, truncated or corrupt ({type(error).__name__})"


def _check_finite(embeddings: np.ndarray, what: str) -> None:
    """Raise ValueError naming the first row of ``embeddings`` [n, dim] holding a NaN or an infinity."""
    finite = np.isfinite(embeddings).all(axis=1)
    if not finite.all():
        position = int(np.argmin(finite))
        raise ValueError(
            f"{what} {position}: the query tower's embedding is not finite (NaN or inf), so it has no "
            f"nearest items; {_NON_FINITE_CAUSE}"
        )


_NON_FINITE_CAUSE = (
    "a numeric feature value far outside the training range overflows the tower, or the model was trained to NaN"
)


def _seen_inputs(manifest: Mapping[str, Any], query_features: Sequence[str]) -> tuple[str, str | None]:
    """(the query key holding the user id, the query input holding the click history or None).

    From the run's config in the manifest: the query tower's id feature read from the click log's
    user_id column (else ``user_id``, which ``TowerTables.queries`` always sets), and
    ``towers.query.history.name``.
    """
    query_tower = ((manifest.get("config") or {}).get("towers") or {}).get("query") or {}
    user = next(
        (
            str(feature["name"])
            for feature in query_tower.get("features") or ()
            if feature.get("kind") == "id" and (feature.get("source") or feature.get("name")) == USER
        ),
        USER,
    )
    history = (query_tower.get("history") or {}).get("name")
    return user, (str(history) if history is not None and history in query_features else None)


def _user_key(user: Any) -> str | None:
    """A user-id value as the id it names (a string or an int), else None (no user)."""
    return str(user) if isinstance(user, str | int) and not isinstance(user, bool) else None


def _query_value(query: Any, key: str) -> Any:
    return query.get(key) if isinstance(query, Mapping) else None


def _input_tensor(values: Sequence[Any], spec: tf.TensorSpec) -> tf.Tensor:
    """Checked raw values of one input (``Bundle.check_query``) -> a tensor matching ``spec``."""
    if spec.dtype != tf.string:
        return tf.constant([np.nan if v is None else float(v) for v in values], dtype=spec.dtype)
    if spec.shape.rank == 2:
        width = spec.shape[1]
        rows = [[str(v) for v in value][:width] for value in values]
        return tf.constant([row + [""] * (width - len(row)) for row in rows], dtype=tf.string, shape=[len(rows), width])
    return tf.constant(["" if v is None else str(v) for v in values], dtype=tf.string)


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


def recommend(args: argparse.Namespace) -> int:
    """Print one JSON line per query of ``recommend_parser``'s ``args``: its top-k ids, scores and fallback;
    with ``--out``, write them for many users or items to a file (``retrieval.batch_recommend``)."""
    if args.k <= 0:
        raise UserError(f"-k must be a positive number of items, got {args.k}")
    if args.similar and args.include_seen:
        raise UserError("--include-seen applies to --user-id queries; --similar has no user whose items to keep")
    if args.out is not None or args.users is not None:
        from retrieval.batch_recommend import recommend_to_files  # same stage; imports this module

        return recommend_to_files(args)
    for flag, given in (("--overwrite", args.overwrite), ("--block-size", args.block_size is not None)):
        if given:
            raise UserError(f"{flag} applies to --out, which this command was not given")
    bundle = Bundle.load(args.bundle)
    if args.similar:
        similar = bundle.similar_items_batch(args.similar, args.k, [args.exclude] * len(args.similar))
        for item, result in zip(args.similar, similar):
            print(json.dumps({"item_id": item, **asdict(result)}))
        return 0
    queries = [{"user_id": user} for user in args.user_id]
    results = bundle.recommend_batch(
        queries, args.k, [args.exclude] * len(queries), exclude_seen=not args.include_seen
    )
    for query, result in zip(queries, results):
        print(json.dumps({"query": query, **asdict(result)}))
    return 0


@entry_point
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m retrieval.serving`` (``retrieval recommend``): a user error is one line and status 2
    (``retrieval.errors``)."""
    return recommend(recommend_parser().parse_args(argv))

if __name__ == "__main__":
    sys.exit(main())
