"""Input files that change under a running job fail it, naming the file; an unchanged run is unaffected.

The job takes ``RunInputs`` at its start (``retrieval.data.fingerprint``), checks the streamed
shards' sizes and mtimes after every epoch and every input once more, content included, before
the run directory is put in place. A shard unreadable mid-epoch surfaces as a one-line
``DataError`` naming it, not as TensorFlow's wrapped error and traceback.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_out_of_core import _write

import retrieval  # noqa: F401
from retrieval.config import ColumnsConfig, DataConfig, SplitConfig, SyntheticConfig, TableConfig, load_config
from retrieval.data import DataError, generate_clicks
from retrieval.data.fingerprint import InputsChangedError, RunInputs, fingerprint_file
from retrieval.data.streaming import ClickShards, plan_split, scan_counts
from retrieval.training import FrameClicks, StreamedClicks

ROOT = Path(__file__).resolve().parents[2]
NAME = "watched"


def _clicks(seed: int = 0) -> pd.DataFrame:
    """A few hundred clicks (60 users, 40 items)."""
    clicks, _, _ = generate_clicks(SyntheticConfig(n_users=60, n_items=40, mean_clicks_per_user=6, seed=seed))
    return clicks


def _other_rows(path: Path) -> None:
    """Rewrite a Parquet shard with more rows and other ids."""
    rows = _clicks(seed=9).head(150)
    rows.assign(user_id="x" + rows["user_id"], item_id="y" + rows["item_id"]).to_parquet(path, index=False)


def _overrides(tmp_path: Path, clicks_path: Path, *extra: str) -> list[str]:
    return [
        "data.source=files",
        f"data.clicks.path={clicks_path}",
        "model.embedding_dim=8",
        "train.epochs=3",
        "train.batch_size=64",
        "train.validation_fraction=0",
        "train.verbose=0",
        "evaluation.ks=[10]",
        "evaluation.plots=false",
        "evaluation.baselines.rankers=[popularity]",
        "export.topk_model=false",
        f"run.output_dir={tmp_path / 'runs'}",
        f"run.name={NAME}",
        *extra,
    ]


def _config(tmp_path: Path, clicks_path: Path, *extra: str):
    return load_config(ROOT / "configs/default.yaml", _overrides(tmp_path, clicks_path, *extra))


@pytest.fixture
def shards(tmp_path) -> Path:
    """The tiny log as 4 Parquet shards in ``tmp_path/shards``."""
    folder = tmp_path / "shards"
    _write(_clicks(), folder, "parquet", shards=4)
    return folder


def _left_behind(tmp_path: Path) -> list[str]:
    """What a failed run left in the output directory, name locks aside (no bundle, no checkpoints)."""
    runs = tmp_path / "runs"
    return sorted(p.name for p in runs.iterdir() if not p.name.endswith(".lock")) if runs.exists() else []


def _at_epoch(monkeypatch, source: type, epoch: int, change) -> list[int]:
    """Call ``change()`` when the job asks ``source`` for epoch ``epoch``; return the epochs asked for."""
    real, asked = source.epoch, []

    def epoch_then_change(self, number, skip_batches=0):
        asked.append(int(number))
        if number == epoch:
            change()
        return real(self, number, skip_batches)

    monkeypatch.setattr(source, "epoch", epoch_then_change)
    return asked


# --- RunInputs alone: what counts as a change, and how it is named. ---


def _csv_inputs(tmp_path: Path, hashed: bool) -> tuple[RunInputs, Path]:
    path = tmp_path / "clicks.csv"
    path.write_text("user_id,item_id\nu1,i1\nu2,i2\n")
    return RunInputs.take(DataConfig(source="files", clicks=TableConfig(path=str(path))), hashed=hashed), path


@pytest.mark.parametrize("hashed", [True, False])
def test_a_touch_is_a_change_only_without_a_start_hash(tmp_path, monkeypatch, hashed):
    from retrieval.data import fingerprint

    inputs, path = _csv_inputs(tmp_path, hashed)
    inputs.check_stats(), inputs.check_content()
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # same bytes, a new mtime
    if hashed:  # hashed again, once: the same bytes
        hashes = []
        monkeypatch.setattr(fingerprint, "fingerprint_file", lambda p: hashes.append(p) or fingerprint_file(p))
        inputs.check_stats(), inputs.check_stats(), inputs.check_stats()
        assert len(hashes) == 1
        inputs.check_content()
    else:
        with pytest.raises(InputsChangedError, match=rf"^data.clicks {re.escape(str(path))} changed during the run "
                           r"\(same size, modified .* -> .*\); rerun on a stable copy$"):
            inputs.check_stats()


def test_a_rewrite_keeping_size_and_mtime_is_seen_by_the_content_check_alone(tmp_path):
    inputs, path = _csv_inputs(tmp_path, hashed=True)
    stat = path.stat()
    path.write_text("user_id,item_id\nu1,i2\nu2,i1\n")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    inputs.check_stats()  # one stat a file cannot tell
    with pytest.raises(InputsChangedError, match=r"clicks.csv changed during the run \(same size and mtime, other "
                       r"content\); rerun on a stable copy$") as raised:
        inputs.check_content()
    assert raised.value.files == [str(path)] and raised.value.file == str(path)


def test_every_changed_file_is_named_on_one_line(tmp_path, shards):
    data = DataConfig(source="files", clicks=TableConfig(path=str(shards)), out_of_core=True)
    inputs = RunInputs.take(data, hashed=False)
    (shards / "part-0.parquet").unlink()
    _other_rows(shards / "part-2.parquet")
    (shards / "part-9.parquet").write_bytes((shards / "part-1.parquet").read_bytes())  # not read by this run
    with pytest.raises(DataError) as raised:
        inputs.check_stats()
    message = str(raised.value)
    assert "\n" not in message
    assert re.fullmatch(
        rf"2 input files changed during the run: data.clicks shard {re.escape(str(shards / 'part-0.parquet'))} "
        rf"\(deleted or moved\); data.clicks shard {re.escape(str(shards / 'part-2.parquet'))} "
        r"\(size \d+ -> \d+ bytes\); rerun on a stable copy", message,
    ), message


EDITS = ["keep", "touch", "same size and mtime", "other size", "delete"]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.binary(min_size=1, max_size=64), st.sampled_from(EDITS)), min_size=1, max_size=5))
def test_the_checks_report_exactly_the_files_that_changed(files):
    """Over any edits of any shards: the content check of a hashed start names exactly the files whose
    bytes differ or went away; the stat check of an unhashed start also a touched one, and misses only a
    rewrite that put size and mtime back."""
    with tempfile.TemporaryDirectory() as folder:
        paths = [Path(folder) / f"part-{i}.csv" for i in range(len(files))]
        for path, (data, _) in zip(paths, files):
            path.write_bytes(data)
        data_config = DataConfig(source="files", clicks=TableConfig(path=folder), out_of_core=True)
        hashed, unhashed = (RunInputs.take(data_config, hashed=flag) for flag in (True, False))
        for path, (data, edit) in zip(paths, files):
            stat = path.stat()
            if edit == "delete":
                path.unlink()
            elif edit == "other size":
                path.write_bytes(data + b"+")
            elif edit == "same size and mtime":
                path.write_bytes(bytes(b ^ 1 for b in data))
                os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
            elif edit == "touch":
                os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))

        def named(inputs: RunInputs, content: bool) -> list[str]:
            return [path for path, _ in inputs.changes(content=content)]

        def edited(*kinds: str) -> list[str]:
            return [str(path) for path, (_, edit) in zip(paths, files) if edit in kinds]

        assert named(hashed, content=True) == edited("same size and mtime", "other size", "delete")
        assert named(hashed, content=False) == edited("other size", "delete")
        assert named(unhashed, content=False) == edited("touch", "other size", "delete")


# --- A shard unreadable mid-epoch: a DataError naming it, out of tf.data. ---


def test_a_shard_deleted_before_the_stream_reaches_it_is_a_one_line_data_error(shards):
    table = ClickShards.open(TableConfig(path=str(shards)), ColumnsConfig(), read_batch_size=50)
    plan = plan_split(table, SplitConfig(kind="random", test_fraction=0.2))
    source = StreamedClicks(table, plan, 16, shuffle_buffer=32, seed=0, train_rows=scan_counts(table, plan).train_rows)
    batches = sum(1 for _ in source.epoch(0))
    source.check_epoch()
    (shards / "part-3.parquet").unlink()
    fewer = sum(1 for _ in source.epoch(1))  # ends at the missing shard instead of raising inside tf.data
    assert fewer < batches
    with pytest.raises(DataError, match=rf"^{re.escape(str(shards / 'part-3.parquet'))}: the shard is missing: "
                       r"deleted or moved since the run listed it$"):
        source.check_epoch()
    source.check_epoch()  # raised once


# --- The whole job. ---


@pytest.mark.slow
@pytest.mark.parametrize("checkpoints", ["on", "off"])
def test_a_shard_rewritten_between_epochs_fails_the_streamed_run_naming_it(tmp_path, monkeypatch, shards,
                                                                          checkpoints):
    from retrieval.jobs import train_evaluate_export

    shard = shards / "part-1.parquet"
    asked = _at_epoch(monkeypatch, StreamedClicks, 1, lambda: _other_rows(shard))
    config = _config(tmp_path, shards, "data.out_of_core=true",
                     *(["train.checkpoint_every_seconds=0"] if checkpoints == "off" else []))
    with pytest.raises(DataError, match=rf"^data.clicks shard {re.escape(str(shard))} changed during the run "
                       r"\(size \d+ -> \d+ bytes\); rerun on a stable copy$"):
        train_evaluate_export(config)
    assert asked == [0, 1]  # failed at the end of the epoch that read the new rows, not after the run
    assert _left_behind(tmp_path) == []  # no run directory, no scratch, no checkpoints of mixed data


@pytest.mark.slow
@pytest.mark.parametrize("rewrite", ["longer", "same size and mtime"])
def test_a_log_rewritten_during_in_memory_training_is_refused(tmp_path, monkeypatch, rewrite):
    """The log was read whole at the start: a rewrite that changes its size fails the run after the
    epoch that met it (the stat check every epoch makes), one that keeps size and mtime at the end
    (the content check); either way no run directory is left."""
    from retrieval.jobs import train_evaluate_export

    path = tmp_path / "clicks.csv"
    _clicks().to_csv(path, index=False)
    text, stat = path.read_text(), path.stat()

    def change():
        if rewrite == "longer":
            path.write_text(text + "u9999,i9999,1,1.0\n")
        else:  # two ids of the same length swapped, the mtime put back: only the content hash can tell
            path.write_text(text.replace("u0001,", "u000X,").replace("u0002,", "u0001,").replace("u000X,", "u0002,"))
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert path.read_text() != text

    asked = _at_epoch(monkeypatch, FrameClicks, 1, change)  # a log in memory trains from its clicks in memory
    detail = r"size \d+ -> \d+ bytes" if rewrite == "longer" else "same size and mtime, other content"
    with pytest.raises(DataError, match=rf"^data.clicks {re.escape(str(path))} changed during the run "
                       rf"\({detail}\); rerun on a stable copy$"):
        train_evaluate_export(_config(tmp_path, path))
    assert asked == ([0, 1] if rewrite == "longer" else [0, 1, 2])
    assert _left_behind(tmp_path) == []


@pytest.mark.slow
def test_a_shard_deleted_mid_run_is_one_line_naming_it(tmp_path, monkeypatch, shards):
    from retrieval.jobs import train_evaluate_export

    shard = shards / "part-2.parquet"
    _at_epoch(monkeypatch, StreamedClicks, 1, shard.unlink)
    with pytest.raises(DataError) as raised:
        train_evaluate_export(_config(tmp_path, shards, "data.out_of_core=true"))
    message = str(raised.value)
    assert message == f"data.clicks shard {shard} changed during the run (deleted or moved); rerun on a stable copy"
    assert "the shard is missing" in str(raised.value.__cause__)  # the read that met it, chained
    assert _left_behind(tmp_path) == []


@pytest.mark.slow
def test_pipelines_train_prints_a_deleted_shard_as_one_line(tmp_path, shards):
    """``python -m pipelines.train`` with a shard deleted when epoch 2 starts: one error line, no traceback."""
    shard = shards / "part-2.parquet"
    overrides = _overrides(tmp_path, shards, "data.out_of_core=true")
    script = f"""
