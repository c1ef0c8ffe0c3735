"""TensorFlow's start-up lines that nobody can act on, kept off stderr.

TensorFlow 2.21 logs from its native libraries through absl. While those load (``import
tensorflow``), before TensorFlow has read ``TF_CPP_MIN_LOG_LEVEL``, absl writes every message
straight to file descriptor 2, so no setting hides them, twice over (two libraries, each with
its own absl)::

    WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
    I0000 00:00:... port.cc:153] oneDNN custom operations are on. You may see slightly different ...
    I0000 00:00:... cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.

and on a machine without a GPU, the first device lookup adds ``E0000 ... cuda_platform.cc:52]
failed call to cuInit: ... UNKNOWN ERROR (303)``, an ERROR that only says there is no GPU.

``install`` (``import retrieval`` calls it) wraps the first ``import tensorflow``: meanwhile file
descriptor 2 writes to a temporary file, and afterwards every line of it but those of ``NOISE``
goes to stderr, in order; a real error of the import (or a Python warning) still shows. On a
machine with no NVIDIA device (``has_nvidia_device``) the import also lists the physical devices,
so the cuInit line falls inside that window, and the CUDA lines of ``NO_GPU_NOISE`` are dropped.
On a machine with one, nothing CUDA says is hidden and TensorFlow finds its devices when it
always did (``CUDA_VISIBLE_DEVICES`` is read then, unchanged). While the job runs
(``runtime_filtered_stderr``), the lines of ``RUNTIME_NOISE`` (grappler's ``Error in PredictCost()``
warnings, oneDNN's AVX-512 fallback ERROR at export) are dropped as they come, every other line
passed on live: ``TF_CPP_MIN_LOG_LEVEL=2`` would hide every warning with them. ``RETRIEVAL_DEBUG=1`` or a
user's ``TF_CPP_MIN_LOG_LEVEL=0`` turns all of this off. Standard library only (and
``retrieval.common.errors``, which is too): it runs before anything else is imported.
"""

from __future__ import annotations

import faulthandler
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from retrieval.common.errors import debugging  # standard library only, as this module must be

# An absl line: severity letter, date, time, thread, file:line] message.
_ABSL = r"[IWEF]\d{4} [\d:.]+\s+\d+ "
NOISE = re.compile(
    "|".join([
        r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$",
        # retrieval sets TF_ENABLE_ONEDNN_OPTS=1 on purpose (retrieval/__init__.py).
        _ABSL + r"port\.cc:\d+\] oneDNN custom operations are on\. ",
        _ABSL + r"cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized to use available CPU instructions",
        r"To enable the following instructions: .*, in other operations, rebuild TensorFlow with the appropriate "
        r"compiler flags\.$",
    ])
)
NO_GPU_NOISE = re.compile(
    "|".join([
        _ABSL + r"cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine, GPU will not be used\.",
        _ABSL + r"cuda_(platform|executor)\.cc:\d+\] failed call to cuInit: ",
    ])
)


# Lines TensorFlow's runtime writes while a job runs, after start-up: TF_CPP_MIN_LOG_LEVEL=2 would hide
# them and every other warning with them, so ``runtime_filtered_stderr`` drops these alone.
RUNTIME_NOISE = re.compile(
    "|".join([
        # Grappler's cost model has no estimate for some ops (the transformer history's among them) and
        # warns, ~600 characters each, per optimised graph: the graph still runs as written.
        _ABSL + r"op_level_cost_estimator\.cc:\d+\] Error in PredictCost\(\) for the op: ",
        # oneDNN has no kernel of a dtype on a CPU without AVX-512 and says so as an ERROR while the
        # SavedModel is written; TensorFlow runs its Eigen kernel instead.
        _ABSL + r"\S+\] oneDNN supports \S+ only on platforms with AVX-512\. Falling back to the default ",
    ])
)


def wanted() -> bool:
    """Whether TensorFlow's start-up lines are filtered: not with RETRIEVAL_DEBUG=1 or TF_CPP_MIN_LOG_LEVEL=0."""
    return not debugging() and os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1") != "0"


def has_nvidia_device() -> bool:
    """An NVIDIA driver or device node is present (Linux, WSL's /dev/dxg too): CUDA's lines may matter here."""
    dev = Path("/dev")
    return Path("/proc/driver/nvidia").exists() or (dev / "dxg").exists() or any(dev.glob("nvidia[0-9]*"))


