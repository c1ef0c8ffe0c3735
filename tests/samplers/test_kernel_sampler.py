"""Quadratic-kernel tree sampler (Blanc & Rendle) against brute force."""

import numpy as np
import pytest
from scipy import stats

from retrieval.samplers.kernel import QuadraticKernelTree


def _brute_probabilities(queries, items, alpha):
    kernel = alpha * (queries @ items.T) ** 2 + 1.0
    return kernel / kernel.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("num_items,leaf_size", [(37, 4), (64, 8), (5, 32), (1, 1)])
def test_tree_sums_equal_brute_force(num_items, leaf_size):
    rng = np.random.default_rng(num_items)
    items = rng.normal(size=(num_items, 6))
    tree = QuadraticKernelTree(items, alpha=3.0, leaf_size=leaf_size)
    np.testing.assert_allclose(tree.sums[0], items.T @ items, rtol=1e-10, atol=1e-10)
    assert tree.counts[0] == num_items
    # Every internal node is the sum of its children; every leaf of its bucket.
    internal = np.arange(tree.num_leaves - 1)
    np.testing.assert_allclose(tree.sums[internal], tree.sums[2 * internal + 1] + tree.sums[2 * internal + 2])
    for leaf in range(tree.num_leaves):
        members = items[leaf * leaf_size : (leaf + 1) * leaf_size]
        np.testing.assert_allclose(tree.sums[tree.num_leaves - 1 + leaf], members.T @ members, atol=1e-10)


def test_incremental_update_equals_refresh():
    rng = np.random.default_rng(0)
    items = rng.normal(size=(50, 5))
    tree = QuadraticKernelTree(items, leaf_size=4)
    rows = np.array([0, 7, 49, 23])
    new = rng.normal(size=(4, 5))
    tree.update(rows, new)
    items[rows] = new
    fresh = QuadraticKernelTree(items, leaf_size=4)
    np.testing.assert_allclose(tree.sums, fresh.sums, atol=1e-10)
    queries = rng.normal(size=(3, 5))
    np.testing.assert_allclose(tree.partition(queries), fresh.partition(queries))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_log_prob_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    items, queries = rng.normal(size=(40, 8)), rng.normal(size=(5, 8))
    tree = QuadraticKernelTree(items, alpha=10.0, leaf_size=4)
    ids = rng.integers(0, 40, size=(5, 7))
    expected = np.log(np.take_along_axis(_brute_probabilities(queries, items, 10.0), ids, axis=1))
    np.testing.assert_allclose(tree.log_prob(queries, ids), expected, rtol=1e-10)
    np.testing.assert_allclose(tree.partition(queries), (10.0 * (queries @ items.T) ** 2 + 1).sum(axis=1))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_draw_frequencies_match_the_kernel_distribution(seed):
    rng = np.random.default_rng(seed)
    num_items = 30
    items = rng.normal(size=(num_items, 4)) / 2
    queries = rng.normal(size=(2, 4))
    tree = QuadraticKernelTree(items, alpha=5.0, leaf_size=4, max_chunk=1000)
    draws = tree.sample(queries, 20_000, np.random.default_rng(seed + 100))
    expected = _brute_probabilities(queries, items, 5.0)
    for q in range(2):
        observed = np.bincount(draws.ids[q], minlength=num_items)
        _, p_value = stats.chisquare(observed, expected[q] * observed.sum())
        assert p_value > 1e-3, p_value
    np.testing.assert_allclose(
        draws.log_prob, np.log(np.take_along_axis(expected, draws.ids, axis=1)), rtol=1e-10
    )


def test_a_sampler_that_ignored_the_query_would_fail_the_frequency_check():
    # Guard that the chi-square test above can fail: uniform draws against a skewed kernel.
    rng = np.random.default_rng(3)
    items, query = rng.normal(size=(30, 4)), rng.normal(size=(1, 4)) * 3
    expected = _brute_probabilities(query, items, 5.0)[0]
    observed = np.bincount(rng.integers(0, 30, 20_000), minlength=30)
    assert stats.chisquare(observed, expected * observed.sum())[1] < 1e-6


def test_bad_inputs():
    with pytest.raises(ValueError, match="alpha"):
        QuadraticKernelTree(np.ones((3, 2)), alpha=0)
    with pytest.raises(ValueError, match="NaN"):
        QuadraticKernelTree(np.array([[np.nan, 1.0]]))
    tree = QuadraticKernelTree(np.ones((3, 2)))
    with pytest.raises(ValueError, match="queries must be"):
        tree.sample(np.ones((1, 3)), 2, np.random.default_rng(0))
    with pytest.raises(ValueError, match="rows must be unique"):
        tree.update(np.array([0, 0]), np.ones((2, 2)))


