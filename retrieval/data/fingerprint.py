"""Fingerprints of the files a data config reads, so a resumed run can tell that its inputs changed.

A run killed mid-training keeps its checkpoints; the same command started
again resumes from them. If an input file was changed in between, the
resumed run would silently train the second half on other data. The job
records ``fingerprint_inputs(config.data)`` beside its checkpoints and
compares it on a resume (``changed_inputs``).

Cost: every byte of every input is read once more at the start of a
checkpointed run, hashed with BLAKE2b in 1 MiB chunks (constant memory).
BLAKE2b runs at roughly 0.3-1 GB/s on one core (275 MiB/s measured on a
busy shared core), so a 1 GB log adds one to four seconds; the files are
usually in the page cache afterwards, which the loader then reads from.
"""

from __future__ import annotations

import glob
import hashlib
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import TypedDict

from retrieval.config import DataConfig
from retrieval.data.movielens import locate_movielens_100k
from retrieval.data.schema import DataError
from retrieval.data.shards import list_shard_files

_CHUNK = 1 << 20  # bytes read per hash update
# The files ``load_movielens_100k`` reads from the ml-100k folder.
_MOVIELENS_FILES = ("u.data", "u.item", "u.user", "u.genre")


class FileFingerprint(TypedDict):
    """One input file: its size, modification time and content hash."""

    size: int  # bytes
    mtime_ns: int  # st_mtime_ns
    blake2b: str  # hex digest (32 bytes) of the whole content


def input_files(data: DataConfig) -> list[Path]:
    """Every file ``load_dataset(data, ...)`` reads, absolute, in a stable order.

    ``synthetic``: none (the config holds the generator's parameters).
    ``movielens-100k``: the four files of the located ml-100k folder, none if
    it cannot be found (the loader then says where it looked). ``files``:
    ``data.clicks``, ``data.test_clicks``, ``data.item_features`` and
    ``data.user_features``; a directory or glob stands for each of its shards
    (as ``streaming.list_shard_files`` lists them). A configured path that does
    not exist is kept, so that its absence is part of the fingerprint.
    """
    if data.source == "synthetic":
        return []
    if data.source == "movielens-100k":
        try:
            folder = locate_movielens_100k(data.movielens_dir)
        except FileNotFoundError:
            return []
        return [folder / name for name in _MOVIELENS_FILES]
    files: list[Path] = []
    for table in (data.clicks, data.test_clicks, data.item_features, data.user_features):
        if table is None:
            continue
        if Path(table.path).is_dir() or glob.has_magic(table.path):
            try:
                files += [Path(file) for file in list_shard_files(table.path)]
            except DataError:  # an empty directory or a pattern matching nothing: the loader says so
                continue
        else:
            files.append(Path(table.path))
    return list(dict.fromkeys(file.absolute() for file in files))


def fingerprint_file(path: str | Path) -> FileFingerprint:
    """Size, mtime and BLAKE2b of ``path``, read in 1 MiB chunks (see the module docstring for the cost)."""
    digest = hashlib.blake2b()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb") as file:
        stat = os.fstat(file.fileno())
        while size := file.readinto(buffer):
            digest.update(view[:size])
    return FileFingerprint(size=stat.st_size, mtime_ns=stat.st_mtime_ns, blake2b=digest.hexdigest())


def fingerprint_inputs(data: DataConfig) -> dict[str, FileFingerprint | None]:
    """``input_files(data)`` as absolute path -> ``fingerprint_file``, or None for a file not there."""
    return {str(path): fingerprint_file(path) if path.is_file() else None for path in input_files(data)}


def changed_inputs(
    before: dict[str, FileFingerprint | None], now: dict[str, FileFingerprint | None]
) -> list[str]:
    """What differs between two ``fingerprint_inputs``, one line per file; empty when the inputs are the same.

    Files are compared by content (size and hash). A file whose modification
    time alone changed (touched, or copied back) holds the same bytes and is
    not a change.
    """
    changes = []
    for path in sorted({*before, *now}):
        old, new = before.get(path), now.get(path)
        if path not in before:
            changes.append(f"{path}: not an input of the unfinished run (a new file or shard)")
        elif path not in now:
            changes.append(f"{path}: an input of the unfinished run, no longer read (removed shard?)")
        elif old is None and new is not None:
            changes.append(f"{path}: created since the unfinished run started")
        elif new is None and old is not None:
            changes.append(f"{path}: no longer there")
        elif old is not None and new is not None and (old["size"], old["blake2b"]) != (new["size"], new["blake2b"]):
            changes.append(
                f"{path}: content changed since the unfinished run started (size {old['size']} -> {new['size']} "
                f"bytes, modified {_time(old['mtime_ns'])} -> {_time(new['mtime_ns'])})"
            )
    return changes


def _time(mtime_ns: int) -> str:
    return datetime.fromtimestamp(mtime_ns / 1e9, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
