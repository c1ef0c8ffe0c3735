"""Exact top-k for evaluation and Flat search: ExactTopK vs FAISS vs TFRS, against the matrix-product bound.

    python -m benchmarks.bench_eval                 # or: make bench-eval (mode topk, ~10 min on 2 cores)
    python -m benchmarks.bench_eval --items 100000 --eval-users 2000 --repeats 1   # quick
    python -m benchmarks.bench_eval --mode tfrs     # the earlier FAISS-vs-TFRS evaluation comparison

Mode ``topk`` (default), on one seeded set of L2-normalised item and query
embeddings (1M x 64, 1000 queries):

- ``bare matmul``: the blocked matrix product alone, scores written and
  dropped, in two blockings: one BLAS thread in each of 2 worker threads over
  [500 x 1024] blocks (what ExactTopK runs; the faster one, and the bound),
  and BLAS's own threads over [1000 x 16384] blocks.
- ``ExactTopK``: ``retrieval.index.exact_topk`` at k = 10, 100, 1000, without and with
  exclusion masks (training items per query, sizes lognormal, median 20).
- ``faiss IndexFlatIP``: ``index.search`` at each k (no masks: with masks FAISS
  must over-fetch, which only slows it further).
- ``tfrs BruteForce``: ``tf.matmul`` + ``tf.math.top_k`` over query batches of 1000.

Every run is paired with a bound run just before it (load from other
processes on a shared machine changes over seconds; a pair sees about the
same), and its ratio to the bound is that pair's; the median over runs is
reported. ExactTopK runs ``--repeats`` rounds (order rotated); FAISS and TFRS,
3-10x slower, run once each so that the mode fits in ten minutes. Every
ExactTopK result is checked against FAISS's (same ids, or equal scores at
float near-ties) and, with masks, for masked items returned.

Then the evaluation row: users/s of a full-corpus ranking (depth 100) of
``--eval-users`` users over the same items, each with its training items masked,
by ``retrieval.evaluation.index_ranking`` over a Flat ``ItemIndex`` (which
searches with ExactTopK), the same with the index forced onto FAISS
(over-fetch k + largest mask in the batch, then drop), and TFRS BruteForce
(same over-fetch). FAISS and TFRS rank the first ``--baseline-users`` of those
users (their rate does not depend on how many), ExactTopK all of them.

Mode ``tfrs``: the earlier comparison of the evaluation path with TFRS
``BruteForce`` and ``FactorizedTopK`` at 10k and 100k items (see ``bench``).

Each mode rewrites its own section of ``bench_eval.json`` / ``bench_eval.md``
in ``--out`` and keeps the other's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS and TF_ENABLE_ONEDNN_OPTS before TensorFlow is imported)

# isort: split
import faiss  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tensorflow_recommenders as tfrs  # noqa: E402
from threadpoolctl import threadpool_info, threadpool_limits  # noqa: E402

from benchmarks._harness import RESULTS, command, load_average, machine, versions_of, write_report  # noqa: E402
from retrieval.common.arrays import drop_members  # noqa: E402
from retrieval.evaluation import EvalSet, index_ranking  # noqa: E402
from retrieval.index import FAISS_ONLY, MEASURED_ROUTING, ItemIndex  # noqa: E402
from retrieval.index.exact_topk import ExactTopK  # noqa: E402

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
    """Time every method on one seeded set of embeddings; returns one dict per method.

    The Flat ``ItemIndex`` is kept on FAISS here (``FAISS_ONLY`` routing), as when this comparison was made.
    """
    return _bench(num_items, dim, num_queries, k, batch, candidate_batches, repeats, seed)


def _bench(num_items, dim, num_queries, k, batch, candidate_batches, repeats, seed):
    rng = np.random.default_rng(seed)
    items = _embeddings(rng, num_items, dim)
    queries = _embeddings(rng, num_queries, dim)
    true_items = rng.integers(0, num_items, size=num_queries)
    ids = [f"i{i}" for i in range(num_items)]

    def eval_set(n):
        return EvalSet(np.arange(n), [np.zeros(1, np.int64)] * n, [np.zeros(0, np.int64)] * n)

    index = ItemIndex.build(ids, items, "Flat")
    index.routing = FAISS_ONLY
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


def _markdown_tfrs(results: dict) -> str:
    env = results["environment"]
    lines = [
        "## Evaluation top-k: FAISS vs TFRS (mode tfrs)",
        "",
        f"`{results['command']}` on {env['cpus']} CPU cores ({env['processor']}); faiss {versions_of(env)['faiss']} "
        f"({env['faiss_threads']} OpenMP threads), tensorflow {versions_of(env)['tensorflow']}, "
        f"tfrs {versions_of(env)['tfrs']}. Methods "
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


def _bare_matmul(items: np.ndarray, queries: np.ndarray, mode: str) -> None:
    """The blocked matrix product alone: every score written to a reused buffer, none read."""
    if mode == "blas threads":
        block = 16_384
        out = np.empty((len(queries), block), np.float32)
        for start in range(0, len(items), block):
            stop = min(start + block, len(items))
            np.matmul(queries, items[start:stop].T, out=out[:, : stop - start])
        return
    block, chunk = 1024, -(-len(queries) // 2)

    def product(first: int) -> None:
        mine = queries[first : first + chunk]
        out = np.empty((len(mine), block), np.float32)
        for start in range(0, len(items), block):
            stop = min(start + block, len(items))
            np.matmul(mine, items[start:stop].T, out=out[:, : stop - start])

    with threadpool_limits(1, user_api="blas"), ThreadPoolExecutor(2) as pool:
        list(pool.map(product, range(0, len(queries), chunk)))


def _training_masks(rng: np.random.Generator, num_users: int, num_items: int) -> list[np.ndarray]:
    """Per-user training items to exclude: lognormal sizes (median 20, 1-2000), distinct items."""
    sizes = np.clip(rng.lognormal(np.log(20), 1.0, size=num_users), 1, 2000).astype(int)
    return [np.unique(rng.integers(0, num_items, size=size)) for size in sizes]


def _tfrs_ranking(brute, queries: np.ndarray, exclude: list[np.ndarray], depth: int, batch: int) -> np.ndarray:
    """TFRS BruteForce top-``depth`` with masks: over-fetch depth + the batch's largest mask, then drop."""
    ranked = np.empty((len(queries), depth), np.int64)
    for start in range(0, len(queries), batch):
        stop = min(start + batch, len(queries))
        extra = max(len(e) for e in exclude[start:stop])
        scores, rows = brute(tf.constant(queries[start:stop]), k=depth + extra)
        rows, _ = drop_members(rows.numpy().astype(np.int64), scores.numpy(), exclude[start:stop])
        ranked[start:stop] = rows[:, :depth]
    return ranked


