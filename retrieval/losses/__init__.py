"""Losses and logit transforms.

Every sampled loss here scores a batch of queries against candidates and
corrects the logits for how the candidates were sampled:
``logit / temperature - log Q``. That correction (Bengio & Senecal 2008; Jean
et al. 2015; Yi et al., RecSys 2019) removes the popularity bias that in-batch
or sampled negatives would otherwise bake into the model: popular items appear
as negatives more often, so without it they are pushed down too hard. ``log Q``
is the log expected count of the candidate in the batch's candidate set, as
the samplers (``retrieval.samplers``) return it. (``CosineContrastive`` is the
exception: SimpleX's loss compares raw cosines with a margin, uncorrected.)

Pure functions first (logits first, as ``tf.nn``):
  ``correct_log_q``, ``remove_accidental_hits`` (``accidental_hits``),
  ``mine_hard_negatives`` (``hard_negative_columns``),
  ``candidate_scores``, ``softmax_cross_entropy``, ``weighted_mean``, ``gbce_beta``,
  ``HuffmanTree`` and ``hierarchical_log_probability``; ``gather_across_replicas``
  (in-batch negatives over every ``tf.distribute`` replica).
Then the loss classes, one method each (``per_example``) on a base that
validates and reduces:
  ``SampledSoftmax`` (in-batch, corpus-sampled, mixed, full: the sampler decides; with
  ``log_q_variant="corrected"`` the refined correction of Khrylchenko et al. 2025),
  ``FullSoftmax`` (the full one over ``AllItems`` from one block of logits),
  ``NegativeSampling`` (word2vec SGNS; NCE when log Q is subtracted),
  ``CosineContrastive`` (SimpleX's cosine contrastive loss; Mao et al. 2021),
  ``BilateralSoftmax`` (BSL; Wu et al. 2024),
  ``GeneralizedBinaryCrossEntropy`` (gSASRec's gBCE over uniform negatives; Petrov & Macdonald 2023),
  ``HierarchicalSoftmax`` (Huffman tree over items; Morin & Bengio 2005, Mikolov et al. 2013).

The package's modules: ``functions`` (the pure functions), ``inputs``
(``LossInputs``, ``BatchCandidates``, ``gather_across_replicas``),
``sampled`` (``RetrievalLoss``, ``SampledSoftmax``, ``FullSoftmax``, ``NegativeSampling``,
``CosineContrastive``, ``BilateralSoftmax``, ``GeneralizedBinaryCrossEntropy``),
``hierarchical`` (``HuffmanTree``, ``hierarchical_log_probability``,
``HierarchicalSoftmax``).
"""

from retrieval.losses.functions import (
    MAX_FLOAT,
    MIN_FLOAT,
    accidental_hits,
    candidate_scores,
    correct_log_q,
    gbce_beta,
    hard_negative_columns,
    mine_hard_negatives,
    remove_accidental_hits,
    softmax_cross_entropy,
    weighted_mean,
)
from retrieval.losses.hierarchical import HierarchicalSoftmax, HuffmanTree, hierarchical_log_probability
from retrieval.losses.inputs import BatchCandidates, LossInputs, OwnItems, gather_across_replicas, own_item_hits
from retrieval.losses.sampled import (
    BilateralSoftmax,
    CosineContrastive,
    FullSoftmax,
    GeneralizedBinaryCrossEntropy,
    NegativeSampling,
    RetrievalLoss,
    SampledSoftmax,
)

__all__ = [
    "MAX_FLOAT",
    "MIN_FLOAT",
    "BatchCandidates",
    "BilateralSoftmax",
    "CosineContrastive",
    "FullSoftmax",
    "GeneralizedBinaryCrossEntropy",
    "HierarchicalSoftmax",
    "HuffmanTree",
    "LossInputs",
    "NegativeSampling",
    "OwnItems",
    "RetrievalLoss",
    "SampledSoftmax",
    "accidental_hits",
    "candidate_scores",
    "correct_log_q",
    "gather_across_replicas",
    "gbce_beta",
    "hard_negative_columns",
    "hierarchical_log_probability",
    "mine_hard_negatives",
    "own_item_hits",
    "remove_accidental_hits",
    "softmax_cross_entropy",
    "weighted_mean",
]
