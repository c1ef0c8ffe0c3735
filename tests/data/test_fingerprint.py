"""Input fingerprints: a killed run is resumed only on the input files it started with.

``retrieval.data.fingerprint`` records size, mtime and BLAKE2b of every file a data config reads
(each shard of a directory or glob); ``training_checkpoints`` saves it beside the checkpoints and
refuses a resume whose inputs changed, naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from contextlib import ExitStack
from pathlib import Path

import pytest

import retrieval  # noqa: F401
from retrieval.config import Config, DataConfig, TableConfig, load_config
from retrieval.data.fingerprint import changed_inputs, fingerprint_file, fingerprint_inputs
from retrieval.training.checkpoint_directory import UnfinishedRunError, training_checkpoints

NAME = "fingerprinted"
CLICKS = "user_id,item_id,timestamp\n" + "".join(f"u{i % 7},i{i % 5},{1000 + i}\n" for i in range(60))


def _files_config(tmp_path: Path, *overrides: str) -> Config:
    for name, text in {  # written once: later calls keep what a test changed
        "clicks.csv": CLICKS,
        "test.csv": "user_id,item_id,timestamp\nu1,i2,2000\n",
        "items.csv": "item_id,genre\n" + "".join(f"i{i},g{i % 2}\n" for i in range(5)),
        "users.csv": "user_id,age\n" + "".join(f"u{i},{20 + i}\n" for i in range(7)),
    }.items():
        if not (tmp_path / name).exists():
            (tmp_path / name).write_text(text)
    return load_config(None, [
        "data.source=files",
        f"data.clicks.path={tmp_path / 'clicks.csv'}",
        f"data.test_clicks.path={tmp_path / 'test.csv'}",
        f"data.item_features.path={tmp_path / 'items.csv'}",
        f"data.user_features.path={tmp_path / 'users.csv'}",
        "split.kind=none",
        f"run.output_dir={tmp_path / 'runs'}",
        f"run.name={NAME}",
        "train.checkpoint_every_steps=5",
        *overrides,
    ])


def _start(config: Config) -> tuple[Path | None, ExitStack]:
    cleanup = ExitStack()
    return training_checkpoints(config, NAME, cleanup), cleanup


def _killed(cleanup: ExitStack) -> None:
    """What a killed job leaves: lock released, checkpoints kept."""
    cleanup.__exit__(RuntimeError, RuntimeError("killed"), None)


def test_resume_refuses_an_input_changed_in_place_and_names_it(tmp_path):
    config = _files_config(tmp_path)
    clicks = tmp_path / "clicks.csv"
    directory, cleanup = _start(config)
    assert directory is not None
    recorded = json.loads((directory / "inputs.json").read_text())
    assert sorted(recorded) == sorted(str(tmp_path / f) for f in ["clicks.csv", "test.csv", "items.csv", "users.csv"])
    (directory / "checkpoint").write_text('model_checkpoint_path: "ckpt-5"\n')  # as if one was saved
    _killed(cleanup)

    # Same bytes: resumes, even with a new mtime (touched, or copied back).
    os.utime(clicks, ns=(clicks.stat().st_atime_ns, clicks.stat().st_mtime_ns + 10**9))
    directory, cleanup = _start(config)
    _killed(cleanup)

    # Changed in place with the same size and the old mtime: only the content hash can tell.
    stat = clicks.stat()
    changed = CLICKS.replace("u3,i3", "u3,i4", 1)
    assert len(changed) == len(CLICKS) and changed != CLICKS
    clicks.write_text(changed)
    os.utime(clicks, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(UnfinishedRunError, match=rf"(?s)other input files:.*{re.escape(str(clicks))}: content "
                       r"changed.*restore the file\(s\) to resume it, or set train.resume=false.*run.name"):
        _start(config)
    assert (directory / "checkpoint").exists()  # refused, nothing deleted

    clicks.write_text(CLICKS)  # restored: resumes
    directory, cleanup = _start(config)
    _killed(cleanup)

    (tmp_path / "users.csv").unlink()
    with pytest.raises(UnfinishedRunError, match=rf"{re.escape(str(tmp_path / 'users.csv'))}: no longer there"):
        _start(config)
    (tmp_path / "users.csv").write_text("user_id,age\nu0,99\n")
    with pytest.raises(UnfinishedRunError, match=r"users.csv: content changed"):
        _start(config)

    # Another run name, or train.resume=false, starts over on the new inputs.
    with ExitStack() as other:
        assert training_checkpoints(config, "another", other) != directory
    directory, cleanup = _start(_files_config(tmp_path, "train.resume=false"))
    assert not (directory / "checkpoint").exists()
    assert json.loads((directory / "inputs.json").read_text()) == fingerprint_inputs(config.data)
    _killed(cleanup)


def test_resume_refuses_checkpoints_without_recorded_inputs(tmp_path):
    config = _files_config(tmp_path)
    directory, cleanup = _start(config)
    (directory / "checkpoint").write_text('model_checkpoint_path: "ckpt-5"\n')
    _killed(cleanup)
    (directory / "inputs.json").unlink()  # as an older version left them
    with pytest.raises(UnfinishedRunError, match="inputs.json is missing"):
        _start(config)


def test_every_shard_of_a_directory_or_glob_is_fingerprinted(tmp_path):
    shards = tmp_path / "logs"
    shards.mkdir()
    for name in ["a.csv", "b.tsv", ".hidden.csv", "_SUCCESS", "notes.md"]:
        (shards / name).write_text(f"user_id,item_id\nu,{name}\n")
    config = DataConfig(source="files", clicks=TableConfig(path=str(shards)), out_of_core=True)
    before = fingerprint_inputs(config)
    assert sorted(before) == [str(shards / "a.csv"), str(shards / "b.tsv")]  # what the stream reads
    assert fingerprint_inputs(config) == before and changed_inputs(before, before) == []

    (shards / "c.csv").write_text("user_id,item_id\nu,c\n")
    (shards / "b.tsv").write_text("user_id\titem_id\nu\tB\n")
    (shards / "a.csv").unlink()
    changes = changed_inputs(before, fingerprint_inputs(config))
    assert [line.split(": ")[0] for line in changes] == [str(shards / n) for n in ["a.csv", "b.tsv", "c.csv"]]
    assert "no longer read" in changes[0] and "content changed" in changes[1] and "new file" in changes[2]

    pattern = DataConfig(source="files", clicks=TableConfig(path=str(shards / "*.csv")), out_of_core=True)
    assert sorted(fingerprint_inputs(pattern)) == [str(shards / "c.csv")]


def test_synthetic_data_has_no_files_and_movielens_has_four(tmp_path):
    assert fingerprint_inputs(DataConfig(source="synthetic")) == {}
    for name in ["u.data", "u.item", "u.user", "u.genre"]:
        (tmp_path / name).write_text(name)
    movielens = fingerprint_inputs(DataConfig(source="movielens-100k", movielens_dir=str(tmp_path)))
    assert sorted(movielens) == sorted(str(tmp_path / n) for n in ["u.data", "u.genre", "u.item", "u.user"])


@pytest.mark.parametrize("size", [0, 1, (1 << 20) - 1, 1 << 20, (3 << 20) + 17])
def test_fingerprint_file_matches_hashlib_over_the_whole_file(tmp_path, size):
    """Streaming in 1 MiB chunks hashes exactly the bytes hashlib hashes in one call."""
    data = os.urandom(size)
    path = tmp_path / "blob"
    path.write_bytes(data)
    got = fingerprint_file(path)
    assert got == {"size": size, "mtime_ns": path.stat().st_mtime_ns, "blake2b": hashlib.blake2b(data).hexdigest()}
