"""Fixtures shared by the test modules.

Importing ``retrieval`` first sets ``TF_USE_LEGACY_KERAS`` before any test module
imports TensorFlow or TFRS (``tests/reference_losses.py`` imports TFRS directly).

Trained bundles: a module that only reads what the job writes takes ``trained_bundle`` (one small
synthetic run, trained once per test process and shared by every such module); a test that changes
the bundle or its run directory takes ``trained_bundle_copy`` (its own copy). A module whose point is
the job under a config of its own (warm starts, resuming, determinism, a cluster, tuning, bad input,
streamed or changing inputs, a tower or loss under test) trains with ``train_run``.

Written bundles: bundles over fixed ID towers (known vectors, the reference the serving tests compute
their answers from), written once per test process and shared by the modules that import them as
``world``: ``fixed_tower_bundles``, ``seen_item_bundles``, ``web_page_bundles``.

Every shared fixture is read-only by contract: file modes cannot enforce it where tests run as root
(as in containers), so at the end of the session each one fails naming any file a test added,
removed or changed in it.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

import retrieval  # noqa: F401

if TYPE_CHECKING:
    from retrieval.config import Config
    from retrieval.jobs import RunResult

ROOT = Path(__file__).resolve().parents[1]

# The small synthetic job: ``configs/default.yaml`` (temporal split, every default of the recipe) on a log of
# 600 users, 300 items and about 18,000 clicks, 8 epochs. The log (data.synthetic.seed) and the training
# (train.seed, op determinism) are seeded, so every test process trains the same model.
SMALL_JOB = (
    "data.synthetic.n_users=600",
    "data.synthetic.n_items=300",
    "data.synthetic.mean_clicks_per_user=30",
    "train.epochs=8",
    "train.batch_size=512",
)


def _load(config_file: str, overrides: list[str] | tuple[str, ...], name: str, out: Path) -> Config:
    from retrieval.config import load_config

    return load_config(
        ROOT / "configs" / config_file,
        [*overrides, "train.verbose=0", f"run.name={name}", f"run.output_dir={out}"],
    )


@pytest.fixture(scope="module")
def train_run(tmp_path_factory):
    """Runs the whole job (``train_evaluate_export``) once into a fresh output directory.

    ``train_run(config_file, overrides, name)`` loads ``configs/<config_file>`` with the
    ``--set``-style ``overrides`` (quiet training, run ``name``, a temporary
    ``run.output_dir`` added) and returns ``(config, RunResult)``. Each call trains: for a
    module whose point is the job under its own config; a module that only reads a
    trained bundle takes ``trained_bundle``.
    """

    def run(config_file: str, overrides: list[str], name: str):
        from retrieval.jobs import train_evaluate_export

        config = _load(config_file, overrides, name, tmp_path_factory.mktemp("artifacts"))
        return config, train_evaluate_export(config)

    return run


@dataclass(frozen=True)
class TrainedBundle:
    """One finished run of the job: its config and what ``train_evaluate_export`` returned.

    ``directory`` is the run directory (the bundle: manifest, SavedModels, FAISS index, seen items,
    display features, and the run outputs: ``metrics.json``, ``report.md``, plots, TensorBoard logs,
    ``train_log.csv``, ``config.yaml``); it is the only entry of ``config.run.output_dir``.
    ``overrides`` are the ``--set`` values the run was loaded with, on top of ``configs/default.yaml``.
    """

    config: Config
    result: RunResult
    overrides: tuple[str, ...]

    @property
    def directory(self) -> Path:
        return self.result.directory

    @property
    def metrics(self) -> dict:
        return self.result.metrics


def _contents(folder: Path) -> dict[str, str]:
    """Every path under ``folder`` with its SHA-256 (a folder maps to "")."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
        for path in sorted(folder.rglob("*"))
    }


@contextmanager
def _left_unchanged(folder: Path, fixture: str, instead: str) -> Iterator[None]:
    """Fails, once the block is over, naming every file under ``folder`` added, removed or changed in it.

    File modes cannot keep a shared fixture's files read-only where tests run as root (as in
    containers): this check at the end of the session does, naming the files and what to do ``instead``.
    """
    before = _contents(folder)
    yield
    after = _contents(folder)
    changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
    assert not changed, f"a test changed the shared {fixture} in {folder}: {changed}; {instead}"