def bench_topk(args) -> dict:
    """Mode topk: the bound, ExactTopK, FAISS and TFRS per k, then the evaluation row."""
    rng = np.random.default_rng(args.seed)
    items = _embeddings(rng, args.items, args.dim)
    queries = _embeddings(rng, args.queries, args.dim)
    masks = _training_masks(rng, args.queries, args.items)
    exact = ExactTopK(items)
    flat = faiss.IndexFlatIP(args.dim)
    flat.add(items)
    brute = tfrs.layers.factorized_top_k.BruteForce(k=max(args.ks))
    brute.index(tf.constant(items))

    def tfrs_top_k(k: int):
        parts = [brute(tf.constant(queries[s : s + args.batch]), k=k) for s in range(0, len(queries), args.batch)]
        return np.concatenate([p[0].numpy() for p in parts]), np.concatenate([p[1].numpy() for p in parts])

    bound = "bare matmul (1 BLAS thread x 2 workers, 1024-item blocks)"
    methods = {"bare matmul (BLAS threads, 16384-item blocks)": lambda: _bare_matmul(items, queries, "blas threads")}
    for k in args.ks:
        methods[f"ExactTopK k={k}"] = lambda k=k: exact.search(queries, k)
        methods[f"ExactTopK k={k}, masks"] = lambda k=k: exact.search(queries, k, masks)
    once = {}
    for k in args.ks:
        once[f"faiss IndexFlatIP k={k}"] = lambda k=k: flat.search(queries, k)
        once[f"tfrs BruteForce k={k}"] = lambda k=k: tfrs_top_k(k)
    # Warm-up on a slice: thread pools, BLAS buffers, tf.function tracing.
    exact.search(queries[:64], 10, masks[:64])
    flat.search(queries[:64], 10)
    brute(tf.constant(queries[: args.batch]), k=10)
    names = list(methods)
    seconds: dict[str, list[float]] = {name: [] for name in [bound, *names, *once]}
    ratios: dict[str, list[float]] = {name: [] for name in [*names, *once]}
    results = {}
    for round_ in range(args.repeats):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        if round_ == 0:
            order += list(once)
        for name in order:
            # Each run is paired with a bound run just before it: load from other processes
            # changes over seconds, and the pair sees about the same.
            started = time.perf_counter()
            _bare_matmul(items, queries, "workers")
            seconds[bound].append(time.perf_counter() - started)
            run = methods.get(name) or once[name]
            started = time.perf_counter()
            results[name] = run()
            seconds[name].append(time.perf_counter() - started)
            ratios[name].append(seconds[bound][-1] / seconds[name][-1])
        print(json.dumps({"round": round_, **{n: round(v[-1], 3) for n, v in seconds.items() if v}}), flush=True)
    rows = []
    for name in [bound, *names, *once]:
        times = seconds[name]
        row = {"method": name, "seconds": statistics.median(times), "runs": len(times),
               "queries_per_second": args.queries / statistics.median(times),
               "fraction_of_bound": statistics.median(ratios[name]) if name != bound else 1.0}
        if name != bound:
            row["fraction_of_bound_per_run"] = [round(r, 3) for r in ratios[name]]
        k = int(name.rsplit("k=", 1)[1].split(",")[0]) if "k=" in name else None
        if name.startswith("ExactTopK") and "masks" not in name:
            faiss_scores, faiss_rows = results[f"faiss IndexFlatIP k={k}"]
            row["agreement_with_faiss"] = _agreement(faiss_rows, faiss_scores, results[name][1], results[name][0])
        if name.startswith("ExactTopK") and "masks" in name:
            leaked = sum(np.isin(r, m).sum() for r, m in zip(results[name][1], masks))
            row["masked_items_returned"] = int(leaked)
        rows.append(row)
        print(json.dumps({key: row[key] for key in ("method", "queries_per_second", "fraction_of_bound")}),
              flush=True)
    return {"rows": rows, "evaluation": bench_full_eval(args, rng, items, brute),
            "mask_sizes": {"mean": float(np.mean([len(m) for m in masks])),
                           "max": int(max(len(m) for m in masks))}}


