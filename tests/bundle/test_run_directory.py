"""The run directory: nothing outside a run's own bundle is ever deleted, one job per run name, no litter."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import retrieval  # noqa: F401
from retrieval.bundle.manifest import MANIFEST_FILE
from retrieval.bundle.run_directory import RunExistsError, atomic_directory
from retrieval.config import ConfigError, load_config
from retrieval.jobs import train_evaluate_export

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "data.synthetic.n_users=120",
    "data.synthetic.n_items=60",
    "data.synthetic.mean_clicks_per_user=10",
    "train.epochs=1",
    "train.batch_size=128",
    "train.verbose=0",
    "evaluation.baselines.rankers=[popularity]",
    "evaluation.plots=false",
]


def _bundle(path: Path, created_at: str | None = None) -> Path:
    path.mkdir(parents=True)
    (path / MANIFEST_FILE).write_text("{}" if created_at is None else json.dumps({"created_at": created_at}))
    return path


def _dead_pid() -> int:
    """The id of a process that has exited."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(dead.stdout)


@pytest.mark.parametrize("name", [".", "..", "a/b", "../x", ".hidden", "", "x" * 201, "-flag"])
def test_run_name_must_be_one_plain_directory_name(name):
    with pytest.raises(ConfigError, match="run.name"):
        load_config(ROOT / "configs/default.yaml", [f"run.name={json.dumps(name)}"])


def test_overwrite_replaces_only_a_bundle_and_keeps_everything_beside_it(tmp_path):
    _bundle(tmp_path / "sibling")
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "clicks.csv").write_text("user_id,item_id\n")
    with pytest.raises(RunExistsError, match="not a run bundle"), atomic_directory(tmp_path / "data", overwrite=True):
        pass
    assert (tmp_path / "data" / "clicks.csv").exists()

    old = _bundle(tmp_path / "run")
    (old / "old-only").write_text("")
    with atomic_directory(tmp_path / "run", overwrite=True) as scratch:
        (scratch / MANIFEST_FILE).write_text('{"new": true}')
    assert json.loads((tmp_path / "run" / MANIFEST_FILE).read_text()) == {"new": True}
    assert not (tmp_path / "run" / "old-only").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "notes.txt", "run", "sibling"]


def test_a_run_name_is_held_for_the_whole_block(tmp_path):
    with atomic_directory(tmp_path / "run") as scratch:
        (scratch / MANIFEST_FILE).write_text("{}")
        with pytest.raises(RunExistsError, match="another process is writing run 'run'"):
            with atomic_directory(tmp_path / "run", overwrite=True):
                pass
        with atomic_directory(tmp_path / "other"):  # other names are free
            pass
    with atomic_directory(tmp_path / "run", overwrite=True):  # released, and its lock file is gone
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "run"]


def test_a_second_process_cannot_take_a_held_name(tmp_path):
    code = (
        "import sys; from retrieval.bundle.run_directory import atomic_directory, RunExistsError\n"
        "try:\n    atomic_directory(sys.argv[1]).__enter__()\nexcept RunExistsError as e:\n    print(e); sys.exit(3)\n"
    )
    with atomic_directory(tmp_path / "run"):
        held = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True)
    assert held.returncode == 3, held.stderr
    assert "another process is writing run 'run'" in held.stdout


def test_a_failed_block_leaves_nothing_behind(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), atomic_directory(tmp_path / "run") as scratch:
        (scratch / "half-written").write_text("")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_scratch_of_a_killed_process_is_cleaned_but_a_live_ones_is_not(tmp_path):
    (tmp_path / f".run.partial-{_dead_pid()}").mkdir()
    (tmp_path / f".run.partial-{os.getppid()}").mkdir()  # alive: another job's scratch
    with atomic_directory(tmp_path / "run") as scratch:
        (scratch / MANIFEST_FILE).write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".run.partial-{os.getppid()}", "run"]


