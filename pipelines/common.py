"""Argument handling shared by the entry points."""

from __future__ import annotations

import argparse
import logging
import sys

import retrieval  # noqa: F401  (sets TF_USE_LEGACY_KERAS before anything imports TensorFlow)
from retrieval.config import Config, ConfigError, load_config


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


def load_or_exit(path: str | None, overrides: list[str]) -> Config:
    try:
        return load_config(path, overrides)
    except ConfigError as error:
        sys.exit(f"error: {error}")


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
