"""ExactTopK against the bare blocked matrix product of the same blocks, and FAISS's IndexFlatIP.

    python -m benchmarks.bench_exact_topk                 # or: make bench-topk (~10 min on 2 cores)
    python -m benchmarks.bench_exact_topk --items 100000 --repeats 3 --faiss-repeats 0   # quick
    git show main:retrieval/index/exact_topk.py > /tmp/before.py
    python -m benchmarks.bench_exact_topk --reference /tmp/before.py   # and an older ExactTopK beside it

Per catalogue (``--items``: 1M, and 40,981 as Gowalla's), one seeded set of unit item vectors
(``--dim`` 64) and ``--queries`` unit queries in one batch, with per-query exclusion masks
(training items, lognormal sizes, median 20: the seen-items exclusion of evaluation and serving).
Methods, each timed on the whole batch:

- ``bare``: the product ExactTopK computes, alone: the same query chunks on the same worker
  threads (one BLAS thread each), the same [block x chunk] item-major blocks written to a
  reused buffer, no selection. The bound ExactTopK is measured against.
- ``bare, query-major [chunk x 1024]``: the product in the other layout (queries as rows), the
  bound an earlier benchmark used, for reference: if it were much faster than ``bare``, ExactTopK's
  blocking would be the thing to fix.
- ``ExactTopK k=..`` without and with masks, at every ``--ks``; with ``--reference FILE``, the
  ``ExactTopK`` of that file too (e.g. an older version), side by side.
- ``faiss IndexFlatIP k=..`` (no masks: FAISS would have to over-fetch), ``--faiss-repeats`` runs.

The machine is shared: every run is paired with a ``bare`` run just before it, its ``x bare`` is
that pair's bare seconds / its seconds, and the table reports the median over the pairs; the
methods' order rotates between rounds. Every ExactTopK result is checked: same ids as FAISS (or
equal scores at float near-ties), and no masked item returned.

Then ``validation pass``: early stopping's shape (``--valid-users`` users over the smaller
catalogue, k = 20, batches of 1024, masks), ExactTopK against the bare product of that shape.

Writes ``bench_exact_topk.json`` / ``.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

import retrieval.index.exact_topk as exact_topk
from benchmarks._harness import RESULTS, command, load_average, machine, markdown_table, write_report
from retrieval.index.exact_topk import ExactTopK

NEAR_TIE = 1e-5  # float32 scores from differently blocked sgemms: ids may swap only this close


def _unit(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    x = rng.normal(size=(n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _masks(rng: np.random.Generator, num_users: int, num_items: int) -> list[np.ndarray]:
    """Per-user training items to exclude: lognormal sizes (median 20, 1-2000), distinct items."""
    sizes = np.clip(rng.lognormal(np.log(20), 1.0, size=num_users), 1, min(2000, num_items)).astype(int)
    return [np.unique(rng.integers(0, num_items, size=size)) for size in sizes]


def _threads() -> int:
    return exact_topk.blas_threads()


def bare_product(items: np.ndarray, queries: np.ndarray, block: int, chunk: int, threads: int,
                 item_major: bool = True) -> None:
    """The blocked product alone, as ExactTopK runs it: query chunks on ``threads`` workers, one BLAS thread each.

    ``item_major``: blocks are [block, chunk] (``items[a:b] @ chunk.T``, ExactTopK's layout);
    otherwise [chunk, block] (``chunk @ items[a:b].T``).
    """
    def product(first: int) -> None:
        mine = queries[first : first + chunk]
        shape = (block, len(mine)) if item_major else (len(mine), block)
        out = np.empty(shape, np.float32)
        for start in range(0, len(items), block):
            stop = min(start + block, len(items))
            if item_major:
                np.matmul(items[start:stop], mine.T, out=out[: stop - start])
            else:
                np.matmul(mine, items[start:stop].T, out=out[:, : stop - start])

    starts = list(range(0, len(queries), chunk))
    with threadpool_limits(1, user_api="blas"), ThreadPoolExecutor(min(threads, len(starts))) as pool:
        list(pool.map(product, starts))


def _load_reference(path: str):
    spec = importlib.util.spec_from_file_location("exact_topk_reference", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--reference: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ExactTopK


def _check(name: str, result, faiss_result, masks) -> dict:
    """Agreement with FAISS (no masks) or masked items returned (masks)."""
    scores, rows = result
    if masks is not None:
        leaked = int(sum(np.isin(r, m).sum() for r, m in zip(rows, masks)))
        if leaked:
            raise AssertionError(f"{name}: {leaked} masked items returned")
        return {"masked_items_returned": leaked}
    reference_scores, reference_rows = faiss_result
    same = rows == reference_rows
    gap = float(np.max(np.abs(scores - reference_scores)))
    if gap > NEAR_TIE:
        raise AssertionError(f"{name}: scores differ from FAISS's by {gap}")
    return {"same_ids_as_faiss": float(same.mean()), "max_score_gap": gap}


def bench_catalogue(args, num_items: int, reference) -> dict:
    """Rounds of paired runs over one catalogue: bare, ExactTopK at each k with and without masks, FAISS."""
    rng = np.random.default_rng(args.seed)
    items = _unit(rng, num_items, args.dim)
    queries = _unit(rng, args.queries, args.dim)
    masks = _masks(rng, args.queries, num_items)
    threads = _threads()
    exact = ExactTopK(items)
    block = -(-exact.block_items // exact_topk.SEGMENT) * exact_topk.SEGMENT
    chunk = exact.query_chunk
    flat = faiss.IndexFlatIP(args.dim)
    flat.add(items)

    def bare() -> None:
        bare_product(items, queries, block, chunk, threads)

    methods: dict[str, Callable] = {
        f"bare, query-major [{chunk} x 1024]": lambda: bare_product(items, queries, 1024, chunk, threads, False),
    }
    for k in args.ks:
        methods[f"ExactTopK k={k}"] = lambda k=k: exact.search(queries, k)
        methods[f"ExactTopK k={k}, masks"] = lambda k=k: exact.search(queries, k, masks)
        if reference is not None:
            before = reference(items)
            methods[f"reference ExactTopK k={k}"] = lambda k=k, s=before: s.search(queries, k)
            methods[f"reference ExactTopK k={k}, masks"] = lambda k=k, s=before: s.search(queries, k, masks)
    slow = {f"faiss IndexFlatIP k={k}": (lambda k=k: flat.search(queries, k)) for k in args.ks}
    # Warm-up: thread pools, BLAS buffers, page faults of the item matrix.
    bare()
    exact.search(queries[:64], 10, masks[:64])
    flat.search(queries[:8], 10)
    bare_name = f"bare (ExactTopK's blocks: [{block} x {chunk}], {threads} workers x 1 BLAS thread)"
    seconds: dict[str, list[float]] = {name: [] for name in [bare_name, *methods, *slow]}
    cpu: dict[str, list[float]] = {name: [] for name in [bare_name, *methods, *slow]}
    ratios: dict[str, list[float]] = {name: [] for name in [*methods, *slow]}
    cpu_ratios: dict[str, list[float]] = {name: [] for name in [*methods, *slow]}
    results: dict[str, Any] = {}
    names = list(methods)
    for round_ in range(args.repeats):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        order += [name for name in slow if round_ < args.faiss_repeats]
        for name in order:
            started, used = time.perf_counter(), time.process_time()
            bare()
            seconds[bare_name].append(time.perf_counter() - started)
            cpu[bare_name].append(time.process_time() - used)
            run = methods.get(name) or slow[name]
            started, used = time.perf_counter(), time.process_time()
            results[name] = run()
            seconds[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - used)
            ratios[name].append(seconds[bare_name][-1] / seconds[name][-1])
            cpu_ratios[name].append(cpu[bare_name][-1] / cpu[name][-1])
        print(json.dumps({"items": num_items, "round": round_, "load": load_average(),
                          **{n: round(v[-1], 3) for n, v in seconds.items() if v}}), flush=True)
    exact_results = {k: exact.search(queries, k) for k in args.ks} if not args.faiss_repeats else {}
    rows = []
    for name in [bare_name, *methods, *slow]:
        times = seconds[name]
        if not times:
            continue
        row: dict = {"method": name, "runs": len(times), "seconds": statistics.median(times),
                     "queries_per_second": args.queries / statistics.median(times),
                     "x_bare": statistics.median(ratios[name]) if name in ratios else 1.0,
                     "cpu_seconds": statistics.median(cpu[name]),
                     "cpu_x_bare": statistics.median(cpu_ratios[name]) if name in ratios else 1.0}
        if name in ratios:
            row["x_bare_per_run"] = [round(r, 3) for r in ratios[name]]
            row["cpu_x_bare_per_run"] = [round(r, 3) for r in cpu_ratios[name]]
        if name.startswith(("ExactTopK", "reference ExactTopK")):
            k = int(name.split("k=")[1].split(",")[0])
            with_masks = name.endswith("masks")
            faiss_result = results.get(f"faiss IndexFlatIP k={k}")
            if with_masks or faiss_result is not None:
                row |= _check(name, results[name], faiss_result, masks if with_masks else None)
            elif k in exact_results:
                np.testing.assert_allclose(results[name][0], exact_results[k][0], atol=NEAR_TIE)
        rows.append(row)
        print(json.dumps({key: row[key] for key in ("method", "queries_per_second", "x_bare", "cpu_x_bare")}),
              flush=True)
    return {"items": num_items, "dim": args.dim, "queries": args.queries, "block": block, "chunk": chunk,
            "threads": threads, "mask_sizes": {"mean": float(np.mean([len(m) for m in masks])),
                                               "max": int(max(len(m) for m in masks))},
            "rows": rows}


def bench_validation(args, reference) -> dict:
    """Early stopping's shape: ``--valid-users`` over the smaller catalogue, k = 20, batches of 1024, masks."""
    rng = np.random.default_rng(args.seed + 1)
    num_items = min(args.items)
    items = _unit(rng, num_items, args.dim)
    users = _unit(rng, args.valid_users, args.dim)
    masks = _masks(rng, args.valid_users, num_items)
    batch, k, threads = 1024, 20, _threads()
    exact = ExactTopK(items)
    block = -(-exact.block_items // exact_topk.SEGMENT) * exact_topk.SEGMENT

    def ranked(search) -> None:
        for start in range(0, len(users), batch):
            search.search(users[start : start + batch], k, masks[start : start + batch])

    def bare() -> None:
        for start in range(0, len(users), batch):
            bare_product(items, users[start : start + batch], block, exact.query_chunk, threads)

    methods: dict[str, Callable[[], None]] = {"ExactTopK": lambda: ranked(exact)}
    if reference is not None:
        before = reference(items)
        methods["reference ExactTopK"] = lambda: ranked(before)
    bare()
    seconds: dict[str, list[float]] = {"bare": [], **{name: [] for name in methods}}
    cpu: dict[str, list[float]] = {"bare": [], **{name: [] for name in methods}}
    for round_ in range(args.repeats):
        for name in list(methods)[round_ % len(methods) :] + list(methods)[: round_ % len(methods)]:
            for timed, run in (("bare", bare), (name, methods[name])):
                started, used = time.perf_counter(), time.process_time()
                run()
                seconds[timed].append(time.perf_counter() - started)
                cpu[timed].append(time.process_time() - used)
    pairs: dict[str, list[float]] = {name: [] for name in methods}
    cpu_pairs: dict[str, list[float]] = {name: [] for name in methods}
    position = 0
    for round_ in range(args.repeats):
        for name in list(methods)[round_ % len(methods) :] + list(methods)[: round_ % len(methods)]:
            pairs[name].append(seconds["bare"][position] / seconds[name][round_])
            cpu_pairs[name].append(cpu["bare"][position] / cpu[name][round_])
            position += 1
    rows = [{"method": "bare", "runs": len(seconds["bare"]), "seconds": statistics.median(seconds["bare"]),
             "x_bare": 1.0, "cpu_seconds": statistics.median(cpu["bare"]), "cpu_x_bare": 1.0}]
    rows += [{"method": name, "runs": len(seconds[name]), "seconds": statistics.median(seconds[name]),
              "x_bare": statistics.median(pairs[name]), "x_bare_per_run": [round(r, 3) for r in pairs[name]],
              "cpu_seconds": statistics.median(cpu[name]), "cpu_x_bare": statistics.median(cpu_pairs[name])}
             for name in methods]
    for row in rows:
        print(json.dumps({"validation": row}), flush=True)
    return {"users": args.valid_users, "items": num_items, "dim": args.dim, "k": k, "batch": batch, "rows": rows}


def _markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        "# Exact top-k: ExactTopK against the bare blocked product of the same blocks",
        "",
        f"`{report['command']}` on {env['cpu']} ({env['cpus']} CPUs); BLAS: {'; '.join(env['blas'])}; "
        f"faiss {env['versions']['faiss']} ({env['faiss_threads']} OpenMP threads), numpy {env['versions']['numpy']}. "
        f"`uptime` at start: `{report['uptime']['start']}`; at end: `{report['uptime']['end']}`. "
        f"ExactTopK's selection: {report['selection']}"
        + (f"; `reference ExactTopK` rows: `{report['reference']}`." if report["reference"] else "."),
        "",
        "`x bare` = the median over pairs of (bare seconds / method seconds), each method run paired with a bare "
        "run just before it (per-pair values in the JSON); `bare` = the same query chunks, worker threads and "
        "item-major blocks as ExactTopK, without selection. Every ExactTopK result is checked against FAISS "
        "(scores within 1e-5) and, with masks, for masked items returned (none). `x bare (CPU)`: the same ratio "
        "of process CPU seconds (all threads), which load from other processes on a shared machine disturbs "
        "less than wall time.",
    ]
    for section in report["catalogues"]:
        lines += [
            "",
            f"## {section['items']:,} x {section['dim']} unit items, {section['queries']:,} queries",
            "",
            f"Blocks of {section['block']} items x {section['chunk']} queries, {section['threads']} worker threads. "
            f"Masks: mean {section['mask_sizes']['mean']:.0f}, max {section['mask_sizes']['max']} items a query.",
            "",
        ]
        table = []
        for row in section["rows"]:
            agreement = f"{row['same_ids_as_faiss']:.4f}" if "same_ids_as_faiss" in row else "—"
            table.append([row["method"], row["runs"], f"{row['seconds']:.3f}", f"{row['queries_per_second']:.0f}",
                          f"{row['x_bare']:.2f}", f"{row['cpu_seconds']:.3f}", f"{row['cpu_x_bare']:.2f}", agreement])
        lines += markdown_table(["method", "runs", "seconds (median)", "queries/s", "x bare", "CPU seconds (median)",
                                 "x bare (CPU)", "same ids as FAISS"], table, "lrrrrrrr")
    validation = report.get("validation")
    if validation:
        lines += [
            "",
            f"## Validation pass: {validation['users']:,} users over {validation['items']:,} items, "
            f"k = {validation['k']}, batches of {validation['batch']}, masks",
            "",
        ]
        lines += markdown_table(["method", "runs", "seconds (median)", "x bare", "CPU seconds (median)",
                                 "x bare (CPU)"],
                                [[r["method"], r["runs"], f"{r['seconds']:.3f}", f"{r['x_bare']:.2f}",
                                  f"{r['cpu_seconds']:.3f}", f"{r['cpu_x_bare']:.2f}"]
                                 for r in validation["rows"]], "lrrrrr")
    return "\n".join(lines) + "\n"


def _selection() -> str:
    """Which selection ExactTopK ran: the compiled kernel (numba) or the numpy fallback."""
    kernel = exact_topk.compiled_kernel()
    return f"compiled (numba {kernel.numba.__version__})" if kernel is not None else "numpy (numba not installed)"


def _uptime() -> str:
    with open("/proc/uptime") as f:
        up = float(f.read().split()[0])
    return f"up {up / 3600:.1f} h, load average: " + ", ".join(f"{x:.2f}" for x in load_average())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, nargs="+", default=[1_000_000, 40_981])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--ks", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--repeats", type=int, default=5, help="rounds of paired runs")
    parser.add_argument("--faiss-repeats", type=int, default=1, help="rounds that also run FAISS (slow)")
    parser.add_argument("--valid-users", type=int, default=10_000, help="users of the validation-pass row (0: none)")
    parser.add_argument("--reference", default=None, help="a file defining another ExactTopK, timed beside this one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    for name in ("items", "ks"):
        if min(getattr(args, name)) <= 0:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    reference = _load_reference(args.reference) if args.reference else None
    started = _uptime()
    catalogues = [bench_catalogue(args, n, reference) for n in args.items]
    validation = bench_validation(args, reference) if args.valid_users else None
    blas = [f"{i['internal_api']} {i['version']} {i.get('architecture', '')}"
            for i in threadpool_info() if i["user_api"] == "blas"]
    report = {"command": command("bench_exact_topk", argv), "uptime": {"start": started, "end": _uptime()},
              "environment": machine("numpy", "faiss", blas=blas, faiss_threads=faiss.omp_get_max_threads()),
              "reference": args.reference, "selection": _selection(), "catalogues": catalogues,
              "validation": validation}
    write_report(Path(args.out) / "bench_exact_topk", report, _markdown(report))
    print(_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
