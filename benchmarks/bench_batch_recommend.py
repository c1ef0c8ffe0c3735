"""Batch recommendation into a Parquet file: users/s of ``retrieval recommend --users ... --out``
(``retrieval.serving.batch.recommend_to_file``) at k=100 over a 1M-item catalogue, for an exact
(Flat) and an IVF bundle.

The bundles are not trained models: no 1M-item trained bundle exists to measure on, and training
one is not what this measures. They are written through the export path (``write_bundle``: the
SavedModels, the FAISS index, the seen items and a fingerprinted manifest, exactly what
``Bundle.load`` checks and serves) from fixed towers (``benchmarks._serving_http.towers_for``)
over the serving benchmark's clustered synthetic embeddings (unit vectors, 64 dims, 1000
clusters). The IVF index is tuned as the job tunes it (``build_index``: the smallest nprobe
whose recall@k against exact search reaches 0.95 on held-out users) unless ``--nprobe`` pins
it. Each user has ``--seen`` training items drawn at random, excluded as a trained bundle's
seen items are.

What is timed is the whole batch path a real bundle runs: the query SavedModel on a block of
user ids, the seen-item lookup, one index search a block (the Flat bundle's on ``ExactTopK``:
a block is over ``ExactRouting.min_queries``), the answers turned into rows and written as one
row group. A warm-up of one block (the SavedModel's first call) runs before the clock starts.
recall@k of the IVF file is against the Flat file, user by user.

With ``--bundle DIR`` it measures a trained bundle instead (e.g. the 1M-item one ``make bench-scale``
keeps with ``--keep-run``): ``--users`` of its training users, drawn with ``--seed``, each answered
once with its seen items excluded, the bundle's own index as it serves.

    python -m benchmarks.bench_batch_recommend                  # 1M items, 20k users (make bench-batch-recommend)
    python -m benchmarks.bench_batch_recommend --items 20000 --users 2000 --out /tmp/bench   # a smoke run
    python -m benchmarks.bench_batch_recommend --bundle /tmp/retrieval-scale/runs/<run> \
        --out benchmarks/results/bench_batch_recommend_trained
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq

from benchmarks._harness import RESULTS, command, machine, markdown_table, write_report
from benchmarks._serving_http import towers_for, write_test_bundle
from benchmarks._serving_index import log, synthetic

FACTORIES = ["Flat", "IVF1024,Flat"]


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--users", type=int, default=20_000, help="users answered (each is timed once)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--clusters", type=int, default=1000)
    parser.add_argument("--spread", type=float, default=0.125, help="noise std per dimension around a centre")
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--seen", type=int, default=20, help="training items per user, excluded from the answers")
    parser.add_argument("--block-size", type=int, default=1024, help="users per search and per row group")
    parser.add_argument("--factories", nargs="+", default=FACTORIES)
    parser.add_argument("--nprobe", type=int, default=None,
                        help="IVF lists probed (default: tuned as the job tunes, recall@k >= 0.95 on held-out users)")
    parser.add_argument("--tune-queries", type=int, default=1000, help="held-out user embeddings IVF is tuned on")
    parser.add_argument("--train-sample", type=int, default=65_536, help="vectors an IVF index is trained on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="where bundles and files go (default: a temporary directory)")
    parser.add_argument("--bundle", default=None, help="a trained bundle to measure instead of synthetic ones")
    parser.add_argument("--out", default=str(RESULTS / "bench_batch_recommend"),
                        help="results stem: <out>.json and <out>.md")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if args.bundle is not None:
        with tempfile.TemporaryDirectory(prefix="bench-batch-") as workdir:
            return run_trained(args, Path(args.bundle), Path(workdir), argv)
    if args.workdir is None:
        with tempfile.TemporaryDirectory(prefix="bench-batch-") as workdir:
            return run(args, Path(workdir), argv)
    return run(args, Path(args.workdir), argv)


def run(args, workdir: Path, argv: list[str] | None = None) -> int:
    import faiss

    from retrieval.bundle.seen_items import SeenItems
    from retrieval.config import IndexConfig
    from retrieval.index import build_index
    from retrieval.serving import Bundle

    started = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    sizes = SimpleNamespace(items=args.items, dim=args.dim, clusters=args.clusters, spread=args.spread,
                            queries=args.users, tune_queries=args.tune_queries)
    items, tune_queries, users = synthetic(rng, sizes)
    item_ids = [f"i{r:07d}" for r in range(args.items)]
    user_ids = [f"u{q}" for q in range(args.users)]
    towers = towers_for(user_ids, users, item_ids, items)
    seen = SeenItems.from_pairs(np.repeat(np.array(user_ids, dtype=object), args.seen),
                                rng.integers(0, args.items, args.users * args.seen))
    log(f"catalogue of {args.items:,} items and {args.users:,} users drawn in {time.perf_counter() - started:.1f} s")

    (workdir / "out").mkdir(parents=True, exist_ok=True)
    rows, files = [], {}
    for factory in args.factories:
        seconds = time.perf_counter()
        config = IndexConfig(factory=factory, train_sample_size=args.train_sample, tune_k=args.k, seed=args.seed,
                             tune_queries=args.tune_queries)
        if args.nprobe is not None and "IVF" in factory:
            config = config.model_copy(update={"search_params": f"nprobe={args.nprobe}"})
        index = build_index(item_ids, items, config, tune_queries, "held-out synthetic users")
        build_seconds = time.perf_counter() - seconds
        directory = write_test_bundle(workdir, factory, index, towers, seen_items=seen)
        del index
        seconds = time.perf_counter()
        bundle = Bundle.load(directory)
        load_seconds = time.perf_counter() - seconds
        out = workdir / "out" / f"{directory.name}.parquet"
        files[factory] = out
        rows.append({**_timed_file(bundle, user_ids, args, out), "build_seconds": round(build_seconds, 2),
                     "load_seconds": round(load_seconds, 2)})
        del bundle
    exact = next((f for f in args.factories if f == "Flat"), None)
    for row in rows:
        if exact is not None and row["factory"] != exact:
            row[f"recall_at_{args.k}_vs_flat"] = round(_recall(files[row["factory"]], files[exact]), 4)

    report = {
        "command": command("bench_batch_recommend", argv),
        "bundles": "synthetic: fixed towers over clustered random embeddings, written by bundle.writer.write_bundle "
                   "(not a trained model)",
        "items": args.items, "users": args.users, "dim": args.dim, "clusters": args.clusters,
        "spread": args.spread, "k": args.k, "seen_per_user": args.seen, "block_size": args.block_size,
        "nprobe": args.nprobe, "tune_queries": args.tune_queries, "train_sample": args.train_sample, "seed": args.seed,
        "machine": machine("numpy", "faiss", "tensorflow", "pyarrow", faiss_threads=faiss.omp_get_max_threads()),
        "results": rows,
        "seconds": round(time.perf_counter() - started, 1),
    }
    write_report(args.out, report, markdown(report))
    log(f"written {args.out}.json and .md")
    return 0


def _timed_file(bundle, user_ids: list[str], args, out: Path) -> dict:
    """One warm-up block, then every user answered into ``out``; the row of the results table."""
    from retrieval.common.progress import Progress
    from retrieval.serving.batch import IdList, recommend_to_file

    bundle.recommend_batch([{"user_id": u} for u in user_ids[: args.block_size]], args.k)  # warm-up
    with Progress(len(user_ids), f"recommend {bundle.index.factory}", "users") as progress:
        summary = recommend_to_file(bundle, IdList(user_ids), args.k, out, block_size=args.block_size,
                                    overwrite=True, progress=progress)
    log(summary.line())
    routing = bundle.index.routing.uses_exact_top_k(args.block_size, len(bundle.index))
    return {
        "factory": bundle.index.factory,
        "search_params": bundle.index.search_params,
        "search": "ExactTopK" if bundle.index.is_exact and routing else "FAISS",
        "users": summary.queries,
        "rows": summary.rows,
        "row_groups": summary.row_groups,
        "seconds": round(summary.seconds, 3),
        "users_per_s": round(summary.queries / summary.seconds, 1),
        "file_bytes": out.stat().st_size,
    }


def run_trained(args, directory: Path, workdir: Path, argv: list[str] | None = None) -> int:
    """``--bundle``: users/s of a trained bundle over its own index and training users."""
    from retrieval.serving import Bundle

    started = time.perf_counter()
    bundle = Bundle.load(directory)
    load_seconds = time.perf_counter() - started
    if bundle.seen_items is None:
        raise SystemExit(f"error: {directory} has no seen_items/: its training users are unknown")
    known = np.asarray(bundle.seen_items.user_ids)
    rows = np.sort(np.random.default_rng(args.seed).choice(len(known), min(args.users, len(known)), replace=False))
    user_ids = [known[r].decode("utf-8") for r in rows]
    row = {**_timed_file(bundle, user_ids, args, workdir / "recs.parquet"), "build_seconds": None,
           "load_seconds": round(load_seconds, 2)}
    manifest = bundle.manifest
    report = {
        "command": command("bench_batch_recommend", argv),
        "bundles": f"trained: {directory.name} (created {manifest.get('created_at')})",
        "items": len(bundle.index), "users": len(user_ids), "dim": bundle.index.dim, "k": args.k,
        "seen_per_user": "the bundle's", "block_size": args.block_size, "seed": args.seed,
        "machine": machine("numpy", "faiss", "tensorflow", "pyarrow"),
        "results": [row],
        "seconds": round(time.perf_counter() - started, 1),
    }
    write_report(args.out, report, markdown(report))
    log(f"written {args.out}.json and .md")
    return 0


def _recall(found: Path, exact: Path) -> float:
    """Mean share of each user's exact top-k (the Flat file) that ``found`` holds for that user."""
    def by_user(path: Path) -> dict[str, set[str]]:
        table = pq.read_table(path, columns=["user_id", "item_id"]).to_pandas()
        return {user: set(group) for user, group in table.groupby("user_id", sort=False)["item_id"]}

    got, truth = by_user(found), by_user(exact)
    return float(np.mean([len(got.get(user, set()) & items) / len(items) for user, items in truth.items()]))


