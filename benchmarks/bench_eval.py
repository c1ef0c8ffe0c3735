"""Full-corpus top-k for evaluation: our FAISS path vs TFRS, on the same embeddings.

    python benchmarks/bench_eval.py            # or: make bench
    python benchmarks/bench_eval.py --items 10000 --queries 1024 --repeats 1   # quick

For each catalogue size, one seeded set of L2-normalised item and query
embeddings is ranked by:

- ``faiss``: ``retrieval.evaluation.index_ranking`` over an exact ``IndexFlatIP``
  (``ItemIndex``), the path ``evaluate_against_baselines`` takes; FAISS
  batches the queries itself and uses every core (OpenMP).
- ``tfrs BruteForce``: ``tfrs.layers.factorized_top_k.BruteForce`` (``tf.matmul``
  + ``tf.math.top_k``) over query batches, TensorFlow using every core.
- ``tfrs FactorizedTopK``: ``tfrs.metrics.FactorizedTopK`` built from a candidate
  ``tf.data.Dataset`` (its default: a ``Streaming`` top-k layer) as in the TFRS
  retrieval tutorials (candidate batch 128), and with a larger candidate batch;
  ``update_state`` over query batches; it also checks each query's true item, as
  TFRS evaluation does.

Methods run interleaved, one run each per round (order rotated), after a
warm-up on one query batch; seconds are the median over ``--repeats`` rounds
and the FAISS speed-up is the median of the per-round ratios, so load from
other processes on a shared machine hits every method alike. The top-k of
each TFRS path is checked against FAISS: identical ids, or equal scores where
float rounding swaps near-ties. Writes ``bench_eval.json`` and ``bench_eval.md``
to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import faiss
import numpy as np
import tensorflow as tf
import tensorflow_recommenders as tfrs

import retrieval  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)
from retrieval.evaluation import EvalSet, index_ranking
from retrieval.index import ItemIndex

FAISS = "faiss (index_ranking, IndexFlatIP)"
BRUTE_FORCE = "tfrs BruteForce"


def _embeddings(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    x = rng.normal(size=(n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _interleaved(methods: dict, repeats: int) -> tuple[dict, dict, dict]:
    """Time every method once per round, rotating the order, after one warm-up each.

    Rounds interleave the methods so that load from other processes on a shared
    machine hits them alike; the ratio to FAISS is taken within each round.

    Args:
      methods: name -> (run, warm_up); the first name is the reference (FAISS).

    Returns:
      (median seconds, median ratio to the reference within a round, last result), each by name.
    """
    for _run, warm_up in methods.values():
        warm_up()  # tf.function tracing, tf.data pipelines, thread pools
    names = list(methods)
    seconds = {name: [] for name in names}
    results = {}
    for round_ in range(repeats):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            started = time.perf_counter()
            results[name] = methods[name][0]()
            seconds[name].append(time.perf_counter() - started)
    reference = seconds[names[0]]
    ratios = {name: statistics.median(t / r for t, r in zip(seconds[name], reference)) for name in names}
    return {name: statistics.median(values) for name, values in seconds.items()}, ratios, results


def _agreement(reference_rows, reference_scores, rows, scores) -> dict:
    """Share of identical top-k ids, and the largest score gap (~1e-7 when only near-ties differ)."""
    same = float(np.mean(reference_rows == rows))
    return {"same_ids": same, "max_score_gap": float(np.max(np.abs(reference_scores - scores)))}


def bench(num_items: int, dim: int, num_queries: int, k: int, batch: int, candidate_batches, repeats: int, seed: int):
    """Time every method on one seeded set of embeddings; returns one dict per method."""
    rng = np.random.default_rng(seed)
    items = _embeddings(rng, num_items, dim)
    queries = _embeddings(rng, num_queries, dim)
    true_items = rng.integers(0, num_items, size=num_queries)
    ids = [f"i{i}" for i in range(num_items)]

    def eval_set(n):
        return EvalSet(np.arange(n), [np.zeros(1, np.int64)] * n, [np.zeros(0, np.int64)] * n)

    index = ItemIndex.build(ids, items, "Flat")
    everyone, first_batch = eval_set(num_queries), eval_set(batch)
    methods = {
        FAISS: (
            lambda: index_ranking(index, queries, everyone, k),
            lambda: index_ranking(index, queries[:batch], first_batch, k),
        )
    }

    brute = tfrs.layers.factorized_top_k.BruteForce(k=k)
    brute.index(tf.constant(items))

    def tfrs_bruteforce(n=num_queries):
        parts = [brute(tf.constant(queries[s : min(s + batch, n)]), k=k) for s in range(0, n, batch)]
        return np.concatenate([p[0].numpy() for p in parts]), np.concatenate([p[1].numpy() for p in parts])

    methods[BRUTE_FORCE] = (tfrs_bruteforce, lambda: tfrs_bruteforce(batch))

    streaming_layers = {}
    for candidate_batch in candidate_batches:
        candidates = tf.data.Dataset.from_tensor_slices(items).batch(candidate_batch)
        metric = tfrs.metrics.FactorizedTopK(candidates=candidates, ks=(k,))

        def factorized(n=num_queries, metric=metric):
            metric.reset_states()
            for s in range(0, n, batch):
                e = min(s + batch, n)
                metric.update_state(tf.constant(queries[s:e]), tf.constant(items[true_items[s:e]]))
            return float(metric.result()[0])

        name = f"tfrs FactorizedTopK (Streaming, candidate batch {candidate_batch})"
        methods[name] = (factorized, lambda factorized=factorized: factorized(batch))
        # The ranking FactorizedTopK scores comes from this same Streaming layer: checked on one batch below.
        streaming_layers[name] = tfrs.layers.factorized_top_k.Streaming(k=k).index_from_dataset(candidates)

    seconds, ratios, results = _interleaved(methods, repeats)
    faiss_rows = results[FAISS]
    faiss_scores = np.einsum("qd,qkd->qk", queries, items[faiss_rows])
    faiss_hit_rate = float(np.mean((faiss_rows == true_items[:, None]).any(axis=1)))
    rows = []
    for name in methods:
        agreement = None
        if name == BRUTE_FORCE:
            brute_scores, brute_rows = results[name]
            agreement = _agreement(faiss_rows, faiss_scores, brute_rows, brute_scores)
        elif name in streaming_layers:
            stream_scores, stream_rows = streaming_layers[name](tf.constant(queries[:batch]), k=k)
            agreement = _agreement(faiss_rows[:batch], faiss_scores[:batch], stream_rows.numpy(), stream_scores.numpy())
            agreement |= {"hit_rate@k": results[name], "faiss_hit_rate@k": faiss_hit_rate}
        rows.append(
            {
                "items": num_items,
                "dim": dim,
                "queries": num_queries,
                "k": k,
                "method": name,
                "seconds": seconds[name],
                "queries_per_second": num_queries / seconds[name],
                "faiss_speedup": ratios[name],
                "agreement": agreement,
            }
        )
    return rows


def _markdown(results: dict) -> str:
    env = results["environment"]
    lines = [
        "# Evaluation top-k: FAISS vs TFRS",
        "",
        f"`{results['command']}` on {env['cpus']} CPU cores ({env['processor']}); faiss {env['faiss']} "
        f"({env['faiss_threads']} OpenMP threads), tensorflow {env['tensorflow']}, tfrs {env['tfrs']}. Methods "
        f"interleaved over {results['repeats']} rounds after a warm-up: median seconds, and the median per-round "
        "ratio as the FAISS speed-up; exact inner-product top-k of L2-normalised embeddings; TFRS queries in "
        f"batches of {results['query_batch']}. Load average (1, 5, 15 min) at start / end: "
        f"{env['load_average_1_5_15_min']['start']} / {env['load_average_1_5_15_min']['end']}.",
        "",
        "| items | dim | queries | k | method | seconds | queries/s | FAISS speed-up | same ids as FAISS "
        "| max score gap |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["runs"]:
        agree = row["agreement"] or {}
        same = f"{agree['same_ids']:.4f}" if agree else "—"
        gap = f"{agree['max_score_gap']:.1e}" if agree else "—"
        lines.append(
            f"| {row['items']} | {row['dim']} | {row['queries']} | {row['k']} | {row['method']} | "
            f"{row['seconds']:.3f} | {row['queries_per_second']:.0f} | {row['faiss_speedup']:.1f}x | {same} | {gap} |"
        )
    lines += [
        "",
        "FAISS speed-up = method seconds / FAISS seconds in the same round. "
        "FactorizedTopK times include its accuracy update; "
        "candidate batch 128 is the TFRS tutorials' `candidates=items.batch(128).map(model)`. FactorizedTopK "
        "agreement is checked on the first query batch. Ids that differ from FAISS do so only at near-ties "
        "(max score gap ~1e-7, float rounding).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--queries", type=int, default=4096)
    parser.add_argument("-k", type=int, default=100)
    parser.add_argument("--batch", type=int, default=1024, help="query batch of the TFRS paths")
    parser.add_argument(
        "--candidate-batch", type=int, nargs="+", default=[128, 4096], help="FactorizedTopK candidate dataset batches"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)

    load_at_start = [round(x, 2) for x in os.getloadavg()]
    runs = []
    for num_items in args.items:
        rows = bench(
            num_items, args.dim, args.queries, args.k, args.batch, args.candidate_batch, args.repeats, args.seed
        )
        for row in rows:
            print(json.dumps({key: row[key] for key in ("items", "method", "seconds", "faiss_speedup")}), flush=True)
        runs += rows
    results = {
        "command": " ".join(["python benchmarks/bench_eval.py", *(argv if argv is not None else sys.argv[1:])]),
        "repeats": args.repeats,
        "query_batch": args.batch,
        "environment": {
            "cpus": os.cpu_count(),
            "load_average_1_5_15_min": {"start": load_at_start, "end": [round(x, 2) for x in os.getloadavg()]},
            "processor": platform.processor() or platform.machine(),
            "faiss": faiss.__version__,
            "faiss_threads": faiss.omp_get_max_threads(),
            "tensorflow": tf.__version__,
            "tfrs": tfrs.__version__,
            "numpy": np.__version__,
        },
        "runs": runs,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_eval.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "bench_eval.md").write_text(_markdown(results))
    print(_markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
