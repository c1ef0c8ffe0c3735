"""FAISS index: top-k equals numpy argsort of the dot products; exclusions; round trip."""

import numpy as np
import pytest

from retrieval.common.arrays import drop_members
from retrieval.index import ItemIndex


def _random_catalogue(seed, num_items=500, dim=16):
    rng = np.random.default_rng(seed)
    ids = [f"item{i}" for i in range(num_items)]
    return ids, rng.normal(size=(num_items, dim)).astype(np.float32), rng.normal(size=(40, dim)).astype(np.float32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flat_top_k_equals_numpy_argsort(seed):
    ids, items, queries = _random_catalogue(seed)
    index = ItemIndex.build(ids, items)
    assert index.is_exact
    top = index.search(queries, k=10)
    expected = np.argsort(-(queries @ items.T), axis=1, kind="stable")[:, :10]
    np.testing.assert_array_equal(top.rows, expected)
    np.testing.assert_allclose(top.scores, np.take_along_axis(queries @ items.T, expected, axis=1), rtol=1e-5)


def test_excluded_rows_never_returned_and_order_kept():
    ids, items, queries = _random_catalogue(3)
    index = ItemIndex.build(ids, items)
    scores = queries @ items.T
    full = np.argsort(-scores, axis=1)
    exclude = [full[i, : i % 7] for i in range(len(queries))]  # drop each query's best i % 7 rows
    top = index.search(queries, k=10, exclude=exclude)
    for i in range(len(queries)):
        expected = [r for r in full[i] if r not in set(exclude[i].tolist())][:10]
        np.testing.assert_array_equal(top.rows[i], expected)


def test_drop_members_by_hand():
    # Members and padding (-1) anywhere in a row move to its end as -1 / -inf; the rest keep their order.
    rows = np.array([[4, -1, 2, 7, 1], [3, 5, 6, 3, 8]])
    scores = np.array([[5.0, 4.0, 3.0, 2.0, 1.0], [9.0, 8.0, 7.0, 6.0, 5.0]])
    kept_rows, kept_scores = drop_members(rows, scores, [np.array([2]), np.array([3, 99])])
    assert kept_rows.tolist() == [[4, 7, 1, -1, -1], [5, 6, 8, -1, -1]]
    assert kept_scores.tolist() == [[5.0, 2.0, 1.0, -np.inf, -np.inf], [8.0, 7.0, 5.0, -np.inf, -np.inf]]


def test_asking_for_more_than_the_catalogue_pads():
    ids, items, queries = _random_catalogue(4, num_items=5)
    top = ItemIndex.build(ids, items).search(queries[:2], k=8, exclude=[np.array([0]), np.array([], dtype=int)])
    assert (top.rows[0] >= 0).sum() == 4 and (top.rows[1] >= 0).sum() == 5
    assert np.all(np.isneginf(top.scores[top.rows < 0]))


def test_save_load_round_trip(tmp_path):
    ids, items, queries = _random_catalogue(5)
    index = ItemIndex.build(ids, items)
    index.save(tmp_path)
    loaded = ItemIndex.load(tmp_path)
    assert list(loaded.item_ids) == ids
    np.testing.assert_array_equal(loaded.search(queries, 5).rows, index.search(queries, 5).rows)


def test_bad_inputs():
    ids, items, queries = _random_catalogue(6)
    with pytest.raises(ValueError, match="unique"):
        ItemIndex.build(["a", "a"], items[:2])
    with pytest.raises(ValueError, match="factory"):
        ItemIndex.build(ids, items, factory="NotAnIndex")
    with pytest.raises(ValueError, match="NaN"):
        bad = items.copy()
        bad[3, 1] = np.nan
        ItemIndex.build(ids, bad)
    with pytest.raises(ValueError, match="queries must be"):
        ItemIndex.build(ids, items).search(queries[:, :3], 5)
