"""ExactTopK against np.argsort of the full float64 score matrix, over seeds and shapes.

Every test runs twice: with the compiled selection (numba) and with the numpy one it falls back to.
"""

from concurrent.futures import ThreadPoolExecutor

import faiss
import numpy as np
import pytest

import retrieval.index as index_module
import retrieval.index.exact_topk as exact_topk
from retrieval.index import ItemIndex
from retrieval.index.exact_topk import ExactTopK

NEAR_TIE = 1e-5  # float32 blocked sgemm vs float64: ids may swap only between scores this close


@pytest.fixture(autouse=True, params=["compiled", "numpy"])
def selection(request, monkeypatch):
    """Which selection ExactTopK runs: the compiled kernel, or the numpy fallback (numba absent)."""
    if request.param == "compiled":
        if exact_topk.compiled_kernel() is None:
            pytest.skip("numba is not installed: ExactTopK falls back to the numpy selection")
    else:
        monkeypatch.setattr(exact_topk, "compiled_kernel", lambda: None)
    return request.param


def _only(selection: str, wanted: str) -> None:
    if selection != wanted:
        pytest.skip(f"checks the {wanted} selection only")


def _data(seed: int, num_items: int, num_queries: int, dim: int = 16):
    rng = np.random.default_rng(seed)
    items = rng.normal(size=(num_items, dim)).astype(np.float32)
    queries = rng.normal(size=(num_queries, dim)).astype(np.float32)
    return rng, items, queries


def _exclusions(rng, num_queries: int, num_items: int, most: int):
    return [rng.choice(num_items, rng.integers(0, most + 1), replace=False) for _ in range(num_queries)]


def _assert_top_k(scores, rows, queries, items, k, exclude=None):
    """rows/scores equal np.argsort's top-k of queries @ items.T (float64), excluded items removed."""
    full = queries.astype(np.float64) @ items.astype(np.float64).T
    for query, excluded in enumerate(exclude or []):
        full[query, excluded] = -np.inf
    order = np.argsort(-full, axis=1, kind="stable")[:, :k]
    expected = np.take_along_axis(full, order, axis=1)
    width = expected.shape[1]
    assert scores.shape == rows.shape == (len(queries), k)
    assert scores.dtype == np.float32 and rows.dtype == np.int64
    found = np.isfinite(expected)
    np.testing.assert_allclose(scores[:, :width][found], expected[found], atol=NEAR_TIE)
    # Positions whose score is within NEAR_TIE of a neighbour's may hold either id.
    with np.errstate(invalid="ignore"):  # -inf - -inf past the last item
        gap = np.abs(np.diff(expected, axis=1)) < NEAR_TIE
    tied = np.zeros_like(found)
    tied[:, 1:] |= gap
    tied[:, :-1] |= gap
    same = rows[:, :width] == np.where(found, order, -1)
    assert same[~tied].all(), f"{int((~same[~tied]).sum())} ids differ from np.argsort"
    assert (rows[:, :width][~found] == -1).all() and np.isneginf(scores[:, :width][~found]).all()
    assert (rows[:, width:] == -1).all() and np.isneginf(scores[:, width:]).all()
    for row in rows:
        real = row[row >= 0]
        assert len(np.unique(real)) == len(real), "an item was returned twice"


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("num_items", "k", "block_items", "query_chunk", "threads"),
    [
        (5_000, 10, 256, 32, 1),  # many blocks; the last block is partial (5000 = 19 * 256 + 136)
        (5_000, 100, 256, 64, 2),  # block raised to 4k = 400; two threads
        (3_001, 700, 256, 16, 2),  # k close to the corpus: few blocks, many cut-backs
        (20_000, 1000, 1024, 128, 2),  # extrapolated thresholds (guess) engage
        (9_999, 50, 128, 500, 3),  # one query chunk: the corpus is split between threads, then merged
    ],
)
def test_equals_argsort_with_and_without_exclusions(seed, num_items, k, block_items, query_chunk, threads):
    rng, items, queries = _data(seed, num_items, 200)
    search = ExactTopK(items, block_items=block_items, query_chunk=query_chunk, threads=threads)
    _assert_top_k(*search.search(queries, k), queries, items, k)
    exclude = _exclusions(rng, len(queries), num_items, most=300)
    _assert_top_k(*search.search(queries, k, exclude), queries, items, k, exclude)


