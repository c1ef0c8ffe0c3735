"""Approximate indexes: recall against a numpy brute-force oracle, tuning, persistence of tuned params."""

import json
import logging
from pathlib import Path

import faiss
import numpy as np
import pytest

from retrieval import index as index_module
from retrieval.config import EXACT_MAX_FLOATS, IndexConfig
from retrieval.index import ItemIndex, build_index, build_index_in_blocks, exact_search, recall_at_k
from retrieval.index.item_index import _BlockedTopK


@pytest.fixture(autouse=True, scope="module")
def one_faiss_thread():
    # These indexes are tiny; OpenMP threads only add contention on a shared machine.
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(threads)


def clustered(seed, num_items=4000, num_queries=400, dim=24, clusters=40, spread=0.35):
    """Unit vectors from a Gaussian mixture; queries from the same mixture (as real towers produce)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, dim))

    def draw(n):
        points = centres[rng.integers(0, clusters, n)] + spread * rng.normal(size=(n, dim))
        return (points / np.linalg.norm(points, axis=1, keepdims=True)).astype(np.float32)

    return [f"i{i}" for i in range(num_items)], draw(num_items), draw(num_queries)


def oracle_recall(rows, items, queries, k):
    """Share of returned rows that belong in the exact top-k; an item tied with the k-th score counts."""
    scores = queries @ items.T
    kth = -np.sort(-scores, axis=1)[:, k - 1 : k]
    returned = np.take_along_axis(scores, np.where(rows >= 0, rows, 0), axis=1)
    return float(((returned >= kth - 1e-5) & (rows >= 0)).sum() / rows.size)


@pytest.mark.parametrize("factory", ["IVF64,Flat", "HNSW16"])
@pytest.mark.parametrize("seed", [0, 1])
def test_tuned_ann_clears_recall_floor_on_unseen_queries(factory, seed):
    ids, items, queries = clustered(seed)
    tune, held_out = queries[:200], queries[200:]
    config = IndexConfig(factory=factory, target_recall=0.95, tune_k=50)
    index = build_index(ids, items, config, queries=tune, query_source="test queries")
    assert not index.is_exact
    assert index.tuning.reached_target and index.tuning.recall >= 0.95
    assert index.tuning.query_source == "test queries"
    assert index.search_params == index.tuning.params != ""
    recall = oracle_recall(index.search(held_out, 50).rows, items, held_out, 50)
    assert recall >= 0.93, recall  # tuned on other queries: a small margin below the target
    # The tuning did something: FAISS's defaults (nprobe=1 / efSearch=16) are clearly worse here.
    untuned = ItemIndex(index.index, ids, factory)
    untuned.set_search_params("nprobe=1" if factory.startswith("IVF") else "efSearch=16")
    assert oracle_recall(untuned.search(held_out, 50).rows, items, held_out, 50) < recall - 0.02


def test_recall_at_k_counts_the_intersection():
    exact = np.array([[0, 1, 2, 3], [4, 5, 6, 7]])
    found = np.array([[3, 2, 9, 8], [4, 5, 6, -1]])
    assert recall_at_k(found, exact) == pytest.approx((2 + 3) / 8)
    with pytest.raises(ValueError, match="same"):
        recall_at_k(found[:, :3], exact)


def test_tuned_params_are_saved_and_applied_on_load(tmp_path):
    ids, items, queries = clustered(2)
    index = build_index(ids, items, IndexConfig(factory="IVF64,Flat", tune_k=20), queries=queries)
    nprobe = faiss.extract_index_ivf(index.index).nprobe
    assert index.search_params == f"nprobe={nprobe}" and nprobe > 1
    index.save(tmp_path)
    loaded = ItemIndex.load(tmp_path)
    assert faiss.extract_index_ivf(loaded.index).nprobe == nprobe
    assert loaded.search_params == index.search_params
    assert loaded.tuning == index.tuning
    assert loaded.normalized
    np.testing.assert_array_equal(loaded.search(queries, 20).rows, index.search(queries, 20).rows)


def test_items_stand_in_for_queries_when_none_are_given():
    ids, items, _ = clustered(3)
    index = build_index(ids, items, IndexConfig(factory="HNSW16", tune_k=20, tune_queries=300))
    assert index.tuning.query_source == "items"
    assert index.tuning.tuning_queries + index.tuning.validation_queries == 300
    assert index.search_params.startswith("efSearch=")


def test_exact_index_is_not_tuned():
    ids, items, queries = clustered(4, num_items=500)
    index = build_index(ids, items, IndexConfig(factory="Flat"), queries=queries)
    assert index.is_exact and index.tuning is None and index.search_params == ""


def test_fixed_search_params_are_measured_not_tuned():
    ids, items, queries = clustered(5)
    index = build_index(ids, items, IndexConfig(factory="IVF64,Flat", search_params="nprobe=2", tune_k=20),
                        queries=queries)
    assert index.search_params == "nprobe=2"
    assert index.tuning.method == "config" and index.tuning.operating_points == []
    # Measured on a random half of the queries: close to the recall over all of them.
    expected = oracle_recall(index.search(queries, 20).rows, items, queries, 20)
    assert expected < 0.97  # nprobe=2 of 64 lists really is approximate here
    assert index.tuning.recall == pytest.approx(expected, abs=0.03)


def test_unreachable_target_is_reported_not_hidden():
    ids, items, queries = clustered(6)
    # 4 bytes per vector cannot reach 0.999 recall@50 whatever nprobe is.
    index = build_index(ids, items, IndexConfig(factory="IVF16,PQ4x4", target_recall=0.999, tune_k=50),
                        queries=queries)
    assert not index.tuning.reached_target
    assert index.tuning.recall < 0.999
    best = max(point["recall"] for point in index.tuning.operating_points)
    chosen = [p for p in index.tuning.operating_points if p["params"] == index.search_params]
    assert chosen and chosen[0]["recall"] == best


def test_ivf_pq_trains_on_a_sample_and_reports_progress(monkeypatch, caplog):
    ids, items, queries = clustered(7, num_items=3000)
    monkeypatch.setattr(index_module, "ADD_BATCH_SIZE", 1000)
    with caplog.at_level(logging.INFO, logger="retrieval.index"):
        index = build_index(
            ids, items, IndexConfig(factory="IVF32,PQ8x4", train_sample_size=1500, tune_k=20), queries=queries
        )
    messages = [record.getMessage() for record in caplog.records]
    assert any("trained IVF32,PQ8x4 on 1500 vectors" in m for m in messages), messages
    assert sum(m.startswith("index add:") for m in messages) == 3
    assert len(index) == 3000 and 0.3 < index.tuning.recall <= 1


def test_opq_rotation_keeps_inner_product_search():
    ids, items, queries = clustered(10, num_items=1000, dim=8, clusters=10)
    index = build_index(ids, items, IndexConfig(factory="OPQ2,IVF8,PQ2x4", tune_k=10), queries=queries)
    assert index.tuning.params.startswith("nprobe=")
    # A lossy 1-byte code, yet clearly better than chance (10 / 1000) against the exact top-10.
    assert oracle_recall(index.search(queries, 10).rows, items, queries, 10) > 0.15


def test_normalized_flag_follows_the_vectors():
    ids, items, _ = clustered(8, num_items=300)
    with_zero = items.copy()
    with_zero[5] = 0  # an out-of-vocabulary item row does not break "normalised"
    assert ItemIndex.build(ids, with_zero).normalized
    assert not ItemIndex.build(ids, items * 2).normalized


def test_bad_tuning_and_training_inputs():
    ids, items, queries = clustered(9, num_items=200)
    too_large = "IVF1024,Flat needs at least 1024 catalogue items .* the catalogue has 200: use Flat or IVF<=5"
    with pytest.raises(ValueError, match=too_large):
        ItemIndex.build(ids, items, "IVF1024,Flat")
    index = ItemIndex.build(ids, items, "HNSW8")
    with pytest.raises(ValueError, match="target_recall"):
        index.tune(items, queries, target_recall=1.5)
    with pytest.raises(ValueError, match="at least 2 non-zero queries"):
        index.tune(items, np.zeros((10, items.shape[1]), np.float32))
    with pytest.raises(ValueError, match="embeddings must be"):
        index.tune(items[:10], queries)
    with pytest.raises(ValueError, match="do not apply"):
        index.set_search_params("nprobe=4")
    with pytest.raises(ValueError, match="exact must be"):
        index.tune(items, queries, k=10, exact=exact_search(items, queries[:5], 10))


def test_precomputed_exact_reference_gives_the_same_tuning():
    ids, items, queries = clustered(11, num_items=2000)
    first = build_index(ids, items, IndexConfig(factory="IVF32,Flat", tune_k=20), queries=queries)
    second = ItemIndex.build(ids, items, "IVF32,Flat")
    second.tune(items, queries, k=20, exact=exact_search(items, queries, 20))
    assert second.search_params == first.search_params
    assert second.tuning.recall == pytest.approx(first.tuning.recall)


@pytest.mark.parametrize("items, factory", [(1, "Flat"), (100_000, "Flat"), (100_001, "IVF1024,Flat"),
                                            (1_000_000, "IVF4096,Flat"), (10_000_000, "IVF16384,Flat")])
def test_auto_is_exact_up_to_its_size_then_ivf_with_about_four_sqrt_n_lists(items, factory):
    assert IndexConfig(factory="auto", exact_max_items=100_000).factory_for(items, 256) == factory
    assert IndexConfig(factory="HNSW32").factory_for(items, 256) == "HNSW32"  # an explicit factory is kept


@pytest.mark.parametrize("dim, exact_up_to", [(256, EXACT_MAX_FLOATS // 256), (64, EXACT_MAX_FLOATS // 64)])
def test_auto_is_the_default_and_its_exact_size_follows_the_floats_a_query_scans(dim, exact_up_to):
    config = IndexConfig()
    assert config.factory == "auto"
    assert config.factory_for(exact_up_to, dim) == "Flat"
    assert config.factory_for(exact_up_to + 1, dim).startswith("IVF")


def test_the_exact_bound_is_the_one_the_index_benchmark_measured():
    report = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/results/bench_index_auto.json").read_text())
    assert report["exact_max_floats"] == EXACT_MAX_FLOATS
    assert report["exact_p99_ms"] == 5.0


def test_auto_builds_the_factory_it_names_and_records_it(caplog):
    ids, items, queries = clustered(5, num_items=3000)
    config = IndexConfig(factory="auto", exact_max_items=1000, tune_k=10)
    with caplog.at_level(logging.INFO, logger="retrieval.index"):
        index = build_index(ids, items, config, queries=queries)
    assert index.factory == index.info()["factory"] == "IVF256,Flat" == config.factory_for(3000, items.shape[1])
    assert index.tuning is not None and index.tuning.recall >= 0.95
    assert any("index.factory auto: IVF256,Flat for 3000 items" in r.getMessage() for r in caplog.records)
    assert build_index(ids, items, IndexConfig()).factory == "Flat"  # below its size


def test_auto_refuses_fixed_search_parameters():
    with pytest.raises(ValueError, match=r"index\.search_params 'nprobe=8' fix one factory's parameters.*auto"):
        IndexConfig(factory="auto", search_params="nprobe=8")


@pytest.mark.parametrize("with_queries", [True, False])
def test_a_catalogue_indexed_in_blocks_is_the_index_of_the_whole_matrix(monkeypatch, with_queries):
    """build_index_in_blocks never asks for more rows than a block or the training sample, and gives
    the index, tuning and reference of build_index on the whole matrix."""
    ids, items, queries = clustered(8, num_items=3000)
    config = IndexConfig(factory="IVF32,Flat", train_sample_size=1200, tune_k=20, tune_queries=150)
    whole = build_index(ids, items, config, queries=queries if with_queries else None)
    monkeypatch.setattr(index_module, "ADD_BATCH_SIZE", 500)
    asked = []

    def embed_rows(rows):
        asked.append(len(rows))
        return items[rows]

    blocked = build_index_in_blocks(ids, embed_rows, items.shape[1], config, queries if with_queries else None)
    assert max(asked) <= 1200 and sum(asked) >= len(items)
    assert blocked.tuning.query_source == whole.tuning.query_source == ("queries" if with_queries else "items")
    assert blocked.search_params == whole.search_params and blocked.tuning.recall == whole.tuning.recall
    np.testing.assert_array_equal(blocked.search(queries, 10).rows, whole.search(queries, 10).rows)


def test_the_blocked_reference_is_exact_search_over_the_whole_catalogue():
    _, items, queries = clustered(9, num_items=2500)
    reference = _BlockedTopK(queries, 30)
    for first in range(0, len(items), 700):
        reference.add(first, items[first:first + 700])
    found, exact = reference.result(), exact_search(items, queries, 30)
    np.testing.assert_allclose(found.scores, exact.scores, rtol=1e-5)
    assert recall_at_k(found.rows, exact.rows) == 1.0
