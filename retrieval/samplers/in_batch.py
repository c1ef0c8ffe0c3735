"""In-batch negatives, alone or mixed with corpus-sampled ones.

In-batch: each row's negatives are the other rows' positives (Covington et
al. 2016; Yi et al. 2019), which costs no extra doc-tower work but samples
items by popularity, so log-Q correction matters.

Mixed negative sampling (Yang et al., "Mixed Negative Sampling for Learning
Two-tower Neural Networks in Recommendations", WWW 2020): the batch's
positives plus ``m`` items drawn from the corpus, so items that are rarely or
never positives still appear as negatives. The candidate set is the union of
both, and an item's expected count in it is the sum of its expected counts in
each part: ``B * p_train(i) + E_corpus[count of i]``.
"""

from __future__ import annotations

import tensorflow as tf

from retrieval.common.replicas import global_batch_size
from retrieval.samplers.base import Negatives, Sampler
from retrieval.samplers.corpus import CorpusSampler


class InBatchSampler(Sampler):
    """The batch's own positives; ``positive_log_q = log(B * p(positive))``.

    ``Negatives.ids`` is empty: the candidates *are* the positives (see
    ``Sampler.includes_batch_positives``).

    Args:
      frequency: a log-Q source (``StaticFrequency`` or ``StreamingFrequency``)
        giving the per-draw probability ``p`` of each positive.
    """

    includes_batch_positives = True

    def __init__(self, frequency: tf.Module, name: str = "in_batch"):
        super().__init__(name=name)
        self.frequency = frequency

    def observe(self, positive_ids: tf.Tensor) -> None:
        self.frequency.update(positive_ids)

    def batch_log_count(self, ids: tf.Tensor, batch_size) -> tf.Tensor:
        """log(B * p(ids)): log expected count of ``ids`` among B in-batch positives."""
        return tf.math.log(tf.cast(batch_size, tf.float32)) + self.frequency.log_probability(ids)

    def sample(self, positive_ids: tf.Tensor, queries=None, embed_catalogue=None) -> Negatives:
        positive_ids = tf.cast(positive_ids, tf.int64)
        return Negatives(
            ids=tf.zeros([0], tf.int64),
            log_q=tf.zeros([0], tf.float32),
            # Under tf.distribute the candidates are every replica's positives (the model gathers them).
            positive_log_q=self.batch_log_count(positive_ids, global_batch_size(tf.size(positive_ids))),
        )


class MixedSampler(Sampler):
    """In-batch positives plus ``corpus.num_samples`` corpus draws (Yang et al. 2020).

    Every candidate's log Q is ``log(B * p_train(i) + corpus expected count of i)``,
    for the positives (first B columns) and the corpus draws alike.

    Args:
      frequency: log-Q source of the in-batch part.
      corpus: the corpus sampler (uniform in the paper).
    """

    includes_batch_positives = True

    def __init__(self, frequency: tf.Module, corpus: CorpusSampler, name: str = "mixed"):
        super().__init__(name=name)
        self.in_batch = InBatchSampler(frequency)
        self.corpus = corpus

    def observe(self, positive_ids: tf.Tensor) -> None:
        self.in_batch.observe(positive_ids)

    def _log_count(self, ids, batch_size, num_tries):
        return tf.math.reduce_logsumexp(
            tf.stack(
                [
                    self.in_batch.batch_log_count(ids, batch_size),
                    self.corpus.log_expected_count(ids, num_tries),
                ],
                axis=0,
            ),
            axis=0,
        )

    def sample(self, positive_ids: tf.Tensor, queries=None, embed_catalogue=None) -> Negatives:
        positive_ids = tf.cast(positive_ids, tf.int64)
        batch_size = global_batch_size(tf.size(positive_ids))  # every replica's positives
        ids, num_tries = self.corpus.draw()
        return Negatives(
            ids=ids,
            log_q=self._log_count(ids, batch_size, num_tries),
            positive_log_q=self._log_count(positive_ids, batch_size, num_tries),
        )
