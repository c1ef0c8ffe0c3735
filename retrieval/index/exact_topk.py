"""Exact inner-product top-k by blocked matrix products and a running threshold.

Brute-force top-k over n items costs one score per (query, item) pair, and on
a CPU the score itself is cheap: an sgemm computes a block of scores at BLAS
speed. What is slow is selecting the k best of each query afterwards —
FAISS's ``IndexFlatIP`` pushes every score through a heap, a full
``argpartition`` reads every score several times. Here the selection reads
each score once and does further work only for the few scores that can still
enter a query's top k.

Two selections share the blocks, the masks' contract and the thread pool:

- compiled (``topk_kernel``, when numba is installed; ``_compiled_chunk_top_k``):
  after each block's sgemm, one compiled pass over the block while it is still
  in cache — segment maxima, threshold test and reservoir updates fused — with
  thresholds that are always the exact k-th best seen, and for large k a guess
  from a random sample of blocks scanned first (checked, as below). At 1M items
  with masks it runs at about 0.9 of the bare product's speed at k = 10 and 100
  and 0.8 at k = 1,000, whose ~2k candidates a query still cost a fifth of it
  (``make bench-topk``).
- numpy (the fallback; ``_chunk_top_k``), in vectorised passes:

1. Each query's list is seeded from the first max(block, ``SEED_MULTIPLE`` * k)
   items (one ``argpartition``); the k-th best of them is its first
   threshold, a lower bound of its final k-th best (any subset's k-th best is).
2. The rest of the corpus is cut into blocks of ``block_items`` rows; per
   block, one sgemm writes the scores item-major, [block, queries], into a
   preallocated buffer, and one pass takes the max of every ``SEGMENT``
   consecutive items for each query (a reduction that accumulates whole rows).
   Only (segment, query) pairs whose max beats the query's threshold are read
   again, and only their scores strictly above it are candidates. After the
   first blocks a threshold passes well under one score in a hundred, so
   selection costs about one read of the block. While thresholds are still
   low (more than ``DENSE_SEGMENTS`` of the segments hit), the block's scores
   are all compared instead.
3. Candidates go into a per-query buffer of ``BUFFER_MULTIPLE * k``; when a
   row's buffer is full it is cut back to its best k (``argpartition``) and
   its threshold raised to the k-th of those.
4. For large k the proven bound lags: after a share f of the items, the
   final k-th best is near the (k f)-th best seen, far above the k-th. At each
   cut-back the threshold is raised to an extrapolated guess, the
   (k f / ``GUESS_MARGIN``)-th best seen (when that rank is at least
   ``GUESS_MIN_RANK``, so its relative error ~ 1/sqrt(rank) is small). A guess
   is not a proof: at the end, a query whose k-th best found does not beat its
   guess is searched again without guessing. The result is exact either way.
5. At the end, each buffer's best k are sorted by score.

Excluded items (e.g. a user's training clicks) are never written into a block:
candidates are looked up in the query's excluded items (sorted keys, one
``searchsorted`` per block with candidates) and dropped, so masks cost nothing
in blocks without candidates. Only the seed, which is partitioned whole, gets
-inf at its excluded items.

Query chunks run on a thread pool (numpy releases the GIL in sgemm and in the
reductions), one BLAS thread each: the same number of cores as a
multi-threaded matrix product, without BLAS's per-call thread synchronisation,
which on small blocks costs more than the product. A batch with fewer chunks
than threads splits the corpus between threads instead and merges.

The reservoir (a buffer of a few k candidates per query, cut back to k by a
partition when full, with the threshold at its k-th) is the scheme of FAISS's
``ReservoirTopN`` result handlers; here it is vectorised over the queries of a
chunk in numpy, around one sgemm per block.

Measured against the bare product of the same blocks, chunks and threads
(``make bench-topk``, results in ``benchmarks/results/bench_exact_topk.md``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import numpy as np
from threadpoolctl import ThreadpoolController

BLOCK_ITEMS = 1024  # corpus rows per sgemm: with QUERY_CHUNK, a 2 MiB float32 block
QUERY_CHUNK = 512  # queries per sgemm and per task of the thread pool
SEGMENT = 16  # items per segment: a segment is read again only when its max beats the threshold
DENSE_SEGMENTS = 1 / 16  # above this share of segments over the threshold, compare the whole block instead
INSERT_EVERY = 0.5  # candidates wait until there are this many per query, in units of k
SEED_MULTIPLE = 4  # the first max(block, SEED_MULTIPLE * k) items seed each query's list
BUFFER_MULTIPLE = 3  # candidates held per query before cutting back to k, in units of k
GUESS_MARGIN = 0.7  # extrapolated thresholds aim at k / GUESS_MARGIN passing items
GUESS_MIN_RANK = 64  # extrapolate from the r-th best seen only when r >= this (relative error ~ 1/sqrt(r))
SAMPLE_RANK = 48  # compiled path: the guess is the r-th best of a random sample (relative error ~ 1/sqrt(r))
SAMPLE_EXPECTED = 2.0  # ... of a sample sized so that about this many times k items of the part beat it

# threadpoolctl sets BLAS threads process-wide and restores the previous count
# on exit; two searches overlapping would restore each other's values, so one
# search runs at a time (each uses every core anyway).
_BLAS_LOCK = threading.Lock()


@cache
def compiled_kernel():
    """``retrieval.index.topk_kernel`` when numba is installed, else None (the numpy selection runs)."""
    try:
        from retrieval.index import topk_kernel
    except ImportError:
        return None
    return topk_kernel


@cache
def _blas_controller() -> ThreadpoolController:
    """The loaded BLAS libraries (inspecting them takes milliseconds, so once)."""
    return ThreadpoolController()


def blas_threads() -> int:
    """Threads the BLAS behind numpy's matrix product would use (at least 1)."""
    counts = [info["num_threads"] for info in _blas_controller().info() if info["user_api"] == "blas"]
    return max(counts, default=os.cpu_count() or 1)


