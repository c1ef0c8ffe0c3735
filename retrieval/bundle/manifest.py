"""The bundle's manifest.json, typed: what the bundle holds, written last, read first.

``Manifest`` is the one description of the file: every key it may hold, typed, and unknown keys
refused with an error that names them (a misspelt key, or a bundle written by a newer library).
Older manifests are brought to the current shape by one function, ``migrate``, before they are
validated, so every reader sees one shape:

- format 1 (no ``fingerprints``, no ``probe``) did not list ``index.json`` under ``files``;
- the first jobs wrote their training speed (``epoch_seconds``, ``clicks_per_second``) at the top,
  which nothing reads (``metrics.json`` holds the timings now);
- bundles written before ``user_input`` and ``query_history`` were recorded get them from the
  run's config in the manifest, as they were found before.

``format_version`` stays the version the file was written in: format 1 bundles have no
fingerprints or probe to check, and serving says so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from retrieval.bundle.fingerprints import fingerprint_files
from retrieval.common.errors import nearest_name
from retrieval.data import USER
from retrieval.index import INDEX_INFO_FILE

MANIFEST_FILE = "manifest.json"
# 2: the manifest holds fingerprints of the served files and a probe query.
BUNDLE_FORMAT_VERSION = 2
# Format 1 bundles still load (serving warns that their parts cannot be checked against the export).
READABLE_FORMAT_VERSIONS = (1, 2)
# Top-level keys of the first jobs that no reader uses: ``migrate`` drops them.
RETIRED_KEYS = ("epoch_seconds", "clicks_per_second")


class ManifestError(ValueError):
    """A manifest.json that is not one this library reads; the message names the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputSpec(_Strict):
    """One raw input of a serving signature: dtype and shape (None = any size; "" pads lists)."""

    dtype: str
    shape: list[int | None]


class QueryHistory(_Strict):
    """How a client lays out the query tower's history input (towers reading a click history only)."""

    input: str
    length: int | None = None
    pooling: str | None = None
    order: str | None = None


class Parent(_Strict):
    """The bundle this one was derived from, and how: its lineage across updates.

    ``change`` names the update: ``"warm_start"`` (trained on from the parent's weights),
    ``"catalogue_add"``, ``"catalogue_remove"``, ``"catalogue_update"`` (the parent's models, the
    catalogue edited). ``created_at`` is the parent manifest's, so a chain of updates reads in order.
    """

    directory: str
    run: str | None = None
    created_at: str | None = None
    change: str


class Manifest(_Strict):
    """manifest.json: every key a bundle's manifest holds (``migrate`` brings older ones to this shape).

    The part records (``seen_items``, ``user_features``, ``user_histories``, ``item_features``) are
    each part's ``info()``, which its loader compares with what it read; ``index`` is the index's
    ``info()``; ``config`` the run's resolved config as a dict (``Config.from_dict`` reads it).
    """

    format_version: int
    created_at: str | None = None
    # The SavedModels' TensorFlow Serving version (their folder under models/<name>/); None: older layout.
    model_version: int | None = None
    versions: dict[str, str] = {}
    # The git commit of the code that wrote the bundle ("<sha>-dirty" with uncommitted changes); None
    # when it ran from an installed package, not a checkout, or from before this was recorded.
    source_commit: str | None = None
    run: str | None = None
    config: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    derived: dict[str, Any] | None = None
    reindexed_from: dict[str, Any] | None = None
    # The bundle this one updates (a warm start, a catalogue edit); None for a bundle trained from scratch.
    parent: Parent | None = None
    # Most popular first: what an unknown query gets.
    popular_item_ids: list[str] = []
    embedding_dim: int | None = None
    metric: str = "inner_product"
    # Unit-norm item vectors: inner product is cosine similarity.
    normalized: bool | None = None
    num_items: int | None = None
    index: dict[str, Any] | None = None
    query_features: list[str]
    doc_features: list[str]
    # dtype and shape of each raw input of the serving signatures ("" pads lists, NaN = missing number).
    query_inputs: dict[str, InputSpec] | None = None
    doc_inputs: dict[str, InputSpec] | None = None
    # The query key holding the user id (its training items are excluded, its features and history filled in).
    user_input: str = USER
    query_history: QueryHistory | None = None
    # Manifest key -> path inside the bundle of every served file or folder.
    files: dict[str, str]
    fingerprints: dict[str, Any] | None = None
    probe: dict[str, Any] | None = None
    query_norms: dict[str, Any] | None = None
    seen_items: dict[str, Any] | None = None
    user_features: dict[str, Any] | None = None
    user_histories: dict[str, Any] | None = None
    item_features: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, raw: Any, source: str = MANIFEST_FILE) -> Manifest:
        """Migrate (``migrate``) and validate a parsed manifest.json.

        Raises:
          ManifestError naming ``source`` and the key: an unknown key (with the nearest known one),
            a value of the wrong type, a missing key, or a format version this library does not read.
        """
        try:
            return cls.model_validate(migrate(raw, source))
        except ValidationError as error:
            raise ManifestError(f"{source}: {_describe(error)}") from None

    def to_dict(self) -> dict[str, Any]:
        """The manifest as JSON values (keys without a value left out), as manifest.json holds it."""
        return self.model_dump(mode="json", exclude_none=True)

    @property
    def history_input(self) -> str | None:
        """The query input holding the click history; None when the query tower reads none."""
        history = self.query_history
        return history.input if history is not None and history.input in self.query_features else None


