"""Catalogue edits without retraining: add, remove or update items of an exported bundle.

An edit writes a new bundle, whole, from the source bundle (``edit_catalogue``); the source is never
changed. Its models are the source's (the SavedModels are hard-linked, same paths and TensorFlow
Serving version, as is every other file the edit does not change), its index the source's with the
edit applied, and its manifest gets fresh fingerprints, a probe recorded through the new index and
``parent`` = the source with the change (``catalogue_add``, ``catalogue_remove``, ``catalogue_update``).

- **add**: each new item is embedded from its raw doc features through the bundle's own doc
  SavedModel (the model that embedded the catalogue at export, its normalisation included) and
  appended to the index: new rows at the end, so the rows the seen items and user histories name
  keep their items. A doc tower that reads only ``item_id`` cannot embed an id it never saw (it
  maps to the out-of-vocabulary row): such a bundle takes new items only with an ``embedding``
  column ([dim] numbers each, L2-normalised when the index is), and refuses them without one,
  naming the items. An id already served is refused (update changes it); an id removed earlier
  is brought back (its row gets the new vector).
- **remove**: the items stay in the index under their rows and are listed in the manifest's
  ``disabled_item_ids``; serving excludes them from every answer (recommendations, similar items,
  the popular fallback) through the exclusion path it already has. Renumbering instead would
  rewrite every user's seen items and histories, and the histories are query-tower inputs: a
  user's embedding would change because an item sold out.
- **update**: display features of existing items (``item_features.parquet``, the columns given);
  with every doc input given (a feature doc tower), their vectors are re-embedded in place; an ID-only
  bundle takes an ``embedding`` column instead.

The topk SavedModel, when the source has one, holds the catalogue's embeddings and popular list
inside the graph: an edited bundle leaves it out (``models.config`` lists the query and doc
models); re-export the run for one. ``metrics`` are left out too: they measured the source's
catalogue.

Versions (``publish_edit``): a bundle directory ``B`` served and edited in place of a retrain keeps
its versions beside it, ``B.catalogue/<B>.v0001``, ``...v0002``, and a symlink
``B.catalogue/current`` to the newest, swapped atomically (``os.replace``). ``current_version(B)``
follows it (``B`` itself before the first edit): the HTTP service opens it, so a restart with
``--bundle B`` serves the edited catalogue, and each edit starts from it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import faiss
import numpy as np
import pandas as pd
import pyarrow as pa
import tensorflow as tf

from retrieval.bundle.display_features import DisplayFeatures
from retrieval.bundle.fingerprints import check_fingerprints
from retrieval.bundle.manifest import InputSpec, Manifest, read_manifest
from retrieval.bundle.parts import BundlePart, DisplayFeaturesPart, IndexPart
from retrieval.bundle.run_directory import atomic_directory
from retrieval.bundle.saved_models import write_tf_serving_config
from retrieval.bundle.seen_items import find_sorted
from retrieval.common.errors import UserError
from retrieval.data import ITEM
from retrieval.index import ItemIndex
from retrieval.index.item_index import NORM_TOLERANCE

Change = Literal["add", "remove", "update"]
CHANGES: tuple[Change, ...] = ("add", "remove", "update")
# The column of a supplied item vector: how an ID-only bundle takes a new item.
EMBEDDING_COLUMN = "embedding"
VERSIONS_SUFFIX = ".catalogue"  # B's versions live in B.catalogue/
CURRENT = "current"  # B.catalogue/current -> the newest version
EMBED_BATCH = 8192  # items one doc-model call embeds
_VERSION = re.compile(r"\.v(\d+)$")
# manifest files entries an edit writes itself (the index) or leaves out (the topk model).
_INDEX_ENTRIES = ("index", "index_info", "item_ids")
# Parts written fresh by some edits are linked when unchanged; the config files are small and copied.
_COPIED = ("tf_serving_config",)
_NAMED = 10  # ids an error names before "and N more"


class CatalogueError(UserError, ValueError):
    """A catalogue edit that cannot be applied: the message names the items, the column or the file."""


@dataclass
class CatalogueModels:
    """What an edit runs: the doc SavedModel's serving function (raw inputs -> ``{"embedding"}``) and
    a function giving a raw query's [1, dim] embedding (to record the probe through the new index).

    ``load`` reads both from a bundle; a running service passes its loaded ones instead, so an edit
    loads no SavedModel.
    """

    embed_items: Callable[..., Mapping[str, tf.Tensor]]
    embed_query: Callable[[Mapping[str, Any]], np.ndarray]

    @classmethod
    def load(cls, directory: str | Path, manifest: Manifest | None = None) -> CatalogueModels:
        directory = Path(directory)
        manifest = read_manifest(directory) if manifest is None else manifest
        doc = tf.saved_model.load(str(directory / manifest.files["doc_model"])).signatures["serving_default"]
        query = tf.saved_model.load(str(directory / manifest.files["query_model"])).signatures["serving_default"]
        specs = manifest.query_inputs or {}

        def embed_query(raw: Mapping[str, Any]) -> np.ndarray:
            inputs = {name: input_tensor([raw.get(name)], specs[name], name) for name in manifest.query_features}
            return query(**inputs)["embedding"].numpy()

        return cls(doc, embed_query)


def read_items(path: str | Path) -> pd.DataFrame:
    """An items file as a frame: CSV (``.csv``), Parquet (``.parquet``) or JSON lines (``.jsonl``,
    ``.json``: one object a line); ``item_id`` read as strings.

    Raises:
      CatalogueError: a missing file, another suffix, a JSON line that is not an object (naming it).
    """
    path = Path(path)
    if not path.is_file():
        raise CatalogueError(f"--items {path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        frame = pd.read_csv(path, dtype={ITEM: str}, keep_default_na=True)
    elif suffix == ".parquet":
        frame = pd.read_parquet(path)
    elif suffix in (".jsonl", ".json"):
        records = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise CatalogueError(f"{path} line {number}: not JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise CatalogueError(f"{path} line {number}: an item must be a JSON object, got "
                                     f"{type(record).__name__}")
            records.append(record)
        frame = pd.DataFrame.from_records(records)
    else:
        raise CatalogueError(f"--items {path}: read .csv, .parquet or .jsonl (JSON lines), got {suffix or 'none'}")
    return frame


def edit_catalogue(
    source: str | Path,
    change: Change,
    items: pd.DataFrame,
    out: str | Path,
    *,
    overwrite: bool = False,
    run: str | None = None,
    models: CatalogueModels | None = None,
    loaded: tuple[ItemIndex, DisplayFeatures | None] | None = None,
) -> Manifest:
    """Write the bundle ``source`` with ``change`` applied to ``items`` into ``out``; return its manifest.

    ``out`` is written whole under a scratch name and renamed into place (``atomic_directory``): a
    crash leaves no half bundle, and ``source`` is never touched. See the module docstring for what
    each change does.

    Args:
      source: the bundle to edit (its files are checked against its fingerprints first).
      change: "add", "remove" or "update".
      items: [n] rows, an ``item_id`` column of distinct ids. add: every doc-model input
        (the manifest's ``doc_features``; ``embedding`` instead for an ID-only doc tower), and any
        display feature (``item_features.parquet``'s columns). remove: ``item_id`` only. update:
        display features and/or every doc input (or ``embedding``).
      out: the new bundle's directory; ``overwrite`` replaces a bundle there.
      run: the new manifest's ``run`` (default: ``out``'s name).
      models: the loaded doc and query models (default: loaded from ``source``).
      loaded: ``source``'s index and display table as already loaded (a running service's, which
        checked every file against the fingerprints at load and sees a file changed since:
        ``Bundle.changed_files``), else read from ``source`` after that check; neither is changed.

    Raises:
      CatalogueError: naming the items (unknown, duplicate, already served, removed), the columns
        (missing, unknown) or the values that cannot be read.
    """
    prepared = prepare_edit(source, change, items, run=run or Path(out).name, models=models, loaded=loaded)
    return write_edit(prepared, out, overwrite=overwrite)


@dataclass(frozen=True)
class PreparedEdit:
    """An edit applied in memory, not yet written (``prepare_edit``): what serving swaps in at once
    and ``write_edit`` persists.

    ``manifest`` is the new version's manifest as served: every key the written one will hold but
    ``fingerprints`` (still the source's) and ``created_at`` (the writer sets both).
    """

    source: Path  # the version the edit starts from
    source_manifest: Manifest
    change: Change
    manifest: Manifest
    index: ItemIndex  # the edited index (the source's object itself when no vector moved)
    display: DisplayFeatures | None  # the edited display table, None when it did not change
    changes: dict[str, Any]  # the caller keys of the new manifest (run, metrics, disabled_item_ids, parent)
    dropped: list[str]  # manifest files entries left out (the topk model)


def prepare_edit(
    source: str | Path,
    change: Change,
    items: pd.DataFrame,
    *,
    run: str,
    models: CatalogueModels | None = None,
    loaded: tuple[ItemIndex, DisplayFeatures | None] | None = None,
    row_of: Mapping[str, int] | None = None,
) -> PreparedEdit:
    """Check ``items`` and apply ``change`` to ``source``'s index and display table in memory; nothing
    is written. ``run`` is the new version's name; ``models`` and ``loaded`` as ``edit_catalogue``
    takes them; ``row_of``: the loaded index's row of each id (a served bundle keeps one), so that
    an edit of a few items looks up a few ids instead of hashing the whole catalogue's. Raises
    CatalogueError naming the items, columns or values it cannot take."""
    # The writer imports tensorflow_recommenders: loaded here, so that a server that only opens
    # versions (current_version) starts without it.
    from retrieval.bundle.writer import probe_record

    if change not in CHANGES:
        raise CatalogueError(f"change must be one of {list(CHANGES)}, got {change!r}")
    source = Path(source)
    manifest = read_manifest(source)
    if loaded is None:  # a loaded bundle's files were checked at its load (and a service watches them)
        try:
            check_fingerprints(source, manifest.to_dict())
        except ValueError as error:
            raise CatalogueError(f"{source}: {error}") from None
    if loaded is not None:
        index, display = loaded
    else:
        index, display = ItemIndex.load(source), None
        if manifest.files.get(DisplayFeaturesPart.KEY) is not None:
            display = DisplayFeatures.load(source / manifest.files[DisplayFeaturesPart.KEY])
    edit = _plan(manifest, index, display, change, items, row_of)
    vectors = None
    if edit.embed is not None:
        models = CatalogueModels.load(source, manifest) if models is None else models
        vectors = _vectors(manifest, index, edit.embed, models)
    new_index = _edited_index(index, edit, vectors)
    probe = manifest.probe
    if probe:
        models = CatalogueModels.load(source, manifest) if models is None else models
        probe = probe_record(probe["query"], models.embed_query(probe["query"]), new_index)
    new_display = _edited_display(display, edit)
    dropped = ["topk_model"] if "topk_model" in manifest.files else []
    changes = {
        "run": run,
        "metrics": None,
        "disabled_item_ids": sorted(edit.disabled) or None,
        "parent": {"directory": str(source.resolve()), "run": manifest.run, "created_at": manifest.created_at,
                   "change": f"catalogue_{change}"},
    }
    records = {**IndexPart(new_index).info(), **(DisplayFeaturesPart(new_display).info() if new_display else {})}
    served = Manifest.from_dict({
        **manifest.to_dict(), **records, "probe": probe, **changes,
        "files": {key: path for key, path in manifest.files.items() if key not in dropped},
    }, source="the edited manifest")
    return PreparedEdit(source, manifest, change, served, new_index, new_display, changes, dropped)


def write_edit(prepared: PreparedEdit, out: str | Path, *, overwrite: bool = False) -> Manifest:
    """Write ``prepared`` as the bundle ``out``, whole, and return its manifest.

    Written under a scratch name, its files checked against the fingerprints just recorded (as
    ``Bundle.load`` checks them: what a restart reads is what was served), then renamed into place
    (``atomic_directory``). Files the edit does not change (the SavedModels, seen items, user
    features and histories, and the display table unless the edit changes it) are hard-linked from
    the source: a version's files are never rewritten in place, so sharing them is safe, and a
    large catalogue is not copied per edit (copied where the file system cannot link).
    """
    from retrieval.bundle.writer import rewrite_bundle

    source, manifest = prepared.source, prepared.source_manifest
    parts: list[BundlePart] = [DisplayFeaturesPart(prepared.display)] if prepared.display is not None else []
    out = Path(out)
    with atomic_directory(out, overwrite=overwrite) as scratch:
        rewritten = {*_INDEX_ENTRIES, *prepared.dropped, *([DisplayFeaturesPart.KEY] if parts else [])}
        for key, relative in manifest.files.items():
            if key in rewritten:
                continue
            _copy(source / relative, scratch / relative, link=key not in _COPIED)
        if prepared.dropped:
            kept = {key: path for key, path in manifest.files.items() if key not in prepared.dropped}
            (scratch / manifest.files["tf_serving_config"]).unlink(missing_ok=True)
            write_tf_serving_config(scratch, kept)
        if (source / "config.yaml").is_file():
            shutil.copy2(source / "config.yaml", scratch / "config.yaml")
        written = rewrite_bundle(scratch, manifest, index=prepared.index, probe=prepared.manifest.probe, parts=parts,
                                 dropped_files=prepared.dropped, changes=prepared.changes)
        try:  # the version is complete and equal to its fingerprints before anyone can open it
            check_fingerprints(scratch, written.to_dict())
        except ValueError as error:
            raise CatalogueError(f"{out}: the written version does not match its fingerprints: {error}") from None
        return written


def current_version(root: str | Path) -> Path:
    """The newest catalogue version of bundle ``root`` (``root.catalogue/current``), else ``root``."""
    root = Path(root)
    pointer = _versions_dir(root) / CURRENT
    return pointer.resolve() if pointer.is_symlink() and pointer.exists() else root


def publish_edit(root: str | Path, change: Change, items: pd.DataFrame, *,
                 models: CatalogueModels | None = None,
                 loaded: tuple[ItemIndex, DisplayFeatures | None] | None = None) -> Path:
    """Apply ``change`` to the newest version of bundle ``root`` as its next version; return its directory.

    The new version is ``root.catalogue/<root>.v<n>`` (n one past the highest there), written by
    ``edit_catalogue`` from ``current_version(root)``; then ``root.catalogue/current`` is pointed at
    it in one ``os.replace`` (a reader sees the old or the new link). Two processes publishing at
    once cannot both take version n: the second fails (``RunExistsError``) and nothing is lost.
    ``models`` and ``loaded`` (of the newest version) as ``edit_catalogue`` takes them.
    """
    root = Path(root)
    source = current_version(root)
    name = next_version(root)
    prepared = prepare_edit(source, change, items, run=name, models=models, loaded=loaded)
    return publish_prepared(root, prepared)


def next_version(root: str | Path) -> str:
    """The name of bundle ``root``'s next catalogue version: ``<root>.v<n>``, n one past the highest."""
    root = Path(root)
    versions = _versions_dir(root)
    numbers = [int(match.group(1)) for path in (versions.iterdir() if versions.is_dir() else ())
               if path.name.startswith(f"{root.name}.v") and (match := _VERSION.search(path.name))]
    return f"{root.name}.v{max(numbers, default=0) + 1:04d}"


def publish_prepared(root: str | Path, prepared: PreparedEdit) -> Path:
    """Write ``prepared`` (an edit of ``current_version(root)``) as ``root.catalogue/<its run>``
    (``write_edit``: complete and checked against its fingerprints), then point
    ``root.catalogue/current`` at it in one ``os.replace``; return its directory."""
    root = Path(root)
    versions = _versions_dir(root)
    versions.mkdir(exist_ok=True)
    name = str(prepared.changes["run"])
    write_edit(prepared, versions / name)
    link = versions / f".{CURRENT}.{os.getpid()}"
    link.unlink(missing_ok=True)
    link.symlink_to(name)
    os.replace(link, versions / CURRENT)
    return versions / name


def _versions_dir(root: Path) -> Path:
    return root.parent / f"{root.name}{VERSIONS_SUFFIX}"


@dataclass
class _Edit:
    """What an edit does to the index and tables (rows are the source index's)."""

    change: Change
    ids: list[str]  # [n] the items of the edit, in the file's order
    embed: pd.DataFrame | None  # the rows to embed (the doc inputs, or an embedding column), or None
    replace_rows: np.ndarray  # [r] existing rows that get new vectors (the first r rows of ``embed``)
    append_ids: list[str]  # [a] new items, appended (the last a rows of ``embed``)
    disabled: set[str]  # the new bundle's removed items
    display: pd.DataFrame | None  # item_id and the display columns given, or None


def _plan(manifest: Manifest, index: ItemIndex, display: DisplayFeatures | None, change: Change,
          items: pd.DataFrame, row_of: Mapping[str, int] | None = None) -> _Edit:
    """Check ``items`` against the bundle and say what the edit does (``_Edit``)."""
    if not isinstance(items, pd.DataFrame):
        raise CatalogueError(f"items must be a table of items, got {type(items).__name__}")
    if ITEM not in items.columns:
        raise CatalogueError(f"the items have no {ITEM!r} column (columns: {[str(c) for c in items.columns]})")
    if not len(items):
        raise CatalogueError("the items are empty: nothing to edit")
    if items[ITEM].isna().any():
        raise CatalogueError(f"{ITEM} is missing in row {int(np.flatnonzero(items[ITEM].isna())[0])} of the items")
    ids = [_text(value) for value in items[ITEM].tolist()]
    repeated = sorted({item for item in ids if ids.count(item) > 1}) if len(set(ids)) < len(ids) else []
    if repeated:
        raise CatalogueError(f"the items repeat {_named(repeated)}: give each item once")
    items = items.assign(**{ITEM: ids}).reset_index(drop=True)
    if row_of is not None:
        rows = np.array([row_of.get(item, -1) for item in ids], dtype=np.int64)
    else:
        rows = pd.Index(index.item_ids.astype(str), dtype=object).get_indexer(pd.Index(ids, dtype=object))
    disabled = set(manifest.disabled_item_ids or ())
    doc_inputs = list(manifest.doc_features)
    id_only = doc_inputs == [ITEM]
    display_features = display.features if display is not None else []
    columns = [str(column) for column in items.columns if column != ITEM]
    if change == "remove":
        if columns:
            raise CatalogueError(f"remove reads only {ITEM!r}; the items also have {columns}")
        unknown = [item for item, row in zip(ids, rows) if row < 0]
        if unknown:
            raise CatalogueError(f"cannot remove {_named(unknown)}: not in the catalogue of {len(index)} items")
        again = [item for item in ids if item in disabled]
        if again:
            raise CatalogueError(f"cannot remove {_named(again)}: already removed")
        left = disabled | set(ids)
        if len(left) >= len(index):
            raise CatalogueError(f"removing {len(ids)} items would leave the catalogue empty: nothing to serve")
        return _Edit(change, ids, None, np.zeros(0, np.int64), [], left, None)
    known = {ITEM, *doc_inputs, *display_features, *([EMBEDDING_COLUMN] if id_only else [])}
    unknown_columns = [column for column in columns if column not in known]
    if unknown_columns:
        what = (f"the doc model's inputs {doc_inputs}" + (f", {EMBEDDING_COLUMN!r} (an ID-only doc tower)"
                                                          if id_only else "")
                + (f" and the display features {display_features}" if display_features else
                   " (the bundle has no display features)"))
        raise CatalogueError(f"the items have columns {unknown_columns} this bundle does not read: it reads {what}")
    given_inputs = [name for name in doc_inputs if name != ITEM and name in columns]
    if id_only:
        embeds = EMBEDDING_COLUMN in columns
    else:
        missing = [name for name in doc_inputs if name != ITEM and name not in columns]
        if given_inputs and missing:
            raise CatalogueError(f"the items lack the doc model's inputs {missing}: it embeds an item from all of "
                                 f"{doc_inputs}, so give every one (or none, to change display features only)")
        embeds = not missing
    if change == "add":
        served = [item for item, row in zip(ids, rows) if row >= 0 and item not in disabled]
        if served:
            raise CatalogueError(f"cannot add {_named(served)}: already in the catalogue (update changes an item)")
        if id_only and not embeds:
            raise CatalogueError(
                f"cannot add {_named(ids)}: this bundle's doc model reads only {ITEM!r}, and an id it never saw "
                f"maps to its out-of-vocabulary row, so it cannot embed a new item; give each item's vector in "
                f"an {EMBEDDING_COLUMN!r} column ({index.dim} numbers), or train a model that knows it")
        if not embeds:
            missing = [name for name in doc_inputs if name != ITEM and name not in columns]
            raise CatalogueError(f"cannot add {_named(ids)}: the items lack the doc model's inputs {missing} "
                                 f"(it embeds an item from {doc_inputs})")
        back = rows >= 0  # removed earlier: brought back under their own rows
        order = np.concatenate([np.flatnonzero(back), np.flatnonzero(~back)])
        return _Edit(change, ids, items.iloc[order].reset_index(drop=True), rows[back].astype(np.int64),
                     [ids[i] for i in np.flatnonzero(~back)], disabled - set(ids), _display_rows(items, display))
    unknown = [item for item, row in zip(ids, rows) if row < 0]
    if unknown:
        raise CatalogueError(f"cannot update {_named(unknown)}: not in the catalogue of {len(index)} items "
                             "(add puts new items in)")
    removed = [item for item in ids if item in disabled]
    if removed:
        raise CatalogueError(f"cannot update {_named(removed)}: removed from the catalogue (add brings one back)")
    if not embeds and not any(column in display_features for column in columns):
        raise CatalogueError("the items change nothing: give display features "
                             f"({display_features or 'the bundle has none'}) or every doc-model input {doc_inputs}")
    return _Edit(change, ids, items if embeds else None, rows.astype(np.int64) if embeds else np.zeros(0, np.int64),
                 [], disabled, _display_rows(items, display))


def _display_rows(items: pd.DataFrame, display: DisplayFeatures | None) -> pd.DataFrame | None:
    """``item_id`` and the display columns ``items`` gives; None when it gives none."""
    columns = [column for column in (display.features if display is not None else []) if column in items.columns]
    return items[[ITEM, *columns]] if columns else None


def _vectors(manifest: Manifest, index: ItemIndex, rows: pd.DataFrame, models: CatalogueModels) -> np.ndarray:
    """[n, dim] float32 vectors of ``rows``: their ``embedding`` column, else the doc model's embedding
    of their raw inputs. Refused (naming the items): a wrong width, NaN or inf, an all-zero vector."""
    ids = rows[ITEM].tolist()
    if EMBEDDING_COLUMN in rows.columns:
        vectors = np.zeros((len(rows), index.dim), np.float32)
        for position, value in enumerate(rows[EMBEDDING_COLUMN].tolist()):
            try:
                vector = np.asarray(value, dtype=np.float32).reshape(-1)
            except (TypeError, ValueError):
                vector = np.zeros(0, np.float32)
            if vector.shape != (index.dim,):
                raise CatalogueError(f"item {ids[position]!r}: {EMBEDDING_COLUMN} must be a list of {index.dim} "
                                     f"numbers (the index's dimension), got {str(value)[:80]}")
            vectors[position] = vector
        if index.normalized:  # the index holds unit vectors: inner product is cosine
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            vectors = np.divide(vectors, norms, out=np.zeros_like(vectors), where=norms > 0)
    else:
        specs = manifest.doc_inputs or {}
        blocks = []
        for start in range(0, len(rows), EMBED_BATCH):
            block = rows.iloc[start:start + EMBED_BATCH]
            inputs = {name: input_tensor(block[name].tolist(), specs[name], name, ids[start:])
                      for name in manifest.doc_features}
            blocks.append(models.embed_items(**inputs)["embedding"].numpy())
        vectors = np.concatenate(blocks).astype(np.float32)
    bad = [ids[i] for i in np.flatnonzero(~np.isfinite(vectors).all(axis=1))]
    if bad:
        raise CatalogueError(f"items {_named(bad)} embed to NaN or inf: a feature value far outside the "
                             "training range")
    zero = [ids[i] for i in np.flatnonzero(~np.any(vectors != 0, axis=1))]
    if zero:
        raise CatalogueError(f"items {_named(zero)} embed to the zero vector (every feature missing, or a zero "
                             "embedding given): no query would ever find them")
    return vectors


def input_tensor(values: Sequence[Any], spec: InputSpec, name: str, ids: Sequence[str] = ()) -> tf.Tensor:
    """Raw values of one SavedModel input (its manifest ``InputSpec``) as the tensor it takes.

    Strings: None / NaN -> "" (missing), 3.0 -> "3"; a list input [batch, W]: a list (or one string)
    truncated or padded with "" to W; numbers: floats, None / NaN missing. A value that is no number
    for a number input is refused, naming the input and the item (``ids``).
    """
    if spec.dtype != "string":
        numbers = []
        for position, value in enumerate(values):
            if value is None or (isinstance(value, float) and np.isnan(value)):
                numbers.append(np.nan)
                continue
            try:
                if isinstance(value, bool):
                    raise ValueError
                numbers.append(float(value))
            except (TypeError, ValueError):
                who = f"item {ids[position]!r}" if position < len(ids) else f"value {position}"
                raise CatalogueError(f"{who}: {name!r} must be a number, got {str(value)[:80]!r}") from None
        return tf.constant(numbers, dtype=spec.dtype)
    if len(spec.shape) == 2:
        width = spec.shape[1]
        rows = []
        for value in values:
            listed = [] if _missing(value) else [value] if isinstance(value, str) else list(value)
            texts = [_text(v) for v in listed if not _missing(v)][: width]
            rows.append(texts + [""] * ((width or len(texts)) - len(texts)))
        return tf.constant(rows, dtype=tf.string, shape=[len(rows), width or max((len(r) for r in rows), default=0)])
    return tf.constant(["" if _missing(value) else _text(value) for value in values], dtype=tf.string)


def _missing(value: Any) -> bool:
    if value is None or value is pd.NA:
        return True
    return isinstance(value, float) and np.isnan(value)


def _text(value: Any) -> str:
    """A raw value as the string a tower reads (3.0 -> "3", as the feature tables write it)."""
    if isinstance(value, float | np.floating) and float(value).is_integer():
        return str(int(value))
    return str(value)


def _edited_index(index: ItemIndex, edit: _Edit, vectors: np.ndarray | None) -> ItemIndex:
    """A new ItemIndex: ``index`` with ``edit.replace_rows`` given new vectors and ``edit.append_ids``
    appended (the rows of ``vectors`` in that order); the same object when the edit moves no vector.

    Appending adds to a copy of the FAISS index (``clone_index``): a trained index (IVF, PQ) keeps
    its training. Replacing reads every vector back (``ItemIndex.vectors``), changes the rows and adds
    them to an emptied copy, so rows keep their numbers. The search parameters and tuning record
    stay the source's.
    """
    if vectors is None:
        return index
    replaced = len(edit.replace_rows)
    faiss_index = faiss.clone_index(index.index)
    if replaced:
        everything = index.vectors(np.arange(len(index)))
        everything[edit.replace_rows] = vectors[:replaced]
        faiss_index.reset()
        faiss_index.add(np.ascontiguousarray(everything))
    if edit.append_ids:
        faiss_index.add(np.ascontiguousarray(vectors[replaced:]))
    norms = np.linalg.norm(vectors, axis=1)
    normalized = index.normalized and bool(np.all(np.abs(norms - 1) <= NORM_TOLERANCE))
    # The appended ids were checked against the index's (``_plan``) and are distinct: not hashed again.
    return ItemIndex(faiss_index, np.concatenate([index.item_ids, np.array(edit.append_ids, dtype=object)]),
                     index.factory, normalized=normalized, search_params=index.search_params, tuning=index.tuning,
                     routing=index.routing, ids_checked=True)


def _edited_display(display: DisplayFeatures | None, edit: _Edit) -> DisplayFeatures | None:
    """The display table with the edit's rows added or changed; None when it does not change.

    A column the edit gives replaces those items' values (an item the table did not describe gets a
    row, missing in the columns not given); every column keeps its Arrow type (numbers stay numbers).
    Only the edit's rows go through Python: the others are filtered, concatenated and sorted as Arrow
    arrays, so an edit of a million-item table costs a sort of its ids.
    """
    if display is None or edit.display is None:
        return None
    given_ids = edit.display[ITEM].tolist()
    positions = find_sorted(display.item_ids, given_ids)
    keep = np.ones(len(display), dtype=bool)
    keep[positions[positions >= 0]] = False
    kept = bool(keep.all())  # an add of new ids keeps every row: no filtering pass
    kept_ids = display.item_ids if kept else display.item_ids[keep]
    ids = np.concatenate([kept_ids, np.array([item.encode("utf-8") for item in given_ids])])
    # Both halves in the concatenation's (widest) bytes dtype: a search never truncates a longer new id.
    order = _merged_order(ids[: len(kept_ids)], ids[len(kept_ids):])
    columns = {}
    for name, column in display.columns.items():
        old = [column[int(row)].as_py() if row >= 0 else None for row in positions.tolist()]
        values = edit.display[name].tolist() if name in edit.display.columns else old
        rows = pa.array([_cell(value, column.type) for value in values], type=column.type)
        columns[name] = pa.concat_arrays([column if kept else column.filter(pa.array(keep)), rows]).take(
            pa.array(order))
    return DisplayFeatures(ids[order], columns)


def _merged_order(sorted_ids: np.ndarray, new_ids: np.ndarray) -> np.ndarray:
    """The order that sorts ``concatenate([sorted_ids, new_ids])`` ([n + m] int64), ``sorted_ids``
    already sorted and no id in both: the new ids are sorted and inserted by binary search, so an
    edit of m items costs O(m log n) comparisons and one O(n) pass, not a sort of the catalogue's ids."""
    n, m = len(sorted_ids), len(new_ids)
    new_order = np.argsort(new_ids, kind="stable")
    # Final position of the i-th smallest new id: the kept ids below it plus the i new ids before it.
    at = np.searchsorted(sorted_ids, new_ids[new_order], side="left") + np.arange(m)
    is_new = np.zeros(n + m, dtype=bool)
    is_new[at] = True
    order = np.empty(n + m, dtype=np.int64)
    order[at] = n + new_order
    order[~is_new] = np.arange(n)
    return order


def _cell(value: Any, kind: pa.DataType) -> Any:
    """A display value (None, NaN or pandas' NA missing) as a value of an Arrow column of type ``kind``."""
    listed = isinstance(value, list | tuple | np.ndarray)
    missing = not listed and bool(pd.isna(value))
    if pa.types.is_list(kind):
        return [] if missing else [str(v) for v in (value if listed else [value]) if str(v) != ""]
    if pa.types.is_floating(kind):
        return float("nan") if missing else float(value)
    if pa.types.is_integer(kind):
        return None if missing else int(value)
    if pa.types.is_string(kind):
        return None if missing else str(value)
    return None if missing else value


def _copy(source: Path, target: Path, *, link: bool) -> None:
    """Copy a served file or folder, hard-linked when ``link`` (a version's files are never rewritten in
    place), copied where the file system cannot link."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, target, copy_function=_link_or_copy if link else shutil.copy2)
    elif link:
        _link_or_copy(str(source), str(target))
    else:
        shutil.copy2(source, target)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _named(ids: Sequence[str]) -> str:
    """``ids`` for a message: the first few quoted, then how many more."""
    shown = ", ".join(repr(item) for item in ids[:_NAMED])
    more = f" and {len(ids) - _NAMED} more" if len(ids) > _NAMED else ""
    return f"item{'s' if len(ids) > 1 else ''} {shown}{more}"

