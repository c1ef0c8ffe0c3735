"""Re-evaluate an exported bundle: ``python -m pipelines.evaluate --run artifacts/<run>``.

Uses the bundle's SavedModel and FAISS index (what would be served) on the
data and split its saved config names; ``--set`` overrides any config key,
e.g. ``--set evaluation.ks=[5,10]``. Metrics are printed; ``metrics.json``,
``report.md`` and the plots are written to ``--out`` (default
``<run>/reevaluated``), so the run's own report is never overwritten.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipelines.common import setup_logging
from retrieval.errors import entry_point


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="bundle directory, e.g. artifacts/<run>")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", help="where to write metrics.json, report.md and plots (default: <run>/reevaluated)")
    args = parser.parse_args(argv)
    setup_logging()

    from retrieval.bundles import evaluate_bundle
    from retrieval.evaluation import format_table

    out = Path(args.out) if args.out else Path(args.run) / "reevaluated"
    metrics = evaluate_bundle(args.run, args.overrides, out=out)
    print(format_table(metrics))
    print(f"written to {out}")
    print(json.dumps({"counts": metrics["counts"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