def migrate(raw: Any, source: str = MANIFEST_FILE) -> dict[str, Any]:
    """A parsed manifest.json of any readable format version, in the current shape (a new dict).

    Raises:
      ManifestError: not an object, or a format version outside ``READABLE_FORMAT_VERSIONS``.
    """
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or version not in READABLE_FORMAT_VERSIONS or isinstance(version, bool):
        raise ManifestError(f"{source}: bundle format {version!r}, this library reads {list(READABLE_FORMAT_VERSIONS)}")
    manifest = {key: value for key, value in raw.items() if key not in RETIRED_KEYS}
    if version == 1 and isinstance(manifest.get("files"), dict):
        manifest["files"] = {**manifest["files"]}
        manifest["files"].setdefault("index_info", INDEX_INFO_FILE)
    query_tower = _query_tower_config(manifest.get("config"))
    if "user_input" not in manifest:
        manifest["user_input"] = user_input_of(query_tower)
    if "query_history" not in manifest:
        history = query_history_of(query_tower)
        if history is not None:
            manifest["query_history"] = history
    return manifest


def _query_tower_config(config: Any) -> Mapping[str, Any]:
    towers = config.get("towers") if isinstance(config, Mapping) else None
    query = towers.get("query") if isinstance(towers, Mapping) else None
    return query if isinstance(query, Mapping) else {}


def user_input_of(query_tower: Mapping[str, Any]) -> str:
    """The query key of the user id: the query tower's id feature read from the click log's user_id
    column, else ``user_id`` (which ``TowerTables.queries`` always sets)."""
    for feature in query_tower.get("features") or ():
        if isinstance(feature, Mapping) and feature.get("kind") == "id" \
                and (feature.get("source") or feature.get("name")) == USER:
            return str(feature["name"])
    return USER


def query_history_of(query_tower: Mapping[str, Any]) -> dict[str, Any] | None:
    """How a client lays out the query tower's history input (``towers.query.history``); None without one."""
    history = query_tower.get("history")
    if not isinstance(history, Mapping) or history.get("name") is None:
        return None
    pooling = history.get("pooling")
    return {
        "input": str(history["name"]), "length": history.get("length"), "pooling": pooling,
        "order": "most recent first; \"\" pads the end; a longer history keeps its most recent items; items "
                 "unknown to training are " + ("skipped" if pooling == "transformer" else "the OOV row"),
    }


def _describe(error: ValidationError) -> str:
    """Each problem of a validation error as ``key: what is wrong`` (an unknown key with the nearest known one)."""
    problems = []
    for problem in error.errors():
        where = ".".join(str(part) for part in problem["loc"]) or "manifest"
        if problem["type"] == "extra_forbidden":
            known = _known_keys(problem["loc"][:-1])
            near = nearest_name(problem["loc"][-1], known)
            problems.append(f"{where}: unknown key" + (f"; did you mean {near}?" if near else
                                                       f" (the keys are {', '.join(sorted(known))})"))
        else:
            problems.append(f"{where}: {problem['msg']}")
    return "; ".join(problems)


# Keys whose values are models of their own: an unknown key under them is named with that model's keys.
_NESTED: dict[str, type[BaseModel]] = {
    "query_inputs": InputSpec, "doc_inputs": InputSpec, "query_history": QueryHistory,
}


def _known_keys(parent: tuple[Any, ...]) -> list[str]:
    """The keys of the model an unknown key at ``parent`` (its path) sits in."""
    return list((_NESTED.get(str(parent[0]), Manifest) if parent else Manifest).model_fields)


def write_manifest(directory: str | Path, manifest: Manifest) -> Manifest:
    """Write ``manifest`` (with ``fingerprints`` of the files under its ``files``) to manifest.json; return it.

    Call it after every served file is in place: the fingerprints are taken now. Only the writer
    (``retrieval.bundle.writer``) calls it.
    """
    directory = Path(directory)
    manifest = manifest.model_copy(update={"fingerprints": fingerprint_files(directory, manifest.files)})
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest.to_dict(), indent=2, default=str))
    return manifest


def read_manifest(directory: str | Path) -> Manifest:
    """The bundle's manifest.json, migrated and validated (``Manifest.from_dict``).

    Raises:
      FileNotFoundError: ``directory`` holds no manifest.json.
      ManifestError: one this library does not read (names the key); json.JSONDecodeError: not JSON.
    """
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a bundle: {MANIFEST_FILE} is missing")
    return Manifest.from_dict(json.loads(path.read_text()), source=str(path))
