"""Candidate samplers: ``sample(positive_ids) -> Negatives(ids, log_q, positive_log_q)``.

``log_q`` is always the log *expected count* of an item in the batch's
candidate set (``samplers.base`` explains the unit), so every loss corrects its
logits the same way: ``logit - log_q``.

- ``base``: the ``Negatives`` type, the ``Sampler`` base class, expected counts;
- ``corpus``: uniform, unigram^alpha, log-uniform (Zipfian) and all-items samplers;
- ``in_batch``: in-batch and mixed (in-batch + corpus) negatives;
- ``frequency``: log-Q sources for in-batch negatives, static and streaming;
- ``hard``: hard negatives mined from a FAISS index of the current doc embeddings;
- ``kernel``: per-query draws from a quadratic kernel of the current model (Blanc & Rendle 2018);
  ``kernel_tree`` holds its tree's node statistics.
"""

from retrieval.samplers.base import (
    MASKED_LOG_Q,
    Negatives,
    Sampler,
    log_expected_count,
)
from retrieval.samplers.corpus import (
    AllItems,
    CorpusSampler,
    frequency_ranks,
    log_uniform_probability,
    log_uniform_sampler,
    uniform_sampler,
    unigram_sampler,
)
from retrieval.samplers.frequency import StaticFrequency, StreamingFrequency
from retrieval.samplers.hard import FaissHardNegativeMiner, UserHistory
from retrieval.samplers.in_batch import InBatchSampler, MixedSampler
from retrieval.samplers.kernel import KernelSampler, QuadraticKernelTree

__all__ = [
    "MASKED_LOG_Q",
    "AllItems",
    "CorpusSampler",
    "FaissHardNegativeMiner",
    "InBatchSampler",
    "KernelSampler",
    "MixedSampler",
    "Negatives",
    "QuadraticKernelTree",
    "Sampler",
    "StaticFrequency",
    "StreamingFrequency",
    "UserHistory",
    "frequency_ranks",
    "log_expected_count",
    "log_uniform_probability",
    "log_uniform_sampler",
    "uniform_sampler",
    "unigram_sampler",
]
