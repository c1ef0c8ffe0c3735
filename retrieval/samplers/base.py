"""The sampler interface: candidate item ids and the log expected count of each.

Every sampled loss corrects its logits the same way, ``logit - log Q``
(Bengio & Senecal 2008; Jean et al. 2015; Yi et al., RecSys 2019), so every
sampler states Q in the same unit:

    log_q = log E[number of times the item appears among the batch's candidates]

- drawn ``m`` times *with* replacement from a distribution ``p``: ``m * p(i)``
  (``tf.random.*_candidate_sampler(unique=False)``'s ``expected_count``);
- drawn *without* replacement (``unique``), by drawing until ``m`` distinct ids
  were seen, which took ``T`` draws: ``1 - (1 - p(i)) ** T``, TensorFlow's
  approximation of the inclusion probability (``RangeSampler::ExpectedCountHelper``);
- the batch's own positives (in-batch negatives): ``B * p(i)`` with ``p`` the
  training popularity, since each of the ``B`` rows' positive is one draw from it;
- a union of candidate sets (mixed negative sampling): the *sum* of the parts'
  expected counts (linearity of expectation);
- every item once (full softmax) or a deterministic per-query choice (mined hard
  negatives): ``1``, so ``log_q = 0``.

Ids are tower indices: 0 is the out-of-vocabulary row, ``i + 1`` is
``Vocabulary.ids[i]``. No sampler ever returns 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import tensorflow as tf

# log_q given to candidate columns that must not count (padding): logit - log_q is then
# hugely negative, so the column gets no probability mass and no gradient.
MASKED_LOG_Q = 1e30


class Negatives(NamedTuple):
    """Candidates drawn for one batch, with their log expected counts.

    Attributes:
      ids: int64 tower indices, ``[num_candidates]`` shared by every query of the
        batch, or ``[batch_size, num_candidates]`` drawn per query.
      log_q: float32, same shape as ``ids``: log of the expected count of
        ``ids[..., j]`` in the candidate set (not a per-draw probability; see the
        module docstring).
      positive_log_q: float32 ``[batch_size]``: log of the expected count of each
        row's positive item in the candidate set under the same scheme (what
        ``tf.nn.sampled_softmax_loss`` calls ``true_expected_count``).
    """

    ids: tf.Tensor
    log_q: tf.Tensor
    positive_log_q: tf.Tensor

    @property
    def per_query(self) -> bool:
        """True when ``ids`` is ``[batch_size, num_candidates]``."""
        return self.ids.shape.rank == 2


class Sampler(tf.Module):
    """Base class: ``sample(positive_ids) -> Negatives``.

    Attributes:
      includes_batch_positives: True when the candidate set is the batch's own
        positives (in row order) followed by ``Negatives.ids``; their log
        expected counts are ``Negatives.positive_log_q``. A loss then puts the
        positives in the first ``batch_size`` columns (labels on the diagonal),
        as TFRS ``Retrieval`` does. False: each row's positive is a column of its
        own beside the sampled ones, as in ``tf.nn.sampled_softmax_loss``.
      supports_replicas: False when the sampler keeps host state (numpy, FAISS) that
        several ``tf.distribute`` replicas would share; the model then refuses to train
        it with more than one replica.
    """

    includes_batch_positives: bool = False
    supports_replicas: bool = True

    def sample(
        self,
        positive_ids: tf.Tensor,
        queries: tf.Tensor | None = None,
        embed_catalogue: Callable[[], tf.Tensor] | None = None,
    ) -> Negatives:
        """Draw candidates for a batch.

        Args:
          positive_ids: int64 ``[batch_size]`` tower indices of the rows' positives.
          queries: ``[batch_size, dim]`` the batch's query embeddings, for samplers
            whose proposal depends on the query (``KernelSampler``); others ignore it.
            No gradient flows through a sampler.
          embed_catalogue: zero-argument callable returning the doc embeddings of
            every tower index ``[num_items + 1, dim]`` (the model's
            ``embed_catalogue``), for samplers that track the model; others ignore it.
        """
        raise NotImplementedError

    def observe(self, positive_ids: tf.Tensor) -> None:
        """See a training batch's positives (streaming log-Q sources learn from them).

        Called by the model once per training step, before ``sample``. No-op by default.
        """
        del positive_ids


def log_expected_count(probability: tf.Tensor, num_draws, num_tries=None) -> tf.Tensor:
    """log E[count] of items with per-draw ``probability`` in a candidate set.

    Args:
      probability: float ``[...]`` per-draw probabilities.
      num_draws: ``m``, the number of candidates drawn.
      num_tries: draws it took to see ``m`` distinct ids (sampling without
        replacement), or None for sampling with replacement.

    Returns:
      float32 ``[...]``: ``log(m p)``, or ``log(1 - (1 - p) ** T)`` computed as
      ``log(-expm1(T log1p(-p)))`` like TensorFlow. When ``T == m`` (no repeat
      was drawn) TensorFlow uses ``m p`` too, and so do we.
    """
    probability = tf.cast(probability, tf.float64)
    num_draws = tf.cast(num_draws, tf.float64)
    with_replacement = num_draws * probability
    if num_tries is None:
        return tf.cast(tf.math.log(with_replacement), tf.float32)
    num_tries = tf.cast(num_tries, tf.float64)
    inclusion = -tf.math.expm1(num_tries * tf.math.log1p(-probability))
    count = tf.where(tf.equal(num_tries, num_draws), with_replacement, inclusion)
    return tf.cast(tf.math.log(count), tf.float32)


def check_probability(probability, name: str = "probability") -> np.ndarray:
    """Validate a per-item distribution over tower indices; returns it normalised (float64).

    Args:
      probability: ``[num_items + 1]`` non-negative weights; entry 0 (OOV) must be 0.
    """
    probability = np.asarray(probability, dtype=np.float64)
    if probability.ndim != 1 or probability.size < 2:
        raise ValueError(f"{name} must be a vector [num_items + 1], got shape {probability.shape}")
    if not np.all(np.isfinite(probability)) or np.any(probability < 0):
        raise ValueError(f"{name} must be finite and non-negative")
    if probability[0] != 0:
        raise ValueError(f"{name}[0] is the out-of-vocabulary row and must be 0, got {probability[0]}")
    total = probability.sum()
    if total <= 0:
        raise ValueError(f"{name} must have a positive entry")
    return probability / total