def bench_full_eval(args, rng: np.random.Generator, items: np.ndarray, brute) -> list[dict]:
    """Users/s of a full-corpus, masked ranking of ``args.eval_users`` users: ExactTopK vs FAISS vs TFRS."""
    depth = 100
    users = _embeddings(rng, args.eval_users, args.dim)
    masks = _training_masks(rng, args.eval_users, args.items)
    eval_set = EvalSet(np.arange(args.eval_users), [np.zeros(1, np.int64)] * args.eval_users, masks)
    index = ItemIndex.build([f"i{i}" for i in range(args.items)], items, "Flat")
    few = min(args.baseline_users, args.eval_users)
    # index_ranking batches users by mask size; TFRS ranks its sample in that order too.
    sample = np.sort(rng.choice(args.eval_users, few, replace=False))
    sample_set = EvalSet(np.arange(few), [np.zeros(1, np.int64)] * few, [masks[i] for i in sample])
    sample_order = sample[np.argsort([len(masks[i]) for i in sample], kind="stable")]
    runs = []

    def timed(name: str, count: int, run) -> np.ndarray:
        started = time.perf_counter()
        ranked = run()
        elapsed = time.perf_counter() - started
        runs.append({"method": name, "users": count, "items": args.items, "depth": depth, "seconds": elapsed,
                     "users_per_second": count / elapsed})
        print(json.dumps(runs[-1]), flush=True)
        return ranked

    exact_ranked = timed("ExactTopK (index_ranking, Flat ItemIndex)", args.eval_users,
                         lambda: index_ranking(index, users, eval_set, depth))
    index.routing = FAISS_ONLY
    faiss_ranked = timed("faiss IndexFlatIP (index_ranking, over-fetch + drop)", few,
                         lambda: index_ranking(index, users[sample], sample_set, depth))
    index.routing = MEASURED_ROUTING
    tfrs_ranked = timed("tfrs BruteForce (over-fetch + drop)", few,
                        lambda: _tfrs_ranking(brute, users[sample_order], [masks[i] for i in sample_order], depth,
                                              args.batch))
    tfrs_by_user = np.empty_like(tfrs_ranked)
    tfrs_by_user[np.searchsorted(sample, sample_order)] = tfrs_ranked
    for run, ranked in zip(runs[1:], (faiss_ranked, tfrs_by_user)):
        run["same_ids_as_exact"] = float(np.mean(ranked == exact_ranked[sample]))
    runs[0]["masked_items_returned"] = int(sum(np.isin(r, m).sum() for r, m in zip(exact_ranked, masks)))
    return runs


