"""Samplers that draw from the whole corpus with a fixed distribution.

- ``uniform_sampler``: every vocabulary item equally likely
  (``tf.random.uniform_candidate_sampler``);
- ``unigram_sampler``: ``count ** alpha`` from training popularity; ``alpha = 1``
  is popularity, ``alpha = 0.75`` word2vec's choice (Mikolov et al., 2013)
  (``tf.random.fixed_unigram_candidate_sampler`` with ``distortion = alpha``);
- ``log_uniform_sampler``: Zipfian over the items sorted by training frequency,
  ``P(rank r) = log((r + 2) / (r + 1)) / log(V + 1)``
  (``tf.random.log_uniform_candidate_sampler`` over ranks);
- ``AllItems``: every vocabulary item exactly once (full softmax).

Draws are shared by the whole batch (``Negatives.ids`` is ``[num_samples]``), as
in ``tf.nn.sampled_softmax_loss``: one set of ``m`` doc-tower evaluations serves
every query. With ``per_row`` each row gets its own ``m`` draws
(``[batch_size, num_samples]``, with replacement), as SimpleX's and BSL's
samplers do, at ``batch_size`` times the doc-tower cost.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from retrieval.samplers.base import Negatives, Sampler, check_probability, log_expected_count


class CorpusSampler(Sampler):
    """Draws ``num_samples`` tower indices from a fixed distribution over the corpus.

    With ``unique=False`` the draws are independent (repeats possible) and the
    expected count of item i is ``num_samples * p(i)``. With ``unique=True`` it
    draws until ``num_samples`` distinct items were seen, as TensorFlow's
    candidate samplers do, and the expected count is TensorFlow's
    ``1 - (1 - p(i)) ** num_tries`` (see ``samplers.base``).

    Args:
      probability: ``[num_items + 1]`` per-draw weights over tower indices
        (normalised here); entry 0, the OOV row, must be 0.
      num_samples: candidates per batch, ``m``.
      unique: sample without replacement.
      seed: seed of the sampler's own ``tf.random.Generator`` (its state is a
        variable, so it is checkpointed with the model).
      per_row: ``sample`` draws ``num_samples`` for each row (``Negatives.ids``
        ``[batch_size, num_samples]``); the expected count of item i in a row's
        candidates is then ``num_samples * p(i)``. With replacement only.
      name: module name.
    """

    def __init__(
        self,
        probability,
        num_samples: int,
        *,
        unique: bool = False,
        seed: int = 0,
        per_row: bool = False,
        name: str = "corpus",
    ):
        super().__init__(name=name)
        probability = check_probability(probability, "probability")
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        if per_row and unique:
            raise ValueError("per_row draws are with replacement: unique must be False")
        self.per_row = bool(per_row)
        support = int(np.count_nonzero(probability))
        if unique and num_samples > support:
            raise ValueError(
                f"num_samples={num_samples} distinct items cannot be drawn from {support} items with "
                "non-zero probability; lower num_samples or sample with replacement"
            )
        self.num_samples = int(num_samples)
        self.unique = bool(unique)
        self.probability = probability  # float64 numpy, for tests and reports
        cdf = np.cumsum(probability)
        cdf[-1] = 1.0  # u < 1 always lands inside
        self._probability = tf.constant(probability, tf.float64, name="probability")
        self._cdf = tf.constant(cdf, tf.float64, name="cdf")
        self._last = tf.constant(int(np.flatnonzero(probability)[-1]), tf.int64)
        self._generator = tf.random.Generator.from_seed(seed)

    @property
    def num_items(self) -> int:
        """Vocabulary size (tower indices 1..num_items)."""
        return int(self.probability.size - 1)

    def _draw_with_replacement(self, n) -> tf.Tensor:
        u = self._generator.uniform([n], dtype=tf.float64)
        ids = tf.searchsorted(self._cdf, u, side="right")
        # Entries with p = 0 have cdf equal to their predecessor's, so searchsorted
        # never lands on them; the clip only guards float round-off at the top.
        return tf.minimum(tf.cast(ids, tf.int64), self._last)

    def draw(self) -> tuple[tf.Tensor, tf.Tensor]:
        """One batch's draws.

        Returns:
          ``(ids, num_tries)``: int64 ``[num_samples]`` tower indices (distinct when
          ``unique``, in order of first draw) and the int64 scalar number of draws
          taken (``num_samples`` when sampling with replacement).
        """
        m = self.num_samples
        if not self.unique:
            return self._draw_with_replacement(m), tf.constant(m, tf.int64)

        def not_enough(draws):
            return tf.size(tf.unique(draws).y) < m

        def more(draws):
            return (tf.concat([draws, self._draw_with_replacement(m)], axis=0),)

        (draws,) = tf.while_loop(
            not_enough, more, (self._draw_with_replacement(m),), shape_invariants=(tf.TensorShape([None]),)
        )
        distinct, position = tf.unique(draws)
        # tf.unique keeps first-occurrence order; the m-th distinct value's first
        # position + 1 is the number of tries it took (TensorFlow's num_tries).
        # (tf.range(tf.size(draws)) here is mis-folded to the loop's *initial* size inside
        # tf.function on TF 2.21; the shape of tf.unique's output is not.)
        first = tf.math.unsorted_segment_min(tf.range(tf.shape(position)[0]), position, tf.size(distinct))
        return distinct[:m], tf.cast(first[m - 1] + 1, tf.int64)

    def log_expected_count(self, ids: tf.Tensor, num_tries) -> tf.Tensor:
        """log expected count of ``ids`` (any shape) given the draw's ``num_tries``."""
        p = tf.gather(self._probability, ids)
        return log_expected_count(p, self.num_samples, num_tries if self.unique else None)

    def sample(self, positive_ids: tf.Tensor, queries=None, embed_catalogue=None) -> Negatives:
        if self.per_row:
            batch_size = tf.size(positive_ids)
            ids = tf.reshape(self._draw_with_replacement(batch_size * self.num_samples), [-1, self.num_samples])
            return Negatives(
                ids=ids,
                log_q=self.log_expected_count(ids, None),
                positive_log_q=self.log_expected_count(tf.cast(positive_ids, tf.int64), None),
            )
        ids, num_tries = self.draw()
        return Negatives(
            ids=ids,
            log_q=self.log_expected_count(ids, num_tries),
            positive_log_q=self.log_expected_count(tf.cast(positive_ids, tf.int64), num_tries),
        )