import os, runpy, sys
from retrieval.training import StreamedClicks
real = StreamedClicks.epoch
def epoch(self, number, skip_batches=0):
    if number == 1 and os.path.exists({str(shard)!r}):
        os.unlink({str(shard)!r})
    return real(self, number, skip_batches)
StreamedClicks.epoch = epoch
sys.argv = ["pipelines.train", "--config", "configs/default.yaml", *{json.dumps([a for o in overrides for a in
                                                                             ("--set", o)])}]
runpy.run_module("pipelines.train", run_name="__main__", alter_sys=True)
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if str(shard) in line]
    assert lines == [f"error: data.clicks shard {shard} changed during the run (deleted or moved); "
                     "rerun on a stable copy"], result.stderr
    assert result.stderr.rstrip().endswith(lines[0])
    assert _left_behind(tmp_path) == []


@pytest.mark.slow
def test_an_unchanged_streamed_run_passes_with_the_metrics_of_an_unwatched_one(tmp_path, monkeypatch, shards):
    from retrieval import jobs

    config = _config(tmp_path, shards, "data.out_of_core=true")
    checks = []
    real = RunInputs.check_stats
    monkeypatch.setattr(RunInputs, "check_stats", lambda self: checks.append(1) or real(self))
    watched = jobs.train_evaluate_export(config)
    assert len(checks) == 3  # after each epoch
    assert (watched.directory / "manifest.json").exists()
    assert not (tmp_path / "runs" / f".{NAME}.checkpoints").exists()

    # The same run with every check a no-op: the same metrics (the checks read files, never the model).
    for check in ("check_stats", "check_content"):
        monkeypatch.setattr(RunInputs, check, lambda self: None)
    unwatched = jobs.train_evaluate_export(_config(tmp_path, shards, "data.out_of_core=true", "run.name=unwatched"))
    for key in ("model", "popularity", "counts", "final_train_loss"):
        assert watched.metrics[key] == unwatched.metrics[key], key
