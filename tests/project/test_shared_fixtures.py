"""The guard that keeps tests/conftest.py's shared bundles unchanged: a test that writes into one fails the session."""

import pytest
from conftest import _left_unchanged


def _files(folder, **contents):
    for name, text in contents.items():
        (folder / name).write_text(text)


def test_a_file_added_removed_or_changed_under_a_shared_fixture_is_named(tmp_path):
    _files(tmp_path, kept="a", changed="b", removed="c")
    (tmp_path / "models").mkdir()
    expected = r"shared trained_bundle in .*: \['added', 'changed', 'models/x', 'removed'\]; use a copy"
    with pytest.raises(AssertionError, match=expected):
        with _left_unchanged(tmp_path, "trained_bundle", "use a copy"):
            _files(tmp_path, changed="B", added="d")
            (tmp_path / "removed").unlink()
            (tmp_path / "models" / "x").write_text("")


def test_reading_a_shared_fixture_passes(tmp_path):
    _files(tmp_path, kept="a")
    with _left_unchanged(tmp_path, "trained_bundle", "use a copy"):
        assert (tmp_path / "kept").read_text() == "a"
