"""A FAISS inner-product index over every catalogue item, with the row -> id map.

Retrieval is an argmax over logits: softmax is monotone, so
``argmax_i softmax(z)_i == argmax_i z_i`` and the top-k by dot product is the
top-k by model probability. Neither softmax nor the log-Q correction (a
training-time fix for how negatives were sampled) is applied at inference.

The metric is always inner product. When the towers L2-normalise their
outputs (``model.normalize``) every non-zero embedding is a unit vector and
inner product *is* cosine similarity; ``ItemIndex.normalized`` records whether
that held for the indexed vectors.

Approximate indexes (IVF, HNSW, PQ, ...) are tuned after building: over the
settings FAISS's ``ParameterSpace`` knows for the index (nprobe, efSearch,
...), recall@k against exact search is measured on a sample of queries, and
the fastest setting that reaches the target recall is kept
(``ItemIndex.search_params``) and saved with the index, so a loaded index
searches exactly as measured.

The package's modules: ``item_index`` (``ItemIndex``, ``build_index``, ``build_index_in_blocks``
for a catalogue embedded a block at a time, the saved files), ``search`` (``TopK``, exact search, ``recall_at_k``),
``tuning`` (the ``Tuning`` record and the parameter search). Exact search
picks ``ExactTopK`` or FAISS by an ``ExactRouting`` (``ItemIndex.routing``,
``exact_search(..., routing=)``), so a benchmark or test pins a path by passing
one, not by setting module globals.
"""

from retrieval.index.item_index import (
    INDEX_FILE,
    INDEX_INFO_FILE,
    ITEM_IDS_FILE,
    IndexFilesError,
    ItemIndex,
    build_index,
    build_index_in_blocks,
    check_index_fits,
)
from retrieval.index.search import (
    EXACT_ALWAYS,
    FAISS_ONLY,
    MEASURED_ROUTING,
    ExactRouting,
    TopK,
    exact_search,
    flat_vectors,
    recall_at_k,
)
from retrieval.index.tuning import MAX_EF_SEARCH, Tuning

# Vectors per index.add call, and per block of an index built in blocks (``build_index_in_blocks``): bounds
# the progress interval and the vectors a catalogue's indexing holds beside its index.
ADD_BATCH_SIZE = 100_000

__all__ = [
    "ADD_BATCH_SIZE",
    "EXACT_ALWAYS",
    "FAISS_ONLY",
    "MEASURED_ROUTING",
    "ExactRouting",
    "INDEX_FILE",
    "INDEX_INFO_FILE",
    "ITEM_IDS_FILE",
    "MAX_EF_SEARCH",
    "IndexFilesError",
    "ItemIndex",
    "TopK",
    "Tuning",
    "build_index",
    "build_index_in_blocks",
    "check_index_fits",
    "exact_search",
    "flat_vectors",
    "recall_at_k",
]
