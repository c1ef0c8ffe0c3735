"""`make lint` is a gate that can fail: ruff and mypy, with this project's configuration, reject a
planted unused import and a planted type error, and accept the same module without them."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"
BIN = Path(sys.executable).parent  # .venv/bin: the tools `make lint` runs

CLEAN = '''"""A tiny module both linters accept."""

from __future__ import annotations


def double(x: int) -> int:
    return 2 * x
'''

PLANTED = '''"""The same module with an unused import and a type error."""

from __future__ import annotations

import os


def double(x: int) -> int:
    return 2 * x


count: int = "a"
'''


def _tool(name: str) -> Path:
    path = BIN / name
    assert path.exists(), f"{path} is missing: `make install` installs the dev tools next to the interpreter"
    return path


def _ruff(module: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(_tool("ruff")), "check", "--no-cache", "--config", str(PYPROJECT), str(module)],
        cwd=module.parent, capture_output=True, text=True, timeout=120,
    )


def _mypy(module: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(_tool("mypy")), "--config-file", str(PYPROJECT), "--cache-dir", str(module.parent / ".mypy_cache"),
         str(module)],
        cwd=module.parent, capture_output=True, text=True, timeout=300,
    )


@pytest.mark.slow
def test_ruff_and_mypy_reject_planted_errors_and_accept_clean_code(tmp_path):
    clean = tmp_path / "clean" / "probe.py"
    planted = tmp_path / "planted" / "probe.py"
    for path, text in ((clean, CLEAN), (planted, PLANTED)):
        path.parent.mkdir()
        path.write_text(text)

    ruff = _ruff(clean)
    assert ruff.returncode == 0, ruff.stdout + ruff.stderr
    mypy = _mypy(clean)
    assert mypy.returncode == 0, mypy.stdout + mypy.stderr

    ruff = _ruff(planted)
    assert ruff.returncode != 0, ruff.stdout + ruff.stderr
    assert "F401" in ruff.stdout, ruff.stdout + ruff.stderr  # `os` imported but unused
    mypy = _mypy(planted)
    assert mypy.returncode != 0, mypy.stdout + mypy.stderr
    assert "[assignment]" in mypy.stdout, mypy.stdout + mypy.stderr  # str assigned to an int
