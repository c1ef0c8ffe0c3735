"""Query-time filters: the language (``retrieval.serving.item_filters``) and the filtered index search.

- ``parse_filters``: bad shapes, operators and values are a RequestError naming them;
- ``FilterTable``: the rows that pass equal a pandas evaluation of the same conditions over the raw item
  frame (strings, numbers with NaN, lists of strings, items the table does not describe); unknown
  columns, operators a column's kind does not take and values of the wrong type are refused by name;
- ``ItemIndex.search(allow=...)``: a Flat index returns exactly the numpy top-k of the allowed rows, with
  exclusions on top, on both search paths (gathered rows, FAISS skipping the others) and at 1, 10 and
  50 % of the catalogue; an IVF returns k items at 1 % where its tuned nprobe alone finds fewer; an HNSW
  never returns fewer than min(k, allowed - excluded).
"""

from __future__ import annotations

import math

import faiss
import numpy as np
import pandas as pd
import pytest

from retrieval.bundle.display_features import DisplayFeatures
from retrieval.index import EXACT_ALWAYS, FAISS_ONLY, ItemIndex, item_index
from retrieval.serving.item_filters import FilterTable, parse_filters
from retrieval.serving.request_checks import RequestError

NUM_ITEMS = 400


@pytest.fixture(scope="module")
def catalogue():
    """Index ids (every 7th item missing from the table, which also describes two items the index lacks)."""
    rng = np.random.default_rng(0)
    ids = [f"i{n:03d}" for n in range(NUM_ITEMS)]
    described = [item for n, item in enumerate(ids) if n % 7]
    count = len(described)
    genres = np.array(["Comedy", "Drama", "Horror", "Sci-Fi"], dtype=object)
    frame = pd.DataFrame({
        "item_id": described + ["gone1", "gone2"],
        "genre": [None if n % 11 == 0 else genres[n % 4] for n in range(count)] + ["Comedy", "Drama"],
        "year": rng.integers(1950, 2020, count + 2).astype(np.int64),
        "price": np.where(rng.random(count + 2) < 0.1, np.nan, rng.uniform(1, 100, count + 2)),
        "tags": [list(rng.choice(["a", "b", "c", "d"], int(rng.integers(0, 3)), replace=False))
                 for _ in range(count + 2)],
    })
    table = DisplayFeatures.from_frame(frame, ids)
    return ids, frame, FilterTable(table, ids)


def _reference(frame: pd.DataFrame, ids: list[str], passes) -> np.ndarray:
    """Index rows whose item's row of ``frame`` passes ``passes(row)``; items without a row never pass."""
    rows = {row["item_id"]: row for _, row in frame.iterrows()}
    return np.array([n for n, item in enumerate(ids) if item in rows and passes(rows[item])], dtype=np.int64)


def _in_range(value, low=-math.inf, high=math.inf):
    return value is not None and not (isinstance(value, float) and math.isnan(value)) and low <= value <= high