@pytest.mark.parametrize("k", [37, 40, 41, 100])
def test_k_at_or_past_the_corpus_pads(k):
    rng, items, queries = _data(3, 40, 25, dim=8)
    search = ExactTopK(items, block_items=16, query_chunk=8, threads=2)
    scores, rows = search.search(queries, k)
    _assert_top_k(scores, rows, queries, items, k)
    assert (rows[:, : min(k, 40)] >= 0).all()
    exclude = _exclusions(rng, len(queries), 40, most=20)
    _assert_top_k(*search.search(queries, k, exclude), queries, items, k, exclude)


def test_exclusions_may_leave_fewer_than_k():
    _, items, queries = _data(4, 500, 6)
    exclude = [np.arange(495), np.arange(500), np.zeros(0, np.int64), np.arange(0, 500, 2), np.array([7]),
               np.arange(10)]
    scores, rows = ExactTopK(items, block_items=64, query_chunk=2).search(queries, 20, exclude)
    _assert_top_k(scores, rows, queries, items, 20, exclude)
    assert (rows[0] >= 0).sum() == 5 and (rows[1] == -1).all()


def test_out_of_range_and_repeated_exclusions_are_ignored():
    rng, items, queries = _data(5, 2_000, 30)
    exclude = [np.concatenate([e, e, [-1, 2_000, 10**9]]) for e in _exclusions(rng, 30, 2_000, most=50)]
    clean = [e[(e >= 0) & (e < 2_000)] for e in exclude]
    scores, rows = ExactTopK(items, block_items=128, query_chunk=8).search(queries, 30, exclude)
    _assert_top_k(scores, rows, queries, items, 30, clean)


def test_a_guess_that_is_too_high_is_searched_again(monkeypatch, selection):
    """Extrapolated thresholds far too high drop top-k items; the end-of-scan check must catch every one."""
    _only(selection, "numpy")
    monkeypatch.setattr(exact_topk, "GUESS_MARGIN", 50.0)
    monkeypatch.setattr(exact_topk, "GUESS_MIN_RANK", 1)
    calls = []
    original = exact_topk._chunk_top_k

    def counting(queries, *args, **kwargs):
        calls.append(kwargs.get("guess", True))
        return original(queries, *args, **kwargs)

    monkeypatch.setattr(exact_topk, "_chunk_top_k", counting)
    rng, items, queries = _data(6, 8_000, 40)
    exclude = _exclusions(rng, 40, 8_000, most=100)
    _assert_top_k(*ExactTopK(items, block_items=256, query_chunk=40, threads=1).search(queries, 200, exclude),
                  queries, items, 200, exclude)
    assert False in calls, "no query was searched again: the guess never failed, so this test checks nothing"


def test_items_sorted_by_score_grow_the_buffer():
    """The first blocks are the worst items, so every block beats the threshold (the buffer must grow)."""
    _, items, queries = _data(7, 4_000, 1)
    items = items[np.argsort(items @ queries[0])]
    queries = np.repeat(queries, 3, axis=0) + np.float32(1e-3) * np.arange(3, dtype=np.float32)[:, None]
    _assert_top_k(*ExactTopK(items, block_items=128, query_chunk=4).search(queries, 300), queries, items, 300)


def test_zero_queries_tie_everywhere_but_return_k_distinct_items():
    _, items, _ = _data(8, 3_000, 1)
    scores, rows = ExactTopK(items, block_items=256).search(np.zeros((4, 16), np.float32), 50)
    assert (scores == 0).all()
    assert all(len(np.unique(row)) == 50 for row in rows) and (rows >= 0).all()


def test_no_queries():
    scores, rows = ExactTopK(np.ones((10, 4), np.float32)).search(np.zeros((0, 4), np.float32), 3)
    assert scores.shape == rows.shape == (0, 3)


