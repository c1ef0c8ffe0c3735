"""Load-time integrity of a bundle: its files, their fingerprints, its parts fitting together, the probe query.

``Bundle`` (``retrieval.serving.bundle``) composes these: before anything is loaded every served file must
match its fingerprint (``check_files``); each optional part is read and checked against the manifest
(``load_seen_items``, ``load_user_features``, ``load_user_histories``, ``load_display_features``); after the
last part is read the files must still be those watched at the start (``served_states``, ``changed_files``:
also what ``/healthz`` asks); and the manifest's probe query must give the items it gave at export
(``probe_problem``). Every failure is a ``BundleError``: one line naming the directory and the part,
never quoting file bytes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import numpy as np

from retrieval.bundle.display_features import DisplayFeatures
from retrieval.bundle.fingerprints import check_fingerprints, served_files
from retrieval.bundle.manifest import MANIFEST_FILE, Manifest, ManifestError
from retrieval.bundle.parts import DisplayFeaturesPart, SeenItemsPart, UserFeaturesPart, UserHistoriesPart
from retrieval.bundle.seen_items import SeenItems
from retrieval.bundle.user_features import UserFeatures
from retrieval.bundle.user_histories import UserHistories
from retrieval.common.errors import UserError
from retrieval.index import INDEX_FILE, INDEX_INFO_FILE, ITEM_IDS_FILE, IndexFilesError, ItemIndex
from retrieval.serving.request_checks import short as _short

log = logging.getLogger("retrieval.serving")

Verify = Literal["quick", "full"]
# Scores of the probe query equal those at export within this (absolute and relative); ids may reorder in ties.
PROBE_TOLERANCE = 1e-5
# Bytes hashed at each end of every bundle file when /healthz checks that the files are those loaded.
WATCH_BYTES = 64 * 1024
# A served file's state (``file_state``): size, mtime in ns, inode, blake2b of both ends.
FileState = tuple[int, int, int, str]


class BundleError(UserError, ValueError):
    """A bundle that cannot be served: one line naming the directory, the part and why.

    The message never quotes file contents (FAISS and TensorFlow errors echo
    bytes of the file they failed on), so it is safe to print or send back.
    """


def served_states(root: Path, files: Mapping[str, Any], missing_ok: bool = False) -> dict[str, FileState | None]:
    """manifest.json and every served file (``served_files`` of the manifest's ``files`` under ``root``) ->
    ``file_state``; None for a file that cannot be read, and {} when the manifest's files cannot be listed
    with ``missing_ok`` (the fingerprint check then says why)."""
    try:
        found = served_files(root, files)
    except Exception:
        if missing_ok:
            return {}
        raise
    found[MANIFEST_FILE] = root / MANIFEST_FILE
    states: dict[str, FileState | None] = {}
    for name, path in found.items():
        try:
            states[name] = file_state(path)
        except OSError:
            states[name] = None
    return states


def changed_files(watched: Mapping[str, FileState | None], root: Path, files: Mapping[str, Any]) -> list[str]:
    """The files of ``watched`` (``served_states`` when loaded) that differ on disk now (sorted; empty when
    none): see ``Bundle.changed_files``."""
    try:
        now = served_states(root, files)
    except Exception:  # the manifest's files can no longer be listed (a part deleted or replaced)
        return sorted(watched) or [MANIFEST_FILE]
    names = set(watched) | set(now)
    return sorted(name for name in names if watched.get(name) is None or watched.get(name) != now.get(name))


def check_files(directory: Path, manifest_model: Manifest, manifest: Mapping[str, Any], verify: Verify) -> None:
    """Paths inside the bundle, and (format 2) every served file equal to its fingerprint."""
    files = manifest_model.files
    try:
        if manifest_model.format_version == 1:
            served_files(directory, files)
            log.warning(
                "%s: bundle format 1 has no fingerprints or probe query, so its parts cannot be checked "
                "against the export; re-export it (python -m pipelines.export) to get these checks",
                directory,
            )
            return
        check_fingerprints(directory, manifest, full=verify == "full")
    except ValueError as error:  # names the file and what is wrong with it
        raise BundleError(f"{directory}: {error}") from None
    except Exception as error:  # an unreadable file, or a fingerprint record of the wrong shape
        raise BundleError(f"{directory}: the files cannot be checked: {reason(error)}") from None
    unlisted = [name for name in (INDEX_FILE, ITEM_IDS_FILE, INDEX_INFO_FILE)
                if name not in manifest["fingerprints"]["files"]]
    if unlisted:
        raise BundleError(
            f"{directory}: manifest.json files does not list {unlisted}, which the index is loaded from, "
            "so they are not checked: re-export the bundle"
        )


def probe_problem(manifest: Mapping[str, Any], embed: Callable[[list[Any]], np.ndarray], index: ItemIndex,
                  ids: Callable[[np.ndarray], list[str]]) -> str | None:
    """Why the manifest's probe query fails through ``embed`` (raw queries -> [n, dim]) and ``index``
    (``ids``: rows -> item ids), or None when it passes or there is none (no server paths: /healthz sends it)."""
    probe = manifest.get("probe")
    if not probe:
        return None
    who = "query"
    try:
        query = probe["query"]
        who = f"user {_short(query.get('user_id'))}" if "user_id" in query else f"query {_short(query)}"
        top = index.search(embed([query]), int(probe["k"]))
        rows = top.rows[0][top.rows[0] >= 0]
        same = same_top_k(list(probe["item_ids"]), list(probe["scores"]), ids(rows), top.scores[0][: len(rows)])
    except Exception as error:
        return f"probe query for {who} cannot be run: {error if isinstance(error, ValueError) else reason(error)}"
    if not same:
        return (f"probe query for {who} returned other items than at export: "
                "the bundle's parts do not belong together")
    return None


def _read_checked(directory: Path, manifest_model: Manifest, part_class: Any, what: str, recorded: Any,
                  *, always_recorded: bool = False) -> Any:
    """One optional bundle part read as ``part_class.read`` does (None where the bundle has none), any
    failure a BundleError naming the part, and its info checked against what the manifest recorded
    (skipped for an older manifest that recorded nothing, unless ``always_recorded``)."""
    name = manifest_model.files.get(part_class.KEY)
    with part(directory, f"{what} {str(name)!r}"):
        value = part_class.read(directory, manifest_model)
    if value is not None and (recorded is not None or always_recorded) and recorded != value.info():
        raise BundleError(f"{directory}: {what} hold {value.info()} ({str(name)!r}), the manifest says "
                          f"{_short(recorded)}")
    return value


def load_seen_items(directory: Path, manifest_model: Manifest, num_rows: int) -> SeenItems | None:
    """The training users' items (``seen_items/``); None for a bundle exported without them.
    ``num_rows``: the index's rows, which every seen item must name."""
    seen = _read_checked(directory, manifest_model, SeenItemsPart, "seen items", manifest_model.seen_items)
    if seen is not None and seen.num_pairs and not 0 <= seen.item_rows.min() <= seen.item_rows.max() < num_rows:
        raise BundleError(f"{directory}: seen items name index rows outside the {num_rows} rows of "
                          "index.faiss: the bundle's parts do not belong together")
    return seen


def load_user_features(directory: Path, manifest_model: Manifest, query_features: Sequence[str]) -> UserFeatures | None:
    """The known users' raw query features (``user_features.parquet``); None for a bundle without them."""
    table = _read_checked(directory, manifest_model, UserFeaturesPart, "user features", manifest_model.user_features)
    strangers = [] if table is None else [feature for feature in table.features if feature not in query_features]
    if strangers:
        raise BundleError(f"{directory}: {manifest_model.files.get(UserFeaturesPart.KEY)} holds {strangers}, "
                          f"which are not query features of this bundle ({list(query_features)})")
    return table


def load_user_histories(directory: Path, manifest_model: Manifest, num_rows: int) -> UserHistories | None:
    """The training users' recent clicks, newest first (``user_histories/``); None for a bundle
    without them (one whose query tower reads no history, or exported before they were stored)."""
    histories = _read_checked(directory, manifest_model, UserHistoriesPart, "user histories",
                              manifest_model.user_histories, always_recorded=True)
    if histories is None:
        return None
    if manifest_model.history_input is None:
        raise BundleError(f"{directory}: it stores user histories but its query tower reads no history")
    if histories.num_clicks and int(histories.item_rows.max()) >= num_rows:
        raise BundleError(f"{directory}: user histories name index rows past its {num_rows} items")
    return histories


def load_display_features(directory: Path, manifest_model: Manifest) -> DisplayFeatures | None:
    """The catalogue's display features (``item_features.parquet``); None for a bundle without them."""
    return _read_checked(directory, manifest_model, DisplayFeaturesPart, "item features", manifest_model.item_features)


def same_top_k(expected_ids: Sequence[str], expected_scores: Sequence[float], ids: Sequence[str],
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


def same_files(old: Mapping[str, Any], new: Mapping[str, Any], folder: str) -> bool:
    """Whether two manifests fingerprint the same files, all alike, under ``folder`` (a SavedModel's)."""
    def under(manifest: Mapping[str, Any]) -> dict[str, Any]:
        files = (manifest.get("fingerprints") or {}).get("files") or {}
        return {name: record for name, record in files.items() if name.startswith(f"{folder}/")}

    found = under(new)
    return bool(found) and found == under(old)


def file_state(path: Path) -> tuple[int, int, int, str]:
    """(size, mtime in ns, inode, blake2b-128 of the first and last ``WATCH_BYTES``) of ``path``: cheap
    enough for every ``/healthz``, and it changes with an edit in place, a copy or a move over the file."""
    with open(path, "rb") as handle:
        stat = os.fstat(handle.fileno())
        digest = hashlib.blake2b(handle.read(WATCH_BYTES), digest_size=16)
        if stat.st_size > WATCH_BYTES:
            handle.seek(max(stat.st_size - WATCH_BYTES, WATCH_BYTES))
            digest.update(handle.read(WATCH_BYTES))
    return stat.st_size, stat.st_mtime_ns, stat.st_ino, digest.hexdigest()


@contextmanager
def part(directory: Path, what: str) -> Iterator[None]:
    """Any failure while loading one part of a bundle -> BundleError naming the directory and the part."""
    try:
        yield
    except BundleError:
        raise
    except Exception as error:
        raise BundleError(f"{directory}: {what} cannot be loaded: {reason(error)}") from error


def reason(error: Exception) -> str:
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
    if isinstance(error, ManifestError):
        return str(error).split(": ", 1)[-1]  # read_manifest's message names the key (or the format version)
    if isinstance(error, IndexFilesError):
        return str(error)  # names the file and the rows, never its bytes
    return f"missing, truncated or corrupt ({type(error).__name__})"
