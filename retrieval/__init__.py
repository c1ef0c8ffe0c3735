"""Two-tower retrieval: click logs -> query/doc towers -> FAISS index -> top-k.

TensorFlow Recommenders 0.7 is written against Keras 2. TensorFlow >= 2.16 ships
Keras 3 as ``tf.keras`` unless ``TF_USE_LEGACY_KERAS=1`` is set *before*
TensorFlow is first imported, so we set it here: importing ``retrieval`` is
enough, no user has to remember it. The same goes for TensorFlow's oneDNN CPU
kernels (``TF_ENABLE_ONEDNN_OPTS``, see below). Either can be overridden by
setting the variable before importing ``retrieval``. The lines TensorFlow's native libraries print
while they load, which no variable silences, are filtered out of stderr (``retrieval.common.native_logs``).
"""

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
# TensorFlow turns its oneDNN kernels on by default only on CPUs with AVX512-VNNI,
# AVX512-BF16 or AMX; elsewhere (AVX2 machines, most AMD ones) it runs Eigen's.
# On a 2-core AVX2 EPYC the oneDNN kernels halve the training step (1024-batch
# in-batch softmax, 2M-click scale log of 100k users x 1M items: 40-49 ms -> 19-22 ms;
# docs/operations.md, "CPU kernels"). Results differ from Eigen's only by float round-off.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
# TensorFlow's C++ INFO lines drown the progress output; warnings and errors still show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
# That level is read only once TensorFlow's libraries have loaded: what they print while loading
# (absl's "before InitializeLog" line, the oneDNN notice, and on a machine without a GPU the CUDA
# driver's absence, an ERROR among them) is filtered out of the first `import tensorflow` instead
# (retrieval/common/native_logs.py; RETRIEVAL_DEBUG=1 or TF_CPP_MIN_LOG_LEVEL=0 keeps it).
from retrieval.common import native_logs  # noqa: E402  (after the environment it reads)

native_logs.install()

__version__ = "0.1.0"

# The Python API (retrieval/api.py), imported on first use: `import retrieval` stays free of
# TensorFlow, so the command line's --help and a user's own environment settings come first.
_API = ("train", "open_run", "Run", "load_config")


def __getattr__(name: str):
    if name in _API:
        from retrieval import api

        return getattr(api, name)
    raise AttributeError(f"module 'retrieval' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