def test_bad_arguments_name_themselves():
    search = ExactTopK(np.ones((10, 4), np.float32))
    with pytest.raises(ValueError, match=r"queries must be \[num_queries, 4\]"):
        search.search(np.ones((2, 3), np.float32), 1)
    with pytest.raises(ValueError, match="k must be positive, got 0"):
        search.search(np.ones((2, 4), np.float32), 0)
    with pytest.raises(ValueError, match="exclude has 1 entries for 2 queries"):
        search.search(np.ones((2, 4), np.float32), 1, [np.zeros(0, np.int64)])
    with pytest.raises(ValueError, match="NaN or inf"):
        search.search(np.full((2, 4), np.nan, np.float32), 1)
    with pytest.raises(ValueError, match="items must be"):
        ExactTopK(np.ones(10, np.float32))
    with pytest.raises(ValueError, match="block_items must be positive, got 0"):
        ExactTopK(np.ones((10, 4), np.float32), block_items=0)
    with pytest.raises(ValueError, match="threads must be positive, got -1"):
        ExactTopK(np.ones((10, 4), np.float32), threads=-1)


def test_item_index_flat_search_takes_the_exact_path_and_matches_faiss(monkeypatch):
    rng, items, queries = _data(9, 3_000, 150)
    index = ItemIndex.build([f"i{i}" for i in range(len(items))], items, "Flat")
    exclude = _exclusions(rng, len(queries), len(items), most=40)
    assert not index.routing.uses_exact_top_k(len(queries), len(items)), "3k items go to FAISS by default"
    by_faiss = index.search(queries, 25, exclude=exclude)
    index.routing = index_module.EXACT_ALWAYS
    used = []
    original = ExactTopK.search
    monkeypatch.setattr(ExactTopK, "search", lambda self, *a, **kw: used.append(1) or original(self, *a, **kw))
    by_exact = index.search(queries, 25, exclude=exclude)
    assert used, "the Flat index did not search with ExactTopK"
    _assert_top_k(by_exact.scores, by_exact.rows, queries, items, 25, exclude)
    np.testing.assert_allclose(by_exact.scores, by_faiss.scores, atol=NEAR_TIE)
    assert np.mean(by_exact.rows == by_faiss.rows) > 0.999
    oracle = index_module.exact_search(items, queries, 25)
    _assert_top_k(oracle.scores, oracle.rows, queries, items, 25)


def test_flat_vectors_is_a_view_of_the_index():
    items = np.arange(12, dtype=np.float32).reshape(3, 4)
    flat = faiss.IndexFlatIP(4)
    flat.add(items)
    np.testing.assert_array_equal(index_module.flat_vectors(flat), items)


def test_concurrent_searches_are_exact_and_restore_the_blas_threads():
    _, items, queries = _data(10, 6_000, 300)
    search = ExactTopK(items, block_items=512, query_chunk=64, threads=2)
    before = exact_topk.blas_threads()
    with ThreadPoolExecutor(3) as pool:
        found = list(pool.map(lambda _: search.search(queries, 20), range(3)))
    for scores, rows in found:
        _assert_top_k(scores, rows, queries, items, 20)
    assert exact_topk.blas_threads() == before


@pytest.mark.parametrize("dense_share", [0.0, 2.0])
def test_whole_block_and_segment_screens_both_equal_argsort(monkeypatch, selection, dense_share):
    """DENSE_SEGMENTS 0 compares every score of every block; 2 always screens by segment maxima first."""
    _only(selection, "numpy")
    monkeypatch.setattr(exact_topk, "DENSE_SEGMENTS", dense_share)
    rng, items, queries = _data(11, 7_003, 90)
    exclude = _exclusions(rng, len(queries), len(items), most=200)
    for k in (1, 17, 300):
        search = ExactTopK(items, block_items=200, query_chunk=32, threads=2)  # 200 -> 208, a SEGMENT multiple
        _assert_top_k(*search.search(queries, k), queries, items, k)
        _assert_top_k(*search.search(queries, k, exclude), queries, items, k, exclude)