def test_an_interrupted_swap_is_recovered_from_the_newest_complete_bundle(tmp_path, caplog):
    """Killed between ``final -> .old`` and ``scratch -> final``: two complete bundles and no final."""
    pid, other = _dead_pid(), _dead_pid()
    old = _bundle(tmp_path / f".run.old-{pid}", "2026-01-01T00:00:00+00:00")
    new = _bundle(tmp_path / f".run.partial-{pid}", "2026-01-02T00:00:00+00:00")
    (new / "payload").write_text("new")
    (tmp_path / f".run.partial-{other}").mkdir()  # a scratch killed before its manifest: incomplete
    with caplog.at_level("WARNING", logger="retrieval.bundle"), pytest.raises(RunExistsError, match="already exists"):
        with atomic_directory(tmp_path / "run"):  # no overwrite: the recovered bundle stays
            pass
    assert (tmp_path / "run" / "payload").read_text() == "new"
    assert "moved it back to run" in caplog.text and new.name in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".run.old-{pid}", f".run.partial-{other}", "run"]
    with pytest.raises(RuntimeError, match="boom"), atomic_directory(tmp_path / "run", overwrite=True):
        raise RuntimeError("boom")  # a rerun that fails: the recovered bundle is still there, the rest cleaned
    assert (tmp_path / "run" / "payload").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert not old.exists()


def test_an_incomplete_scratch_is_never_recovered(tmp_path):
    pid = _dead_pid()
    _bundle(tmp_path / f".run.old-{pid}", "2026-01-01T00:00:00+00:00")
    half = tmp_path / f".run.partial-{pid}"
    half.mkdir()
    (half / "index.faiss").write_text("")  # no manifest: it was still being written
    with atomic_directory(tmp_path / "run", overwrite=True) as scratch:
        assert json.loads((tmp_path / "run" / MANIFEST_FILE).read_text())["created_at"].startswith("2026-01-01")
        (scratch / MANIFEST_FILE).write_text('{"created_at": "2026-01-03T00:00:00+00:00"}')
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


KILLED_BETWEEN_RENAMES = """
import json, os, pathlib, sys
from retrieval.bundle.manifest import MANIFEST_FILE
from retrieval.bundle.run_directory import atomic_directory
final = pathlib.Path(sys.argv[1])
rename = pathlib.Path.rename
def dies_after_moving_the_old_bundle_aside(self, target):
    moved = rename(self, target)
    if pathlib.Path(target).name.startswith(f".{final.name}.old-"):
        os._exit(9)  # killed: no cleanup runs
    return moved
pathlib.Path.rename = dies_after_moving_the_old_bundle_aside
with atomic_directory(final, overwrite=True) as scratch:
    (scratch / "payload").write_text(sys.argv[2])
    (scratch / MANIFEST_FILE).write_text(json.dumps({"created_at": "2030-01-01T00:00:00+00:00"}))
"""


@pytest.mark.slow
def test_a_job_killed_between_the_swap_renames_leaves_a_bundle_the_next_job_recovers(tmp_path):
    final = _bundle(tmp_path / "run", "2026-01-01T00:00:00+00:00")
    (final / "payload").write_text("old")
    killed = subprocess.run([sys.executable, "-c", KILLED_BETWEEN_RENAMES, str(final), "new"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == 9, killed.stderr
    assert not final.exists()  # the window: both bundles only under hidden names
    left = sorted(p.name.split("-")[0] for p in tmp_path.iterdir() if p.name != ".run.lock")
    assert left == [".run.old", ".run.partial"]
    with pytest.raises(RuntimeError, match="boom"), atomic_directory(final, overwrite=True):
        raise RuntimeError("boom")  # the next job recovers first, then fails
    assert (final / "payload").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.slow
def test_job_that_fails_on_a_missing_input_leaves_nothing_behind(tmp_path):
    config = load_config(
        ROOT / "configs/default.yaml",
        TINY + ["data.source=files", f"data.clicks.path={tmp_path / 'missing.csv'}", "run.name=missing",
                f"run.output_dir={tmp_path / 'out'}"],
    )
    with pytest.raises(Exception, match="missing.csv"):
        train_evaluate_export(config)
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.slow
def test_job_refuses_a_run_name_another_job_holds(tmp_path):
    out = tmp_path / "out"
    config = load_config(ROOT / "configs/default.yaml", TINY + ["run.name=same", f"run.output_dir={out}"])
    with atomic_directory(out / "same") as scratch:  # stands in for a job started seconds earlier
        with pytest.raises(RunExistsError, match="another process is writing run 'same'"):
            train_evaluate_export(config)
        (scratch / MANIFEST_FILE).write_text('{"first": true}')
    assert json.loads((out / "same" / MANIFEST_FILE).read_text()) == {"first": True}
    assert sorted(p.name for p in out.iterdir()) == ["same"]
