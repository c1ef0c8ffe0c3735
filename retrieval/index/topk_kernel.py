"""ExactTopK's selection compiled with numba: each score block read once, right after its sgemm.

``ExactTopK`` computes a block of scores with one sgemm, item-major ([block, queries]),
into a buffer that still sits in the core's cache. ``screen_block`` then reads each score
once: the max of every ``SEGMENT`` consecutive items for each query (vertical maxima of
whole rows, which the compiler vectorises across queries) and, in the same loop, a flag
per query whose max beats its threshold. Segments where none does cost that one read;
otherwise the flags are scanned eight at a time (as 64-bit words) and each flagged
(segment, query) pair item by item, its scores above the threshold offered to the
query's reservoir.

The reservoir holds up to ``capacity`` candidates a query; when full, an in-place
quickselect (``select_best``) keeps the best k and raises the query's threshold to the
k-th of them, so the threshold is always a proven lower bound of the final k-th best.
Masked items are looked up among a query's excluded rows (sorted, binary search) only
when they pass the threshold, so masks cost nothing elsewhere.

Every function releases the GIL (``nogil``): ExactTopK's worker threads run them in
parallel. Compiled once per machine (``cache=True`` keeps the machine code beside this
file, or in numba's cache directory where that is read-only).
"""

from __future__ import annotations

import numba
import numpy as np

SEGMENT = 8  # items per segment: one hit costs SEGMENT scores read again (strided)


@numba.njit(nogil=True, cache=True)
def select_best(values: np.ndarray, rows: np.ndarray, n: int, k: int) -> float:
    """Rearranges ``values[:n]`` (and ``rows`` alike) so that the first k are the k largest; returns the k-th largest.

    Quickselect (Hoare partition, median-of-three pivot), in place, 1 <= k <= n.
    """
    lo = 0
    hi = n - 1
    target = k - 1
    while lo < hi:
        a = values[lo]
        b = values[(lo + hi) >> 1]
        c = values[hi]
        if a < b:
            a, b = b, a
        if b < c:
            b = c
            if a < b:
                b = a
        pivot = b  # the median of a, b, c
        i = lo
        j = hi
        while i <= j:
            while values[i] > pivot:
                i += 1
            while values[j] < pivot:
                j -= 1
            if i <= j:
                values[i], values[j] = values[j], values[i]
                rows[i], rows[j] = rows[j], rows[i]
                i += 1
                j -= 1
        # values[lo:j+1] >= pivot >= values[i:hi+1]; between them (if anything) equals the pivot.
        if target <= j:
            hi = j
        elif target >= i:
            lo = i
        else:
            break
    return values[target]


@numba.njit(nogil=True, cache=True, inline="always")
def _excluded(starts: np.ndarray, excluded: np.ndarray, query: int, item: int) -> bool:
    """Whether ``item`` is among ``excluded[starts[query]:starts[query + 1]]`` (sorted, not empty).

    A branch-free binary search: the halving step compiles to a conditional move, so a
    candidate's lookup costs no mispredicted branches.
    """
    base = starts[query]
    n = starts[query + 1] - base
    while n > 1:
        half = n >> 1
        base = base + half if excluded[base + half] <= item else base
        n -= half
    return excluded[base] == item


@numba.njit(nogil=True, cache=True, inline="always")
def _offer(value, item, query, threshold, kept_scores, kept_rows, count, k, capacity, starts, excluded):
    """Adds (value, item) to ``query``'s reservoir unless masked; a full reservoir is cut back to k first."""
    if starts[query] < starts[query + 1] and _excluded(starts, excluded, query, item):
        return
    if count[query] == capacity:
        kth = select_best(kept_scores[query], kept_rows[query], capacity, k)
        count[query] = k
        if kth > threshold[query]:
            threshold[query] = kth
        if not value > threshold[query]:
            return
    slot = count[query]
    kept_scores[query, slot] = value
    kept_rows[query, slot] = item
    count[query] = slot + 1


@numba.njit(nogil=True, cache=True)
def screen_block(scores, width, first_item, threshold, kept_scores, kept_rows, count, k, capacity, starts,
                 excluded, flags, flag_words):
    """Offers every score of ``scores[:width]`` above its query's threshold to that query's reservoir.

    Args:
      scores: [block, m] float32, item-major: row i holds item ``first_item + i`` for the m queries.
      width: rows of ``scores`` that hold this block's items.
      first_item: corpus row of ``scores[0]``.
      threshold: [m] float32, each query's current bound (raised in place at cut-backs).
      kept_scores, kept_rows: [m, capacity] reservoirs; count: [m] int64 slots in use.
      k: what a cut-back keeps; capacity: slots a query (k < capacity <= kept_scores.shape[1]).
      starts, excluded: the queries' excluded rows, CSR: ``excluded[starts[q]:starts[q + 1]]`` sorted.
      flags: [8 * ceil(m / 8)] uint8 scratch (zero past m); flag_words: the same memory as uint64.
    """
    m = scores.shape[1]
    full = width - width % SEGMENT
    for s0 in range(0, full, SEGMENT):
        r0 = scores[s0]
        r1 = scores[s0 + 1]
        r2 = scores[s0 + 2]
        r3 = scores[s0 + 3]
        r4 = scores[s0 + 4]
        r5 = scores[s0 + 5]
        r6 = scores[s0 + 6]
        r7 = scores[s0 + 7]
        hits = 0
        for q in range(m):  # vectorised across queries: vertical maxima, a flag and a count of those over threshold
            top = max(max(max(r0[q], r1[q]), max(r2[q], r3[q])), max(max(r4[q], r5[q]), max(r6[q], r7[q])))
            over = top > threshold[q]
            flags[q] = over
            hits += over
        if hits == 0:
            continue
        for word in range(len(flag_words)):  # the flags 8 at a time: most words are 0
            if flag_words[word] == 0:
                continue
            for q in range(8 * word, 8 * word + 8):
                if flags[q]:
                    for i in range(s0, s0 + SEGMENT):
                        value = scores[i, q]
                        if value > threshold[q]:
                            _offer(value, first_item + i, q, threshold, kept_scores, kept_rows, count, k, capacity,
                                   starts, excluded)
    for i in range(full, width):
        for q in range(m):
            value = scores[i, q]
            if value > threshold[q]:
                _offer(value, first_item + i, q, threshold, kept_scores, kept_rows, count, k, capacity, starts,
                       excluded)


@numba.njit(nogil=True, cache=True)
def cut_back(kept_scores, kept_rows, count, threshold, k):
    """Each reservoir holding at least k candidates keeps its best k; its threshold rises to the k-th of them."""
    for q in range(kept_scores.shape[0]):
        if count[q] >= k:
            kth = select_best(kept_scores[q], kept_rows[q], count[q], k)
            count[q] = k
            if kth > threshold[q]:
                threshold[q] = kth


@numba.njit(nogil=True, cache=True)
def best_unsorted(kept_scores, kept_rows, count, k, out_scores, out_rows):
    """Each reservoir's best k, in no order, into [m, k] ``out_scores``/``out_rows``; -inf and -1 past its count.

    The caller sorts them (numpy's vectorised argsort beats a compiled per-row sort).
    """
    for q in range(kept_scores.shape[0]):
        n = count[q]
        if n > k:
            select_best(kept_scores[q], kept_rows[q], n, k)
            n = k
        out_scores[q, :n] = kept_scores[q, :n]
        out_rows[q, :n] = kept_rows[q, :n]
        out_scores[q, n:] = -np.inf
        out_rows[q, n:] = -1