def uniform_sampler(num_items: int, num_samples: int, **kwargs) -> CorpusSampler:
    """Uniform over tower indices 1..num_items."""
    if num_items <= 0:
        raise ValueError(f"num_items must be positive, got {num_items}")
    probability = np.ones(num_items + 1)
    probability[0] = 0.0
    return CorpusSampler(probability, num_samples, name="uniform", **kwargs)


def unigram_sampler(counts, num_samples: int, *, alpha: float = 0.75, **kwargs) -> CorpusSampler:
    """``p(i) ∝ counts[i] ** alpha`` (items with no count are never drawn).

    Args:
      counts: ``[num_items + 1]`` training clicks per tower index (``ItemPopularity.counts``).
      alpha: distortion; 1 = popularity, 0.75 = word2vec, 0 = uniform over items with clicks.
    """
    counts = np.asarray(counts, dtype=np.float64)
    if alpha < 0:
        raise ValueError(f"alpha must be non-negative, got {alpha}")
    weights = np.where(counts > 0, counts**alpha, 0.0)
    weights[0] = 0.0
    return CorpusSampler(weights, num_samples, name="unigram", **kwargs)


def frequency_ranks(counts) -> np.ndarray:
    """Tower indices 1..V sorted by descending count (ties: lower index first). [V] int64."""
    counts = np.asarray(counts, dtype=np.float64)[1:]
    return (np.lexsort((np.arange(counts.size), -counts)) + 1).astype(np.int64)


def log_uniform_probability(num_items: int) -> np.ndarray:
    """TensorFlow's log-uniform (Zipfian) distribution over ranks 0..num_items-1. [num_items]."""
    ranks = np.arange(num_items, dtype=np.float64)
    return (np.log(ranks + 2.0) - np.log(ranks + 1.0)) / np.log(num_items + 1.0)


def log_uniform_sampler(counts, num_samples: int, **kwargs) -> CorpusSampler:
    """Zipfian over items sorted by training frequency (rank 0 = most clicked).

    ``P(rank r) = log((r + 2) / (r + 1)) / log(V + 1)``, exactly
    ``tf.random.log_uniform_candidate_sampler``'s distribution over classes,
    with class r mapped to the tower index of the r-th most clicked item.
    """
    ranks = frequency_ranks(counts)
    probability = np.zeros(ranks.size + 1)
    probability[ranks] = log_uniform_probability(ranks.size)
    return CorpusSampler(probability, num_samples, name="log_uniform", **kwargs)


class AllItems(Sampler):
    """Every vocabulary item once: tower indices 1..num_items, each with expected count 1.

    With it, sampled softmax (accidental hits removed, so the positive is not
    counted twice) is the full softmax over the corpus.
    """

    def __init__(self, num_items: int, name: str = "all_items"):
        super().__init__(name=name)
        if num_items <= 0:
            raise ValueError(f"num_items must be positive, got {num_items}")
        self.num_items = int(num_items)
        self._ids = tf.range(1, num_items + 1, dtype=tf.int64)

    def sample(self, positive_ids: tf.Tensor, queries=None, embed_catalogue=None) -> Negatives:
        return Negatives(
            ids=self._ids,
            log_q=tf.zeros([self.num_items], tf.float32),
            positive_log_q=tf.zeros(tf.shape(positive_ids), tf.float32),
        )
