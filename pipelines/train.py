"""Train, evaluate and export: ``python -m pipelines.train [--config F] [--set k=v ...]``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipelines.common import config_arguments, setup_logging
from retrieval.config import load_config
from retrieval.errors import entry_point


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    config_arguments(parser, default_config="configs/default.yaml")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides)
    setup_logging()

    from retrieval.evaluation import format_table
    from retrieval.jobs import train_evaluate_export

    result = train_evaluate_export(config, config_name=Path(args.config).stem if args.config else "default")
    print()
    print(format_table(result.metrics))
    print(json.dumps({"counts": result.metrics["counts"]}))
    print(f"\nrun directory: {result.directory}  ({result.seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
