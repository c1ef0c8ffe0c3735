"""Importing ``retrieval`` chooses TensorFlow's Keras 2 and oneDNN kernels before TensorFlow loads.

Each case runs in a fresh interpreter: in this one TensorFlow is long imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json
import retrieval
import tensorflow as tf
from tensorflow.python.util import _pywrap_util_port
print(json.dumps({"keras": tf.keras.__name__, "onednn": bool(_pywrap_util_port.IsMklEnabled())}))
"""


def _import_retrieval(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("TF_USE_LEGACY_KERAS", "TF_ENABLE_ONEDNN_OPTS")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_selects_keras_2_and_onednn_kernels():
    state = _import_retrieval()
    assert state["keras"].startswith("tf_keras"), state  # Keras 2 (tf-keras), not Keras 3
    assert state["onednn"] is True


@pytest.mark.parametrize("value, enabled", [("0", False), ("1", True)])
def test_a_users_own_onednn_setting_wins(value, enabled):
    assert _import_retrieval(TF_ENABLE_ONEDNN_OPTS=value)["onednn"] is enabled
