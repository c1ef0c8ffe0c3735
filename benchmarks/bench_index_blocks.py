"""The memory of indexing a catalogue: embedded a block at a time into the index, or as one matrix first.

The job indexes its catalogue with ``build_index_in_blocks`` (``retrieval/jobs/train.py``,
``index_catalogue``): each block of ``retrieval.index.ADD_BATCH_SIZE`` items is embedded by the
doc tower and added to the index, so the [items, dim] matrix is never held beside the index. The
other way, ``embed_frame`` over the whole catalogue and then ``build_index``, holds both. Each way
runs in its own subprocess on the same doc tower (an ID tower: ``StringLookup`` + an embedding
table of ``--items`` x ``--dim`` drawn from a seed) and index (``--factory``, tuned on
``--queries`` random unit queries): the extra peak RSS of indexing is ``VmHWM`` after indexing
less the RSS once the tower is built (the peak reset there), and the two indexes must answer the
same top-10.

    python -m benchmarks.bench_index_blocks            # 1M items x 256, IVF1024,Flat: ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._harness import RESULTS, machine, markdown_table, write_report
from benchmarks._harness import command as command_line

WAYS = ("blocks", "whole matrix")


def _status_bytes(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith(f"{field}:")).split()[1]) * 1024


def _reset_peak_rss() -> int:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux: ``5`` into clear_refs); that RSS."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_bytes("VmRSS")


def run_way(way: str, items: int, dim: int, factory: str, queries: int, seed: int) -> dict:
    """Index the catalogue one way in this process (the parent runs each in a fresh one)."""
    import numpy as np
    import pandas as pd
    import tensorflow as tf

    import retrieval  # noqa: F401  (tf-keras before TensorFlow)
    from retrieval.config import IndexConfig
    from retrieval.index import build_index, build_index_in_blocks
    from retrieval.training.embeddings import embed_frame

    ids = np.array([f"item{i}" for i in range(items)], dtype=object)
    table = np.random.default_rng(seed).normal(size=(items + 1, dim)).astype(np.float32)
    item_id = tf.keras.Input(shape=(), dtype=tf.string, name="item_id")
    rows = tf.keras.layers.StringLookup(vocabulary=ids[:], num_oov_indices=1)(item_id)
    embedding = tf.keras.layers.Embedding(items + 1, dim, embeddings_initializer=tf.keras.initializers.Constant(table))
    tower = tf.keras.Model(item_id, embedding(rows))
    del table
    catalogue = pd.DataFrame({"item_id": ids})
    probe = np.random.default_rng(seed + 1).normal(size=(queries, dim)).astype(np.float32)
    probe /= np.linalg.norm(probe, axis=1, keepdims=True)
    config = IndexConfig(factory=factory, tune_k=100, tune_queries=queries)
    embed_frame(tower, catalogue.iloc[:10])  # the first call's tracing, before the baseline
    before = _reset_peak_rss()  # building the table peaked above what it holds: measure from here
    started = time.perf_counter()
    if way == "blocks":
        index = build_index_in_blocks(list(ids), lambda block: embed_frame(tower, catalogue.iloc[block]), dim, config,
                                      probe, "random unit queries")
    else:
        index = build_index(list(ids), embed_frame(tower, catalogue), config, probe, "random unit queries")
    seconds = time.perf_counter() - started
    peak = _status_bytes("VmHWM")
    return {"rss_before_bytes": before, "peak_rss_bytes": peak, "indexing_extra_peak_bytes": peak - before,
            "index_bytes": index.index.ntotal * dim * 4, "seconds": seconds,
            "search_params": index.search_params, "tuned_recall": index.tuning.recall if index.tuning else None,
            "top10": index.search(probe[:50], 10).rows.tolist()}


def markdown(report: dict) -> str:
    gib = 1 << 30
    rows = [[way, f"{run['indexing_extra_peak_bytes'] / gib:.2f}", f"{run['rss_before_bytes'] / gib:.2f}",
             f"{run['seconds']:.0f}", run["search_params"] or "-",
             f"{run['tuned_recall']:.4f}" if run["tuned_recall"] is not None else "-"]
            for way, run in report["ways"].items()]
    return "\n".join([
        "# Indexing a catalogue in blocks or from one matrix", "",
        f"`{report['command']}` on {report['machine']['cpu']}, {report['machine']['cpus']} CPUs. "
        f"{report['items']:,} items x {report['dim']} dims (the matrix: {report['matrix_bytes'] / gib:.2f} GiB), "
        f"`{report['factory']}` tuned on {report['queries']} random unit queries, each way in its own process; "
        "the extra peak is the peak RSS while indexing less the RSS before (the tower built, its table held).", "",
        *markdown_table(["way", "indexing's extra peak RSS GiB", "RSS before GiB", "seconds", "tuned params",
                         "tuned recall@100"], rows, "lrrrlr"),
        "", f"Same top-10 for the 50 probe queries: {report['same_top10']}.",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--factory", default="IVF1024,Flat")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # a child process's one way
    parser.add_argument("--out", default=str(RESULTS / "bench_index_blocks"), help="results path without extension")
    args = parser.parse_args()
    if args.way:
        print(json.dumps(run_way(args.way, args.items, args.dim, args.factory, args.queries, args.seed)))
        return
    report: dict = {"command": command_line("bench_index_blocks"), "machine": machine("numpy", "tensorflow", "faiss"),
                    "items": args.items, "dim": args.dim, "factory": args.factory, "queries": args.queries,
                    "matrix_bytes": args.items * args.dim * 4, "ways": {}}
    for way in WAYS:
        child = subprocess.run(
            [sys.executable, "-m", "benchmarks.bench_index_blocks", "--way", way, "--items", str(args.items),
             "--dim", str(args.dim), "--factory", args.factory, "--queries", str(args.queries),
             "--seed", str(args.seed)], capture_output=True, text=True, check=True)
        report["ways"][way] = json.loads(child.stdout.strip().splitlines()[-1])
        print(way, {k: v for k, v in report["ways"][way].items() if k != "top10"}, flush=True)
    tops = [run.pop("top10") for run in report["ways"].values()]
    report["same_top10"] = tops[0] == tops[1]
    write_report(args.out, report, markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
