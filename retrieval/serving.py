"""Serve top-k for raw queries from an exported bundle.

Loads the query SavedModel with plain ``tf.saved_model.load`` (no project
code needed to run it), the FAISS index and the row -> item-id map::

    bundle = Bundle.load("artifacts/my-run")
    bundle.recommend({"user_id": "196"}, k=10, exclude_item_ids=["242"])

or from a shell::

    python -m retrieval.serving --bundle artifacts/my-run --user-id 196 -k 10

Over HTTP, ``retrieval serve --bundle artifacts/my-run`` (``retrieval/service.py``).
"""

from __future__ import annotations

import argparse
import json
import reprlib
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from retrieval.errors import UserError, entry_point
from retrieval.export import read_manifest
from retrieval.index import ItemIndex


class BundleError(UserError, ValueError):
    """A bundle that cannot be served: one line naming the directory, the part and why.

    The message never quotes file contents (FAISS and TensorFlow errors echo
    bytes of the file they failed on), so it is safe to print or send back.
    """



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
    item ids, or parts that do not fit together.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.loaded_at = time.time()
        with _part(self.directory, "manifest.json"):
            self.manifest = read_manifest(self.directory)
            self.query_features: list[str] = [str(f) for f in self.manifest["query_features"]]
            query_model = str(self.manifest["files"]["query_model"])
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
        self._id_array = np.array([str(item) for item in self.index.item_ids], dtype=object)
        self._row_of = {item: row for row, item in enumerate(self.index.item_ids)}
        self._popular_rows = np.array(
            [self._row_of[item] for item in self.manifest.get("popular_item_ids", []) if item in self._row_of],
            dtype=np.int64,
        )

    @classmethod
    def load(cls, directory: str | Path) -> Bundle:
        return cls(directory)

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
            "num_popular_items": int(len(self._popular_rows)),
            "versions": self.manifest.get("versions", {}),
        }

    def check_query(self, query: Any, position: int = 0) -> None:
        """Raise ValueError naming the problem unless ``query`` has every query feature in its type.

        String inputs take a string or int (None: missing, sent as ""); number
        inputs an int, a float or None (missing, NaN); list inputs (e.g. a click
        history) a list of strings or ints, truncated or padded to the signature's width.
        """
        if not isinstance(query, Mapping):
            raise ValueError(f"query {position} must be an object of features, got {type(query).__name__}")
        for feature in self.query_features:
            if feature not in query:
                raise ValueError(
                    f"query {position} lacks the feature {feature!r} (this bundle reads {self.query_features})"
                )
            value, spec = query[feature], self._input_specs[feature]
            if spec.dtype != tf.string:
                if isinstance(value, bool) or not (value is None or isinstance(value, (int, float))):
                    raise ValueError(
                        f"query {position} feature {feature!r} must be a number or null, got {_short(value)}"
                    )
            elif spec.shape.rank == 2:
                if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or any(
                    isinstance(v, bool) or not isinstance(v, (str, int)) for v in value
                ):
                    raise ValueError(
                        f"query {position} feature {feature!r} must be a list of strings or integers, "
                        f"got {_short(value)}"
                    )
            elif value is None and len(self.query_features) > 1:
                continue  # a missing feature of a feature tower; an ID tower's only id must be given
            elif isinstance(value, bool) or not isinstance(value, (str, int)):
                raise ValueError(
                    f"query {position} feature {feature!r} must be a string or integer, got {_short(value)}"
                )

    def embed(self, queries: Sequence[Mapping[str, Any]]) -> np.ndarray:
        """Raw query features -> [num_queries, dim] float32 embeddings."""
        return self._embed_checked(queries)[0]

    def _embed_checked(self, queries: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        """(embeddings [n, dim], known_ids bool [n]: every id feature in the training vocabulary)."""
        for position, query in enumerate(queries):
            self.check_query(query, position)
        inputs = {
            feature: _input_tensor([query[feature] for query in queries], self._input_specs[feature])
            for feature in self.query_features
        }
        outputs = self._embed(**inputs)
        known = outputs["known_ids"].numpy() if self._reports_known_ids else np.ones(len(queries), dtype=bool)
        return outputs["embedding"].numpy(), known

    def recommend(
        self, query: Mapping[str, Any], k: int = 10, exclude_item_ids: Sequence[str] = ()
    ) -> Recommendations:
        """Top-k item ids for one raw query, never returning ``exclude_item_ids``."""
        return self.recommend_batch([query], k, [exclude_item_ids])[0]

    def recommend_batch(
        self,
        queries: Sequence[Mapping[str, Any]],
        k: int = 10,
        exclude_item_ids: Sequence[Sequence[str]] | None = None,
    ) -> list[Recommendations]:
        """Top-k for a batch of raw queries (one FAISS search for all)."""
        if not queries:
            return []
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        if exclude_item_ids is not None and len(exclude_item_ids) != len(queries):
            raise ValueError(f"exclude_item_ids has {len(exclude_item_ids)} lists for {len(queries)} queries")
        embeddings, known_ids = self.embed_with_known(queries)
        return self.recommend_embedded(embeddings, known_ids, k, exclude_item_ids)

    def embed_with_known(self, queries: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
        """Checked raw queries -> (embeddings [n, dim] float32, known_ids bool [n]) for recommend_embedded."""
        return self._embed_checked(queries)

    def recommend_embedded(
        self,
        embeddings: np.ndarray,
        known_ids: np.ndarray,
        k: int = 10,
        exclude_item_ids: Sequence[Sequence[str]] | None = None,
    ) -> list[Recommendations]:
        """Top-k for query embeddings [n, dim] and known_ids [n] from ``embed_with_known`` (one FAISS search).

        ``recommend_batch`` is embed_with_known + this; a caller answering a large batch embeds it
        once and searches it in slices.
        """
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        if exclude_item_ids is not None and len(exclude_item_ids) != len(embeddings):
            raise ValueError(f"exclude_item_ids has {len(exclude_item_ids)} lists for {len(embeddings)} queries")
        exclude = [
            np.array([self._row_of[i] for i in items if i in self._row_of], dtype=np.int64)
            for items in (exclude_item_ids or [()] * len(embeddings))
        ]
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
                fallback = None if known_ids[i] else "features"
                results.append(Recommendations(self._ids(rows), top.scores[i][: len(rows)].tolist(), fallback))
        return results

    def _ids(self, rows) -> list[str]:
        return self._id_array[np.asarray(rows, dtype=np.int64)].tolist()


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
    return f"missing, truncated or corrupt ({type(error).__name__})"


def _input_tensor(values: Sequence[Any], spec: tf.TensorSpec) -> tf.Tensor:
    """Checked raw values of one input (``Bundle.check_query``) -> a tensor matching ``spec``."""
    if spec.dtype != tf.string:
        return tf.constant([np.nan if v is None else float(v) for v in values], dtype=spec.dtype)
    if spec.shape.rank == 2:
        width = spec.shape[1]
        rows = [[str(v) for v in value][:width] for value in values]
        return tf.constant([row + [""] * (width - len(row)) for row in rows], dtype=tf.string, shape=[len(rows), width])
    return tf.constant(["" if v is None else str(v) for v in values], dtype=tf.string)


@entry_point
def main(argv: Sequence[str] | None = None) -> None:
    """``python -m retrieval.serving``: a user error is one line and status 2 (``retrieval.errors``)."""
    parser = argparse.ArgumentParser(description="Top-k item ids for a raw query from a bundle.")
    parser.add_argument("--bundle", required=True, help="bundle directory, e.g. artifacts/<run>")
    parser.add_argument("--user-id", required=True, action="append", help="query user id (repeatable)")
    parser.add_argument("-k", type=int, default=10)
    parser.add_argument("--exclude", nargs="*", default=[], help="item ids never to return")
    args = parser.parse_args(argv)
    if args.k <= 0:
        raise UserError(f"-k must be a positive number of items, got {args.k}")
    bundle = Bundle.load(args.bundle)
    queries = [{"user_id": user} for user in args.user_id]
    results = bundle.recommend_batch(queries, args.k, [args.exclude] * len(queries))
    for query, result in zip(queries, results):
        print(json.dumps({"query": query, **asdict(result)}))


if __name__ == "__main__":
    sys.exit(main())