def test_masked_items_that_would_win_are_dropped_among_survivors():
    """Each query's 40 best items are excluded: they beat every threshold, so only the survivor lookup drops them."""
    _, items, queries = _data(12, 6_000, 50)
    full = queries.astype(np.float64) @ items.astype(np.float64).T
    exclude = list(np.argsort(-full, axis=1)[:, :40])
    search = ExactTopK(items, block_items=256, query_chunk=16, threads=2)
    scores, rows = search.search(queries, 25, exclude)
    _assert_top_k(scores, rows, queries, items, 25, exclude)
    assert not any(np.isin(r, e).any() for r, e in zip(rows, exclude))


@pytest.mark.parametrize("num_items", [1, 15, 16, 17, 1_000])
def test_k_equal_to_the_catalogue_with_and_without_masks(num_items):
    rng, items, queries = _data(13, num_items, 9, dim=5)
    search = ExactTopK(items, block_items=16, query_chunk=4, threads=2)
    _assert_top_k(*search.search(queries, num_items), queries, items, num_items)
    exclude = _exclusions(rng, len(queries), num_items, most=num_items)
    scores, rows = search.search(queries, num_items, exclude)
    _assert_top_k(scores, rows, queries, items, num_items, exclude)
    assert [(r >= 0).sum() for r in rows] == [num_items - len(e) for e in exclude]


def test_k_past_the_unmasked_items_in_a_large_catalogue():
    """Thresholds stay -inf for queries left with fewer than k items: every unmasked item is a survivor."""
    rng, items, queries = _data(14, 5_000, 12)
    exclude = [rng.choice(5_000, 5_000 - keep, replace=False) for keep in rng.integers(0, 60, size=12)]
    scores, rows = ExactTopK(items, block_items=512, query_chunk=4, threads=2).search(queries, 100, exclude)
    _assert_top_k(scores, rows, queries, items, 100, exclude)
    assert [(r >= 0).sum() for r in rows] == [5_000 - len(e) for e in exclude]


def test_tiny_inputs():
    items = np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], np.float32)
    queries = np.array([[1.0, 0.0], [0.0, 2.0]], np.float32)
    scores, rows = ExactTopK(items).search(queries, 2)
    np.testing.assert_array_equal(rows, [[0, 2], [1, 2]])
    np.testing.assert_allclose(scores, [[1.0, 0.6], [2.0, 1.6]], rtol=1e-6)
    scores, rows = ExactTopK(items).search(queries, 5, [np.array([0]), np.array([0, 1, 2])])
    np.testing.assert_array_equal(rows, [[2, 1, -1, -1, -1], [-1] * 5])
    assert np.isneginf(scores[1]).all() and np.isneginf(scores[0, 2:]).all()
    scores, rows = ExactTopK(np.zeros((0, 2), np.float32)).search(queries, 3)
    assert (rows == -1).all() and np.isneginf(scores).all() and rows.shape == (2, 3)


def test_a_sample_guess_that_is_too_high_is_searched_again(monkeypatch, selection):
    """A sample threshold far too high (about k / 20 items beat it) drops top-k items; every query is searched again."""
    _only(selection, "compiled")
    monkeypatch.setattr(exact_topk, "SAMPLE_EXPECTED", 0.05)
    monkeypatch.setattr(exact_topk, "SAMPLE_RANK", 4)  # the sample: 4 * 8,000 / (0.05 * 200) = 3,200 items
    calls = []
    original = exact_topk._compiled_chunk_top_k

    def counting(queries, *args, **kwargs):
        calls.append((len(queries), kwargs.get("guess", True)))
        return original(queries, *args, **kwargs)

    monkeypatch.setattr(exact_topk, "_compiled_chunk_top_k", counting)
    rng, items, queries = _data(6, 8_000, 40)
    exclude = _exclusions(rng, 40, 8_000, most=100)
    _assert_top_k(*ExactTopK(items, block_items=256, query_chunk=40, threads=1).search(queries, 200, exclude),
                  queries, items, 200, exclude)
    assert (40, False) in calls, f"every query's guess was too high, yet the searches were {calls}"


