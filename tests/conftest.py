"""Fixtures shared by the test modules.

Importing ``retrieval`` first sets ``TF_USE_LEGACY_KERAS`` before any test module
imports TensorFlow or TFRS (``tests/reference_losses.py`` imports TFRS directly).
"""

from pathlib import Path

import pytest

import retrieval  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def train_run(tmp_path_factory):
    """Runs the whole job (``train_evaluate_export``) once into a fresh output directory.

    ``train_run(config_file, overrides, name)`` loads ``configs/<config_file>`` with the
    ``--set``-style ``overrides`` (quiet training, run ``name``, a temporary
    ``run.output_dir`` added) and returns ``(config, RunResult)``. Module-scoped: each
    integration module trains its own small model once and shares it between its tests.
    """

    def run(config_file: str, overrides: list[str], name: str):
        from retrieval.config import load_config
        from retrieval.jobs import train_evaluate_export

        out = tmp_path_factory.mktemp("artifacts")
        config = load_config(
            ROOT / "configs" / config_file,
            [*overrides, "train.verbose=0", f"run.name={name}", f"run.output_dir={out}"],
        )
        return config, train_evaluate_export(config)

    return run