def markdown(report: dict) -> str:
    from benchmarks._harness import describe_machine

    k = report["k"]
    header = ["index", "search params", "search", "users", "rows", "row groups", "seconds", "users/s",
              f"recall@{k} vs Flat", "file MB", "build s", "load s"]
    table = markdown_table(header, [
        [r["factory"], r["search_params"] or "-", r["search"], f"{r['users']:,}", f"{r['rows']:,}", r["row_groups"],
         r["seconds"], f"{r['users_per_s']:,.0f}", r.get(f"recall_at_{k}_vs_flat", "-"),
         f"{r['file_bytes'] / 2**20:.1f}", "-" if r["build_seconds"] is None else r["build_seconds"], r["load_seconds"]]
        for r in report["results"]
    ], align="lllrrrrrrrrr")
    return "\n".join([
        "# Batch recommendations to a Parquet file",
        "",
        f"`{report['command']}`",
        "",
        f"{report['items']:,} items, {report['users']:,} users, dim {report['dim']}, k = {k}, "
        f"{report['seen_per_user']} seen items excluded per user, {report['block_size']} users a block "
        f"(one search and one row group each).",
        "",
        f"**The bundle is {report['bundles']}**: its training users, answered once each." if "clusters" not in report
        else "**The bundles are synthetic**: fixed towers over clustered random embeddings "
        f"({report['clusters']} clusters), written through `bundle.writer.write_bundle` and loaded with `Bundle.load` "
        "as a trained bundle is, but not a trained model; the numbers measure the serving path, not a model.",
        "",
        *table,
        "",
        "users/s: users answered and written per second, after a one-block warm-up (the SavedModel's first "
        "call); seconds include the query tower, the seen-item lookup, the search and the Parquet writing. "
        "build s: index train + add; load s: `Bundle.load` (fingerprint check and probe).",
        "",
        f"Machine: {describe_machine(report['machine'])}; load average at the end "
        f"{report['machine']['load_average']}.",
    ])


if __name__ == "__main__":
    sys.exit(main())