class ExactTopK:
    """Exact top-k by inner product over a fixed matrix of item vectors.

    Same contract as ``ItemIndex.search``: best first, -inf scores and -1
    rows where fewer than k items are left. On data without ties the rows
    equal ``np.argsort(-queries @ items.T)[:, :k]``; ties are broken
    arbitrarily (as in FAISS).

    Args:
      items: [num_items, dim] float32 item vectors; used without copying
        when already C-contiguous float32 (e.g. a view of a FAISS Flat index).
      block_items: corpus rows per sgemm block (raised to 4k when k is larger).
      query_chunk: queries per sgemm and per thread-pool task.
      threads: worker threads; None = the BLAS thread count (what the matrix
        product itself would use).
    """

    def __init__(
        self,
        items: np.ndarray,
        *,
        block_items: int = BLOCK_ITEMS,
        query_chunk: int = QUERY_CHUNK,
        threads: int | None = None,
    ):
        items = np.ascontiguousarray(items, dtype=np.float32)
        if items.ndim != 2:
            raise ValueError(f"items must be [num_items, dim], got shape {items.shape}")
        for name, value in (("block_items", block_items), ("query_chunk", query_chunk)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if threads is not None and threads <= 0:
            raise ValueError(f"threads must be positive, got {threads}")
        self.items = items
        self.block_items = block_items
        self.query_chunk = query_chunk
        self.threads = threads

    def __len__(self) -> int:
        return self.items.shape[0]

    @property
    def dim(self) -> int:
        return self.items.shape[1]

    def search(
        self, queries: np.ndarray, k: int, exclude: Sequence[np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k items by inner product for each query.

        Args:
          queries: [num_queries, dim] float32, finite.
          k: results per query (> 0; may exceed the number of items).
          exclude: optional num_queries arrays of item rows never to return
            (e.g. the user's training items); rows outside [0, num_items)
            are ignored.

        Returns:
          (scores, rows): [num_queries, k] float32 and int64, best first;
          -inf and -1 past the last item a query can get.
        """
        queries = checked_search_args(queries, self.dim, k, exclude)
        if not np.all(np.isfinite(queries)):
            raise ValueError("queries contain NaN or inf")
        num_queries = len(queries)
        depth = min(k, len(self))
        scores = np.full((num_queries, k), -np.inf, dtype=np.float32)
        rows = np.full((num_queries, k), -1, dtype=np.int64)
        if num_queries == 0 or depth == 0:
            return scores, rows
        owners, excluded = _pairs(exclude, len(self))
        block = -(-self.block_items // SEGMENT) * SEGMENT
        chunks = range(0, num_queries, self.query_chunk)

        def run(task: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
            start, lo, hi = task
            stop = min(start + self.query_chunk, num_queries)
            mine = slice(np.searchsorted(owners, start), np.searchsorted(owners, stop))
            chunk_top_k = _compiled_chunk_top_k if compiled_kernel() is not None else _chunk_top_k
            return chunk_top_k(
                queries[start:stop], self.items, depth, block, owners[mine] - start, excluded[mine], lo, hi
            )

        # Under the lock, the BLAS thread count read is the caller's, not another search's 1.
        with _BLAS_LOCK:
            threads = self.threads or blas_threads()
            # Fewer query chunks than threads (a small batch): split the corpus too, and merge.
            num_parts = max(1, min(-(-threads // len(chunks)), -(-len(self) // block), len(self) // depth))
            parts = np.linspace(0, len(self), num_parts + 1).astype(np.int64)
            tasks = [(start, int(lo), int(hi)) for start in chunks for lo, hi in zip(parts[:-1], parts[1:])]
            # One BLAS thread per task, a single worker too: BLAS's own threads on these small
            # sgemms spin and synchronise for more than they compute.
            with _blas_controller().limit(limits=1, user_api="blas"):
                if min(threads, len(tasks)) == 1:
                    found = [run(task) for task in tasks]
                else:
                    with ThreadPoolExecutor(min(threads, len(tasks))) as pool:
                        found = list(pool.map(run, tasks))
        for start in chunks:
            stop = min(start + self.query_chunk, num_queries)
            mine = [result for task, result in zip(tasks, found) if task[0] == start]
            top_scores = np.concatenate([result[0] for result in mine], axis=1)
            top_rows = np.concatenate([result[1] for result in mine], axis=1)
            if len(mine) > 1:
                top_scores, top_rows = _best(top_scores, top_rows, depth)
            scores[start:stop, :depth] = top_scores
            rows[start:stop, :depth] = np.where(np.isneginf(top_scores), -1, top_rows)
        return scores, rows


def checked_search_args(queries, dim: int, k: int, exclude: Sequence | None) -> np.ndarray:
    """``queries`` as a C-contiguous float32 ``[num_queries, dim]`` array, after checking ``k`` and ``exclude``.

    Raises:
      ValueError: naming the argument whose shape or value does not fit.
    """
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    if queries.ndim != 2 or queries.shape[1] != dim:
        raise ValueError(f"queries must be [num_queries, {dim}], got {queries.shape}")
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    if exclude is not None and len(exclude) != len(queries):
        raise ValueError(f"exclude has {len(exclude)} entries for {len(queries)} queries")
    return queries


def _pairs(exclude: Sequence[np.ndarray] | None, num_items: int) -> tuple[np.ndarray, np.ndarray]:
    """(query, item) exclusion pairs in range, sorted by query then item. Two [num_pairs] int64."""
    if exclude is None:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    lists = [np.asarray(rows, dtype=np.int64).ravel() for rows in exclude]
    owners = np.repeat(np.arange(len(lists), dtype=np.int64), [len(rows) for rows in lists])
    items = np.concatenate(lists) if lists else np.zeros(0, np.int64)
    keep = (items >= 0) & (items < num_items)
    owners, items = owners[keep], items[keep]
    order = np.lexsort((items, owners))
    return owners[order], items[order]


def _chunk_top_k(
    queries: np.ndarray,
    items: np.ndarray,
    k: int,
    block: int,
    owners: np.ndarray,
    excluded: np.ndarray,
    lo: int,
    hi: int,
    guess: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Best k of ``queries @ items[lo:hi].T`` per row, best first (k <= hi - lo).

    Args:
      queries: [m, dim] float32.
      items: [num_items, dim] float32.
      k: results per query.
      block: corpus rows per sgemm (a multiple of ``SEGMENT``).
      owners, excluded: [num_pairs] (query row in this chunk, item row) pairs to exclude.
      lo, hi: the item rows to search.
      guess: raise thresholds above the proven bound by extrapolation (see below);
        queries whose guess proves too high are searched again without.

    Returns:
      [m, k] scores (-inf where excluded items had to fill the list) and item rows.
    """
    m = len(queries)
    # Excluded pairs as sorted keys item * m + query: survivors are looked up, blocks are never written.
    masked = np.sort(excluded * m + owners)
    capacity = BUFFER_MULTIPLE * k
    kept_scores = np.full((m, capacity), -np.inf, dtype=np.float32)
    kept_rows = np.full((m, capacity), -1, dtype=np.int64)
    count = np.full(m, k, dtype=np.int64)
    guessed = np.full(m, -np.inf, dtype=np.float32)
    # The first SEED_MULTIPLE * k items seed each query's list; their k-th best is its first threshold.
    first = min(hi - lo, max(block, SEED_MULTIPLE * k))
    seed = queries @ items[lo : lo + first].T
    here = (excluded >= lo) & (excluded < lo + first)
    seed[owners[here], excluded[here] - lo] = -np.inf
    best = np.argpartition(seed, first - k, axis=1)[:, first - k :]
    kept_scores[:, :k] = np.take_along_axis(seed, best, axis=1)
    kept_rows[:, :k] = best + lo
    threshold = kept_scores[:, :k].min(axis=1)
    del seed, best
    # Scores of a block item-major, [block, m]: a segment's max over its SEGMENT items is one
    # vectorised pass that accumulates whole rows, and only (segment, query) pairs whose max
    # beats the query's threshold are read again.
    block = min(block, -(-(hi - lo - first) // SEGMENT) * SEGMENT)
    segments = block // SEGMENT
    scores = np.full((block, m), -np.inf, dtype=np.float32)
    flat_scores = scores.reshape(-1)
    tops = np.empty((segments, m), dtype=np.float32)
    above = np.empty((block, m), dtype=bool)
    offsets = np.arange(SEGMENT, dtype=np.int64) * m
    queries_t = queries.T
    owner_type = np.int16 if m <= np.iinfo(np.int16).max else np.int64
    # Candidates wait in lists and enter the buffers a batch at a time (``insert``): per block,
    # only the screen, the gather and three appends run, whatever the number of candidates.
    pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    waiting = 0
    seen = lo + first  # candidates of items before this are in the buffers

    def insert(seen: int) -> None:
        nonlocal kept_scores, kept_rows, capacity
        owner, row, value = (np.concatenate(parts) for parts in zip(*pending))
        pending.clear()
        if len(masked):
            key = row * m + owner
            place = np.minimum(np.searchsorted(masked, key), len(masked) - 1)
            keep = masked[place] != key
            owner, row, value = owner[keep], row[keep], value[keep]
        # Grouped by query (a stable radix sort on small ints): slot = count + rank within the group.
        by_query = np.argsort(owner.astype(owner_type), kind="stable")
        owner, row, value = owner[by_query], row[by_query], value[by_query]
        arrivals = np.bincount(owner, minlength=m)
        full = np.flatnonzero(count + arrivals > capacity)
        if len(full):
            _cut_back(kept_scores, kept_rows, full, k)
            count[full] = k
            threshold[full] = np.maximum(kept_scores[full, :k].min(axis=1), guessed[full])
            # Extrapolation: after a share f of the items, the final k-th best is about the
            # (k f)-th best seen so far. The (k f / GUESS_MARGIN)-th best is a threshold about
            # k / GUESS_MARGIN items of the whole part pass, far fewer than the proven bound
            # (the k-th best seen) lets through; whether it was low enough is checked at the end.
            rank = int(np.ceil(k * (seen - lo) / (hi - lo) / GUESS_MARGIN))
            if guess and GUESS_MIN_RANK <= rank < k:
                bound = np.partition(kept_scores[full, :k], k - rank, axis=1)[:, k - rank]
                guessed[full] = np.maximum(guessed[full], bound)
                threshold[full] = np.maximum(threshold[full], guessed[full])
            needed = int((count + arrivals).max())
            if needed > capacity:  # the threshold lags far behind (e.g. items sorted by score): grow
                grow = needed - capacity
                kept_scores = np.pad(kept_scores, ((0, 0), (0, grow)), constant_values=-np.inf)
                kept_rows = np.pad(kept_rows, ((0, 0), (0, grow)), constant_values=-1)
                capacity = needed
        first_of = np.cumsum(arrivals) - arrivals
        slot = count[owner] + np.arange(len(owner)) - first_of[owner]
        cell = owner * capacity + slot
        kept_scores.reshape(-1)[cell] = value
        kept_rows.reshape(-1)[cell] = row
        count[:] += arrivals

    for start in range(lo + first, hi, block or 1):
        stop = min(start + block, hi)
        width = stop - start
        if width < block:  # the last block: rows past it stay -inf and never pass
            scores[width:] = -np.inf
        np.matmul(items[start:stop], queries_t, out=scores[:width])
        np.max(scores.reshape(segments, SEGMENT, m), axis=1, out=tops)
        hit = np.flatnonzero(tops > threshold)
        if len(hit) > DENSE_SEGMENTS * tops.size:
            # Thresholds still low (the first blocks): compare every score of the block.
            passed = np.flatnonzero(np.greater(scores, threshold, out=above))
            offset, owner = np.divmod(passed, m)
            pending.append((owner, start + offset, flat_scores[passed]))
        elif len(hit):
            # (segment, query) pairs, then their SEGMENT scores each.
            segment, owner = np.divmod(hit, m)
            values = flat_scores[(segment * (SEGMENT * m) + owner)[:, None] + offsets]
            passed = np.flatnonzero(values > threshold[owner][:, None])
            pair, offset = np.divmod(passed, SEGMENT)
            pending.append((owner[pair], start + segment[pair] * SEGMENT + offset, values.reshape(-1)[passed]))
        else:
            continue
        waiting += len(pending[-1][0])
        if waiting >= INSERT_EVERY * k * m:
            insert(seen)
            waiting, seen = 0, stop
    if pending:
        insert(seen)
    top_scores, top_rows = _best(kept_scores, kept_rows, k)
    return _redo_wrong_guesses(_chunk_top_k, top_scores, top_rows, guessed, queries, items, k, block, owners,
                               excluded, lo, hi)


def _compiled_chunk_top_k(
    queries: np.ndarray,
    items: np.ndarray,
    k: int,
    block: int,
    owners: np.ndarray,
    excluded: np.ndarray,
    lo: int,
    hi: int,
    guess: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """``_chunk_top_k`` with the selection compiled (``topk_kernel``): same arguments, same result.

    Per block, one sgemm into a reused [block, m] buffer, then one compiled pass that reads
    each score once while the block is still in cache. For large k (a random sample of at
    most half the part exists), the blocks of a random sample go first with a reservoir of
    ``SAMPLE_RANK``: the r-th best of the sample is a guess of the part's threshold that
    about ``SAMPLE_EXPECTED`` * k of the part's items beat, so the rest of the part passes
    ~2k candidates a query instead of ~k ln(n / k). A guess is not a proof: a query whose
    k-th best found does not beat its guess is searched again without one.
    """
    kernel = compiled_kernel()
    m = len(queries)
    starts = np.searchsorted(owners, np.arange(m + 1))  # owners sorted: query q's excluded rows, CSR
    excluded = np.ascontiguousarray(excluded, dtype=np.int64)
    capacity = max(2 * k, k + 16)
    kept_scores = np.empty((m, capacity), dtype=np.float32)
    kept_rows = np.empty((m, capacity), dtype=np.int64)
    count = np.zeros(m, dtype=np.int64)
    threshold = np.full(m, -np.inf, dtype=np.float32)
    guessed = np.full(m, -np.inf, dtype=np.float32)
    block = min(block, hi - lo)
    scores = np.empty((block, m), dtype=np.float32)
    flags = np.zeros(-(-m // 8) * 8, dtype=np.uint8)
    flag_words = flags.view(np.uint64)
    queries_t = queries.T
    blocks = np.arange(lo, hi, block)
    sample_items = SAMPLE_RANK * (hi - lo) / (SAMPLE_EXPECTED * k)
    phases = [(blocks, k)]
    if guess and sample_items <= (hi - lo) / 2:
        # A random sample of blocks, whatever the corpus order (e.g. sorted by popularity); seeded, so
        # a search is repeatable (the result is exact either way, only the work would vary).
        order = np.random.default_rng(hi - lo).permutation(len(blocks))
        sampled = int(np.ceil(sample_items / block))
        phases = [(np.sort(blocks[order[:sampled]]), SAMPLE_RANK), (np.sort(blocks[order[sampled:]]), k)]
    for phase, (starts_of_blocks, keep) in enumerate(phases):
        keep_capacity = max(2 * keep, keep + 16)
        for start in starts_of_blocks:
            width = min(block, hi - start)
            np.matmul(items[start : start + width], queries_t, out=scores[:width])
            kernel.screen_block(scores, width, start, threshold, kept_scores, kept_rows, count, keep,
                                keep_capacity, starts, excluded, flags, flag_words)
        if phase == 0 and len(phases) > 1:
            # The sample's r-th best: a guess (the r-th best is proven only for the sample's top r).
            kernel.cut_back(kept_scores, kept_rows, count, threshold, keep)
            guessed = np.where(count >= keep, threshold, -np.inf).astype(np.float32)
    top_scores = np.empty((m, k), dtype=np.float32)
    top_rows = np.empty((m, k), dtype=np.int64)
    kernel.best_unsorted(kept_scores, kept_rows, count, k, top_scores, top_rows)
    top_scores, top_rows = _best(top_scores, top_rows, k)
    return _redo_wrong_guesses(_compiled_chunk_top_k, top_scores, top_rows, guessed, queries, items, k, block,
                               owners, excluded, lo, hi)


def _redo_wrong_guesses(chunk_top_k, top_scores: np.ndarray, top_rows: np.ndarray, guessed: np.ndarray,
                        queries: np.ndarray, items: np.ndarray, k: int, block: int, owners: np.ndarray,
                        excluded: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """A chunk's best k made exact (in place): exact where the k-th best found beats the query's
    threshold guess (every item the guess dropped scored at most the guess); elsewhere the guess may
    have dropped a top-k item, so those queries are searched again by ``chunk_top_k`` without one."""
    wrong = np.flatnonzero((guessed > -np.inf) & ~(top_scores[:, k - 1] > guessed))
    if len(wrong):
        redo = np.isin(owners, wrong)
        top_scores[wrong], top_rows[wrong] = chunk_top_k(
            queries[wrong], items, k, block, np.searchsorted(wrong, owners[redo]), excluded[redo], lo, hi, guess=False
        )
    return top_scores, top_rows


def _best(scores: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k highest ``scores`` of each row with their ``rows``, best first. [m, width] -> [m, k]."""
    width = scores.shape[1]
    if width > k:
        best = np.argpartition(scores, width - k, axis=1)[:, width - k :]
        scores, rows = np.take_along_axis(scores, best, axis=1), np.take_along_axis(rows, best, axis=1)
    order = _descending_order(scores)
    return np.take_along_axis(scores, order, axis=1), np.take_along_axis(rows, order, axis=1)


def _descending_order(scores: np.ndarray) -> np.ndarray:
    """Each row's positions by descending score, ties by position: ``np.argsort(-scores, kind="stable")``.

    One sort of 64-bit integer keys per row instead of an argsort: a float32 score's bits, mapped so
    that unsigned order is descending score order, above its position. numpy sorts integers with
    SIMD: on [1000, 1000] scores (k = 1,000) this took 30 ms where the stable argsort took 47 ms
    (2 shared AMD EPYC cores, best of 5).
    """
    width = scores.shape[1]
    bits = (np.asarray(scores, dtype=np.float32) + np.float32(0)).view(np.uint32)  # + 0: -0.0 sorts as 0.0
    # Ascending-order bits (a negative's every bit flipped, a positive's sign bit set), inverted.
    descending = np.where(bits >> 31, bits, ~bits & np.uint32(0x7FFFFFFF))
    position_bits = max(1, int(width - 1).bit_length())
    keys = descending.astype(np.uint64) << np.uint64(position_bits)
    keys |= np.arange(width, dtype=np.uint64)
    keys.sort(axis=1)
    return (keys & np.uint64((1 << position_bits) - 1)).astype(np.intp)


def _cut_back(kept_scores: np.ndarray, kept_rows: np.ndarray, rows: np.ndarray, k: int) -> None:
    """Keep the best k candidates of ``rows`` in their first k slots; empty the rest (in place)."""
    capacity = kept_scores.shape[1]
    scores, items = kept_scores[rows], kept_rows[rows]
    best = np.argpartition(scores, capacity - k, axis=1)[:, capacity - k :]
    kept_scores[rows] = -np.inf
    kept_rows[rows] = -1
    kept_scores[rows, :k] = np.take_along_axis(scores, best, axis=1)
    kept_rows[rows, :k] = np.take_along_axis(items, best, axis=1)
