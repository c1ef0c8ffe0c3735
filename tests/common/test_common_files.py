"""The one file lock and the atomic file write of retrieval/common/, which runs, checkpoints and studies share."""

import subprocess
import sys

import pytest

from retrieval.common.atomic import atomic_file
from retrieval.common.lock import exclusive_lock


class Busy(Exception):
    pass


def test_a_held_lock_refuses_a_second_holder_with_the_callers_error(tmp_path):
    path = tmp_path / "lock"
    with exclusive_lock(path, held=lambda: Busy(f"{path} is busy")):
        with pytest.raises(Busy, match="is busy") as refused:  # a second open file, as another process has
            with exclusive_lock(path, held=lambda: Busy(f"{path} is busy")):
                pass
        assert refused.value.__suppress_context__  # the BlockingIOError is not shown with it
    with exclusive_lock(path, held=lambda: Busy("free again, so never raised")):
        pass
    assert path.exists()  # kept unless asked: the checkpoint directory's and the study's lock files stay


def test_another_process_cannot_take_a_held_lock(tmp_path):
    code = (
        "import sys\nfrom retrieval.common.lock import exclusive_lock\n"
        "try:\n    exclusive_lock(sys.argv[1], held=lambda: RuntimeError('held')).__enter__()\n"
        "except RuntimeError as e:\n    print(e); sys.exit(3)\n"
    )
    with exclusive_lock(tmp_path / "lock", held=lambda: Busy("unexpected")):
        second = subprocess.run([sys.executable, "-c", code, str(tmp_path / "lock")], capture_output=True, text=True)
    assert (second.returncode, second.stdout.strip()) == (3, "held"), second.stderr
    after = subprocess.run([sys.executable, "-c", code, str(tmp_path / "lock")], capture_output=True, text=True)
    assert after.returncode == 0, after.stdout + after.stderr


def test_a_removed_lock_file_is_gone_after_the_block_even_on_an_error(tmp_path):
    path = tmp_path / ".run.lock"
    with pytest.raises(RuntimeError, match="boom"), exclusive_lock(path, held=Busy, remove_on_release=True):
        assert path.exists()
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_an_atomic_file_replaces_the_target_only_when_the_block_succeeds(tmp_path):
    target = tmp_path / "state.json"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="full disk"), atomic_file(target) as partial:
        assert partial.parent == tmp_path and partial.name.startswith(".")
        partial.write_text("half")
        raise RuntimeError("full disk")
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"] and target.read_text() == "old"
    with atomic_file(target) as partial:
        partial.write_text("new")
        assert target.read_text() == "old"  # not before the block ends
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"] and target.read_text() == "new"
