"""Re-export a bundle with another FAISS index:
``python -m pipelines.export --run artifacts/<run> --out artifacts/<run>-ivf --set index.factory=IVF64,Flat``.

``pipelines.train`` already writes a complete bundle; this rebuilds only the
index (from the bundle's own doc model over its catalogue), atomically, into a
new directory.
"""

from __future__ import annotations

import argparse
import sys

from pipelines.common import setup_logging
from retrieval.errors import entry_point


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="source bundle directory")
    parser.add_argument("--out", required=True, help="new bundle directory (must not exist unless run.overwrite)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    setup_logging()

    from retrieval.bundles import reindex_bundle
    from retrieval.config import Config, apply_overrides
    from retrieval.export import read_manifest

    manifest = read_manifest(args.run)
    config = Config.from_dict(apply_overrides(manifest["config"], args.overrides), source="--set")
    out = reindex_bundle(args.run, args.out, config.index, overwrite=config.run.overwrite)
    print(f"bundle with index {config.index.factory!r}: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
