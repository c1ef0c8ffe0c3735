"""The ItemIndex wrapper: a FAISS index over the catalogue with its row -> id map.

``ItemIndex`` builds a FAISS index from a factory string (training it on a
sample when it needs training), searches it with exclusions, tunes its search
parameters, and saves and loads it with its ids and tuning record;
``build_index`` builds and tunes the index an ``IndexConfig`` describes.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pandas as pd
import pyarrow as pa

from retrieval.common.arrays import drop_members, write_faiss_index, write_parquet
from retrieval.config import ConfigError, IndexConfig
from retrieval.index.exact_topk import ExactTopK, checked_search_args
from retrieval.index.search import (
    MEASURED_ROUTING,
    ExactRouting,
    TopK,
    _pad,
    exact_search,
    flat_vectors,
    recall_at_k,
)
from retrieval.index.tuning import Tuning, _explore

INDEX_FILE = "index.faiss"
ITEM_IDS_FILE = "item_ids.parquet"
INDEX_INFO_FILE = "index.json"

log = logging.getLogger("retrieval.index")

# Allowed rows whose vectors a filtered exact search gathers at once: bounds its copy to 64 MiB at dim 64.
ALLOWED_BLOCK = 262_144
# A Flat index's few queries score the allowed rows gathered below this share of the catalogue, through FAISS
# skipping the others (IDSelectorBitmap) above it: one query over 500k 64-d items, 2 busy cores (load 1-6, so
# noisy), medians: 1 %: 0.2 ms gathered, 1.4 ms skipping; 10 %: 6.4 and 5.4 ms in one run, 6.9 and 10.7 ms in
# another; 50 %: 31 and 12 ms.
GATHER_BELOW_SHARE = 0.2
# ... and only for fewer queries than this: FAISS scores a Flat index with a selector one query at a time, without
# BLAS (64 queries over 500k items at 10 %: 1 s skipping, tens of ms gathered).
SKIP_BELOW_QUERIES = 4
ALLOW_CACHE = 16  # allow arrays whose checked rows and bitmap an ItemIndex keeps
SUBINDEX_BYTES = 256 * 2**20  # their gathered vectors, all together (one at most a quarter of it)
_NONE = np.zeros(0, np.int64)  # no rows excluded

# FAISS's k-means (faiss.ClusteringParameters().min_points_per_centroid) warns below this many
# training points per centroid; below one point per centroid it refuses to train.
POINTS_PER_CENTROID = 39

NORM_TOLERANCE = 1e-3  # |norm - 1| below which an embedding counts as a unit vector

# The parts of a factory string that train k-means, and how many centroids each needs.
_IVF = re.compile(r"(?<![A-Za-z])IVF(\d+)")  # the coarse quantizer: one centroid per list (IVF200_HNSW32 too)
_IMI = re.compile(r"(?<![A-Za-z])IMI(\d+)x(\d+)")  # multi-index: 2^nbits centroids per sub-quantizer
_OPQ = re.compile(r"(?<![A-Za-z])OPQ(\d+)")  # the rotation trains an 8-bit PQ of its own
_PQ = re.compile(r"(?<![A-Za-z])PQ(\d+)(?:x(\d+))?")  # M codebooks of 2^nbits (default 8) centroids; fs too
_RQ = re.compile(r"(?<![A-Za-z])RQ(\d+)x(\d+)")  # residual quantizer: 2^nbits centroids per step


def check_index_fits(factory: str, num_items: int, train_sample_size: int | None = None) -> None:
    """Raise ConfigError unless FAISS can train ``factory`` on a catalogue of ``num_items`` items.

    A trainable index (IVF, IMI, PQ, OPQ, RQ) trains k-means on the
    catalogue's embeddings (at most ``train_sample_size`` of them, as
    ``ItemIndex.build`` samples), and FAISS refuses to train k centroids on
    fewer than k vectors: IVF<n> needs n, PQ<M>x<b> (b = 8 by default), OPQ
    and RQ<M>x<b> need 2^b. Flat, HNSW, SQ and the like train nothing and fit
    any size. The job calls this as soon as the catalogue size is known, so a
    misfit fails before training, not after it.
    """
    needs: list[tuple[int, str, str]] = []  # (centroids, what they are, what would fit)
    n = min(num_items, train_sample_size or num_items)
    for match in _IVF.finditer(factory):
        lists = int(match.group(1))
        needs.append((lists, f"its {lists} lists (FAISS wants ~{POINTS_PER_CENTROID} per list)",
                      f"Flat or IVF<={max(1, num_items // POINTS_PER_CENTROID)}"))
    # Codes of b bits: 2^b centroids; fewer bits only while FAISS still gets ~39 points per centroid.
    bits = int(math.log2(num_items // POINTS_PER_CENTROID)) if num_items >= 2 * POINTS_PER_CENTROID else 0
    fewer = f" or {{}}x{bits} (fewer bits per code)" if bits >= 4 else ""
    for match in _IMI.finditer(factory):
        b = int(match.group(2))
        needs.append((2**b, f"its multi-index quantizers of 2^{b} = {2**b} centroids",
                      "Flat" + fewer.format(f"IMI{match.group(1)}")))
    for match in _OPQ.finditer(factory):
        needs.append((256, f"its OPQ{match.group(1)} rotation (it trains a PQ of 2^8 = 256 centroids)",
                      f"Flat or no OPQ{match.group(1)}"))
    for match in _PQ.finditer(factory):
        b = int(match.group(2) or 8)
        needs.append((2**b, f"its PQ codebooks of 2^{b} = {2**b} centroids",
                      "Flat" + fewer.format(f"PQ{match.group(1)}")))
    for match in _RQ.finditer(factory):
        b = int(match.group(2))
        needs.append((2**b, f"its residual codebooks of 2^{b} = {2**b} centroids",
                      "Flat" + fewer.format(f"RQ{match.group(1)}")))
    for centroids, what, instead in sorted(needs, reverse=True):
        if centroids <= n:
            break
        if num_items >= centroids:  # the catalogue is large enough, the training sample is not
            raise ConfigError(
                f"index.factory {factory} trains {what} on index.train_sample_size={train_sample_size} "
                f"items, fewer than its {centroids} centroids: set index.train_sample_size >= {centroids}"
            )
        raise ConfigError(
            f"index.factory {factory} needs at least {centroids} catalogue items to train {what}; "
            f"the catalogue has {num_items}: use {instead}"
        )


class IndexFilesError(ValueError):
    """Saved index files that cannot be served together; the message names the file, never quotes its bytes."""


class ItemIndex:
    """FAISS index + item ids; row r of the index is ``item_ids[r]``."""

    def __init__(
        self,
        index: faiss.Index,
        item_ids: Sequence[str] | np.ndarray,
        factory: str,
        *,
        normalized: bool = False,
        search_params: str = "",
        tuning: Tuning | None = None,
        routing: ExactRouting = MEASURED_ROUTING,
        ids_checked: bool = False,
    ):
        """``ids_checked``: the caller knows ``item_ids`` are unique (a catalogue edit appending ids it
        checked against an index's), so the whole list is not hashed again."""
        if index.ntotal != len(item_ids):
            raise ValueError(f"index holds {index.ntotal} vectors but {len(item_ids)} item ids were given")
        self.index = index
        self.item_ids = np.asarray(item_ids, dtype=object)
        if not ids_checked:
            _require_unique(self.item_ids)
        self.factory = factory
        self.normalized = normalized
        self.tuning = tuning
        self.routing = routing  # when a Flat index's search runs on ExactTopK instead of FAISS
        self.search_params = ""
        self.set_search_params(search_params)
        self._direct_map_lock = threading.Lock()
        # id(allow array) -> its checked rows, bitmap and (once scored exactly) gathered vectors: a filter's rows
        # come back as one array object while its evaluation is cached (``FilterTable``), so they are checked,
        # packed and gathered once (a per-filter sub-index), the last ALLOW_CACHE of them, vectors within
        # SUBINDEX_BYTES.
        self._allow_cache: OrderedDict[int, _Allowed] = OrderedDict()
        self._allow_lock = threading.Lock()
        # Passing vectors a filtered IVF search aims to score per result: it probes at least the lists that hold,
        # at the filter's share, this many times k of them (``_search_within``; 0: its own nprobe, widened only
        # until k items pass). An HNSW walks with efSearch / sqrt(share). Measured against 0 and against
        # nprobe / share lists (as many passing vectors as an unfiltered search scores vectors):
        # benchmarks/results/bench_filters.md.
        self.filter_candidates = 10.0
        self._graphs: tuple[Any, Any] | None = None  # (the IVF, the HNSW) under the wrappers, found on first use

    @classmethod
    def build(
        cls,
        item_ids: Sequence[str],
        embeddings: np.ndarray,
        factory: str = "Flat",
        *,
        train_sample_size: int | None = None,
        seed: int = 0,
    ) -> ItemIndex:
        """Index ``embeddings`` [num_items, dim] for inner-product search.

        Args:
          item_ids: [num_items] unique string ids, in embedding row order.
          embeddings: [num_items, dim] float32.
          factory: a FAISS index factory string ("Flat", "IVF256,Flat", "HNSW32",
            "OPQ16,IVF1024,PQ16", ...).
          train_sample_size: indexes that need training (IVF, PQ, OPQ) are
            trained on at most this many rows drawn at random (None = all rows).
          seed: seed of that sample.
        """
        embeddings = _item_matrix(item_ids, embeddings)
        return cls.build_in_blocks(item_ids, embeddings.__getitem__, embeddings.shape[1], factory,
                                   train_sample_size=train_sample_size, seed=seed)

    @classmethod
    def build_in_blocks(
        cls,
        item_ids: Sequence[str],
        embed_rows: Callable[[np.ndarray], np.ndarray],
        dim: int,
        factory: str = "Flat",
        *,
        train_sample_size: int | None = None,
        seed: int = 0,
        on_block: Callable[[int, np.ndarray], None] | None = None,
    ) -> ItemIndex:
        """``build`` without the [num_items, dim] matrix: the vectors are made a block of rows at a time
        (``embed_rows(rows)``, rows [n] int64 -> [n, dim] float32) and added to the index as they come,
        so a catalogue is indexed in the memory of its index plus one block.

        An index that needs training first gets the rows of its training sample (``build``'s, the
        same seed); then ``retrieval.index.ADD_BATCH_SIZE`` rows a block, in order, each passed to
        ``on_block(first_row, block)`` once added (``build_index`` computes its exact reference there).
        """
        num_items = len(item_ids)
        if num_items == 0:
            raise ValueError("cannot index an empty catalogue")
        _require_unique(np.asarray(item_ids, dtype=object))  # before any training on them
        if train_sample_size is not None and train_sample_size <= 0:
            raise ValueError(f"train_sample_size must be positive, got {train_sample_size}")
        check_index_fits(factory, num_items, train_sample_size)
        try:
            index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
        except RuntimeError as error:
            raise ConfigError(f"index.factory {factory!r} is not a valid FAISS factory string: {error}") from None

        def block_of(rows: np.ndarray) -> np.ndarray:
            block = np.ascontiguousarray(embed_rows(rows), dtype=np.float32)
            if block.shape != (len(rows), dim):
                raise ValueError(f"embeddings must be [{len(rows)}, {dim}] for {len(rows)} rows, got {block.shape}")
            if not np.all(np.isfinite(block)):
                raise ValueError("embeddings contain NaN or inf")
            return block

        if not index.is_trained:
            rows = np.arange(num_items)
            if train_sample_size is not None and num_items > train_sample_size:
                rows = np.sort(np.random.default_rng(seed).choice(num_items, train_sample_size, replace=False))
            sample = block_of(rows)
            started = time.perf_counter()
            try:
                index.train(sample)
            except RuntimeError as error:
                raise ConfigError(
                    f"index.factory {factory!r} cannot be trained on {len(sample)} vectors: {error}"
                ) from None
            log.info("trained %s on %d vectors in %.1f s", factory, len(sample), time.perf_counter() - started)
            del sample
        normalized, nonzero, started = True, False, time.perf_counter()
        for rows in _row_blocks(num_items):
            first, block = int(rows[0]), block_of(rows)
            norms = np.linalg.norm(block, axis=1)
            # Every non-zero row a unit vector: inner product == cosine.
            normalized = normalized and bool(np.all(np.abs(norms[norms > 0] - 1) <= NORM_TOLERANCE))
            nonzero = nonzero or bool(np.any(norms > 0))
            index.add(block)
            if on_block is not None:
                on_block(first, block)
            if num_items > _add_batch_size():  # more than one block
                done = first + len(block)
                log.info("index add: %d / %d vectors (%.0f%%), %.1f s", done, num_items, 100 * done / num_items,
                         time.perf_counter() - started)
        return cls(index, list(item_ids), factory, normalized=normalized and nonzero)

    @property
    def dim(self) -> int:
        return self.index.d

    def __len__(self) -> int:
        return self.index.ntotal

    @property
    def is_exact(self) -> bool:
        """True when search is brute force (results equal a full argsort)."""
        return isinstance(self.index, (faiss.IndexFlatIP, faiss.IndexFlat))

    def flat_vectors(self) -> np.ndarray | None:
        """A Flat index's [ntotal, dim] vectors as a view (no copy; valid while the index lives), else None."""
        return flat_vectors(self.index) if isinstance(self.index, faiss.IndexFlat) else None

    def vectors(self, rows: np.ndarray | Sequence[int]) -> np.ndarray:
        """The vectors the index holds at ``rows`` [n]: [n, dim] float32, read back from FAISS.

        Exact for indexes that store the vectors whole (Flat, IVF*,Flat, HNSW*, a refined
        index's ``RFlat``); approximate for lossy codes (PQ, SQ, RQ, a PCA before the index):
        their decoded vectors, which are what the index scores against. An IVF index gets its
        direct map (row -> list position, 8 bytes a vector, in memory only) on the first call.

        Raises:
          ValueError: a row outside 0..ntotal-1, or an index type FAISS cannot read vectors back from.
        """
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        outside = rows[(rows < 0) | (rows >= len(self))]
        if len(outside):
            raise ValueError(f"row {int(outside[0])} is not in the index (rows 0..{len(self) - 1})")
        ivf = faiss.try_extract_index_ivf(self.index)
        if ivf is not None and ivf.direct_map.no():
            with self._direct_map_lock:  # concurrent first calls build it once; searches never read it
                if ivf.direct_map.no():
                    ivf.make_direct_map()
        try:
            return np.asarray(self.index.reconstruct_batch(rows), dtype=np.float32).reshape(len(rows), self.dim)
        except RuntimeError as error:  # "Error in <signature> at <file>:<line>: <reason>", nested
            reason = " ".join(str(error).rsplit(": ", 1)[-1].split()) or type(error).__name__
            raise ValueError(
                f"index.factory {self.factory!r} cannot give back its vectors ({reason}); re-index the bundle with "
                "one that can, e.g. Flat, IVF<n>,Flat or HNSW<m> (python -m pipelines.export --set index.factory=...)"
            ) from None

    def set_search_params(self, params: str) -> None:
        """Apply a FAISS parameter string such as ``"nprobe=16"`` or ``"efSearch=128"``."""
        if params:
            try:
                # faiss's stub lists the (cno: int) and (param_string: str) overloads without @overload.
                faiss.ParameterSpace().set_index_parameters(self.index, params)  # type: ignore[arg-type]
            except RuntimeError as error:
                raise ValueError(f"search params {params!r} do not apply to {self.factory!r}: {error}") from None
        self.search_params = params

    def search(
        self,
        queries: np.ndarray,
        k: int,
        exclude: Sequence[np.ndarray] | None = None,
        allow: Sequence[np.ndarray | None] | None = None,
    ) -> TopK:
        """Top-k rows by inner product for each query.

        Args:
          queries: [num_queries, dim] float32.
          k: results per query.
          exclude: optional per-query arrays of index rows that must not be
            returned (e.g. items the user already clicked).
          allow: optional per-query arrays of the only index rows that may be
            returned (a query's filters; None for a query without), exclusions
            applied on top. Queries given the same array object are searched
            together (``_search_within``).

        Returns:
          TopK with [num_queries, k] scores and rows.

        A Flat index searches with ``ExactTopK`` when ``self.routing`` says
        it is faster (it masks ``exclude`` in place instead of over-fetching),
        with FAISS otherwise; both return the exact top-k. With ``allow`` a
        Flat index returns the exact top-k of the allowed rows, and an
        approximate one never fewer than min(k, allowed - excluded) rows.
        """
        queries = checked_search_args(queries, self.dim, k, exclude)
        if allow is not None:
            if len(allow) != len(queries):
                raise ValueError(f"allow has {len(allow)} entries for {len(queries)} queries")
            if len(allow) == 1 and allow[0] is not None:  # one query, one filter: the serving path, kept short
                return self._search_within(queries, k, exclude, self._allowed(allow[0]))
            if any(rows is not None for rows in allow):
                return self._search_allowed(queries, k, exclude, allow)
        if isinstance(self.index, faiss.IndexFlat) and self.index.metric_type == faiss.METRIC_INNER_PRODUCT:
            if self.routing.uses_exact_top_k(len(queries), len(self)) and np.all(np.isfinite(queries)):
                scores, rows = ExactTopK(flat_vectors(self.index)).search(queries, k, exclude)
                return TopK(scores=scores, rows=rows)
        if exclude is None or not any(len(rows) for rows in exclude):
            scores, rows = self.index.search(queries, min(k, len(self)))
            return _pad(scores, rows, k)
        # Over-fetch k + |excluded| per query, so k remain after dropping the excluded ones. Queries
        # are searched in groups of similar depth (powers of two): one user with thousands of
        # training items does not make every query of the batch fetch thousands.
        extra = np.array([len(rows) for rows in exclude], dtype=np.int64)
        depths = np.minimum(k + extra, len(self))
        groups = np.ceil(np.log2(np.maximum(depths, 1))).astype(np.int64)
        scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
        rows = np.full((len(queries), k), -1, dtype=np.int64)
        for group in np.unique(groups):
            members = np.flatnonzero(groups == group)
            depth = int(depths[members].max())
            found_scores, found_rows = self.index.search(queries[members], depth)
            found_rows, found_scores = drop_members(found_rows, found_scores, [exclude[int(i)] for i in members])
            top = _pad(found_scores[:, :k], found_rows[:, :k], k)
            scores[members], rows[members] = top.scores, top.rows
        # An approximate index reaches only part of the catalogue from a query (HNSW's graph walk,
        # IVF's probed lists), however deep it is asked to go: when the excluded items fill that
        # part, search that query again with FAISS skipping them (an IDSelector; IVF probing
        # every list), so it still gets k items while the catalogue has them.
        wanted = _wanted(k, exclude, len(self))
        for i in np.flatnonzero((rows >= 0).sum(axis=1) < wanted):
            found_scores, found_rows = self._search_skipping(queries[i : i + 1], k, exclude[int(i)], int(wanted[i]))
            if (found_rows >= 0).sum() > (rows[i] >= 0).sum():
                top = _pad(found_scores, found_rows, k)
                scores[i], rows[i] = top.scores[0], top.rows[0]
        return TopK(scores=scores, rows=rows)

    def _search_allowed(
        self, queries: np.ndarray, k: int, exclude: Sequence[np.ndarray] | None, allow: Sequence[np.ndarray | None]
    ) -> TopK:
        """``search`` with allow-lists: the queries sharing one allow array (the same object) in one search."""
        first = allow[0]
        if first is not None and all(allowed is first for allowed in allow):  # one filter for the batch
            return self._search_within(queries, k, exclude, self._allowed(first))
        scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
        rows = np.full((len(queries), k), -1, dtype=np.int64)
        groups: dict[int, list[int]] = {}
        for position, allowed in enumerate(allow):
            groups.setdefault(id(allowed), []).append(position)
        for members in map(np.array, groups.values()):
            allowed = allow[int(members[0])]
            excluded = None if exclude is None else [exclude[int(i)] for i in members]
            if allowed is None:
                top = self.search(queries[members], k, excluded)
            else:
                top = self._search_within(queries[members], k, excluded, self._allowed(allowed))
            scores[members], rows[members] = top.scores, top.rows
        return TopK(scores=scores, rows=rows)

    def _allowed(self, allowed: np.ndarray) -> _Allowed:
        """An allow array's sorted distinct int64 rows and their bitmap (bit r of byte r // 8 for row r),
        kept for the last ``ALLOW_CACHE`` arrays; ValueError naming a row outside the index."""
        with self._allow_lock:
            cached = self._allow_cache.get(id(allowed))
            if cached is not None and cached.source is allowed and cached.ntotal == len(self):
                self._allow_cache.move_to_end(id(allowed))
                return cached
        rows = np.asarray(allowed, dtype=np.int64).reshape(-1)
        if len(rows) > 1 and not bool(np.all(rows[1:] > rows[:-1])):  # a filter's rows come sorted: no sort
            rows = np.unique(rows)
        if len(rows) and (rows[0] < 0 or rows[-1] >= len(self)):
            outside = int(rows[0] if rows[0] < 0 else rows[-1])
            raise ValueError(f"allow names row {outside}, which is not in the index (rows 0..{len(self) - 1})")
        mask = np.zeros(len(self), dtype=bool)
        mask[rows] = True
        entry = _Allowed(allowed, rows, np.packbits(mask, bitorder="little"), len(self))
        with self._allow_lock:
            self._allow_cache[id(allowed)] = entry
            while len(self._allow_cache) > ALLOW_CACHE:
                self._allow_cache.popitem(last=False)
        return entry

    def _gathered(self, entry: _Allowed, gather: Callable[[np.ndarray], np.ndarray]) -> np.ndarray | None:
        """``entry``'s vectors [allowed, dim] float32, gathered once and kept while the cache's gathered
        vectors stay within ``SUBINDEX_BYTES`` (older entries' dropped first); None when too large to keep."""
        size = len(entry.rows) * self.dim * 4
        if size > SUBINDEX_BYTES // 4:
            return None
        vectors = entry.vectors
        if vectors is None:
            vectors = np.ascontiguousarray(gather(entry.rows), dtype=np.float32)
            with self._allow_lock:
                entry.vectors = vectors
                self._keep_within_budget(entry)
        return vectors

    def _keep_within_budget(self, entry: _Allowed) -> None:
        """Drop the gathered vectors and IVF sub-indexes of the least recent entries other than ``entry`` until
        all of them together fit ``SUBINDEX_BYTES`` (under ``_allow_lock``)."""
        kept = sum(other.kept_bytes() for other in self._allow_cache.values())
        for other in list(self._allow_cache.values()):
            if kept <= SUBINDEX_BYTES:
                break
            if other is not entry and other.kept_bytes():
                kept -= other.kept_bytes()
                other.vectors, other.subindex, other.subindex_bytes, other.has_subindex = None, None, 0, None

    def _ivf_subindex(self, entry: _Allowed, ivf: faiss.IndexIVF) -> Any:
        """``entry``'s rows as an IVF of their own, made once per filter and kept (None where it cannot be).

        The sub-index shares the index's trained coarse quantizer and copies, list by list, the entries
        of the allowed rows (ids = index rows): probing its p nearest lists finds exactly the allowed
        items that the index's p nearest lists hold, what a search of the index skipping every other
        row (an ``IDSelectorBitmap``) finds, but scanning only the allowed entries (at 10 % of the
        catalogue, a tenth of them) and checking no selector. A plain ``IndexIVFFlat`` only (other codes
        and wrappers keep the selector), within ``SUBINDEX_BYTES`` (one at most a quarter of it).
        """
        if entry.has_subindex is not None:
            return entry.subindex
        size = len(entry.rows) * (ivf.code_size + 8)  # codes + ids
        if type(self.index) is not faiss.IndexIVFFlat or size > SUBINDEX_BYTES // 4:
            entry.has_subindex = False
            return None
        # The sub-index points at the index's quantizer: it lives in this ItemIndex's cache, never longer.
        subindex = faiss.IndexIVFFlat(ivf.quantizer, ivf.d, ivf.nlist, ivf.metric_type)
        passing = np.unpackbits(entry.bitmap, count=entry.ntotal, bitorder="little").view(bool)
        code = np.dtype((np.void, ivf.code_size))  # one code: one array element
        lists: Any = ivf.invlists  # faiss's stubs lack release_ids / release_codes
        kept: Any = subindex.invlists
        added = 0
        for number in range(ivf.nlist):
            length = lists.list_size(number)
            if not length:
                continue
            ids_pointer, codes_pointer = lists.get_ids(number), lists.get_codes(number)
            try:
                ids = faiss.rev_swig_ptr(ids_pointer, length)
                keep = np.flatnonzero(passing[ids])
                kept_ids = ids[keep]
                codes = faiss.rev_swig_ptr(codes_pointer, length * ivf.code_size).view(code)[keep]
            finally:
                lists.release_ids(number, ids_pointer)
                lists.release_codes(number, codes_pointer)
            if len(keep):
                kept.add_entries(number, len(keep), faiss.swig_ptr(kept_ids), faiss.swig_ptr(codes.view(np.uint8)))
                added += len(keep)
        subindex.ntotal = added
        with self._allow_lock:
            entry.subindex, entry.subindex_bytes, entry.has_subindex = subindex, size, True
            self._keep_within_budget(entry)
        return subindex

    def _search_within(
        self, queries: np.ndarray, k: int, exclude: Sequence[np.ndarray] | None, entry: _Allowed
    ) -> TopK:
        """Top-k of ``queries`` [n, dim] among the sorted rows ``allowed``, never a row of ``exclude``.

        A Flat index scores exactly the allowed rows: their vectors gathered once per filter and kept
        (``_gathered``: a per-filter sub-index) and scored (``_exact_within``); when they are too many
        to keep, by FAISS skipping every other row (an ``IDSelectorBitmap``) for fewer than
        ``SKIP_BELOW_QUERIES`` queries when at least ``GATHER_BELOW_SHARE`` of the catalogue passes,
        else gathered a block at a time.
        An IVF probes its nprobe lists, or more: enough to hold ``self.filter_candidates`` x k passing
        vectors at the filter's share (share = allowed / ntotal; lists of ntotal / nlist vectors), unless
        the allowed rows are fewer than the entries of the lists it would probe: then their vectors are
        read back and scored exactly (``_exact_within``, a plain IVF only). It probes them in the filter's
        own sub-index (``_ivf_subindex``: the same lists holding only the allowed rows, made on the
        filter's second search), else skipping every other row (an ``IDSelectorBitmap``); both find the
        same items. An HNSW walks with ``efSearch / sqrt(share)``, skipping them too. A query that
        still gets fewer than min(k, allowed - excluded) rows is searched again 4x wider, up to every
        list or the whole graph. Excluded rows are over-fetched and dropped, as ``search`` does without
        ``allow``.
        """
        num, allowed = len(queries), entry.rows
        excluding = exclude is not None and any(len(rows) for rows in exclude)
        if len(allowed) == 0:
            return _pad(np.zeros((num, 0), np.float32), np.zeros((num, 0), np.int64), k)
        if not excluding:
            excluded = [_NONE] * num
        else:
            excluded = [np.intersect1d(np.asarray(rows, dtype=np.int64), allowed) for rows in exclude]  # type: ignore[union-attr]
        index = self.index
        if isinstance(index, faiss.IndexFlat) and index.metric_type == faiss.METRIC_INNER_PRODUCT:
            gather = flat_vectors(index).__getitem__
            kept = self._gathered(entry, gather)
            if kept is not None or len(allowed) < GATHER_BELOW_SHARE * entry.ntotal or num >= SKIP_BELOW_QUERIES:
                return self._exact_within(queries, k, excluded, allowed, gather, kept)
        if self._graphs is None:  # the IVF or HNSW under the index's wrappers: found once
            self._graphs = (faiss.try_extract_index_ivf(index), _hnsw_of(index))
        ivf, hnsw = self._graphs
        plan_key = (ivf.nprobe if ivf is not None else hnsw.hnsw.efSearch if hnsw is not None else 0, k,
                    self.filter_candidates)
        plan = entry.plans.get(plan_key)  # (first breadth, widest, whether to score the allowed rows exactly)
        if plan is None:
            plan = entry.plans[plan_key] = self._plan(entry, k, ivf, hnsw)
        breadth, widest, exact = plan
        if exact:
            # Fewer allowed rows than the lists to probe hold: scoring them all is exact and costs less
            # (a gathered matrix product against a per-entry selector check and distance).
            try:
                kept = self._gathered(entry, self.vectors)
                return self._exact_within(queries, k, excluded, allowed, self.vectors, kept)
            except ValueError:  # vectors FAISS cannot give back: probe the lists
                pass
        entry.searches += 1  # a filter searched again gets its sub-index: a one-off filter never pays for one
        subindex = self._ivf_subindex(entry, ivf) if ivf is not None and entry.searches > 1 else None
        searched = index if subindex is None else subindex
        depth = int(min(k + max(len(rows) for rows in excluded), len(allowed))) if excluding else min(k, len(allowed))
        result: TopK | None = None
        pending: np.ndarray | None = None  # the queries searched again, None: all of them
        while True:
            breadth = min(breadth, widest)
            params = self._filtered_params(entry, subindex, breadth, ivf is not None)
            try:
                asked = queries if pending is None else queries[pending]
                found_scores, found_rows = searched.search(asked, depth, params=params)
            except RuntimeError:  # an index type FAISS cannot filter while searching: score the allowed rows
                return self._exact_within(queries, k, excluded, allowed, self.vectors)
            if excluding:
                owners = range(num) if pending is None else pending
                found_rows, found_scores = drop_members(found_rows, found_scores, [excluded[int(i)] for i in owners])
            # FAISS and drop_members leave the missing results (-1) at the end of each row.
            missing = found_rows.shape[1] < k or bool((found_rows[:, k - 1] < 0).any())
            if not missing and result is None and found_rows.shape[1] == k:  # the common case: k for every query
                return TopK(scores=found_scores, rows=found_rows)
            top = _pad(found_scores[:, :k], found_rows[:, :k], k) if missing else TopK(found_scores[:, :k],
                                                                                        found_rows[:, :k])
            if result is None:
                result = top  # the first search answers every query
            else:
                result.scores[pending], result.rows[pending] = top.scores, top.rows
            if not missing or breadth >= widest:
                break
            left = len(allowed) - np.array([len(rows) for rows in excluded], dtype=np.int64)
            wanted = np.minimum(k, left if pending is None else left[pending])
            short = (top.rows >= 0).sum(axis=1) < wanted
            if not short.any():
                break
            pending, breadth = (np.arange(num) if pending is None else pending)[short], breadth * 4
        assert result is not None  # num >= 1: the loop ran
        return result

    def _plan(self, entry: _Allowed, k: int, ivf: faiss.IndexIVF | None, hnsw: Any) -> tuple[int, int, bool]:
        """(the first breadth a filtered search of ``entry``'s rows probes, the widest, whether to score its rows
        exactly instead): ``_search_within``'s rules, worked out once per filter and setting."""
        share = len(entry.rows) / entry.ntotal
        if ivf is not None:
            lists_for_candidates = self.filter_candidates * k / (share * entry.ntotal / ivf.nlist)
            breadth, widest = max(ivf.nprobe, math.ceil(lists_for_candidates)), ivf.nlist
        elif hnsw is not None:
            breadth, widest = math.ceil(max(hnsw.hnsw.efSearch, k) / math.sqrt(share)), entry.ntotal
        else:
            breadth, widest = 0, 0
        exact = (isinstance(self.index, faiss.IndexIVF) and ivf is not None
                 and len(entry.rows) <= min(breadth, widest) / ivf.nlist * entry.ntotal)
        return breadth, widest, exact

    def _filtered_params(self, entry: _Allowed, subindex: Any, breadth: int, is_ivf: bool) -> Any:
        """The FAISS search parameters of a search ``breadth`` wide among ``entry``'s rows, made once each: the
        sub-index's nprobe, or the index's own parameters with a selector skipping every other row."""
        if subindex is not None:  # every entry of its lists passes: no selector
            params = entry.subindex_params.get(breadth)
            if params is None:
                params = entry.subindex_params[breadth] = faiss.SearchParametersIVF(nprobe=breadth)  # type: ignore[call-arg]
            return params
        params = entry.params.get(breadth)
        if params is None:
            if entry.selector is None:  # ``bitmap`` lives as long as the entry
                entry.selector = faiss.IDSelectorBitmap(len(entry.bitmap), faiss.swig_ptr(entry.bitmap))
            params = entry.params[breadth] = _skipping_params(self.index, entry.selector, breadth,
                                                              nprobe=breadth if is_ivf else None)[0]
        return params

    def _exact_within(
        self,
        queries: np.ndarray,
        k: int,
        excluded: Sequence[np.ndarray],
        allowed: np.ndarray,
        gather: Callable[[np.ndarray], np.ndarray],
        kept: np.ndarray | None = None,
    ) -> TopK:
        """The exact top-k among the sorted rows ``allowed`` (``excluded`` [n] sorted subsets of them left out):
        their vectors gathered ``ALLOWED_BLOCK`` rows at a time (``gather(rows)`` -> [m, dim]) and
        scored by ``ExactTopK`` where ``self.routing`` sends such a batch (it masks the exclusions),
        by FAISS's brute force over the block otherwise (over-fetching the exclusions); the blocks'
        best merged. ``kept``: the allowed rows' vectors [allowed, dim] already gathered (one block)."""
        num = len(queries)
        if kept is not None and not self.routing.uses_exact_top_k(num, len(allowed)) and not any(map(len, excluded)):
            # One block, nothing to drop: FAISS's brute force over the kept vectors alone (a filter's usual case).
            found_scores, found_rows = faiss.knn(queries, kept, min(k, len(allowed)), metric=faiss.METRIC_INNER_PRODUCT)
            return _pad(found_scores, np.where(found_rows >= 0, allowed[np.maximum(found_rows, 0)], -1), k)
        scores = np.full((num, k), -np.inf, dtype=np.float32)
        rows = np.full((num, k), -1, dtype=np.int64)
        step = len(allowed) if kept is not None else ALLOWED_BLOCK
        for start in range(0, len(allowed), max(step, 1)):
            block = allowed[start : start + step]
            vectors = kept if kept is not None else np.ascontiguousarray(gather(block), dtype=np.float32)
            # Positions of the excluded rows in this block (each is an allowed row, so found exactly).
            local = [np.searchsorted(block, own[(own >= block[0]) & (own <= block[-1])]) for own in excluded]
            if self.routing.uses_exact_top_k(num, len(block)) and np.all(np.isfinite(queries)):
                found_scores, found_rows = ExactTopK(vectors).search(queries, k, local)
            else:
                depth = min(k + max(len(own) for own in local), len(block))
                found_scores, found_rows = faiss.knn(queries, vectors, depth, metric=faiss.METRIC_INNER_PRODUCT)
                found_rows, found_scores = drop_members(found_rows, found_scores, local)
                top = _pad(found_scores[:, :k], found_rows[:, :k], k)
                found_scores, found_rows = top.scores, top.rows
            found_rows = np.where(found_rows >= 0, block[np.maximum(found_rows, 0)], -1)
            merged_scores = np.hstack([scores, np.where(found_rows >= 0, found_scores, -np.inf)])
            merged_rows = np.hstack([rows, found_rows])
            best = np.argsort(-merged_scores, axis=1, kind="stable")[:, :k]
            scores, rows = np.take_along_axis(merged_scores, best, 1), np.take_along_axis(merged_rows, best, 1)
        return _pad(scores, np.where(np.isneginf(scores), -1, rows), k)

    def _search_skipping(
        self, query: np.ndarray, k: int, excluded: np.ndarray, wanted: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """FAISS search of one query [1, dim] that never returns ``excluded`` rows; an HNSW walk is
        widened (efSearch x8 a try, up to the catalogue size) until ``wanted`` results come back."""
        selector = faiss.IDSelectorNot(faiss.IDSelectorBatch(np.asarray(excluded, dtype=np.int64)))
        depth = min(k, len(self))
        found = np.full((1, depth), -np.inf, np.float32), np.full((1, depth), -1, np.int64)
        breadth = max(k, 16)
        while True:
            params, widens = _skipping_params(self.index, selector, breadth)
            try:
                found = self.index.search(query, depth, params=params)
            except RuntimeError:  # an index type FAISS cannot filter while searching: keep the over-fetch
                return found
            if not widens or (found[1] >= 0).sum() >= wanted or breadth >= len(self):
                return found
            breadth *= 8

    def tune(
        self,
        embeddings: np.ndarray | None,
        queries: np.ndarray,
        *,
        k: int = 100,
        target_recall: float = 0.95,
        query_source: str = "queries",
        params: str | None = None,
        exact: TopK | None = None,
    ) -> Tuning:
        """Choose search parameters reaching ``target_recall`` recall@k against exact search.

        The queries are shuffled (seeded) and split in two halves. On the
        first, settings from FAISS's ``ParameterSpace`` are measured (recall =
        the share of the exact top-k found in the approximate top-k, FAISS's
        ``IntersectionCriterion``) and the fastest that reaches the target is
        chosen (see ``_explore``); its recall is then measured on the second
        half, which took no part in the choice.
        When no setting reaches the target, the most accurate one is kept and
        ``reached_target`` is False.

        Args:
          embeddings: [num_items, dim] the indexed vectors, for the exact reference (None: ``exact`` is given).
          queries: [num_queries, dim] query embeddings (>= 2); all-zero rows
            (out-of-vocabulary queries, which tie with every item) are dropped.
          k: the k of recall@k (capped at the index size).
          target_recall: recall to reach, in (0, 1].
          query_source: where ``queries`` come from, recorded in the result.
          params: if given, apply these instead of exploring, and only measure.
          exact: ``exact_search(embeddings, queries, k)`` if already computed
            (e.g. to tune several indexes on the same queries); else computed here.

        Returns:
          The Tuning, also kept in ``self.tuning``; ``self.search_params`` is set.
        """
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        if embeddings is None and exact is None:
            raise ValueError("tune needs the indexed vectors or their exact top-k for the queries")
        if embeddings is not None:
            embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
            if embeddings.shape != (len(self), self.dim):
                raise ValueError(f"embeddings must be [{len(self)}, {self.dim}], got {embeddings.shape}")
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise ValueError(f"queries must be [num_queries, {self.dim}], got {queries.shape}")
        if not 0 < target_recall <= 1:
            raise ValueError(f"target_recall must be in (0, 1], got {target_recall}")
        known = np.any(queries != 0, axis=1)
        queries = queries[known]
        if len(queries) < 2:
            raise ValueError(f"tuning needs at least 2 non-zero queries, got {len(queries)}")
        k = min(k, len(self))
        half = len(queries) // 2
        if exact is None:
            exact = exact_search(embeddings, queries, k)  # type: ignore[arg-type]  # checked above
        else:
            if exact.rows.shape != (len(known), k):
                raise ValueError(f"exact must be [{len(known)}, {k}] results for these queries, got {exact.rows.shape}")
            exact = TopK(scores=exact.scores[known], rows=exact.rows[known])
        # Shuffle so that both halves follow the same distribution whatever the input order.
        order = np.random.default_rng(0).permutation(len(queries))
        queries, exact = queries[order], TopK(scores=exact.scores[order], rows=exact.rows[order])
        operating_points: list[dict[str, Any]] = []
        if params is None:
            params, operating_points = _explore(self.index, queries[:half], exact.scores[:half], exact.rows[:half],
                                                k, target_recall)
            method = "faiss.ParameterSpace"
        else:
            method = "config"
        self.set_search_params(params)
        recall = recall_at_k(self.index.search(queries[half:], k)[1], exact.rows[half:])
        self.tuning = Tuning(
            params=params,
            recall=recall,
            k=k,
            target_recall=target_recall,
            reached_target=recall >= target_recall,
            query_source=query_source,
            tuning_queries=half if method != "config" else 0,
            validation_queries=len(queries) - half,
            method=method,
            operating_points=operating_points,
        )
        log.info("tuned %s: %s -> recall@%d %.4f (target %.2f)", self.factory, params or "defaults", k, recall,
                 target_recall)
        return self.tuning

    def info(self) -> dict[str, Any]:
        """What ``index.json`` holds: factory, sizes, metric, search params and tuning."""
        return {
            "factory": self.factory,
            "dim": self.dim,
            "ntotal": len(self),
            "metric": "inner_product",
            "normalized": self.normalized,
            "exact": self.is_exact,
            "search_params": self.search_params,
            "tuning": self.tuning.to_dict() if self.tuning else None,
        }

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        write_faiss_index(self.index, directory / INDEX_FILE)
        frame = pd.DataFrame({"row": np.arange(len(self)), "item_id": self.item_ids.astype(str)})
        write_parquet(pa.Table.from_pandas(frame, preserve_index=False), directory / ITEM_IDS_FILE)
        (directory / INDEX_INFO_FILE).write_text(json.dumps(self.info(), indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> ItemIndex:
        """Load a saved index and apply its saved search parameters."""
        directory = Path(directory)
        info = json.loads((directory / INDEX_INFO_FILE).read_text())
        frame = pd.read_parquet(directory / ITEM_IDS_FILE)
        if not np.array_equal(np.sort(frame["row"].to_numpy()), np.arange(len(frame))):
            raise IndexFilesError(f"{ITEM_IDS_FILE}: its row column is not 0..{len(frame) - 1}, each once")
        item_ids = frame.sort_values("row")["item_id"].astype(str).tolist()
        _require_unique(np.asarray(item_ids, dtype=object), IndexFilesError, f"{ITEM_IDS_FILE}: ")
        tuning = Tuning(**info["tuning"]) if info.get("tuning") else None
        return cls(
            faiss.read_index(str(directory / INDEX_FILE)),
            item_ids,
            info["factory"],
            normalized=bool(info.get("normalized", False)),
            search_params=info.get("search_params", ""),
            tuning=tuning,
        )


def _require_unique(item_ids: np.ndarray, error: type[ValueError] = ValueError, prefix: str = "") -> None:
    """Raise ``error`` naming the first repeated row unless every id is unique.

    One row per id: a repeated id would be excluded through one row and still returned through the other.
    """
    ids = item_ids.astype(str)
    repeats = pd.Index(ids).duplicated()
    if repeats.any():
        row = int(np.flatnonzero(repeats)[0])
        first = int(np.flatnonzero(ids == ids[row])[0])
        raise error(f"{prefix}item ids must be unique: {int(repeats.sum())} rows repeat an earlier id "
                    f"(row {row} repeats row {first})")
def _wanted(k: int, exclude: Sequence[np.ndarray], num_items: int) -> np.ndarray:
    """Per query, how many results it can have: k, or the items left after its exclusions. [n] int64."""
    left = [num_items - len(np.unique(rows[(rows >= 0) & (rows < num_items)])) for rows in map(np.asarray, exclude)]
    return np.minimum(k, np.array(left, dtype=np.int64))


def _skipping_params(
    index: faiss.Index, selector: faiss.IDSelector, breadth: int, nprobe: int | None = None
) -> tuple[faiss.SearchParameters, bool]:
    """(search parameters that make ``index`` skip the rows ``selector`` rejects, through its wrappers;
    whether ``breadth`` widens the search: an HNSW's efSearch).

    An IVF probes every list, so every item is reachable, or ``nprobe`` lists when given (a
    filter's search widens them itself).

    FAISS's Python layer keeps the selector and nested parameters given as keywords alive; its type
    stubs list no keywords, hence the ignores.
    """
    if isinstance(index, faiss.IndexPreTransform):  # OPQ, PCA: the selector goes to the wrapped index
        inner, widens = _skipping_params(faiss.downcast_index(index.index), selector, breadth, nprobe)
        return faiss.SearchParametersPreTransform(index_params=inner), widens  # type: ignore[call-arg]
    if isinstance(index, faiss.IndexRefine):
        inner, widens = _skipping_params(faiss.downcast_index(index.base_index), selector, breadth, nprobe)
        refine = faiss.IndexRefineSearchParameters(  # type: ignore[call-arg]
            k_factor=index.k_factor, sel=selector, base_index_params=inner
        )
        return refine, widens
    if isinstance(index, faiss.IndexIVF):  # every list: all items reachable
        lists = index.nlist if nprobe is None else max(1, min(nprobe, index.nlist))
        return faiss.SearchParametersIVF(sel=selector, nprobe=lists), False  # type: ignore[call-arg]
    if isinstance(index, faiss.IndexHNSW):
        hnsw = faiss.SearchParametersHNSW(  # type: ignore[attr-defined]
            sel=selector, efSearch=max(index.hnsw.efSearch, breadth)
        )
        return hnsw, True
    return faiss.SearchParameters(sel=selector), False  # type: ignore[call-arg]


def build_index(
    item_ids: Sequence[str],
    embeddings: np.ndarray,
    config: IndexConfig,
    queries: np.ndarray | None = None,
    query_source: str = "queries",
) -> ItemIndex:
    """Build the index ``config`` describes and, unless it is exact, tune it.

    Args:
      item_ids: [num_items] unique string ids.
      embeddings: [num_items, dim] float32 item embeddings.
      config: factory string, training sample, tuning target.
      queries: [num_queries, dim] real query embeddings to tune on; when
        None (or fewer than 2 non-zero rows), a sample of the item embeddings
        stands in for queries and the tuning record says so.
      query_source: what ``queries`` are, recorded in the tuning record.
    """
    embeddings = _item_matrix(item_ids, embeddings)
    return build_index_in_blocks(item_ids, embeddings.__getitem__, embeddings.shape[1], config, queries, query_source)


def build_index_in_blocks(
    item_ids: Sequence[str],
    embed_rows: Callable[[np.ndarray], np.ndarray],
    dim: int,
    config: IndexConfig,
    queries: np.ndarray | None = None,
    query_source: str = "queries",
) -> ItemIndex:
    """``build_index`` with the item vectors made a block of rows at a time (``embed_rows(rows)``, rows
    [n] int64 -> [n, dim] float32; ``ItemIndex.build_in_blocks``), never as one [num_items, dim] matrix.

    The exact reference an approximate index is tuned against is merged block by block as the
    blocks are added (``exact_search`` of each block, the best ``tune_k`` kept). Without real
    queries the item vectors standing in for them are known only after that pass (a sample of the
    non-zero ones, as ``build_index`` always drew it), so their reference takes a second pass.
    """
    num_items = len(item_ids)
    factory = config.factory_for(num_items, dim)
    if factory != config.factory:
        log.info("index.factory %s: %s for %d items", config.factory, factory, num_items)
    exact = _is_exact(factory, dim)
    rng = np.random.default_rng(config.seed)
    source = query_source
    if queries is not None:
        queries = np.asarray(queries, dtype=np.float32)
        queries = queries[np.any(queries != 0, axis=1)]
        if len(queries) > config.tune_queries:
            queries = queries[rng.choice(len(queries), config.tune_queries, replace=False)]
    real = queries is not None and len(queries) >= 2
    reference = _BlockedTopK(queries if real and not exact else None, min(config.tune_k, num_items))
    nonzero_rows: list[np.ndarray] = []

    def on_block(first: int, block: np.ndarray) -> None:
        reference.add(first, block)
        if not real:
            nonzero_rows.append(first + np.flatnonzero(np.any(block != 0, axis=1)))

    index = ItemIndex.build_in_blocks(item_ids, embed_rows, dim, factory, train_sample_size=config.train_sample_size,
                                      seed=config.seed, on_block=None if exact else on_block)
    if index.is_exact:
        return index
    if not real:
        source = "items"
        rows = np.concatenate(nonzero_rows) if nonzero_rows else np.zeros(0, np.int64)
        if len(rows) > config.tune_queries:
            rows = rows[rng.choice(len(rows), config.tune_queries, replace=False)]
        queries = np.ascontiguousarray(embed_rows(rows), dtype=np.float32) if len(rows) else np.zeros((0, dim))
        if len(queries) >= 2:
            reference = _BlockedTopK(queries, min(config.tune_k, num_items))
            for rows in _row_blocks(num_items):
                reference.add(int(rows[0]), embed_rows(rows))
    if queries is None or len(queries) < 2:
        log.warning("index %s left untuned: fewer than 2 non-zero embeddings to tune on", factory)
        if config.search_params:
            index.set_search_params(config.search_params)
        return index
    index.tune(
        None,
        queries,
        k=config.tune_k,
        target_recall=config.target_recall,
        query_source=source,
        params=config.search_params,
        exact=reference.result(),
    )
    return index


def _item_matrix(item_ids: Sequence[str], embeddings: np.ndarray) -> np.ndarray:
    """``embeddings`` as a float32 [num_items, dim] matrix of one row per id (ValueError otherwise)."""
    embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
    if embeddings.ndim != 2 or embeddings.shape[0] == 0:
        raise ValueError(f"embeddings must be [num_items, dim] with num_items > 0, got {embeddings.shape}")
    if len(item_ids) != embeddings.shape[0]:
        raise ValueError(f"{len(item_ids)} item ids for {embeddings.shape[0]} embeddings")
    return embeddings


def _add_batch_size() -> int:
    """``retrieval.index.ADD_BATCH_SIZE``, read through the package where tests set it; imported on the call,
    since the package imports this module."""
    import retrieval.index

    return retrieval.index.ADD_BATCH_SIZE


def _row_blocks(num_items: int) -> Iterator[np.ndarray]:
    """Rows ``0 .. num_items - 1`` in order, ``retrieval.index.ADD_BATCH_SIZE`` at a time (int64 arrays).

    Read through the package (retrieval/index/__init__.py), where tests set it."""
    block_size = _add_batch_size()
    for first in range(0, num_items, block_size):
        yield np.arange(first, min(first + block_size, num_items))


def _is_exact(factory: str, dim: int) -> bool:
    """Whether ``factory`` builds a brute-force index (an invalid one: False; building it says why)."""
    try:
        return isinstance(faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT), (faiss.IndexFlatIP,
                                                                                          faiss.IndexFlat))
    except RuntimeError:
        return False


class _BlockedTopK:
    """The exact inner-product top-``k`` of ``queries`` over item blocks added in row order (None: nothing)."""

    def __init__(self, queries: np.ndarray | None, k: int):
        self.queries, self.k = queries, k
        self.scores: np.ndarray | None = None
        self.rows: np.ndarray | None = None

    def add(self, first: int, block: np.ndarray) -> None:
        if self.queries is None:
            return
        found = exact_search(np.asarray(block, dtype=np.float32), self.queries, min(self.k, len(block)))
        scores, rows = found.scores, np.where(found.rows >= 0, found.rows + first, -1)
        if self.scores is not None and self.rows is not None:
            scores, rows = np.hstack([self.scores, scores]), np.hstack([self.rows, rows])
        keep = np.argsort(-scores, axis=1, kind="stable")[:, : self.k]
        self.scores, self.rows = np.take_along_axis(scores, keep, 1), np.take_along_axis(rows, keep, 1)

    def result(self) -> TopK:
        assert self.scores is not None and self.rows is not None, "no block was added"
        return TopK(scores=self.scores, rows=self.rows)


@dataclass
class _Allowed:
    """An allow array (``source``) checked against an index of ``ntotal`` rows: its sorted distinct ``rows``
    [m] int64, their ``bitmap`` [ceil(ntotal / 8)] uint8 and, once gathered, their ``vectors`` [m, dim]."""

    source: np.ndarray
    rows: np.ndarray
    bitmap: np.ndarray
    ntotal: int
    vectors: np.ndarray | None = None
    # An IVF's per-filter sub-index: the index's own coarse quantizer over lists holding only these rows
    # (``ItemIndex._ivf_subindex``), its bytes, whether one can be made (None: not tried yet).
    subindex: Any = None
    subindex_bytes: int = 0
    has_subindex: bool | None = None
    searches: int = 0  # IVF searches with these rows that reached the lists (the sub-index comes on the second)
    selector: Any = None  # faiss.IDSelectorBitmap over ``bitmap``, made on the first search that needs it
    params: dict[int, Any] = field(default_factory=dict)  # breadth -> faiss SearchParameters with ``selector``
    subindex_params: dict[int, Any] = field(default_factory=dict)  # nprobe -> the sub-index's SearchParametersIVF
    plans: dict[tuple, tuple[int, int, bool]] = field(default_factory=dict)  # ``_search_within``'s first breadth

    def kept_bytes(self) -> int:
        """Bytes of the gathered vectors and the IVF sub-index this entry keeps."""
        return (self.vectors.nbytes if self.vectors is not None else 0) + self.subindex_bytes


def _hnsw_of(index: faiss.Index) -> faiss.IndexHNSW | None:
    """The HNSW graph index under ``index``'s wrappers (OPQ/PCA transforms, a refinement), or None."""
    if isinstance(index, faiss.IndexPreTransform):
        return _hnsw_of(faiss.downcast_index(index.index))
    if isinstance(index, faiss.IndexRefine):
        return _hnsw_of(faiss.downcast_index(index.base_index))
    return index if isinstance(index, faiss.IndexHNSW) else None

