"""Helpers of benchmarks.bench_serving_real (the serving benchmark on real embeddings): the disjoint tuning / evaluation
users, the tiled memory catalogue, the nprobe x k_factor_rf sweep and the target bookkeeping."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    from benchmarks import bench_serving_real

    return bench_serving_real


def _unit(rng, n, dim=16):
    x = rng.normal(size=(n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_load_embeddings_draws_disjoint_known_users(bench, tmp_path):
    rng = np.random.default_rng(0)
    queries = _unit(rng, 50)
    queries[[3, 7]] = 0  # users the query tower did not know
    np.save(tmp_path / "items.npy", _unit(rng, 40))
    np.save(tmp_path / "queries.npy", queries)
    (tmp_path / "query_user_ids.txt").write_text("\n".join(f"u{i}" for i in range(50)) + "\n")
    (tmp_path / "manifest.json").write_text(json.dumps({
        "run": "r", "date": "d", "items": {"file": "items.npy"},
        "queries": {"file": "queries.npy", "ids": "query_user_ids.txt", "source": "training users"},
    }))
    real = bench.load_embeddings(tmp_path, SimpleNamespace(tune_queries=20, queries=25, seed=0))
    assert real["items"].shape == (40, 16) and real["users_available"] == 48
    tune, evaluation = real["tune_queries"], real["queries"]
    assert len(tune) == 20 and len(evaluation) == 25
    assert np.all(np.any(tune != 0, axis=1)) and np.all(np.any(evaluation != 0, axis=1))
    rows = lambda part: {int(np.flatnonzero((queries == q).all(axis=1))[0]) for q in part}  # noqa: E731
    assert not rows(tune) & rows(evaluation)
    with pytest.raises(SystemExit):
        bench.load_embeddings(tmp_path, SimpleNamespace(tune_queries=30, queries=25, seed=0))


def test_memory_catalogue_tiles_with_calibrated_noise(bench):
    rng = np.random.default_rng(1)
    items = _unit(rng, 3000)
    items[5] = 0  # an item without training clicks
    vectors, info = bench.memory_catalogue(items, 7000, None, np.random.default_rng(2))
    assert vectors.shape == (7000, 16) and vectors.dtype == np.float32
    assert info["copies"] == 3 and info["zero_items_per_copy"] == 1
    np.testing.assert_array_equal(vectors[:3000], items)  # the first copy is the real items
    assert not vectors[[5, 3005, 6005]].any()  # zero items stay zero in every copy
    norms = np.linalg.norm(np.delete(vectors, [5, 3005, 6005], axis=0), axis=1)
    np.testing.assert_allclose(norms, 1, atol=1e-5)
    # A copy is about as close to its source as the median real nearest neighbour.
    cosine = np.median(np.sum(np.delete(vectors[3000:6000] * items, 5, axis=0), axis=1))
    assert abs(cosine - info["median_nearest_neighbour_cosine"]) < 0.05
    fixed, info = bench.memory_catalogue(items, 3500, 0.01, np.random.default_rng(2))
    assert info["noise_std_per_dim"] == 0.01 and info["median_nearest_neighbour_cosine"] is None
    assert np.median(np.sum(fixed[3000:] * items[:500], axis=1)) > 0.99


def test_sweep_reaches_the_target_on_a_refine_index(bench):
    import faiss

    from retrieval.index import exact_search

    rng = np.random.default_rng(3)
    items, queries = _unit(rng, 4000), _unit(rng, 200)
    index = faiss.index_factory(16, "IVF32,PQ4x8,Refine(SQ8)", faiss.METRIC_INNER_PRODUCT)
    index.train(items)
    index.add(items)
    exact = exact_search(items, queries, 10).rows
    params, points = bench.sweep(index, queries, exact, 10, 0.9)
    assert "nprobe=" in params and "k_factor_rf=" in params
    chosen = next(p for p in points if p["params"] == params)
    assert chosen["recall_lower_bound"] >= 0.9
    faiss.ParameterSpace().set_index_parameters(index, params)
    found = index.search(queries, 10)[1]
    assert np.mean([np.intersect1d(f, e).size / 10 for f, e in zip(found, exact)]) >= 0.85


def test_real_targets_need_all_three_from_one_index(bench):
    def row(factory, recall, qps, p99, concurrent_p99, errors=0):
        return {"factory": factory, "recall": recall, "batch_qps": qps, "speedup_vs_exact": qps / 10,
                "http": {"sequential_p99_ms": p99, "concurrent_p99_ms": concurrent_p99, "concurrency": 4,
                         "errors": errors}}

    results = {
        "real": {"exact": {"batch_qps": 10}, "indexes": [
            row("Flat", 1.0, 10, 40, 100),
            row("A", 0.96, 500, 4.0, 12.0),  # misses the concurrent p99
            row("B", 0.94, 500, 3.0, 8.0),  # misses recall
            row("C", 0.97, 200, 4.5, 9.0, errors=1),  # an error
        ]},
        "memory": {"indexes": [{"factory": "M", "met": False}, {"factory": "N", "met": True}]},
    }
    targets = bench.real_targets(results)
    assert set(targets["real"]["per_index"]) == {"A", "B", "C"}
    assert not targets["real"]["met"] and targets["real"]["met_by"] == []
    assert targets["real"]["per_index"]["A"]["recall_and_speedup"]
    assert not targets["real"]["per_index"]["A"]["concurrent_p99_no_errors"]
    assert not targets["real"]["per_index"]["C"]["concurrent_p99_no_errors"]
    results["real"]["indexes"].append(row("D", 0.95, 100, 5.0, 10.0))
    assert bench.real_targets(results)["real"]["met_by"] == ["D"]
    assert bench.real_targets(results)["memory"] == {
        "target": "index <= 1 GiB at recall@k >= 0.9", "met_by": ["N"], "met": True}


def test_sweep_is_the_library_sweep_once_per_refine_factor(bench, monkeypatch):
    # The memory row's nprobe sweep is retrieval.index.tuning.sweep_parameter, not a copy of it.
    import faiss

    calls = []

    def fake(index, queries, exact_rows, k, target, name, values, fixed=""):
        calls.append((name, tuple(values), fixed))
        recall = 0.5 + 0.1 * len(calls)
        return None, [{"params": f"{name}=8,{fixed}", "recall": recall, "recall_lower_bound": recall,
                       "ms_per_query": 1.0}]

    monkeypatch.setattr(bench, "sweep_parameter", fake)
    refine = faiss.index_factory(8, "IVF4,PQ2x4,Refine(SQ8)", faiss.METRIC_INNER_PRODUCT)
    params, points = bench.sweep(refine, None, None, 10, 0.99)
    assert [c[2] for c in calls] == ["k_factor_rf=2", "k_factor_rf=4", "k_factor_rf=8", "k_factor_rf=16"]
    assert all(c[0] == "nprobe" and c[1] == bench.NPROBES for c in calls)
    assert params == "nprobe=8,k_factor_rf=16" and len(points) == 4  # none reached: the most accurate
