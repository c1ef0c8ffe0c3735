"""``python -m retrieval.serving``: the command line of ``retrieval recommend`` (``bundle.recommend_parser``).

The same as ``bundle.main``, with the usage line naming the command as it is typed (run as a package's
``__main__``, argparse would name this file).
"""

import sys
from collections.abc import Sequence

from retrieval.common.errors import entry_point
from retrieval.serving.bundle import recommend, recommend_parser


@entry_point
def main(argv: Sequence[str] | None = None) -> int:
    return recommend(recommend_parser("python -m retrieval.serving").parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
