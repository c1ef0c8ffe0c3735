"""What ties a bundle's files to its manifest: the size and blake2b-256 of every served file.

``fingerprints`` records each file under the manifest's ``files`` by its path relative to the
bundle: size, the blake2b-256 hash of the whole file and, for files over ``FULL_HASH_MAX_BYTES``
(64 MiB), the hash of its first and last ``HEAD_TAIL_BYTES`` (8 MiB) too: a default load checks
those ends (and the size), ``verify="full"`` the whole file (``check_fingerprints``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from retrieval.data.fingerprint import blake2b_hex

# Files up to this size are hashed whole at every load; larger ones by their size and both ends.
FULL_HASH_MAX_BYTES = 64 * 2**20


HEAD_TAIL_BYTES = 8 * 2**20


def served_files(directory: str | Path, files: Mapping[str, Any]) -> dict[str, Path]:
    """Every file under the entries of a manifest's ``files``, by path relative to the bundle (sorted).

    A directory entry is walked recursively (symlinks followed, each one
    checked). Nothing outside the bundle is ever named or opened.

    Raises:
      ValueError naming the entry or file: an entry that is not a relative path,
        a path (``..``, absolute, or a symlink) that resolves outside the bundle,
        a missing entry, or something that is neither a file nor a directory.
    """
    directory = Path(directory)
    root = directory.resolve()
    found: dict[str, Path] = {}
    for key, entry in files.items():
        if not isinstance(entry, str) or not entry:
            raise ValueError(f"manifest.json files.{key} {_bounded(entry)} is not a path")
        if Path(entry).is_absolute():
            raise ValueError(f"manifest.json files.{key} {_bounded(entry)} points outside the bundle: "
                             "every served path must be relative to it")
        name = Path(os.path.normpath(entry)).as_posix()
        path = directory / name
        _check_inside(root, path, f"manifest.json files.{key} {_bounded(entry)}")
        if not path.exists():
            raise ValueError(f"{name}: listed in manifest.json files.{key} but missing")
        _collect(root, path, name, found, visited=set())
    return dict(sorted(found.items()))


def _collect(root: Path, path: Path, name: str, found: dict[str, Path], visited: set[Path]) -> None:
    if path.is_symlink():
        _check_inside(root, path, f"{name} (a symlink)")
    if path.is_file():
        found[name] = path
    elif path.is_dir():
        real = path.resolve()
        if real in visited:
            raise ValueError(f"{name}: a symlink loops back to a directory above it")
        for child in sorted(path.iterdir()):
            _collect(root, child, f"{name}/{child.name}", found, visited | {real})
    else:
        raise ValueError(f"{name}: neither a file nor a directory")


def _check_inside(root: Path, path: Path, what: str) -> None:
    if not path.resolve().is_relative_to(root):
        raise ValueError(f"{what} points outside the bundle: every served path must stay inside it")


def _bounded(value: Any, quote: bool = True) -> str:
    """``value`` for a message, at most 80 characters (a manifest may hold anything)."""
    text = repr(value) if quote or not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


def _digest(path: Path, *, head_tail: int | None = None) -> str:
    """blake2b-256 of the whole file, or of its first and last ``head_tail`` bytes."""
    with open(path, "rb") as handle:
        if head_tail is None:
            return blake2b_hex(handle, digest_size=32)
        digest = hashlib.blake2b(digest_size=32)
        digest.update(handle.read(head_tail))
        handle.seek(max(os.fstat(handle.fileno()).st_size - head_tail, 0))
        digest.update(handle.read(head_tail))
    return digest.hexdigest()


def fingerprint_files(directory: str | Path, files: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's ``fingerprints``: each served file's size and blake2b-256 (``served_files``).

    ``{"algorithm", "head_tail_bytes", "files": {relative path: {"size", "blake2b",
    "quick_check", ["head_tail_blake2b"]}}}``. ``quick_check`` says what a default
    load compares: ``"whole"`` (the full hash) for files up to ``FULL_HASH_MAX_BYTES``,
    ``"head+tail"`` (size and the hash of the first and last ``HEAD_TAIL_BYTES``) above.
    """
    records = {}
    for name, path in served_files(directory, files).items():
        size = path.stat().st_size
        record: dict[str, Any] = {"size": size, "blake2b": _digest(path), "quick_check": "whole"}
        if size > FULL_HASH_MAX_BYTES:
            record.update(quick_check="head+tail", head_tail_blake2b=_digest(path, head_tail=HEAD_TAIL_BYTES))
        records[name] = record
    return {"algorithm": "blake2b-256", "head_tail_bytes": HEAD_TAIL_BYTES, "files": records}


def check_fingerprints(directory: str | Path, manifest: Mapping[str, Any], *, full: bool = False) -> None:
    """Check the files under the manifest's ``files`` against its ``fingerprints``.

    ``full`` hashes every file whole; otherwise files recorded with
    ``quick_check: "head+tail"`` are checked by size and both ends.

    Raises:
      ValueError naming the file: content that differs, a file missing or one
        the fingerprints do not list, or a path outside the bundle (``served_files``).
    """
    record = manifest.get("fingerprints")
    if not isinstance(record, Mapping) or not isinstance(record.get("files"), Mapping):
        raise ValueError("manifest.json has no fingerprints of its files: re-export the bundle")
    expected: Mapping[str, Any] = record["files"]
    found = served_files(directory, manifest["files"])
    for name in expected:
        if name not in found:
            raise ValueError(
                f"{_bounded(name, quote=False)}: in the manifest's fingerprints but missing from the bundle"
            )
    for name, path in found.items():
        if name not in expected:
            raise ValueError(f"{name}: in the bundle's served files but not in the manifest's fingerprints")
        want = expected[name]
        size = path.stat().st_size
        if size != want["size"]:
            same = False
        elif full or want.get("quick_check") != "head+tail":
            same = _digest(path) == want["blake2b"]
        else:
            same = _digest(path, head_tail=int(record["head_tail_bytes"])) == want["head_tail_blake2b"]
        if not same:
            raise ValueError(f"{name}: content differs from the manifest's fingerprint")
