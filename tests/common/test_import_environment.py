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


# --- a quiet start: TensorFlow's native start-up lines ------------------------------------------------

QUIET_PROBE = """
import json, os
import retrieval, tensorflow as tf
tf.constant(1)
import faiss
print(json.dumps({v: os.environ.get(v) for v in ("TF_CPP_MIN_LOG_LEVEL", "CUDA_VISIBLE_DEVICES")}))
"""
# What TensorFlow 2.21, its CUDA stub and faiss print at start-up on a machine without a GPU.
KNOWN_NOISE = ["absl::InitializeLog", "oneDNN custom operations are on", "Could not find cuda drivers",
               "failed call to cuInit", "cpu_feature_guard", "Could not load library with AVX2 support"]


def _run_quiet_probe(**env: str) -> tuple[dict, str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "RETRIEVAL_DEBUG")}
    done = subprocess.run(
        [sys.executable, "-c", QUIET_PROBE], env={**clean, **env}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_importing_retrieval_then_tensorflow_and_faiss_prints_no_start_up_noise():
    from retrieval.common import native_logs

    state, stderr = _run_quiet_probe(CUDA_VISIBLE_DEVICES="0")
    assert not [line for line in stderr.splitlines() if any(noise in line for noise in KNOWN_NOISE)], stderr
    if not native_logs.has_nvidia_device():  # with a GPU, CUDA's own lines are kept on purpose
        assert stderr == ""
    assert state == {"TF_CPP_MIN_LOG_LEVEL": "1", "CUDA_VISIBLE_DEVICES": "0"}  # a GPU user keeps the GPU


def test_a_users_tf_cpp_min_log_level_0_is_kept_and_shows_everything():
    state, stderr = _run_quiet_probe(TF_CPP_MIN_LOG_LEVEL="0")
    assert state["TF_CPP_MIN_LOG_LEVEL"] == "0"
    assert "oneDNN custom operations are on" in stderr


@pytest.mark.parametrize("env, wanted", [({}, True), ({"RETRIEVAL_DEBUG": "1"}, False),
                                         ({"RETRIEVAL_DEBUG": "0"}, True), ({"TF_CPP_MIN_LOG_LEVEL": "0"}, False),
                                         ({"TF_CPP_MIN_LOG_LEVEL": "2"}, True)])
def test_debug_or_log_level_0_turns_the_filter_off(monkeypatch, env, wanted):
    from retrieval.common import native_logs

    monkeypatch.delenv("RETRIEVAL_DEBUG", raising=False)
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert native_logs.wanted() is wanted


def test_the_filter_keeps_real_lines_in_order_and_cuda_lines_where_a_gpu_may_be(capfd):
    from retrieval.common import native_logs

    cuinit = ("E0000 00:00:1796328085.812031    7957 cuda_platform.cc:52] failed call to cuInit: INTERNAL: "
              "CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)")
    lines = [
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
        "I0000 00:00:1796328081.253171    7957 port.cc:153] oneDNN custom operations are on. You may see ...",
        "E0000 00:00:1796328081.3    7957 some_kernel.cc:12] a real error",
        "I0000 00:00:1796328081.253675    7957 cudart_stub.cc:31] Could not find cuda drivers on your machine, "
        "GPU will not be used.",
        cuinit,
        "UserWarning: a Python warning during the import",
    ]
    for gpu_possible, kept in [(False, [lines[2], lines[5]]), (True, [lines[2], lines[3], cuinit, lines[5]])]:
        with native_logs.filtered_stderr(gpu_possible=gpu_possible):
            os.write(2, ("\n".join(lines) + "\n").encode())
        assert capfd.readouterr().err.splitlines() == kept


def test_the_runtime_filter_drops_tensorflows_noise_lines_only_and_passes_the_rest_on_live(capfd, monkeypatch):
    import os

    from retrieval.common import native_logs

    monkeypatch.delenv("RETRIEVAL_DEBUG", raising=False)
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    grappler = ('W0000 00:00:1733570000.123456   4242 op_level_cost_estimator.cc:699] Error in PredictCost() '
                'for the op: op: "Einsum" attr { key: "T" value { type: DT_FLOAT } } ' + "x" * 500)
    onednn = ("E0000 00:00:1733570001.5   4242 mkl_util.h:123] oneDNN supports DT_BF16 only on platforms with "
              "AVX-512. Falling back to the default Eigen-based implementation if present.")
    real = "E0000 00:00:1733570002.0   4242 some_kernel.cc:12] Out of memory while allocating 12 GiB"
    with native_logs.runtime_filtered_stderr():
        os.write(2, (grappler + "\nprogress 1\n" + onednn + "\n").encode())
        os.write(2, (real + "\npartial line without newline").encode())
        with native_logs.runtime_filtered_stderr():  # nested: one filter
            os.write(2, b"\n")
    err = capfd.readouterr().err
    assert err == f"progress 1\n{real}\npartial line without newline\n"
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")  # the user asked for every line
    with native_logs.runtime_filtered_stderr():
        os.write(2, (grappler + "\n").encode())
    assert capfd.readouterr().err == grappler + "\n"