def _environment(load_at_start) -> dict:
    blas = [f"{i['internal_api']} {i['version']} {i.get('architecture', '')} ({i['filepath'].rsplit('/', 1)[-1]})"
            for i in threadpool_info() if i["user_api"] == "blas"]
    return machine(
        "faiss", "tensorflow", "tfrs", "numpy",
        load_average_1_5_15_min={"start": load_at_start, "end": load_average()},
        blas=blas,
        openblas_env={key: os.environ[key] for key in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if key in os.environ},
        faiss_threads=faiss.omp_get_max_threads(),
    )


def _markdown_topk(results: dict) -> str:
    env = results["environment"]
    lines = [
        "## Exact top-k against the matrix-product bound (mode topk)",
        "",
        f"`{results['command']}` on {env['cpus']} CPU cores ({env['processor']}); BLAS: {'; '.join(env['blas'])}"
        f"{', env ' + str(env['openblas_env']) if env['openblas_env'] else ''}; faiss {versions_of(env)['faiss']} "
        f"({env['faiss_threads']} OpenMP threads), tensorflow {versions_of(env)['tensorflow']}, "
        f"tfrs {versions_of(env)['tfrs']}. "
        f"{results['items']:,} x {results['dim']} unit item vectors, {results['queries']} unit queries in one batch "
        f"(TFRS: batches of {results['query_batch']}). Masks: training items per query, mean "
        f"{results['mask_sizes']['mean']:.0f}, max {results['mask_sizes']['max']}. Load average (1, 5, 15 min) at "
        f"start / end: {env['load_average_1_5_15_min']['start']} / {env['load_average_1_5_15_min']['end']}.",
        "",
        "Bound = the bare blocked matrix product, one BLAS thread in each of 2 worker threads over [500 x 1024] "
        "blocks (the faster blocking: BLAS's own threads over [1000 x 16384] blocks is a row below). Every other "
        "run is paired with a bound run just before it; `x bound` = the median over runs of bound seconds / run "
        f"seconds (per-run values in the JSON). ExactTopK: {results['repeats']} rounds, order rotated; FAISS and "
        "TFRS: one run each.",
        "",
        "| method | runs | seconds (median) | queries/s | x bound | same ids as FAISS | max score gap |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        agree = row.get("agreement_with_faiss") or {}
        same = f"{agree['same_ids']:.4f}" if agree else "—"
        gap = f"{agree['max_score_gap']:.1e}" if agree else "—"
        lines.append(f"| {row['method']} | {row['runs']} | {row['seconds']:.2f} | {row['queries_per_second']:.0f} | "
                     f"{row['fraction_of_bound']:.2f} | {same} | {gap} |")
    lines += [
        "",
        "### Full-corpus evaluation with training-item masks",
        "",
        "| method | users ranked | items | depth | seconds | users/s | same ids as ExactTopK |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in results["evaluation"]:
        same = f"{run['same_ids_as_exact']:.4f}" if "same_ids_as_exact" in run else "—"
        lines.append(f"| {run['method']} | {run['users']:,} | {run['items']:,} | {run['depth']} | "
                     f"{run['seconds']:.1f} | {run['users_per_second']:.0f} | {same} |")
    leaked = results["evaluation"][0]["masked_items_returned"]
    lines += [
        "",
        "FAISS and TFRS rank a random sample of the users (users/s does not depend on the count); ExactTopK ranks "
        f"all of them ({leaked} masked items returned). FAISS and TFRS must fetch k + the batch's largest mask and "
        "drop the masked items; ExactTopK masks them in the score block. Ids that differ do so at float near-ties.",
    ]
    return "\n".join(lines) + "\n"


def _markdown(sections: dict) -> str:
    parts = ["# Evaluation top-k: ExactTopK, FAISS, TFRS", ""]
    if "topk" in sections:
        parts.append(_markdown_topk(sections["topk"]))
    if "tfrs" in sections:
        if "note" in sections["tfrs"]:
            parts += [sections["tfrs"]["note"], ""]
        parts.append(_markdown_tfrs(sections["tfrs"]))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["topk", "tfrs"], default="topk")
    parser.add_argument("--items", type=int, nargs="+", default=None,
                        help="catalogue size (topk: one, default 1000000; tfrs: several, default 10000 100000)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--queries", type=int, default=None, help="topk: 1000; tfrs: 4096")
    parser.add_argument("-k", type=int, default=100, help="tfrs mode's k")
    parser.add_argument("--ks", type=int, nargs="+", default=[10, 100, 1000], help="topk mode's ks")
    parser.add_argument("--eval-users", type=int, default=20_000, help="topk: users of the evaluation row")
    parser.add_argument("--baseline-users", type=int, default=2_000,
                        help="topk: users FAISS and TFRS rank in the evaluation row")
    parser.add_argument("--batch", type=int, default=None, help="query batch of the TFRS paths (topk 1000, tfrs 1024)")
    parser.add_argument(
        "--candidate-batch", type=int, nargs="+", default=[128, 4096], help="FactorizedTopK candidate dataset batches"
    )
    parser.add_argument("--repeats", type=int, default=None, help="rounds (topk: 5, tfrs: 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    command_line = command("bench_eval", argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = {}
    if (out / "bench_eval.json").exists():
        sections = json.loads((out / "bench_eval.json").read_text())
        if "runs" in sections:  # written before the topk mode existed: all of it is the tfrs section
            sections = {"tfrs": sections | {"note": "Measured before ExactTopK existed (the Flat index ran FAISS)."}}

    load_at_start = load_average()
    if args.mode == "topk":
        args.items = (args.items or [1_000_000])[0]
        args.queries = args.queries or 1000
        args.batch = args.batch or 1000
        args.repeats = args.repeats or 5
        measured = bench_topk(args)
        sections["topk"] = {"command": command_line, "items": args.items, "dim": args.dim, "queries": args.queries,
                            "repeats": args.repeats, "query_batch": args.batch, **measured,
                            "environment": _environment(load_at_start)}
    else:
        args.repeats = args.repeats or 3
        runs = []
        for num_items in args.items or [10_000, 100_000]:
            rows = bench(num_items, args.dim, args.queries or 4096, args.k, args.batch or 1024, args.candidate_batch,
                         args.repeats, args.seed)
            for row in rows:
                print(json.dumps({key: row[key] for key in ("items", "method", "seconds", "faiss_speedup")}),
                      flush=True)
            runs += rows
        sections["tfrs"] = {"command": command_line, "repeats": args.repeats, "query_batch": args.batch or 1024,
                            "environment": _environment(load_at_start), "runs": runs}
    write_report(out / "bench_eval", sections, _markdown(sections))
    print(_markdown(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