def is_noise(line: str, *, gpu_possible: bool) -> bool:
    """One line TensorFlow wrote at start-up (no newline) that says nothing a user can act on."""
    return bool(NOISE.match(line) or (not gpu_possible and NO_GPU_NOISE.match(line)))


@contextmanager
def filtered_stderr(*, gpu_possible: bool) -> Iterator[None]:
    """File descriptor 2 to a temporary file for the block; then its lines but the noise to stderr.

    A temporary file, not a pipe: native code writing while Python holds the import lock
    would fill a pipe that nothing reads. Should the block kill the process (a CPU TensorFlow
    cannot run on), faulthandler prints where to the real stderr and the lines stay in the file
    (``$TMPDIR/retrieval-tensorflow-import-*.log``).
    """
    sys.stderr.flush()
    real = os.dup(2)
    capture = tempfile.NamedTemporaryFile(prefix="retrieval-tensorflow-import-", suffix=".log", delete=False)
    report_crash = not faulthandler.is_enabled()
    real_file = os.fdopen(real, "w", closefd=False)
    try:
        os.dup2(capture.fileno(), 2)
        if report_crash:
            faulthandler.enable(file=real_file)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real, 2)
        if report_crash:
            faulthandler.disable()
        real_file.close()
        os.close(real)
        capture.seek(0)
        text = capture.read().decode("utf-8", errors="replace")
        capture.close()
        os.unlink(capture.name)
        kept = [line for line in text.splitlines(keepends=True)
                if not is_noise(line.rstrip("\r\n"), gpu_possible=gpu_possible)]
        if kept:
            sys.stderr.write("".join(kept))
            sys.stderr.flush()


@contextmanager
def runtime_filtered_stderr() -> Iterator[None]:
    """File descriptor 2 through a pipe for the block: a thread passes every line on to stderr as it
    comes, but those of ``RUNTIME_NOISE`` (nothing is held back, so progress lines stay live).

    Off (the block runs as is) when not ``wanted`` or when stderr is already filtered. Should the
    process crash inside the block, faulthandler writes its traceback to the real stderr.
    """
    global _RUNTIME_FILTER_ON
    if not wanted() or _RUNTIME_FILTER_ON:
        yield
        return
    sys.stderr.flush()
    real = os.dup(2)
    read_end, write_end = os.pipe()
    report_crash = not faulthandler.is_enabled()
    real_file = os.fdopen(real, "w", closefd=False)

    def forward() -> None:
        pending = b""
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                lines = (pending + chunk).split(b"\n")
                pending = lines.pop()
                kept = [line + b"\n" for line in lines if not RUNTIME_NOISE.match(line.decode("utf-8", "replace"))]
                if kept:
                    os.write(real, b"".join(kept))
        if pending and not RUNTIME_NOISE.match(pending.decode("utf-8", "replace")):
            os.write(real, pending)

    thread = threading.Thread(target=forward, name="retrieval-stderr-filter", daemon=True)
    thread.start()
    os.dup2(write_end, 2)
    os.close(write_end)
    _RUNTIME_FILTER_ON = True
    if report_crash:
        faulthandler.enable(file=real_file)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real, 2)  # the pipe's last write end closes: the thread reads to its end and stops
        thread.join(timeout=5)  # a child process that inherited the pipe keeps it open: it forwards on
        _RUNTIME_FILTER_ON = False
        if report_crash:
            faulthandler.disable()
        real_file.close()
        os.close(real)


_RUNTIME_FILTER_ON = False


class _QuietLoader(importlib.abc.Loader):
    """TensorFlow's own loader, its ``exec_module`` run inside ``filtered_stderr``."""

    def __init__(self, loader: Any):
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        gpu_possible = has_nvidia_device()
        with filtered_stderr(gpu_possible=gpu_possible):
            self._loader.exec_module(module)
            if not gpu_possible:
                # The CUDA driver's lookup, which only fails here: inside the window rather than at the first op.
                module.config.list_physical_devices()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _TensorFlowFinder(importlib.abc.MetaPathFinder):
    """Finds ``tensorflow`` as the other finders do, once, and hands it ``_QuietLoader``."""

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> Any:
        if fullname != "tensorflow":
            return None
        uninstall()
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _QuietLoader(spec.loader)
        return spec


_FINDER = _TensorFlowFinder()


def install() -> None:
    """Filter the first ``import tensorflow`` of this process (see the module docstring), when ``wanted``
    and TensorFlow is not imported yet."""
    if wanted() and "tensorflow" not in sys.modules and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