@pytest.fixture(scope="session")
def trained_bundle(tmp_path_factory) -> Iterator[TrainedBundle]:
    """The small synthetic job (``SMALL_JOB`` on ``configs/default.yaml``, run ``small``), trained once.

    Shared by every module in this test process (each pytest-xdist worker trains its own): read it,
    never change it. At the end of the session the fixture fails naming any file under
    ``config.run.output_dir`` that was added, removed or changed (``_left_unchanged``). A test that
    writes into the bundle or its output directory takes ``trained_bundle_copy``.
    """
    from retrieval.jobs import train_evaluate_export

    config = _load("default.yaml", SMALL_JOB, "small", tmp_path_factory.mktemp("trained-bundle"))
    bundle = TrainedBundle(config, train_evaluate_export(config), SMALL_JOB)
    with _left_unchanged(Path(config.run.output_dir), "trained_bundle", "take trained_bundle_copy to change it"):
        yield bundle


@pytest.fixture
def trained_bundle_copy(trained_bundle: TrainedBundle, tmp_path: Path) -> TrainedBundle:
    """A copy of ``trained_bundle`` of this test's own, in ``tmp_path / "runs"``, to change at will.

    Its config names the copy's output directory (``run.output_dir``); its ``result`` the copied
    directory, with the same metrics.
    """
    output_dir = tmp_path / "runs"
    directory = output_dir / trained_bundle.directory.name
    shutil.copytree(trained_bundle.directory, directory)
    run = trained_bundle.config.run.model_copy(update={"output_dir": str(output_dir)})
    config = trained_bundle.config.model_copy(update={"run": run})
    return TrainedBundle(config, replace(trained_bundle.result, directory=directory), trained_bundle.overrides)


def _shared_bundles(tmp_path_factory, name: str, write) -> Iterator[dict]:
    """``write(root)``'s bundles in a fresh folder, with the arrays it returns made read-only, kept unchanged."""
    root = tmp_path_factory.mktemp(name)
    written = write(root)
    for value in written.values():
        if isinstance(value, np.ndarray):
            value.flags.writeable = False
    with _left_unchanged(root, name, "copy a bundle into tmp_path to change it"):
        yield written


@pytest.fixture(scope="session")
def fixed_tower_bundles(tmp_path_factory) -> Iterator[dict]:
    """Two bundles written from fixed ID towers (no training), shared by the serving and HTTP modules.

    ``tests/serving/test_service.py``'s ``write_fixed_tower_bundles``: 300 items and 60 users as unit
    vectors of dimension 16 around 8 centres (seed 0), one query and one doc tower returning exactly
    those vectors, written twice: ``"bundle-a"`` (exact ``Flat`` index) and ``"bundle-b"`` (``HNSW16``
    tuned for k=10), each with the top-k SavedModel; and ``"items"``, ``"users"`` (the vectors, read-only
    arrays), ``"item_ids"``, ``"user_ids"``, ``"popular"`` (50 items, the bundles' fallback). Modules take
    it as ``world`` (``from test_service import world``). Read it, never change it: a test that breaks a
    bundle copies it into its ``tmp_path``; the session fails naming any file that changed.
    """
    from test_service import write_fixed_tower_bundles

    yield from _shared_bundles(tmp_path_factory, "fixed_tower_bundles", write_fixed_tower_bundles)


@pytest.fixture(scope="session")
def seen_item_bundles(tmp_path_factory) -> Iterator[dict]:
    """Fixed-tower bundles that store the items each user has seen (no training).

    ``tests/serving/test_seen_items.py``'s ``write_seen_item_bundles``: 300 items, 40 users (seed 0), each
    user's seen items drawn among their highest-scored (user00 all but a few, user39 none); bundles
    ``"seen"`` (Flat), ``"seen-hnsw"`` (HNSW16), ``"old"`` (no seen items stored) and ``"history"`` (a query
    tower reading a click history), and ``"had"`` (each user's seen item ids). Modules take it as ``world``
    (``from test_seen_items import world``); read it, never change it (checked as ``fixed_tower_bundles``).
    """
    from test_seen_items import write_seen_item_bundles

    yield from _shared_bundles(tmp_path_factory, "seen_item_bundles", write_seen_item_bundles)


@pytest.fixture(scope="session")
def web_page_bundles(tmp_path_factory) -> Iterator[dict]:
    """The web page's two fixed-tower bundles (no training).

    ``tests/serving/test_web_page.py``'s ``write_web_page_bundles``: ``"shop"`` (a query tower reading a
    click history, seen items, user histories and an item table: category, price, title) and ``"plain"``
    (an ID tower, no seen items, no item table), with ``"seen"``, ``"recent"`` (each user's clicks, newest
    first) and ``"table"``. Modules take it as ``world`` (``from test_web_page import world``); read it,
    never change it (checked as ``fixed_tower_bundles``).
    """
    from test_web_page import write_web_page_bundles

    yield from _shared_bundles(tmp_path_factory, "web_page_bundles", write_web_page_bundles)
