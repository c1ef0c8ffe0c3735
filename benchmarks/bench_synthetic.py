"""Seconds to generate the synthetic click log (``retrieval.data.generate_clicks``).

    python -m benchmarks.bench_synthetic            # or: make bench-synthetic
    python -m benchmarks.bench_synthetic --repeats 1   # quick

The generator is meant to be cheap enough to call in every test and notebook:
~100k clicks in well under a second. That is a timing, so it lives here rather
than in ``tests/data/test_synthetic.py``, where a wall-time bound on a shared 2-core
machine fails for reasons that are not bugs. For each size, the log is
generated ``--repeats`` times after one warm-up; the median seconds and clicks per
second are written to ``bench_synthetic.json`` and ``bench_synthetic.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks._harness import RESULTS, machine, markdown_table, versions_of, write_report
from retrieval.config import SyntheticConfig
from retrieval.data import generate_clicks

# (users, items, mean clicks per user): ~100k clicks (the test suite's scale) and ~1M.
SIZES = [(2_500, 2_000, 40), (25_000, 20_000, 40)]


def bench(n_users: int, n_items: int, mean_clicks: int, repeats: int, seed: int) -> dict:
    config = SyntheticConfig(n_users=n_users, n_items=n_items, mean_clicks_per_user=mean_clicks, seed=seed)
    clicks, _, _ = generate_clicks(config)  # warm-up (imports, allocator)
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        generate_clicks(config)
        seconds.append(time.perf_counter() - started)
    median = statistics.median(seconds)
    return {
        "users": n_users,
        "items": n_items,
        "mean_clicks_per_user": mean_clicks,
        "clicks": len(clicks),
        "seconds": round(median, 4),
        "min_seconds": round(min(seconds), 4),
        "clicks_per_second": round(len(clicks) / median),
    }


def _markdown(results: dict) -> str:
    env = results["environment"]
    lines = [
        "# Synthetic click log generation",
        "",
        f"`python -m benchmarks.bench_synthetic` (`make bench-synthetic`) on {env['cpus']} CPU cores "
        f"({env['processor']}); numpy {versions_of(env)['numpy']}, pandas {versions_of(env)['pandas']}. "
        f"Median of {results['repeats']} "
        f"runs after a warm-up. Load average (1, 5, 15 min) at start: {env['load_average']}.",
        "",
        *markdown_table(
            ["users", "items", "clicks", "seconds (median)", "seconds (min)", "clicks/s"],
            [[r["users"], r["items"], r["clicks"], f"{r['seconds']:.3f}", f"{r['min_seconds']:.3f}",
              f"{r['clicks_per_second']:,}"] for r in results["rows"]],
        ),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    results = {
        "repeats": args.repeats,
        "environment": machine("numpy", "pandas"),
        "rows": [],
    }
    for n_users, n_items, mean_clicks in SIZES:
        row = bench(n_users, n_items, mean_clicks, args.repeats, args.seed)
        print(json.dumps(row), flush=True)
        results["rows"].append(row)
    write_report(Path(args.out) / "bench_synthetic", results, _markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