def test_padding_leaves_are_never_reached():
    # 53 buckets of 32 pad the tree to 64 leaves: the last 11 hold no item and must get no draw.
    rng = np.random.default_rng(5)
    items = rng.normal(size=(1682, 16))
    items /= np.linalg.norm(items, axis=1, keepdims=True)
    tree = QuadraticKernelTree(items, alpha=100.0, leaf_size=32)
    queries = rng.normal(size=(64, 16))
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    draws = tree.sample(queries, 256, np.random.default_rng(0))
    assert draws.ids.min() >= 0 and draws.ids.max() < 1682
    assert np.all(np.isfinite(draws.log_prob))


@pytest.mark.parametrize("num_items,leaf_size", [(50, 4), (7, 4), (3, 4), (200, 3)])
def test_update_of_many_rows_equals_a_fresh_tree(num_items, leaf_size):
    # Depth 0 (3 items), depth 1 (7 items) and deeper trees; unsorted rows, some sharing a leaf.
    rng = np.random.default_rng(num_items)
    items = rng.normal(size=(num_items, 5))
    tree = QuadraticKernelTree(items, leaf_size=leaf_size)
    for _ in range(3):
        rows = rng.choice(num_items, size=max(1, num_items // 3), replace=False)
        new = rng.normal(size=(len(rows), 5))
        tree.update(rows, new)
        items[rows] = new
    fresh = QuadraticKernelTree(items, leaf_size=leaf_size)
    np.testing.assert_allclose(tree.sums, fresh.sums, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(tree.counts, fresh.counts)
    queries = rng.normal(size=(4, 5))
    np.testing.assert_allclose(tree.partition(queries), (1 + 100.0 * (queries @ items.T) ** 2).sum(axis=1))
    ids = rng.integers(0, num_items, size=(4, 6))
    expected = np.log(np.take_along_axis(_brute_probabilities(queries, items, 100.0), ids, axis=1))
    np.testing.assert_allclose(tree.log_prob(queries, ids), expected, rtol=1e-10)


@pytest.mark.parametrize("grid_factor,bucket_grid", [(0.0, 1), (1e9, 10**9), (0.0, 10**9)])
@pytest.mark.parametrize("seed", [0, 1])
def test_both_level_paths_draw_from_the_kernel_distribution(monkeypatch, grid_factor, bucket_grid, seed):
    # grid_factor 0: every level's masses per (query, node) pair; 1e9: one matrix product per level.
    # bucket_grid 1: leaf buckets multiplied with their queries a few buckets at a time; 1e9: per pair.
    from retrieval.samplers import kernel

    monkeypatch.setattr(kernel, "_GRID_FACTOR", grid_factor)
    monkeypatch.setattr(kernel, "_BUCKET_GRID_PAIRS", bucket_grid)
    rng = np.random.default_rng(seed)
    num_items = 45  # 12 buckets of 4 padded to 16 leaves: depth 4, padding subtrees on the right
    items, queries = rng.normal(size=(num_items, 3)) / 2, rng.normal(size=(3, 3))
    tree = QuadraticKernelTree(items, alpha=5.0, leaf_size=4, max_chunk=7)  # several chunks per level
    draws = tree.sample(queries, 20_000, np.random.default_rng(seed + 10))
    expected = _brute_probabilities(queries, items, 5.0)
    for q in range(len(queries)):
        observed = np.bincount(draws.ids[q], minlength=num_items)
        assert len(observed) == num_items
        assert stats.chisquare(observed, expected[q] * observed.sum())[1] > 1e-3
    np.testing.assert_allclose(
        draws.log_prob, np.log(np.take_along_axis(expected, draws.ids, axis=1)), rtol=1e-10
    )


def test_draws_follow_an_update():
    # After update the walk must use the new sums and items, not the mirror of the old ones.
    rng = np.random.default_rng(8)
    items = rng.normal(size=(40, 3))
    tree = QuadraticKernelTree(items, alpha=20.0, leaf_size=4)
    rows = np.arange(0, 40, 3)
    items[rows] = rng.normal(size=(len(rows), 3)) * 2
    tree.update(rows, items[rows])
    query = rng.normal(size=(1, 3))
    draws = tree.sample(query, 20_000, np.random.default_rng(1))
    expected = _brute_probabilities(query, items, 20.0)[0]
    assert stats.chisquare(np.bincount(draws.ids[0], minlength=40), expected * 20_000)[1] > 1e-3
