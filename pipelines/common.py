"""Argument handling shared by the entry points.

Every ``main`` is decorated with ``entry_point`` (``retrieval.errors``): a user error (config,
data, bundle, paths, disk) is one line ``error: <message>`` on stderr and exit status 2, Ctrl-C
``error: interrupted`` and 130; set ``RETRIEVAL_DEBUG=1`` for the traceback.
"""

from __future__ import annotations

import argparse
import logging

import retrieval  # noqa: F401  (sets TF_USE_LEGACY_KERAS before anything imports TensorFlow)


def config_arguments(parser: argparse.ArgumentParser, *, default_config: str | None) -> None:
    parser.add_argument("--config", default=default_config, help="YAML config file (default: %(default)s)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, e.g. --set train.epochs=3 (repeatable; values are YAML)",
    )


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    # faiss's loader says at INFO, over two lines ending in a ModuleNotFoundError, that it fell back
    # from its AVX2 build: not a problem, but it reads like one beside a real error line.
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
