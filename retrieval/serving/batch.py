"""Top-k for many users (or similar items for many items) from a bundle, into one Parquet file.

``retrieval recommend --bundle B --users users.txt|all -k 100 --out recs.parquet`` (and
``--similar items.txt|all --out similar.parquet``) run this::

    bundle = Bundle.load("artifacts/my-run")
    summary = recommend_to_file(bundle, all_users(bundle), k=100, out="recs.parquet")
    summary = similar_to_file(bundle, all_items(bundle), k=10, out="similar.parquet")

Users are answered a block at a time through the bundle's batch path
(``Bundle.recommend_batch``: the query tower on the block, its seen items and the
caller's exclusions, one index search routed to ``ExactTopK`` or FAISS as
``ItemIndex.routing`` says), so every user gets what a single request for them gets.
Each block is one row group of the file, written as it is answered: the result is never
held whole. Files (see ``RECOMMENDATION_SCHEMA`` and ``SIMILAR_SCHEMA``), one row per
(query, rank), best first::

    user_id: string, rank: int32 (1-based), item_id: string, score: float32
    item_id: string, rank: int32 (1-based), similar_item_id: string, score: float32

``score`` is null where the answer is the bundle's popular items (a user id the model
does not know, as a single request answers it). The file is written under a temporary
name beside ``out`` and renamed at the end, so a killed run leaves no partial file
under the final name, and an existing ``out`` is replaced only with ``overwrite``. The
partial file is removed on an error, Ctrl-C, and (``retrieval recommend --out``) SIGTERM or
SIGHUP, after which the process ends by that signal; only SIGKILL leaves it behind.

``all_users(bundle)`` is every user of the bundle's ``seen_items/`` (the users it saw in
training), ``all_items(bundle)`` its catalogue, ``IdFile`` a text file of ids, one a line.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from retrieval.bundle.catalogue import current_version
from retrieval.common.arrays import CheckedSink
from retrieval.common.errors import UserError
from retrieval.common.progress import Progress
from retrieval.serving.bundle import Bundle, Recommendations
from retrieval.serving.item_filters import ItemFilters, parse_filters
from retrieval.serving.request_checks import checked_ids, checked_k

# Queries per search and per row group: >= ExactRouting.min_queries, ~100k rows at k=100. recommend_parser's
# --block-size help quotes it.
DEFAULT_BLOCK_SIZE = 1024
ALL = "all"  # --users all / --similar all
# The longest line an id file may hold (bytes, line end excluded): a file that is not one id a line (a
# 300 MB line) is refused naming the line rather than read whole into memory as one id.
MAX_ID_BYTES = 4096

RECOMMENDATION_SCHEMA = pa.schema(
    [("user_id", pa.string()), ("rank", pa.int32()), ("item_id", pa.string()), ("score", pa.float32())]
)
SIMILAR_SCHEMA = pa.schema(
    [("item_id", pa.string()), ("rank", pa.int32()), ("similar_item_id", pa.string()), ("score", pa.float32())]
)


class IdSource(Protocol):
    """Ids to answer, in order: ``total`` of them, streamed ``blocks(size)`` lists at a time."""

    description: str
    total: int

    def blocks(self, size: int) -> Iterator[list[str]]: ...


class IdList:
    """Ids given in memory (tests, benchmarks, a caller's own list)."""

    def __init__(self, ids: Sequence[str], description: str = "the given ids"):
        self.ids, self.description, self.total = list(ids), description, len(ids)

    def blocks(self, size: int) -> Iterator[list[str]]:
        for start in range(0, self.total, size):
            yield self.ids[start : start + size]


class _Ids:
    """An array of ids (bytes or str), decoded a block at a time: 10M user ids are never all Python strings."""

    def __init__(self, ids: np.ndarray, description: str):
        self._ids, self.description, self.total = ids, description, len(ids)

    def blocks(self, size: int) -> Iterator[list[str]]:
        for start in range(0, self.total, size):
            block = np.asarray(self._ids[start : start + size])
            yield [i.decode("utf-8") for i in block] if block.dtype.kind == "S" else [str(i) for i in block]


def all_users(bundle: Bundle) -> IdSource:
    """Every user the bundle knows: those of its ``seen_items/`` (its training users), in id order.

    Raises:
      UserError: the bundle was exported without seen items, so it holds no list of its users.
    """
    if bundle.seen_items is None:
        raise UserError(
            f"bundle {bundle.version!r} was exported without seen_items/, so it holds no list of its users "
            "for 'all': give a file of user ids, one a line"
        )
    return _Ids(bundle.seen_items.user_ids, f"all {len(bundle.seen_items):,} users of bundle {bundle.version!r}")


def all_items(bundle: Bundle) -> IdSource:
    """Every item the bundle serves, in index order (not those a catalogue edit removed)."""
    served = bundle.served_item_ids()
    return _Ids(served, f"all {len(served):,} items of bundle {bundle.version!r}")


class IdFile:
    """A UTF-8 text file of ids, one a line, checked whole when opened and then streamed in blocks.

    The check (one pass, nothing kept) finds a bad line before any work is done rather than
    after hours of it: a missing or empty file, a blank line, an id with spaces around it
    (which a request would not match), bytes that are not UTF-8 or a line longer than
    ``MAX_ID_BYTES`` (read no further) are each a ``UserError`` naming the file and the line.
    A final newline is optional; ``\\r\\n`` line ends are read.

    Args:
      path: the file.
      what: what an id names ("user", "item"), for messages.
    """

    def __init__(self, path: str | Path, what: str):
        self.path, self.what = Path(path), what
        self.description = f"{what} ids of {self.path}"
        if not self.path.exists():
            raise UserError(f"{self.path}: no such file of {what} ids")
        if not self.path.is_file():
            raise UserError(f"{self.path}: not a file (a file of {what} ids, one a line, is wanted)")
        self.total = sum(1 for _ in self._ids())
        if self.total == 0:
            raise UserError(f"{self.path}: the file is empty; give one {what} id a line")

    def _ids(self) -> Iterator[str]:
        with self.path.open("rb") as lines:
            # At most an id and its line end at a time: a line with no end in sight is never held whole.
            for number, raw in enumerate(iter(lambda: lines.readline(MAX_ID_BYTES + 2), b""), 1):
                line = raw[:-1] if raw.endswith(b"\n") else raw
                line = line[:-1] if line.endswith(b"\r") else line
                if len(line) > MAX_ID_BYTES:
                    raise UserError(f"{self.path} line {number}: longer than {MAX_ID_BYTES:,} bytes; give one "
                                    f"{self.what} id a line")
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError:
                    raise UserError(f"{self.path} line {number}: not UTF-8 text") from None
                if not text.strip():
                    raise UserError(f"{self.path} line {number}: a blank line; give one {self.what} id a line")
                if text != text.strip():
                    raise UserError(
                        f"{self.path} line {number}: {self.what} id {text[:40]!r} has spaces around it; "
                        "ids are matched exactly, so remove them"
                    )
                yield text

    def blocks(self, size: int) -> Iterator[list[str]]:
        block: list[str] = []
        for text in self._ids():
            block.append(text)
            if len(block) == size:
                yield block
                block = []
        if block:
            yield block

    def ids(self) -> list[str]:
        """Every id, in file order."""
        return list(self._ids())


def user_source(bundle: Bundle, users: str | Path) -> IdSource:
    """``"all"`` -> ``all_users(bundle)``, else the ``IdFile`` at ``users`` (a file named all: ``./all``)."""
    return all_users(bundle) if str(users) == ALL else IdFile(users, "user")


def item_source(bundle: Bundle, items: str | Path) -> IdSource:
    """``"all"`` -> ``all_items(bundle)``, else the ``IdFile`` at ``items``, every id checked in the catalogue.

    Raises:
      UserError: an id of the file is not in the bundle's catalogue (naming its line and how many are not).
    """
    if str(items) == ALL:
        return all_items(bundle)
    source = IdFile(items, "item")
    ids = source.ids()
    missing = np.flatnonzero(pd.Index(bundle.index.item_ids).get_indexer(ids) < 0)
    if len(missing):
        first = int(missing[0])
        raise UserError(
            f"{source.path} line {first + 1}: item id {ids[first][:40]!r} is not in the catalogue of bundle "
            f"{bundle.version!r} ({len(missing):,} of the file's {len(ids):,} ids are not); "
            "similar items are found only for catalogue items"
        )
    return IdList(ids, source.description)


@dataclass(frozen=True)
class BatchSummary:
    """What a batch wrote: ``queries`` answered in ``row_groups`` blocks, ``rows`` rows, and how
    many answers were a fallback (``Recommendations.fallback``: "popular", "features")."""

    out: Path
    what: str  # "users" or "items"
    source: str
    queries: int
    rows: int
    row_groups: int
    seconds: float
    fallbacks: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        """One line for the console: what was written, and the fallbacks counted."""
        rate = self.queries / self.seconds if self.seconds > 0 else float("inf")
        text = (f"wrote {self.out}: {self.rows:,} rows for {self.queries:,} {self.what} ({self.source}) in "
                f"{self.row_groups:,} row groups, {self.seconds:.1f} s ({rate:,.0f} {self.what}/s)")
        popular, features = self.fallbacks.get("popular", 0), self.fallbacks.get("features", 0)
        if self.what == "users" and (popular or features):
            text += f"; {popular + features:,} user ids unknown to the model"
            shown = [f"{popular:,} got the popular items (score null)"] if popular else []
            shown += [f"{features:,} were embedded from their other features"] if features else []
            text += " (" + ", ".join(shown) + ")"
        elif popular:
            text += f"; {popular:,} items at the model's all-zero row got the popular items (score null)"
        return text


def recommend_to_file(
    bundle: Bundle,
    users: IdSource,
    k: int,
    out: str | Path,
    *,
    exclude_item_ids: Sequence[str | int] | None = (),
    exclude_seen: bool = True,
    filters: Mapping[str, Any] | ItemFilters | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> BatchSummary:
    """Top-k for each user of ``users`` into the Parquet file ``out`` (``RECOMMENDATION_SCHEMA``).

    Each user's rows are what ``bundle.recommend({"user_id": user}, k, exclude_item_ids,
    exclude_seen=exclude_seen, filters=filters)`` answers: their training items excluded unless
    ``exclude_seen`` is False, ``exclude_item_ids`` and ``filters`` for everyone, popular items (score
    null) for an id the model does not know. ``block_size`` users are searched at once and written
    as one row group. ``progress`` (if given) is told of each block.

    Raises:
      UserError: ``out`` exists and not ``overwrite``, or is a directory; block_size below 1; k,
        ``exclude_item_ids`` or ``filters`` breaking a rule of ``retrieval.serving.request_checks`` or
        ``retrieval.serving.item_filters`` (a RequestError).
    """
    k, exclude_item_ids, filters = _checked_request(bundle, k, block_size, exclude_item_ids, filters)

    def answer(block: list[str]) -> list[Recommendations]:
        queries = [{"user_id": user} for user in block]
        return bundle.recommend_batch(queries, k, [exclude_item_ids] * len(block), exclude_seen=exclude_seen,
                                      filters=filters)

    return _write(users, answer, RECOMMENDATION_SCHEMA, "users", out, block_size, overwrite, progress)


def similar_to_file(
    bundle: Bundle,
    items: IdSource,
    k: int,
    out: str | Path,
    *,
    exclude_item_ids: Sequence[str | int] | None = (),
    filters: Mapping[str, Any] | ItemFilters | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> BatchSummary:
    """The k most similar items of each item of ``items`` into ``out`` (``SIMILAR_SCHEMA``), as
    ``bundle.similar_items_batch`` answers them; otherwise as ``recommend_to_file``.

    Raises:
      RequestError: an id of ``items`` is not in the catalogue (``item_source`` checks a file first).
    """
    k, exclude_item_ids, filters = _checked_request(bundle, k, block_size, exclude_item_ids, filters)

    def answer(block: list[str]) -> list[Recommendations]:
        return bundle.similar_items_batch(block, k, [exclude_item_ids] * len(block), filters=filters)

    return _write(items, answer, SIMILAR_SCHEMA, "items", out, block_size, overwrite, progress)


def check_out(out: str | Path, overwrite: bool) -> Path:
    """``out`` as a Path, unless it exists (and not ``overwrite``) or is a directory: checked before any work."""
    out = Path(out)
    if out.is_dir():
        raise UserError(f"{out}: is a directory; --out names the Parquet file to write")
    if out.exists() and not overwrite:
        raise UserError(f"{out} exists; pass --overwrite (overwrite=True) to replace it")
    return out


def _checked_request(
    bundle: Bundle, k: int, block_size: int, exclude_item_ids: Sequence[str | int] | None,
    filters: Mapping[str, Any] | ItemFilters | None = None,
) -> tuple[int, list[str], ItemFilters | None]:
    """(k capped at the catalogue, the exclusions as id strings, the parsed filters), by the rules every
    entry point shares (``retrieval.serving.request_checks``, ``retrieval.serving.item_filters``: the filters'
    columns checked against the bundle's table), and a positive ``block_size``: before any output is written."""
    if isinstance(block_size, bool) or not isinstance(block_size, int | np.integer) or block_size < 1:
        raise UserError(f"block_size must be a positive integer, got {block_size!r}")
    parsed = parse_filters(filters)
    bundle.allowed_rows(parsed)  # a column the table lacks is refused here, before the file is opened
    return checked_k(k, len(bundle.index)), checked_ids(exclude_item_ids, "exclude_item_ids"), parsed


def _write(
    source: IdSource,
    answer: Callable[[list[str]], list[Recommendations]],
    schema: pa.Schema,
    what: str,
    out: str | Path,
    block_size: int,
    overwrite: bool,
    progress: Progress | None,
) -> BatchSummary:
    """``answer`` each block of ``source`` and write it as one row group of ``out``."""
    out = check_out(out, overwrite)
    started = time.perf_counter()
    queries = rows = groups = 0
    fallbacks: dict[str, int] = {}
    with _atomic_parquet(out, schema) as writer:
        for block in source.blocks(block_size):
            results = answer(block)
            table = _table(block, results, schema)
            writer.write_table(table, row_group_size=max(table.num_rows, 1))
            queries, rows, groups = queries + len(block), rows + table.num_rows, groups + 1
            for result in results:
                if result.fallback is not None:
                    fallbacks[result.fallback] = fallbacks.get(result.fallback, 0) + 1
            if progress is not None:
                progress.update(len(block))
    return BatchSummary(out, what, source.description, queries, rows, groups, time.perf_counter() - started,
                        fallbacks)


def _table(block: list[str], results: list[Recommendations], schema: pa.Schema) -> pa.Table:
    """One row per (query, rank): the block's queries repeated, ranks 1..len(answer), items, scores."""
    lengths = np.array([len(result.item_ids) for result in results], dtype=np.int64)
    queries = np.repeat(np.array(block, dtype=object), lengths)
    # 1..n for each answer: a running count that restarts where each answer starts.
    ranks = np.arange(1, int(lengths.sum()) + 1, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    items = [item for result in results for item in result.item_ids]
    scores = [score for result in results for score in result.scores]  # None: a popularity fallback
    return pa.Table.from_arrays(
        [pa.array(queries, pa.string()), pa.array(ranks.astype(np.int32), pa.int32()),
         pa.array(items, pa.string()), pa.array(scores, pa.float32())],
        schema=schema,
    )


@contextmanager
def _atomic_parquet(out: Path, schema: pa.Schema) -> Iterator[pq.ParquetWriter]:
    """A ParquetWriter on a hidden file beside ``out``, renamed to ``out`` when the block ends
    without an error; on an error (or Ctrl-C) the partial file is removed.

    The writer writes through Python's file layer (``retrieval.common.arrays.CheckedSink``): Arrow's own file sink drops
    an error of its final flush, so on a full disk a small result would be renamed truncated;
    here the close raises ``OSError(ENOSPC)`` naming the file (one line from the command).
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        try:
            with open(partial, "wb") as handle:
                with pq.ParquetWriter(CheckedSink(handle), schema) as writer:
                    yield writer
        except OSError as error:
            if error.errno is None:
                raise
            raise OSError(error.errno, error.strerror or str(error), str(out)) from None
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)


def recommend_to_files(args: argparse.Namespace) -> int:
    """``retrieval recommend --out``: ``recommend_parser``'s ``args`` with ``--users`` or ``--similar``
    -> the file written and one summary line on stdout (progress on stderr)."""
    if args.out is None:
        raise UserError("--users writes a file: give --out FILE.parquet")
    if args.user_id:
        raise UserError("--out writes the answers of --users FILE|all or --similar FILE|all; "
                        "--user-id prints them (drop --out, or put the ids in a file for --users)")
    if args.similar and len(args.similar) > 1:
        raise UserError(f"with --out, --similar takes one source, 'all' or a file of item ids, got {args.similar}")
    block_size = DEFAULT_BLOCK_SIZE if args.block_size is None else args.block_size
    if block_size < 1:
        raise UserError(f"--block-size must be a positive number of queries, got {block_size}")
    check_out(args.out, args.overwrite)  # before the bundle loads: a refusal costs nothing
    with _removing_partial_files_on_termination():
        return _recommend_to_files(args, block_size)


def _recommend_to_files(args: argparse.Namespace, block_size: int) -> int:
    bundle = Bundle.load(current_version(args.bundle))  # its newest catalogue version
    if args.similar:
        items = item_source(bundle, args.similar[0])
        with Progress(items.total, "similar items", "items") as progress:
            summary = similar_to_file(bundle, items, args.k, args.out, exclude_item_ids=args.exclude,
                                      filters=args.filters, block_size=block_size, overwrite=args.overwrite,
                                      progress=progress)
    else:
        users = user_source(bundle, args.users)
        with Progress(users.total, "recommend", "users") as progress:
            summary = recommend_to_file(bundle, users, args.k, args.out, exclude_item_ids=args.exclude,
                                        exclude_seen=not args.include_seen, filters=args.filters,
                                        block_size=block_size,
                                        overwrite=args.overwrite, progress=progress)
    print(summary.line())
    return 0


class _Terminated(BaseException):
    """SIGTERM or SIGHUP, raised where the work is so that every ``finally`` on the way out runs."""


@contextmanager
def _removing_partial_files_on_termination() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP (a ``kill``, a closed terminal, a scheduler stopping the
    job) raise instead of ending the process at once, so ``_atomic_parquet`` removes its partial
    file; then the process ends by the same signal, as it would have. A signal the process ignores
    stays ignored (``nohup`` ignores SIGHUP: a closed terminal must not stop the job). Main thread only
    (elsewhere Python cannot set handlers): the block then runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def terminate(signum: int, frame: object) -> None:
        caught.append(signum)
        raise _Terminated(signum)

    watched = [number for number in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(number) is not signal.SIG_IGN]
    previous = {number: signal.signal(number, terminate) for number in watched}
    try:
        yield
    except _Terminated:
        pass
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    if caught:
        os.kill(os.getpid(), caught[0])  # the previous handler (by default: the process ends by that signal)
        raise SystemExit(128 + caught[0])  # a handler that returned: end as a shell reports the signal
