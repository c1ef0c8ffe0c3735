"""Fingerprints of the files a data config reads: a run must end on the inputs it started on.

A run reads its inputs more than once: out of core, every epoch streams the
click shards again and evaluation reads them once more; in memory, the files
are read at the start and the run directory describes them. A file rewritten,
deleted or moved under a running job would make the run train on other data
and say nothing, so the job (``retrieval.jobs``) takes ``RunInputs`` at its
start, checks them after every epoch of a streamed run (``check_stats``) and
once more, content included, just before the run directory is put in place
(``check_content``); any change fails the run with an ``InputsChangedError``
naming each file and what changed. A killed run's checkpoints record
``fingerprint_inputs(config.data)`` and a resume compares them
(``changed_inputs``).

Cost, per input byte:

* A content hash (``fingerprint_file``) reads every byte once more, hashed
  with BLAKE2b in 1 MiB chunks (constant memory). BLAKE2b runs at roughly
  0.3-1 GB/s on one core (275 MiB/s measured on a busy shared core), so a 1 GB
  log adds one to four seconds; the files are usually in the page cache
  afterwards, which the loader then reads from.
* A checkpointed run (``train.checkpoints``, the default) hashes its inputs
  at the start, as a resume needs, and hashes them again at the end: two more
  reads of the log in all (a 100 GB log: a few minutes each, against the
  epochs that read it anyway). A run without checkpoints records sizes and
  mtimes only and its end check compares them alone: no read at all.
* The check after each epoch is one ``stat`` a file (sizes and mtimes); a file
  whose mtime alone moved is hashed again, when its start hash exists, to
  tell a touch from a rewrite.

A rewrite that keeps size and mtime (a tool copying them back) is seen only by
a content hash: at the end of a checkpointed run, or on a resume.
"""

from __future__ import annotations

import glob
import hashlib
import io
import os
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TypedDict, cast

from retrieval.config import DataConfig
from retrieval.data.movielens import locate_movielens_100k
from retrieval.data.schema import DataError
from retrieval.data.shards import list_shard_files

_CHUNK = 1 << 20  # bytes read per hash update
# The files ``load_movielens_100k`` reads from the ml-100k folder.
_MOVIELENS_FILES = ("u.data", "u.item", "u.user", "u.genre")


class FileStat(TypedDict):
    """One input file's size and modification time (one ``stat``)."""

    size: int  # bytes
    mtime_ns: int  # st_mtime_ns


class FileFingerprint(FileStat):
    """One input file: its size, modification time and content hash."""

    blake2b: str  # hex digest (32 bytes) of the whole content