def test_a_sample_guess_that_holds_is_not_searched_again(monkeypatch, selection):
    """At the default sample size the guess engages (k >= 48) and, on random data, no query needs a second search."""
    _only(selection, "compiled")
    calls = []
    original = exact_topk._compiled_chunk_top_k
    monkeypatch.setattr(exact_topk, "_compiled_chunk_top_k",
                        lambda queries, *a, **kw: calls.append(kw.get("guess", True)) or original(queries, *a, **kw))
    guessed = []
    kernel = exact_topk.compiled_kernel()
    cut_back = kernel.cut_back
    monkeypatch.setattr(kernel, "cut_back", lambda *args: guessed.append(args[-1]) or cut_back(*args))
    rng, items, queries = _data(15, 30_000, 64)
    exclude = _exclusions(rng, 64, 30_000, most=50)
    _assert_top_k(*ExactTopK(items, block_items=512, query_chunk=64, threads=1).search(queries, 300, exclude),
                  queries, items, 300, exclude)
    assert guessed == [exact_topk.SAMPLE_RANK], "the sample phase did not run"
    assert calls == [True], f"searched again: {calls}"


@pytest.mark.parametrize("seed", range(4))
def test_compiled_select_keeps_the_k_largest_with_ties(selection, seed):
    """select_best against np.sort: the first k values are the k largest (as a multiset), rows move with them."""
    _only(selection, "compiled")
    kernel = exact_topk.compiled_kernel()
    rng = np.random.default_rng(seed)
    for _ in range(300):
        n = int(rng.integers(1, 80))
        k = int(rng.integers(1, n + 1))
        values = (rng.integers(0, 4, size=n) if seed % 2 else rng.normal(size=n)).astype(np.float32)
        moved, rows = values.copy(), np.arange(n, dtype=np.int64)
        kth = kernel.select_best(moved, rows, n, k)
        expected = np.sort(values)[::-1][:k]
        assert kth == expected[-1]
        np.testing.assert_array_equal(np.sort(moved[:k]), np.sort(expected))
        np.testing.assert_array_equal(values[rows], moved)


def test_compiled_block_remainders_and_segments(selection):
    """Blocks whose width is not a multiple of the kernel's SEGMENT: the last rows go through its row-by-row tail."""
    _only(selection, "compiled")
    rng, items, queries = _data(16, 1_037, 23)
    exclude = _exclusions(rng, 23, 1_037, most=30)
    for block_items in (16, 100, 1_024):  # 1,037 items: tails of 13, 37 (rounded to 112) and 13 rows
        search = ExactTopK(items, block_items=block_items, query_chunk=5, threads=2)
        for k in (1, 9, 60):
            _assert_top_k(*search.search(queries, k, exclude), queries, items, k, exclude)


def test_a_single_worker_runs_its_products_on_one_blas_thread(monkeypatch, selection):
    """threads=1 (one task, no pool) limits BLAS to one thread as the pool's workers do, and restores it after."""
    name = "_compiled_chunk_top_k" if selection == "compiled" else "_chunk_top_k"
    original = getattr(exact_topk, name)
    seen = []
    monkeypatch.setattr(exact_topk, name,
                        lambda *args, **kwargs: seen.append(exact_topk.blas_threads()) or original(*args, **kwargs))
    _, items, queries = _data(17, 2_000, 20)
    before = exact_topk.blas_threads()
    _assert_top_k(*ExactTopK(items, threads=1).search(queries, 7), queries, items, 7)
    assert seen == [1], f"BLAS threads during the search: {seen}"
    assert exact_topk.blas_threads() == before


@pytest.mark.parametrize("width", [1, 2, 7, 1_000])
def test_the_final_order_equals_a_stable_argsort_of_the_negated_scores(selection, width):
    """The keyed sort behind every result's order against ``np.argsort(-scores, kind="stable")``: signs,
    -0.0 beside 0.0, -inf, subnormals and ties (kept in position order)."""
    _only(selection, "numpy")  # one function, whichever selection runs
    rng = np.random.default_rng(width)
    special = np.array([0.0, -0.0, -np.inf, 1e-45, -1e-45, 3.0e38, -3.0e38, 1.0, -1.0], dtype=np.float32)
    scores = np.where(rng.random((50, width)) < 0.3, rng.choice(special, (50, width)),
                      rng.normal(size=(50, width))).astype(np.float32)
    scores[::5] = np.round(scores[::5])  # rows full of ties
    np.testing.assert_array_equal(exact_topk._descending_order(scores), np.argsort(-scores, axis=1, kind="stable"))
