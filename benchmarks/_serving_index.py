"""The index questions of the serving benchmarks: exact vs approximate FAISS search on one catalogue.

Recall@k against exact search, batch QPS, single-query latency (``measure_index``), FAISS
Flat vs TFRS BruteForce (``tfrs_vs_faiss``), the clustered synthetic catalogue they run on
(``synthetic``) and the setup every results file records (``setup``).
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow)
from benchmarks._harness import machine, timed

# Idle OpenMP threads sleep instead of spinning: on a machine shared with other
# jobs, spinning threads steal the cores the working ones need. Set before FAISS
# loads OpenMP; the server subprocess inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

TARGET_RECALL, TARGET_SPEEDUP, TARGET_P99_MS = 0.95, 10.0, 5.0
SYNTHETIC_FACTORIES = ["Flat", "IVF1024,Flat", "HNSW16"]
# Real mode (--embeddings): the indexes on the trained model's 1M items, and the memory row's on 10M.
REAL_FACTORIES = ["Flat", "IVF1024,Flat", "IVF4096,Flat", "HNSW32"]
# OPQ (e.g. OPQ16_64,IVF4096,PQ16x8,Refine(SQ8)) is accepted but left out: training its rotation took
# 90 s per 10 iterations on 20k vectors on the shared 2 cores (50 by default, on 65k).
# A first run also measured IVF4096,PQ32x8,Refine(SQ4): SQ4 cannot order the candidates (recall@100 0.72 at
# best), kept in bench_serving_real.json's memory_earlier_attempts.
MEMORY_FACTORIES = ["IVF4096,PQ16x8,Refine(SQ8)", "IVF4096,PQ32x8,Refine(SQ8)"]


def log(message: str) -> None:
    logging.getLogger("bench").info(message)


def synthetic(rng: np.random.Generator, args) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Items, tuning queries, evaluation queries: a normalised Gaussian mixture, float32."""
    centres = rng.normal(size=(args.clusters, args.dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)

    def draw(n):
        out = np.empty((n, args.dim), np.float32)
        for start in range(0, n, 100_000):  # bounded float temporaries
            m = min(100_000, n - start)
            chunk = centres[rng.integers(0, args.clusters, m)] + rng.normal(
                scale=args.spread, size=(m, args.dim)
            ).astype(np.float32)
            out[start : start + m] = chunk / np.linalg.norm(chunk, axis=1, keepdims=True)
        return out

    return draw(args.items), draw(args.tune_queries), draw(args.queries)


def setup(args, faiss) -> dict:
    """The run's sizes and the machine (``benchmarks._harness.machine``), with FAISS's threads."""
    return {
        "items": args.items,
        "dim": args.dim,
        "clusters": args.clusters,
        "spread": args.spread,
        "queries": args.queries,
        "tune_queries": args.tune_queries,
        "k": args.k,
        **machine("faiss", "tensorflow", "tfrs", faiss_threads=faiss.omp_get_max_threads(),
                  omp_wait_policy=os.environ.get("OMP_WAIT_POLICY")),
    }


def cores(s: dict) -> int:
    """The core count of a setup record (older records call it "cores")."""
    return s.get("cpus", s.get("cores"))


def load_at_start(s: dict) -> list[float]:
    """The load average at the start of a setup record (older records: "load_average_start")."""
    return s.get("load_average_start", s.get("load_average"))


def measure_index(index, queries, exact, args, recall_at_k, faiss) -> dict:
    with timed() as clock:
        top = index.search(queries, args.k)
    batch = [clock.seconds]
    recall = recall_at_k(top.rows, exact.rows)
    if not index.is_exact:
        for _ in range(2):
            with timed() as clock:
                index.search(queries, args.k)
            batch.append(clock.seconds)
    # One query at a time on one thread, as the service searches (retrieval serve --search-threads 1).
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        single = single_latencies(lambda q: index.search(q, args.k), queries, args.single, args.single_seconds)
    finally:
        faiss.omp_set_num_threads(threads)
    return {
        "search_params": index.search_params,
        "tuned_recall": index.tuning.recall if index.tuning else 1.0,
        "recall": recall,
        "batch_qps": len(queries) / min(batch),
        **percentiles(single, "single"),
    }


def single_latencies(search, queries, count, cap_seconds) -> list[float]:
    search(queries[:1])  # warm-up
    latencies, deadline = [], time.perf_counter() + cap_seconds
    for i in range(count):
        with timed() as clock:
            search(queries[i % len(queries)][None, :])
        latencies.append(clock.seconds)
        if time.perf_counter() > deadline:
            break
    return latencies


def percentiles(seconds: list[float], prefix: str) -> dict:
    ms = 1e3 * np.asarray(seconds)
    return {f"{prefix}_p50_ms": float(np.percentile(ms, 50)), f"{prefix}_p99_ms": float(np.percentile(ms, 99)),
            f"{prefix}_mean_ms": float(ms.mean()), f"{prefix}_count": int(len(ms))}


def served_recall(rows, served, exact_rows, recall_at_k) -> float:
    """Recall@k of what the service returned (by item id) against exact search."""
    if not rows:
        return float("nan")
    k = exact_rows.shape[1]
    found = np.array([[int(item[1:]) for item in served[r]] + [-1] * (k - len(served[r])) for r in rows])
    return recall_at_k(found, exact_rows[rows])


def tfrs_vs_faiss(items, queries, exact, args, recall_at_k) -> dict:
    """TFRS BruteForce (tf.matmul + tf.math.top_k) vs FAISS Flat, same embeddings, same k."""
    import faiss
    import tensorflow as tf
    import tensorflow_recommenders as tfrs

    brute_force = tfrs.layers.factorized_top_k.BruteForce(k=args.k)
    brute_force.index(tf.constant(items), tf.range(len(items), dtype=tf.int64))
    search = tf.function(lambda q: brute_force(q, k=args.k))
    batches = [tf.constant(queries[i : i + args.tfrs_batch]) for i in range(0, len(queries), args.tfrs_batch)]
    search(batches[0])
    search(tf.constant(queries[:1]))  # trace both shapes before timing
    with timed() as clock:
        rows = np.concatenate([search(batch)[1].numpy() for batch in batches])
    tfrs_seconds = clock.seconds
    single = single_latencies(lambda q: search(tf.constant(q))[1].numpy(), queries, min(args.single, 100),
                              args.single_seconds)
    brute_force = search = None  # free the TF copy of the items before FAISS builds its own

    flat = faiss.IndexFlatIP(items.shape[1])
    flat.add(items)
    with timed() as clock:
        for i in range(0, len(queries), args.tfrs_batch):
            flat.search(queries[i : i + args.tfrs_batch], args.k)
    faiss_seconds = clock.seconds
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        faiss_single = single_latencies(lambda q: flat.search(q, args.k), queries, min(args.single, 100),
                                        args.single_seconds)
    finally:
        faiss.omp_set_num_threads(threads)
    return {
        "batch": args.tfrs_batch,
        "tfrs_bruteforce": {"batch_qps": len(queries) / tfrs_seconds, "recall": recall_at_k(rows, exact.rows),
                            **percentiles(single, "single")},
        "faiss_flat": {"batch_qps": len(queries) / faiss_seconds, "recall": 1.0,
                       **percentiles(faiss_single, "single")},
    }