class InputsChangedError(DataError):
    """An input file changed, went away or appeared while a run was reading its inputs.

    Attributes:
      files: the paths that changed (``file``: the first of them).
    """

    def __init__(self, message: str, files: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.files = list(files)
        self.file = self.files[0] if self.files else None


def input_files(data: DataConfig) -> list[Path]:
    """Every file ``load_dataset(data, ...)`` reads, absolute, in a stable order (``input_roles``' keys)."""
    return list(input_roles(data))


def input_roles(data: DataConfig) -> dict[Path, str]:
    """Every file ``load_dataset(data, ...)`` reads, absolute, in a stable order, with the key naming it.

    The key is what an error calls the file: ``data.clicks`` for a single
    file, ``data.clicks shard`` for one shard of a directory or glob.

    ``synthetic``: none (the config holds the generator's parameters).
    ``movielens-100k``: the four files of the located ml-100k folder, none if
    it cannot be found (the loader then says where it looked). ``files``:
    ``data.clicks``, ``data.test_clicks``, ``data.item_features`` and
    ``data.user_features``; a directory or glob stands for each of its shards
    (as ``streaming.list_shard_files`` lists them). A configured path that does
    not exist is kept, so that its absence is part of the fingerprint.
    """
    if data.source == "synthetic":
        return {}
    if data.source == "movielens-100k":
        try:
            folder = locate_movielens_100k(data.movielens_dir)
        except FileNotFoundError:
            return {}
        return {(folder / name).absolute(): "data.movielens_dir file" for name in _MOVIELENS_FILES}
    roles: dict[Path, str] = {}
    for key in ("clicks", "test_clicks", "item_features", "user_features"):
        table = getattr(data, key)
        if table is None:
            continue
        if Path(table.path).is_dir() or glob.has_magic(table.path):
            try:
                files = list_shard_files(table.path)
            except DataError:  # an empty directory or a pattern matching nothing: the loader says so
                continue
            for file in files:
                roles.setdefault(Path(file).absolute(), f"data.{key} shard")
        else:
            roles.setdefault(Path(table.path).absolute(), f"data.{key}")
    return roles


def fingerprint_file(path: str | Path) -> FileFingerprint:
    """Size, mtime and BLAKE2b of ``path``, read in 1 MiB chunks (see the module docstring for the cost)."""
    with open(path, "rb") as file:
        opened = os.fstat(file.fileno())
        digest = blake2b_hex(file)
    return FileFingerprint(size=opened.st_size, mtime_ns=opened.st_mtime_ns, blake2b=digest)


def blake2b_hex(file: io.BufferedIOBase, digest_size: int = 64) -> str:
    """Hex BLAKE2b of what is left to read in the binary ``file``, read in 1 MiB chunks (constant memory)."""
    digest = hashlib.blake2b(digest_size=digest_size)
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    while size := file.readinto(buffer):
        digest.update(view[:size])
    return digest.hexdigest()


def stat_file(path: str | Path) -> FileStat | None:
    """Size and mtime of ``path`` (one ``stat``), None when it is not a file there."""
    try:
        found = os.stat(path)
    except OSError:  # gone, or a path component replaced: either way not the file the run read
        return None
    if not stat.S_ISREG(found.st_mode):
        return None
    return FileStat(size=found.st_size, mtime_ns=found.st_mtime_ns)


def fingerprint_inputs(data: DataConfig) -> dict[str, FileFingerprint | None]:
    """``input_files(data)`` as absolute path -> ``fingerprint_file``, or None for a file not there."""
    return {str(path): _fingerprint(path) for path in input_files(data)}


def _fingerprint(path: str | Path) -> FileFingerprint | None:
    return fingerprint_file(path) if Path(path).is_file() else None


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


def _time(mtime_ns: int, precise: bool = False) -> str:
    """UTC time of an mtime; ``precise``: to the millisecond (a rewrite within the second still shows)."""
    stamp = datetime.fromtimestamp(mtime_ns / 1e9, timezone.utc)
    return stamp.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC" if precise else stamp.strftime("%Y-%m-%d %H:%M:%S UTC")


@dataclass(frozen=True)
class RunInputs:
    """The input files of one run as it started on them, checked again while it runs.

    ``take`` records them (content hashes only with ``hashed``: see the module
    docstring for the cost); ``check_stats`` and ``check_content`` raise
    ``InputsChangedError`` when a file changed since. Only the files read at the
    start count: a shard added to a directory later is not read by this run.

    Attributes:
      roles: absolute path -> the key naming it (``input_roles``).
      start: path -> its ``FileStat`` at the start (a ``FileFingerprint`` when
        ``hashed``), None for a configured file that was not there.
      hashed: whether ``start`` holds content hashes.
    """

    roles: dict[str, str]
    start: dict[str, FileStat | None]
    hashed: bool
    # path -> an mtime found later with the start's bytes (touched): not hashed again at that mtime
    _touched: dict[str, int] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def take(cls, data: DataConfig, *, hashed: bool) -> RunInputs:
        """The inputs of ``data`` now: sizes and mtimes, and with ``hashed`` every byte hashed."""
        roles = {str(path): role for path, role in input_roles(data).items()}
        read = _fingerprint if hashed else stat_file
        return cls(roles, {path: read(path) for path in roles}, hashed)

    @property
    def fingerprints(self) -> dict[str, FileFingerprint | None] | None:
        """``start`` as ``fingerprint_inputs`` gives it (what a resume compares); None when not ``hashed``."""
        return cast("dict[str, FileFingerprint | None]", self.start) if self.hashed else None

    def check_stats(self) -> None:
        """Raise ``InputsChangedError`` if a file's size or mtime moved since the start, or it went away.

        One ``stat`` a file; a file whose mtime alone moved is hashed again when
        its start hash exists, so a touch with the same bytes is no change.
        """
        self._raise_if(self.changes(content=False))

    def check_content(self) -> None:
        """``check_stats``, and with start hashes every file hashed again (one more read of every byte)."""
        self._raise_if(self.changes(content=self.hashed))

    def after_epoch(self, epoch: int, logs: dict) -> None:
        """``check_stats`` as a training epoch hook (``retrieval.training.fit``'s ``epoch_hooks``)."""
        self.check_stats()

    @contextmanager
    def explaining(self) -> Iterator[None]:
        """Inside, an error of a run whose inputs moved since the start becomes ``InputsChangedError``.

        A shard deleted or rewritten mid-epoch fails the read that meets it;
        the change, not the read, is what the user has to fix, so the error
        raised names the changed files (the read's error stays chained).
        """
        try:
            yield
        except InputsChangedError:
            raise
        except Exception as error:
            changes = self.changes(content=False)
            if changes:
                raise self._error(changes) from error
            raise

    def changes(self, *, content: bool) -> list[tuple[str, str]]:
        """``(path, what changed)`` for each file that differs from the start; empty when none does.

        ``content``: hash every file again whose stat is unchanged (needs ``hashed``).
        """
        found = []
        for path, before in self.start.items():
            change = self._change(path, before, content)
            if change is not None:
                found.append((path, change))
        return found

    def _change(self, path: str, before: FileStat | None, content: bool) -> str | None:
        """What changed in ``path`` since ``before`` (its start stat or fingerprint), None if nothing did."""
        now = stat_file(path)
        if before is None:
            return None if now is None else "appeared after the run started"
        if now is None:
            return "deleted or moved"
        if now["size"] != before["size"]:
            return f"size {before['size']} -> {now['size']} bytes"
        moved = now["mtime_ns"] != before["mtime_ns"]
        if not (moved or content) or (not content and self._touched.get(path) == now["mtime_ns"]):
            return None
        modified = f"modified {_time(before['mtime_ns'], precise=True)} -> {_time(now['mtime_ns'], precise=True)}"
        if "blake2b" not in before:  # sizes and mtimes only: a new mtime is all there is to go by
            return f"same size, {modified}"
        if fingerprint_file(path)["blake2b"] == cast(FileFingerprint, before)["blake2b"]:
            self._touched[path] = now["mtime_ns"]
            return None  # touched, or copied back: the same bytes
        return f"same size, other content, {modified}" if moved else "same size and mtime, other content"

    def _raise_if(self, changes: list[tuple[str, str]]) -> None:
        if changes:
            raise self._error(changes)

    def _error(self, changes: list[tuple[str, str]]) -> InputsChangedError:
        described = [f"{self.roles[path]} {path}" for path, _ in changes]
        if len(changes) == 1:
            message = f"{described[0]} changed during the run ({changes[0][1]})"
        else:
            listed = "; ".join(f"{name} ({what})" for name, (_, what) in zip(described[:5], changes))
            more = f"; and {len(changes) - 5} more" if len(changes) > 5 else ""
            message = f"{len(changes)} input files changed during the run: {listed}{more}"
        return InputsChangedError(f"{message}; rerun on a stable copy", [path for path, _ in changes])