CASES = {
    "genre in": ({"genre": {"in": ["Comedy", "Drama"]}}, lambda r: r["genre"] in ("Comedy", "Drama")),
    "genre bare": ({"genre": "Horror"}, lambda r: r["genre"] == "Horror"),
    "year range": ({"year": {"min": 1990, "max": 1999}}, lambda r: 1990 <= r["year"] <= 1999),
    "price max": ({"price": {"max": 30.5}}, lambda r: _in_range(r["price"], high=30.5)),
    "year eq": ({"year": {"eq": 1990}}, lambda r: r["year"] == 1990),
    "year in": ({"year": {"in": [1960, 1961, 2001]}}, lambda r: r["year"] in (1960, 1961, 2001)),
    "tags any": ({"tags": {"in": ["a", "d"]}}, lambda r: bool({"a", "d"} & set(r["tags"]))),
    "tags has": ({"tags": "b"}, lambda r: "b" in r["tags"]),
    "and": ({"genre": {"in": ["Comedy"]}, "year": {"min": 1980}, "tags": {"in": ["c"]}},
            lambda r: r["genre"] == "Comedy" and r["year"] >= 1980 and "c" in r["tags"]),
    "eq and in": ({"genre": {"eq": "Drama", "in": ["Drama", "Comedy"]}}, lambda r: r["genre"] == "Drama"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_rows_that_pass_equal_a_pandas_evaluation(catalogue, case):
    ids, frame, table = catalogue
    filters, passes = CASES[case]
    expected = _reference(frame, ids, passes)
    assert len(expected) > 0, "the case must select something"
    np.testing.assert_array_equal(table.allowed_rows(filters), expected)


def test_an_id_allow_list_passes_undescribed_items_and_ignores_unknown_ids(catalogue):
    ids, _, table = catalogue
    rows = table.allowed_rows({"item_id": {"in": ["i000", "i007", "i013", "nowhere", "gone1"]}})
    assert ids[0] == "i000" and ids[7] == "i007"  # both without a row in the table
    np.testing.assert_array_equal(rows, [0, 7, 13])
    assert table.allowed_rows({"item_id": {"in": []}}).tolist() == []
    both = table.allowed_rows({"item_id": {"in": ["i001", "i002"]}, "genre": {"in": ["Drama", "Comedy", "Horror"]}})
    assert set(both.tolist()) <= {1, 2}
    assert table.allowed_rows(None) is None and table.allowed_rows({}) is None


@pytest.mark.parametrize("filters, message", [
    ("genre=Comedy", r"filters must be an object of column: condition"),
    ({"genre": {"has": ["Comedy"]}}, r"filters\.genre has the operator 'has', which is not one of"),
    ({"year": {"mni": 1990}}, r"filters\.year has the operator 'mni'.*did you mean 'min'\?"),
    ({"genre": {}}, r"filters\.genre is an empty condition"),
    ({"genre": {"in": "Comedy"}}, r"filters\.genre\.in must be a list of values, got 'Comedy'"),
    ({"genre": {"in": []}}, r"filters\.genre\.in is an empty list"),
    ({"genre": {"in": ["Comedy", None]}}, r"filters\.genre\.in\[1\] must be a string, a number or true/false"),
    ({"genre": {"in": ["Comedy", 3]}}, r"filters\.genre\.in mixes numbers and strings"),
    ({"year": {"min": "1990"}}, r"filters\.year\.min must be a number, got '1990'"),
    ({"year": {"max": True}}, r"filters\.year\.max must be a number, got True"),
    ({"year": {"min": float("nan")}}, r"filters\.year\.min must be a finite number"),
    ({"year": {"min": 2000, "max": 1990}}, r"filters\.year: min 2000 is above max 1990"),
    ({"item_id": {"min": 3}}, r"filters\.item_id\.min: the item id takes 'eq' and 'in'"),
    ({"item_id": {"in": [1.5]}}, r"filters\.item_id\.in\[0\] must be an id"),
    ({"": 1}, r"a column name must be a non-empty string"),
])
def test_a_bad_shape_is_refused_naming_it(filters, message):
    with pytest.raises(RequestError, match=message):
        parse_filters(filters)


@pytest.mark.parametrize("filters, message", [
    ({"genr": "Comedy"}, r"filters\.genr: the item table has no column 'genr' .*did you mean 'genre'\?"),
    ({"genre": {"min": 3}}, r"filters\.genre: 'genre' is a string column, which takes \['eq', 'in'\], not 'min'"),
    ({"tags": {"max": 3}}, r"'tags' is a list-of-strings column, which takes \['eq', 'in'\], not 'max'"),
    ({"genre": {"in": [1990]}}, r"'genre' is a string column, so it compares with strings, not 1990"),
    ({"year": "1990"}, r"'year' is a number column, so it compares with numbers, not '1990'"),
    ({"tags": {"in": [1]}}, r"'tags' is a list-of-strings column, so it compares with strings, not 1"),
])
def test_a_column_or_value_the_table_cannot_take_is_refused_naming_it(catalogue, filters, message):
    with pytest.raises(RequestError, match=message):
        catalogue[2].allowed_rows(filters)


def test_a_bundle_without_an_item_table_takes_only_the_id_allow_list(catalogue):
    ids = catalogue[0]
    table = FilterTable(None, ids)
    with pytest.raises(RequestError, match=r"filters\.genre: this bundle has no item table .* only by 'item_id'"):
        table.allowed_rows({"genre": "Comedy"})
    assert table.allowed_rows({"item_id": {"in": ["i003", "i001"]}}).tolist() == [1, 3]
    numbered = FilterTable(None, ["7", "13", "494"])  # an int id is its decimal string, as everywhere
    assert numbered.allowed_rows({"item_id": {"in": [494, 7]}}).tolist() == [0, 2]
    assert numbered.allowed_rows({"item_id": 13}).tolist() == [1]


# --- The filtered search ------------------------------------------------------------------------------


def _vectors(seed: int, num_items: int, dim: int = 16, num_queries: int = 70):
    rng = np.random.default_rng(seed)
    items = rng.normal(size=(num_items, dim)).astype(np.float32)
    return [f"item{n}" for n in range(num_items)], items, rng.normal(size=(num_queries, dim)).astype(np.float32), rng


def _exact_allowed(items, queries, k, allowed, exclude):
    """Reference: numpy argsort of the allowed rows' scores, excluded rows dropped."""
    out = []
    for query, excluded in zip(queries, exclude):
        rows = np.setdiff1d(allowed, excluded)
        order = np.argsort(-(items[rows] @ query), kind="stable")[:k]
        out.append(np.pad(rows[order], (0, k - len(order)), constant_values=-1))
    return np.array(out)


@pytest.mark.parametrize("share", [0.01, 0.1, 0.5])
@pytest.mark.parametrize("routing", [EXACT_ALWAYS, FAISS_ONLY], ids=["exact_top_k", "faiss"])
@pytest.mark.parametrize("num_queries", [1, 70])
@pytest.mark.parametrize("kept", [True, False], ids=["gathered_once", "too_large_to_keep"])
def test_a_flat_index_returns_the_exact_top_k_of_the_allowed_rows(share, routing, num_queries, kept, monkeypatch):
    if not kept:  # no per-filter sub-index: gathered a block at a time, or FAISS skipping rows (1 query, 50 %)
        monkeypatch.setattr(item_index, "SUBINDEX_BYTES", 0)
        monkeypatch.setattr(item_index, "ALLOWED_BLOCK", 97)
    ids, items, queries, rng = _vectors(1, 3000)
    queries = queries[:num_queries]
    index = ItemIndex.build(ids, items)
    index.routing = routing
    allowed = np.sort(rng.choice(len(ids), int(share * len(ids)), replace=False))
    # Each query's exclusions: some of its best allowed rows and some rows the filter drops anyway.
    best = _exact_allowed(items, queries, 5, allowed, [[]] * num_queries)
    exclude = [np.concatenate([best[i, : i % 4], rng.choice(len(ids), 5)]) for i in range(num_queries)]
    top = index.search(queries, 10, exclude=exclude, allow=[allowed] * num_queries)
    np.testing.assert_array_equal(top.rows, _exact_allowed(items, queries, 10, allowed, exclude))
    # Again with the same array: its rows, bitmap and gathered vectors come from the index's cache.
    np.testing.assert_array_equal(index.search(queries, 10, exclude=exclude, allow=[allowed] * num_queries).rows,
                                  top.rows)
    expected_scores = np.take_along_axis(queries @ items.T, top.rows, 1)
    np.testing.assert_allclose(top.scores, expected_scores, rtol=1e-5, atol=1e-5)


def test_queries_with_other_filters_or_none_in_one_batch(catalogue):
    ids, items, queries, rng = _vectors(2, 2000, num_queries=6)
    index = ItemIndex.build(ids, items)
    first, second = np.arange(0, 2000, 3), np.arange(5, 60)
    allow = [first, None, second, first, None, np.zeros(0, np.int64)]
    top = index.search(queries, 7, allow=allow)
    everything = np.arange(len(ids))
    for position, allowed in enumerate(allow):
        expected = _exact_allowed(items, queries[position : position + 1], 7,
                                  everything if allowed is None else allowed, [[]])[0]
        np.testing.assert_array_equal(top.rows[position], expected)
    with pytest.raises(ValueError, match=r"allow names row 2000, which is not in the index"):
        index.search(queries[:1], 3, allow=[np.array([1, 2000])])
    with pytest.raises(ValueError, match=r"allow has 1 entries for 6 queries"):
        index.search(queries, 3, allow=[first])


def test_an_ivf_index_returns_k_items_at_one_percent_where_its_nprobe_alone_would_not():
    ids, items, queries, rng = _vectors(3, 20_000, num_queries=40)
    index = ItemIndex.build(ids, items, "IVF128,Flat")
    index.set_search_params("nprobe=4")
    allowed = np.sort(rng.choice(len(ids), 200, replace=False))  # 1 %
    k = 10
    # What the unfiltered search at nprobe=4 reaches: its 4 lists hold ~ 4/128 of the allowed rows.
    reached = index.search(queries, len(ids))  # every item of the probed lists
    short = [np.isin(rows[rows >= 0], allowed).sum() for rows in reached.rows]
    assert min(short) < k, "the fixture must need the wider probe"
    exclude = [allowed[:3]] * len(queries)
    top = index.search(queries, k, exclude=exclude, allow=[allowed] * len(queries))
    assert ((top.rows >= 0).sum(axis=1) == k).all()
    assert np.isin(top.rows, allowed).all() and not np.isin(top.rows, allowed[:3]).any()
    exact = _exact_allowed(items, queries, k, allowed, exclude)
    recall = np.mean([len(np.intersect1d(found, truth)) / k for found, truth in zip(top.rows, exact)])
    assert recall >= 0.9, recall


@pytest.mark.parametrize("candidates", [10.0, 0.0])
def test_an_ivf_index_probes_lists_with_a_selector_when_many_items_pass(candidates):
    ids, items, queries, rng = _vectors(5, 20_000, num_queries=30)
    index = ItemIndex.build(ids, items, "IVF128,Flat")
    index.set_search_params("nprobe=4")
    index.filter_candidates = candidates
    allowed = np.sort(rng.choice(len(ids), 10_000, replace=False))  # 50 %: fewer lists hold them than pass
    exact = _exact_allowed(items, queries, 10, allowed, [[]] * len(queries))
    exclude = [exact[i, :3] for i in range(len(queries))]  # each query's best three allowed rows
    top = index.search(queries, 10, exclude=exclude, allow=[allowed] * len(queries))
    assert ((top.rows >= 0).sum(axis=1) == 10).all()
    assert np.isin(top.rows, allowed).all()
    assert not any(np.isin(rows, own).any() for rows, own in zip(top.rows, exclude))
    if candidates:  # lists holding 10 k passing vectors: about the recall of the unfiltered search at its nprobe
        truth = _exact_allowed(items, queries, 10, allowed, exclude)
        recall = np.mean([len(np.intersect1d(found, best)) / 10 for found, best in zip(top.rows, truth)])
        everything = _exact_allowed(items, queries, 10, np.arange(len(ids)), [[]] * len(queries))
        unfiltered = np.mean([len(np.intersect1d(found, best)) / 10
                              for found, best in zip(index.search(queries, 10).rows, everything)])
        assert recall >= unfiltered - 0.1, (recall, unfiltered)


@pytest.mark.parametrize("kept", [True, False], ids=["sub_index", "too_large_to_keep"])
def test_an_ivf_index_returns_the_best_passing_items_of_the_lists_it_probes(kept, monkeypatch):
    """Brute force over the rows a pandas filter passes, within the lists the IVF probes: what the first
    search (skipping every other row) and every later one (the filter's own sub-index, or skipping again
    when it is too large to keep) return, one query or a batch, with exclusions."""
    if not kept:
        monkeypatch.setattr(item_index, "SUBINDEX_BYTES", 0)
    ids, items, queries, rng = _vectors(6, 20_000, num_queries=30)
    frame = pd.DataFrame({"item_id": ids, "bucket": rng.integers(0, 100, len(ids)).astype(np.int64)})
    table = FilterTable(DisplayFeatures.from_frame(frame, ids), ids)
    index = ItemIndex.build(ids, items, "IVF64,Flat")
    index.set_search_params("nprobe=2")
    allowed = table.allowed_rows({"bucket": {"max": 9}})
    passing = np.flatnonzero((frame["bucket"] <= 9).to_numpy())  # frame row n is index row n
    k, lists = 10, index.index.invlists
    # Where the index keeps each item, and the lists a query probes: the nearest that hold 10 x k passing items.
    item_list = np.empty(len(ids), np.int64)
    for number in range(64):
        item_list[faiss.rev_swig_ptr(lists.get_ids(number), lists.list_size(number))] = number
    probes = math.ceil(index.filter_candidates * k / (len(passing) / 64))
    assert 2 < probes < 64, "more lists than the tuned nprobe, fewer than the allowed rows' whole"
    probed = index.index.quantizer.search(queries, probes)[1]
    exclude = [passing[np.isin(item_list[passing], own)][: i % 3] for i, own in enumerate(probed)]
    expected = np.vstack([_exact_allowed(items, queries[i : i + 1], k, passing[np.isin(item_list[passing], own)],
                                         [exclude[i]]) for i, own in enumerate(probed)])
    assert (expected >= 0).all()
    for _ in range(3):  # the first skips the other rows; from the second on, the sub-index (when kept)
        top = index.search(queries, k, exclude=exclude, allow=[allowed] * len(queries))
        np.testing.assert_array_equal(top.rows, expected)
        np.testing.assert_allclose(top.scores, np.take_along_axis(queries @ items.T, expected, 1), rtol=1e-5,
                                   atol=1e-5)
        for i in (0, 7):
            alone = index.search(queries[i : i + 1], k, exclude=[exclude[i]], allow=[allowed])
            np.testing.assert_array_equal(alone.rows[0], expected[i])
    (entry,) = index._allow_cache.values()
    assert (entry.subindex is not None) == kept
    if kept:
        assert entry.subindex.ntotal == len(passing)


def test_an_hnsw_index_never_returns_fewer_than_the_allowed_rows_left():
    ids, items, queries, rng = _vectors(4, 3000, num_queries=20)
    index = ItemIndex.build(ids, items, "HNSW16")
    index.set_search_params("efSearch=16")
    allowed = np.sort(rng.choice(len(ids), 30, replace=False))
    exclude = [allowed[: i % 5] for i in range(len(queries))]
    top = index.search(queries, 40, exclude=exclude, allow=[allowed] * len(queries))
    for rows, excluded in zip(top.rows, exclude):
        found = rows[rows >= 0]
        assert len(found) == len(allowed) - len(excluded)  # fewer than k = 40 pass: all of them
        assert np.isin(found, allowed).all() and not np.isin(found, excluded).any()
