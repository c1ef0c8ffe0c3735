"""Two-tower retrieval: click logs -> query/doc towers -> FAISS index -> top-k.

TensorFlow Recommenders 0.7 is written against Keras 2. TensorFlow >= 2.16 ships
Keras 3 as ``tf.keras`` unless ``TF_USE_LEGACY_KERAS=1`` is set *before*
TensorFlow is first imported, so we set it here: importing ``retrieval`` is
enough, no user has to remember it.
"""

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
# TensorFlow's C++ INFO lines (CPU feature notices, "no CUDA driver") drown the
# progress output on CPU machines; warnings and errors still show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

__version__ = "0.1.0"
