"""Serving benchmark: exact vs approximate FAISS indexes, FAISS vs TFRS BruteForce, and the HTTP service.

    make bench-serving                                   # 1M items x 64 dims (a few minutes)
    python -m benchmarks.bench_serving --items 100000    # quicker

Data: clustered synthetic embeddings, not random unit vectors (on which ANN is
unrealistically hard: no neighbourhood structure at all). ``--clusters``
centres are drawn on the unit sphere; each item and each query is a centre
plus Gaussian noise (``--spread`` per dimension), L2-normalised, as a
normalising two-tower model produces; queries come from the same mixture.
Three disjoint query sets: tuning (``retrieval.index.build_index`` picks
nprobe / efSearch on them), evaluation (recall, QPS, latency) and, as user
ids of a fixed query tower, the HTTP load.

For each ``--factories`` index: build time (train + add), tuning time, index
size (bytes of the serialized index, about its memory), recall@k against
exact search on the evaluation queries, batch QPS (all evaluation queries in
one ``search``), single-query latency (``ItemIndex.search`` one query at a
time), and end to end through ``retrieval serve`` (uvicorn, a subprocess on
127.0.0.1): the bundle is swapped in with ``POST /admin/reload`` and loaded
with a bounded loopback load: ``--http-requests`` sequential single-query
requests (latency) and the same count from ``--http-concurrency`` client
threads (throughput), each capped at ``--http-seconds``. Then FAISS Flat vs
``tfrs.layers.factorized_top_k.BruteForce`` on the same embeddings.

Mixed load, on the ``--mixed-factory`` index's server: one client
sends single queries back to back for ``--mixed-seconds`` with the server
otherwise idle, then again while ``--mixed-bulk-clients`` other clients (each
its own process, niced, as load generators on other machines would not take
the server's cores) send ``--mixed-batch``-query batches with k = ``--k``
without pause. Single-query p50/p99 of both phases, their ratio (target: mixed
p99 <= 3 x idle p99, zero errors) and the batches' own latency are recorded.
``--mixed-only`` runs just that (a few minutes at 1M items) and updates the
``mixed`` section of an existing ``bench_serving.json`` / ``.md``.

Writes ``bench_serving.json`` and ``bench_serving.md`` to ``--out``. Client and
server share this machine's cores, as does whatever else runs on it: the load
average is recorded with the results.

Real mode: ``benchmarks/bench_serving_real.py`` (``--embeddings DIR`` here runs it too). The index
questions live in ``_serving_index``, the HTTP ones in ``_serving_http``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import RESULTS, command, load_average, markdown_table, timed, write_json, write_report
from benchmarks._serving_http import (
    DEFAULT_STACK,
    HTTP_STACKS,
    SERVE_ARGS,
    TARGET_MIXED_RATIO,
    Server,
    mixed_load,
    mixed_markdown,
    towers_for,
    write_test_bundle,
)
from benchmarks._serving_index import (
    MEMORY_FACTORIES,
    REAL_FACTORIES,
    SYNTHETIC_FACTORIES,
    TARGET_P99_MS,
    TARGET_RECALL,
    TARGET_SPEEDUP,
    cores,
    load_at_start,
    log,
    measure_index,
    setup,
    synthetic,
    tfrs_vs_faiss,
)


def arguments(description: str) -> argparse.ArgumentParser:
    """The options of both serving benchmarks (the real one measures the synthetic catalogue too)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--clusters", type=int, default=1000)
    parser.add_argument("--spread", type=float, default=0.125, help="noise std per dimension around a centre")
    parser.add_argument("--queries", type=int, default=500, help="evaluation queries (also the HTTP user ids)")
    parser.add_argument("--tune-queries", type=int, default=500)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--factories", nargs="+", default=None,
                        help=f"indexes (default {' '.join(SYNTHETIC_FACTORIES)}; with --embeddings "
                             f"{' '.join(REAL_FACTORIES)})")
    parser.add_argument("--single", type=int, default=500, help="single-query searches timed per index")
    parser.add_argument("--single-seconds", type=float, default=10.0, help="cap on the single-query loop")
    parser.add_argument("--http-requests", type=int, default=1000)
    parser.add_argument("--http-concurrency", type=int, default=4)
    parser.add_argument("--http-seconds", type=float, default=15.0)
    parser.add_argument("--tfrs-batch", type=int, default=100, help="queries per BruteForce call")
    parser.add_argument("--mixed-only", action="store_true",
                        help="only the mixed-load scenario; updates the 'mixed' section of the results in --out")
    parser.add_argument("--mixed-factory", default="IVF1024,Flat", help="index the mixed-load server serves")
    parser.add_argument("--mixed-seconds", type=float, default=5.0, help="length of one idle or mixed window")
    parser.add_argument("--mixed-rounds", type=int, default=4, help="idle + mixed window pairs")
    parser.add_argument("--mixed-bulk-clients", type=int, default=2)
    parser.add_argument("--mixed-batch", type=int, default=1024, help="queries per bulk request")
    parser.add_argument("--serve-args", default="", help="extra `retrieval serve` flags, e.g. '--bulk-chunk 16'")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--embeddings", default=None, metavar="DIR",
                        help="real mode: the trained model's embeddings saved by bench_scale.py (items.npy, "
                             "queries.npy, manifest.json); writes bench_serving_real.{json,md}")
    parser.add_argument("--sections", nargs="+", default=["real", "synthetic", "memory"],
                        choices=["real", "synthetic", "memory"], help="real mode: what to measure")
    parser.add_argument("--memory-items", type=int, default=10_000_000,
                        help="real mode, memory row: catalogue size, the real items tiled with noise")
    parser.add_argument("--memory-factories", nargs="+", default=MEMORY_FACTORIES)
    parser.add_argument("--memory-noise", type=float, default=None,
                        help="noise std per dim of the tiled copies (default: calibrated, see memory_catalogue)")
    parser.add_argument("--memory-train-sample", type=int, default=262_144, help="training vectors per index")
    parser.add_argument("--memory-tune-margin", type=float, default=0.01,
                        help="the memory row's settings are tuned to recall target + this (see memory_rows)")
    parser.add_argument("--out", default=str(RESULTS))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    args = parser.parse_args(argv)
    SERVE_ARGS[:] = args.serve_args.split()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    if args.embeddings:
        from benchmarks.bench_serving_real import real_main

        return real_main(args, argv)
    args.factories = args.factories or SYNTHETIC_FACTORIES

    import faiss

    from retrieval.index import recall_at_k

    started = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    items, tune_queries, queries = synthetic(rng, args)
    item_ids = [f"i{r:07d}" for r in range(args.items)]
    user_ids = [f"u{q:05d}" for q in range(args.queries)]
    log(f"data: {args.items} items x {args.dim}, {args.clusters} clusters, spread {args.spread}")
    if args.mixed_only:
        return mixed_only(args, argv, items, tune_queries, queries, item_ids, user_ids, started)

    results = {"setup": setup(args, faiss)}
    measured, exact = measure_catalogue(items, tune_queries, queries, item_ids, user_ids, args, argv, HTTP_STACKS)
    results.update(measured)
    results["tfrs"] = tfrs_vs_faiss(items, queries, exact, args, recall_at_k)
    results["setup"]["load_average_end"] = load_average()
    results["argv"] = list(argv if argv is not None else sys.argv[1:])
    results["setup"]["total_seconds"] = time.perf_counter() - started
    results["targets"] = targets(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_report(out / "bench_serving", results, markdown(results, argv if argv is not None else sys.argv[1:]))
    print((out / "bench_serving.md").read_text())
    return 0


def measure_catalogue(items, tune_queries, queries, item_ids, user_ids, args, argv, ann_stacks,
                      mixed: bool = True) -> tuple[dict, Any]:
    """Exact search, then every ``--factories`` index built, tuned on ``tune_queries`` (what
    ``build_index`` does, timed in two parts), measured on ``queries`` and served over HTTP with each
    of ``ann_stacks`` (the default stack only for Flat); the mixed load on ``--mixed-factory``'s server
    when ``mixed``. Returns ({"exact", "indexes"[, "mixed"]}, the exact TopK of ``queries``)."""
    import faiss

    from retrieval.config import IndexConfig
    from retrieval.index import ItemIndex, exact_search, recall_at_k

    with timed() as clock:
        exact = exact_search(items, queries, args.k)
    exact_seconds = clock.seconds
    exact_qps = len(queries) / exact_seconds
    log(f"exact: {exact_qps:.0f} QPS (batch of {len(queries)})")
    tune_exact = exact_search(items, tune_queries, args.k)  # shared by every index's tuning

    results: dict = {"exact": {"batch_seconds": exact_seconds, "batch_qps": exact_qps}, "indexes": []}
    workdir = Path(tempfile.mkdtemp(prefix="bench_serving-"))
    servers: dict[str, Server] = {}
    try:
        towers = towers_for(user_ids, queries, item_ids, items)
        for factory in args.factories:
            # What build_index(item_ids, items, config, tune_queries) does, timed in two parts.
            config = IndexConfig(factory=factory, tune_k=args.k, tune_queries=args.tune_queries, seed=args.seed)
            with timed() as clock:
                index = ItemIndex.build(item_ids, items, factory, train_sample_size=config.train_sample_size,
                                        seed=config.seed)
            build_seconds = clock.seconds
            tune_seconds = 0.0
            if not index.is_exact:
                with timed() as clock:
                    index.tune(items, tune_queries, k=args.k, target_recall=config.target_recall,
                               query_source="held-out queries", exact=tune_exact)
                tune_seconds = clock.seconds
            row = measure_index(index, queries, exact, args, recall_at_k, faiss)
            if index.is_exact:  # the same IndexFlatIP search as the exact reference: one timing, not two
                row["batch_qps"] = exact_qps
            row.update(factory=factory, build_seconds=build_seconds, tune_seconds=tune_seconds,
                       index_bytes=int(faiss.serialize_index(index.index).nbytes))
            if index.tuning is not None:
                row["reached_target_on_tuning"] = index.tuning.reached_target
            row["speedup_vs_exact"] = row["batch_qps"] / exact_qps
            bundle = write_test_bundle(workdir, factory, index, towers)
            exact_index = index.is_exact
            del index
            # The default stack (what `retrieval serve` picks), and for ANN indexes the pure-Python
            # h11/asyncio stack beside it, so the parser/loop share of the latency is measured.
            for stack in [DEFAULT_STACK] if exact_index else ann_stacks:
                if stack not in servers:
                    servers[stack] = Server(bundle, *stack.split("/"))
                key = "http" if stack == DEFAULT_STACK else f"http_{stack.split('/')[0]}"
                row[key] = servers[stack].measure(bundle, user_ids, exact.rows, args, recall_at_k)
            if mixed and factory == args.mixed_factory:  # the server is serving this bundle now
                results["mixed"] = mixed_load(servers[DEFAULT_STACK], factory, user_ids, args)
                results["mixed"]["command"] = command("bench_serving", argv)
            results["indexes"].append(row)
            log(f"{factory}: {json.dumps(row, default=float)}")
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return results, exact


def mixed_only(args, argv, items, tune_queries, queries, item_ids, user_ids, started) -> int:
    """Build the --mixed-factory bundle, serve it, run mixed_load; merge into the results in --out."""
    from retrieval.config import IndexConfig
    from retrieval.index import build_index

    workdir = Path(tempfile.mkdtemp(prefix="bench_serving-"))
    server = None
    try:
        config = IndexConfig(factory=args.mixed_factory, tune_k=args.k, tune_queries=args.tune_queries,
                             seed=args.seed)
        index = build_index(item_ids, items, config, tune_queries, "held-out queries")
        bundle = write_test_bundle(workdir, args.mixed_factory, index, towers_for(user_ids, queries, item_ids, items))
        del index, items
        server = Server(bundle)
        mixed = mixed_load(server, args.mixed_factory, user_ids, args)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    mixed["command"] = command("bench_serving", argv)
    mixed["setup"] = {"items": args.items, "dim": args.dim, "k": args.k, "total_seconds": time.perf_counter() - started}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench_serving.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    results["mixed"] = mixed
    if "indexes" in results:
        results["targets"] = targets(results)
        write_report(out / "bench_serving", results, markdown(results, results.get("argv", [])))
    else:
        write_json(path, results)
    print(mixed_markdown(mixed))
    return 0 if mixed["met"] else 1


def targets(results) -> dict:
    exact_qps = results["exact"]["batch_qps"]
    ann = [r for r in results["indexes"] if r["factory"] != "Flat"]
    meeting = [
        r["factory"] for r in ann if r["recall"] >= TARGET_RECALL and r["batch_qps"] >= TARGET_SPEEDUP * exact_qps
    ]
    p99 = {r["factory"]: r["http"]["sequential_p99_ms"] for r in results["indexes"]}
    mixed = results.get("mixed")
    return {
        **({"mixed_load_single_query_p99": {
            "target": f"single-query p99 under mixed load <= {TARGET_MIXED_RATIO:g} x idle p99, zero errors",
            "idle_p99_ms": mixed["idle"]["p99_ms"], "mixed_p99_ms": mixed["mixed"]["p99_ms"],
            "ratio": mixed["p99_ratio"], "errors": mixed["errors"], "met": mixed["met"]}} if mixed else {}),
        "ann_recall_and_speedup": {"target": f"recall@k >= {TARGET_RECALL} at >= {TARGET_SPEEDUP:g}x exact QPS",
                                   "met_by": meeting, "met": bool(meeting)},
        "http_single_query_p99": {"target_ms": TARGET_P99_MS, "p99_ms": p99,
                                  "met_by": [f for f, v in p99.items() if v <= TARGET_P99_MS],
                                  "met": any(v <= TARGET_P99_MS for f, v in p99.items() if f != "Flat")},
    }


def index_tables(results, k: int, heading_level: str = "##") -> list[str]:
    """The per-index table and the HTTP table of one catalogue's results (Markdown lines)."""
    lines = markdown_table(
        ["index", "search params", "build s", "tune s", "size MiB", "recall@k", "batch QPS", "x exact",
         "single p50 ms", "single p99 ms"],
        [[r["factory"], r["search_params"] or "-", f"{r['build_seconds']:.1f}", f"{r['tune_seconds']:.1f}",
          f"{r['index_bytes'] / 2**20:.0f}", f"{r['recall']:.4f}", f"{r['batch_qps']:.0f}",
          f"{r['speedup_vs_exact']:.1f}", f"{r['single_p50_ms']:.2f}", f"{r['single_p99_ms']:.2f}"]
         for r in results["indexes"]],
        align="llrrrrrrrr",
    )
    lines += [
        "",
        f"{heading_level} End to end over HTTP (`retrieval serve`, uvicorn on 127.0.0.1, JSON, k={k})",
        "",
    ]
    lines += markdown_table(
        ["index", "HTTP parser / loop", "reload s", "requests", "p50 ms", "p99 ms", "QPS (1 client)", "served recall@k",
         "concurrent QPS", "concurrent p50 ms", "concurrent p99 ms", "errors"],
        [[r["factory"], stack, f"{h['reload_seconds']:.1f}", h["sequential_count"], f"{h['sequential_p50_ms']:.2f}",
          f"{h['sequential_p99_ms']:.2f}", f"{h['sequential_qps']:.0f}", f"{h['served_recall']:.4f}",
          f"{h['concurrent_qps']:.0f} ({h['concurrency']} clients)", f"{h['concurrent_p50_ms']:.2f}",
          f"{h['concurrent_p99_ms']:.2f}", h["errors"]]
         for r in results["indexes"]
         for stack, key in ((DEFAULT_STACK, "http"), ("h11/asyncio", "http_h11")) if key in r
         for h in [r[key]]],
        align="llrrrrrrrrrr",
    )
    return lines


def markdown(results, argv) -> str:
    s, k = results["setup"], results["setup"]["k"]
    lines = [
        "# Serving benchmark",
        "",
        f"Command: `make bench-serving` = `{command('bench_serving', argv)}`",
        "",
        f"{s['items']:,} items x {s['dim']} dims, clustered synthetic embeddings ({s['clusters']} Gaussian "
        f"clusters on the unit sphere, noise {s['spread']} per dim, L2-normalised; queries from the same "
        f"mixture): {s['tune_queries']} tuning queries, {s['queries']} other evaluation queries. "
        f"CPU: {s['cpu']}, {cores(s)} cores (FAISS threads {s['faiss_threads']} for batches, 1 for single "
        f"queries; OMP_WAIT_POLICY={s['omp_wait_policy']}), load average "
        f"{load_at_start(s)[0]:.1f} at start and {s['load_average_end'][0]:.1f} at end (other jobs share "
        f"the machine). FAISS {s['versions']['faiss']}, TF {s['versions']['tensorflow']}, TFRS "
        f"{s['versions']['tfrs']}. Total {s['total_seconds'] / 60:.1f} min.",
        "",
        f"## Indexes (recall@{k} vs exact on the evaluation queries; exact batch QPS "
        f"{results['exact']['batch_qps']:.0f})",
        "",
        *index_tables(results, k),
    ]
    t = results["tfrs"]
    lines += [
        "",
        f"## FAISS Flat vs TFRS BruteForce (same embeddings, exact, batches of {t['batch']})",
        "",
    ]
    lines += markdown_table(
        ["engine", "batch QPS", "single p50 ms", "single p99 ms", "recall@k vs FAISS exact"],
        [[label, f"{e['batch_qps']:.0f}", f"{e['single_p50_ms']:.2f}", f"{e['single_p99_ms']:.2f}",
          f"{e['recall']:.4f}"]
         for name, label in [("faiss_flat", "FAISS IndexFlatIP"), ("tfrs_bruteforce", "TFRS BruteForce")]
         for e in [t[name]]],
        align="lrrrr",
    )
    if "mixed" in results:
        lines += ["", *mixed_markdown(results["mixed"]).splitlines()]
    g = results["targets"]
    a, p = g["ann_recall_and_speedup"], g["http_single_query_p99"]
    lines += [
        "",
        "## Targets",
        "",
        f"- ANN {a['target']}: {'met by ' + ', '.join(a['met_by']) if a['met'] else 'MISSED'}.",
        f"- single-query end-to-end p99 <= {p['target_ms']:g} ms: "
        + ", ".join(f"{f} {v:.2f} ms" for f, v in p["p99_ms"].items())
        + f" ({'met' if p['met'] else 'MISSED'} by an ANN index).",
        *([f"- mixed load: single-query p99 {m['mixed_p99_ms']:.2f} ms vs {m['idle_p99_ms']:.2f} ms idle = "
           f"{m['ratio']:.2f}x (target <= {TARGET_MIXED_RATIO:g}x), {m['errors']} errors: "
           f"{'met' if m['met'] else 'MISSED'}."
           for m in [g.get("mixed_load_single_query_p99")] if m]),
        "",
        "Notes: build s = train (on a sample of at most index.train_sample_size items) + add; tune s = "
        "FAISS ParameterSpace exploration on half the tuning queries + recall on the other half "
        "(`ItemIndex.tune`; the exact reference for the tuning queries is computed once, outside); the chosen "
        "params are then measured on the evaluation queries. Size = serialized index. "
        "Single-query latency is `ItemIndex.search` with one "
        "query; HTTP latency is measured at the client and includes JSON encoding, the query "
        "SavedModel and the FAISS search; client and server share the cores.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
