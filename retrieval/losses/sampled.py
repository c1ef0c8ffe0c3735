"""The loss base class and the losses over sampled candidates.

``RetrievalLoss`` validates the inputs, builds the corrected, hit-removed
(and hard-mined) logits with their labels, and reduces ``per_example``;
``SampledSoftmax`` (in-batch, corpus-sampled, mixed, full: the sampler
decides), ``NegativeSampling`` (word2vec SGNS; NCE when log Q is
subtracted), ``CosineContrastive`` (SimpleX's CCL), ``BilateralSoftmax``
(BSL) and ``GeneralizedBinaryCrossEntropy`` (gSASRec's gBCE) implement
``per_example`` on those logits.
"""

from __future__ import annotations

import tensorflow as tf

from retrieval.losses.functions import (
    MIN_FLOAT,
    SCORE_DTYPES,
    accidental_hits,
    candidate_scores,
    correct_log_q,
    gbce_beta,
    hard_negative_columns,
    softmax_cross_entropy,
    weighted_mean,
)
from retrieval.losses.inputs import LossInputs, OwnItems, own_item_hits
from retrieval.samplers import MASKED_LOG_Q


class RetrievalLoss(tf.keras.layers.Layer):
    """Base class: validates the inputs, asks ``per_example`` for ``[batch_size]`` losses, reduces.

    Attributes:
      scores_by_dot_product: True when the loss ranks items by ``query . doc``, so the FAISS
        inner-product index of doc embeddings ranks as the trained model does; a loss that scores
        items otherwise (tree paths) sets it False and the job refuses to index or serve it.

    Args:
      temperature: logits are divided by it.
      log_q_weight: the correction subtracts ``log_q_weight * log Q``: 1 is the
        unbiased correction, 0 none.
      remove_accidental_hits: mask negatives that are the row's own positive.
      num_hard_negatives: keep only the k highest-scoring negatives of each row
        (after correction), as TFRS ``num_hard_negatives``; None keeps all.
      reduction: "mean" divides the summed per-example losses by the batch
        size (the learning rate does not depend on it); "sum" does not, as
        ``tfrs.tasks.Retrieval`` (Keras ``SUM``): its gradients grow with the batch.
      score_dtype: precision of the training logits' matmuls ("float32" or "bfloat16",
        ``candidate_scores``); ranking (``item_scores``) stays float32.
    """

    scores_by_dot_product: bool = True

    def __init__(
        self,
        *,
        temperature: float = 1.0,
        log_q_weight: float = 1.0,
        remove_accidental_hits: bool = True,
        num_hard_negatives: int | None = None,
        reduction: str = "mean",
        score_dtype: str = "float32",
        name: str | None = None,
    ):
        super().__init__(name=name)
        if score_dtype not in SCORE_DTYPES:
            raise ValueError(f"score_dtype must be one of {', '.join(SCORE_DTYPES)}, got {score_dtype!r}")
        self.score_dtype = score_dtype
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        if num_hard_negatives is not None and num_hard_negatives <= 0:
            raise ValueError(f"num_hard_negatives must be positive or None, got {num_hard_negatives}")
        self.temperature = float(temperature)
        self.log_q_weight = float(log_q_weight)
        self.remove_hits = bool(remove_accidental_hits)
        self.num_hard_negatives = num_hard_negatives
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        self.reduction = reduction

    def compute(self, inputs: LossInputs) -> tf.Tensor:
        """The batch loss, ``sum(weight * per_example) / batch_size`` (``reduction="sum"``: not divided).

        With ``inputs.global_batch_size`` the denominator is the global batch:
        this replica's share of the global loss (see ``gather_across_replicas``);
        summed, each replica's share is its own rows' sum.
        """
        _check_inputs(inputs)
        per_example = self.per_example(inputs)
        if self.reduction == "sum":
            return weighted_mean(per_example, inputs.sample_weight, global_batch_size=1)
        return weighted_mean(per_example, inputs.sample_weight, inputs.global_batch_size)

    def per_example(self, inputs: LossInputs) -> tf.Tensor:
        """``[batch_size]`` losses; subclasses implement it."""
        raise NotImplementedError

    def item_scores(self, queries: tf.Tensor, item_embeddings: tf.Tensor) -> tf.Tensor:
        """Ranking scores of every tower index, ``[num_queries, num_items + 1]``.

        A dot product for every loss but the hierarchical softmax, so the
        FAISS index serves the trained model as it is.
        """
        return tf.linalg.matmul(queries, item_embeddings, transpose_b=True)

    def logits_and_labels(self, inputs: LossInputs) -> tuple[tf.Tensor, tf.Tensor]:
        """Corrected, hit-removed (and hard-mined) logits with one-hot labels.

        Column layout: with ``includes_batch_positives`` the first ``batch_size``
        columns are the batch's positives (labels on the diagonal, as TFRS
        ``Retrieval``), or the global batch's (``inputs.batch_candidates``, row
        i's label at column ``row_offset + i``); otherwise column 0 is the row's
        own positive (as ``tf.nn.sampled_softmax_loss``). Then each negatives
        block in order.

        Returns:
          ``(logits, labels)``, ``[batch_size, num_columns]`` each.
        """
        logits, labels, _ = self.candidate_columns(inputs)
        return logits, labels

    def candidate_columns(self, inputs: LossInputs) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """``logits_and_labels`` with the mask of the columns that count.

        Returns:
          ``(logits, labels, kept)``, ``[batch_size, num_columns]`` each: ``kept``
          is bool, False for padding columns (``log_q = MASKED_LOG_Q``) and, with
          ``remove_accidental_hits``, for accidental hits and the rows' ``own_items``;
          label columns are kept.
          Losses that are not a softmax (the masked logits are only pushed to
          ``MIN_FLOAT``) average or sum over ``kept``.
        """
        q, positive_ids = inputs.queries, tf.cast(inputs.positive_ids, tf.int64)
        weight = self.log_q_weight
        positive_log_q = inputs.negatives[0].positive_log_q
        batch_size = tf.shape(q)[0]
        if inputs.includes_batch_positives and inputs.batch_candidates is not None:
            batch = inputs.batch_candidates
            head = candidate_scores(q, batch.embeddings, self.score_dtype) / self.temperature
            head = correct_log_q(head, weight * batch.log_q[tf.newaxis, :])
            head_labels = tf.one_hot(
                batch.row_offset + tf.range(batch_size), tf.shape(batch.ids)[0], dtype=head.dtype
            )
            head_hits = accidental_hits(head_labels, batch.ids, positive_ids)
        elif inputs.includes_batch_positives:
            head = candidate_scores(q, inputs.positives, self.score_dtype) / self.temperature
            head = correct_log_q(head, weight * positive_log_q[tf.newaxis, :])
            head_labels = tf.eye(batch_size, dtype=head.dtype)
            head_hits = accidental_hits(head_labels, positive_ids, positive_ids)
        else:
            head = tf.reduce_sum(q * inputs.positives, axis=1, keepdims=True) / self.temperature
            head = correct_log_q(head, weight * positive_log_q[:, tf.newaxis])
            head_labels = tf.ones_like(head)
            head_hits = tf.zeros_like(head, dtype=tf.bool)
        if self.remove_hits and inputs.own_items is not None and inputs.includes_batch_positives:
            head_ids = positive_ids if inputs.batch_candidates is None else inputs.batch_candidates.ids
            own = own_item_hits(inputs.own_items, head_ids)
            head_hits = tf.logical_or(head_hits, tf.logical_and(own, tf.logical_not(tf.cast(head_labels, tf.bool))))
        if self.remove_hits:
            head = head + tf.cast(head_hits, head.dtype) * MIN_FLOAT
        head_kept = tf.logical_not(head_hits) if self.remove_hits else tf.ones_like(head_hits)
        logits, labels, kept = [head], [head_labels], [head_kept]
        for negatives, embeddings in zip(inputs.negatives, inputs.negative_embeddings):
            block = candidate_scores(q, embeddings, self.score_dtype) / self.temperature
            log_q, padding = _weighted_log_q(negatives.log_q, weight)
            block = correct_log_q(block, log_q)
            block_kept = tf.logical_not(tf.broadcast_to(padding, tf.shape(block)))
            if self.remove_hits:
                hits = _hits(negatives.ids, positive_ids, inputs.own_items)
                block = block + tf.cast(hits, block.dtype) * MIN_FLOAT
                block_kept = tf.logical_and(block_kept, tf.logical_not(hits))
            logits.append(block)
            labels.append(tf.zeros_like(block))
            kept.append(block_kept)
        logits, labels, mask = tf.concat(logits, axis=1), tf.concat(labels, axis=1), tf.concat(kept, axis=1)
        if self.num_hard_negatives is not None:
            columns = hard_negative_columns(logits, labels, self.num_hard_negatives)
            logits, labels, mask = (tf.gather(x, columns, batch_dims=1) for x in (logits, labels, mask))
        return logits, labels, mask


LOG_Q_VARIANTS = ("standard", "corrected")


class SampledSoftmax(RetrievalLoss):
    """Softmax cross-entropy over the positive and the sampled candidates, log-Q corrected.

    The sampler decides what this is: in-batch softmax (``InBatchSampler``),
    sampled softmax (``CorpusSampler``; equals ``tf.nn.sampled_softmax_loss``
    given the same draws), mixed negatives (``MixedSampler``), or the exact
    full softmax (``AllItems`` with accidental hits removed).

    ``log_q_variant="corrected"`` is the refined correction of Khrylchenko et al.
    ("Correcting the LogQ Correction", RecSys 2025, arXiv 2507.09331), as their
    code computes it (NonameUntitled/logq, ``train_*_logq_new.py``). The positive
    is always in a row's softmax, not drawn, so it is left out of the sampled
    part: with ``s+`` the row's positive logit (uncorrected), ``N`` its kept
    negatives (accidental hits and padding removed), ``n' = |N|`` and
    ``log Q'_j = log Q_j - log(M - Q+)`` the log probability of drawing ``j`` given
    that a draw is not the positive (``Q`` the samplers' expected counts, ``Q+``
    the positive's, ``M`` the draws behind the row's candidates)::

        l_j   = s_j - strength * log Q'_j
        loss  = sg(1 - P+) * (-s+ + log sum_{j in N} exp(l_j))
        P+    = exp(s+) / (exp(s+) + (1 / n') sum_{j in N} exp(l_j))

    ``P+`` is the model's probability of the positive, the catalogue's other
    items estimated by importance sampling from the kept negatives, and
    ``sg(1 - P+)`` (no gradient) its probability of misclassifying the row. A
    row with no kept negative has loss 0. Defined for in-batch, corpus (shared
    or per-row, with replacement) and mixed candidates; the config refuses the
    rest (``LossConfig``).
    """

    def __init__(self, *, log_q_variant: str = "standard", **kwargs):
        super().__init__(**kwargs)
        if log_q_variant not in LOG_Q_VARIANTS:
            raise ValueError(f"log_q_variant must be one of {', '.join(LOG_Q_VARIANTS)}, got {log_q_variant!r}")
        if log_q_variant == "corrected" and not self.remove_hits:
            raise ValueError(
                "log_q_variant='corrected' leaves the positive out of the negatives: it needs remove_accidental_hits"
            )
        if log_q_variant == "corrected" and self.num_hard_negatives is not None:
            raise ValueError("log_q_variant='corrected' needs sampled negatives; num_hard_negatives keeps the top ones")
        self.log_q_variant = log_q_variant

    def per_example(self, inputs: LossInputs) -> tf.Tensor:
        if self.log_q_variant == "corrected":
            return self._corrected_per_example(inputs)
        if self.num_hard_negatives is None and inputs.batch_candidates is None and self.score_dtype == "float32":
            return self._blockwise_per_example(inputs)
        logits, labels = self.logits_and_labels(inputs)
        return softmax_cross_entropy(logits, labels)

    def _blockwise_per_example(self, inputs: LossInputs) -> tf.Tensor:
        """The same loss as ``softmax_cross_entropy(*logits_and_labels(inputs))``, block by block.

        ``logsumexp(label logit, logsumexp of each block's kept columns) - label logit``, the label
        logit being ``q . d+ / temperature - strength * log Q+`` from the rows' own pairs: no one-hot
        labels, no masks kept beside the logits and no concatenated copy of them. Each is as large
        as the ``[batch, batch]`` in-batch logits, and building them took about as long as the
        logits' three matmuls at dimension 64 (a TensorFlow profile of the step, 2026-12-07). Hence the label
        column of the in-batch block is masked with the accidental hits (every column of the row's
        own item) and enters once, through the label logit.
        """
        queries = inputs.queries / self.temperature  # [batch, dim]: the temperature on B x dim, not B x columns
        positive_ids = tf.cast(inputs.positive_ids, tf.int64)
        weight = self.log_q_weight
        positive_log_q = tf.cast(inputs.negatives[0].positive_log_q, queries.dtype)
        label = tf.reduce_sum(queries * inputs.positives, axis=1) - weight * positive_log_q  # [batch]
        parts = [label]
        if inputs.includes_batch_positives:
            head = correct_log_q(candidate_scores(queries, inputs.positives), weight * positive_log_q[tf.newaxis, :])
            if self.remove_hits:
                out = _hits(positive_ids, positive_ids, inputs.own_items)
            else:  # the label column only
                rows = tf.range(tf.shape(positive_ids)[0])
                out = tf.equal(rows[tf.newaxis, :], rows[:, tf.newaxis])
            parts.append(tf.reduce_logsumexp(tf.where(out, tf.constant(MIN_FLOAT, head.dtype), head), axis=1))
        for negatives, embeddings in zip(inputs.negatives, inputs.negative_embeddings, strict=True):
            if embeddings.shape[-2] == 0:  # the in-batch sampler's empty block
                continue
            block = correct_log_q(candidate_scores(queries, embeddings), _weighted_log_q(negatives.log_q, weight)[0])
            if self.remove_hits:
                hits = _hits(negatives.ids, positive_ids, inputs.own_items)
                block = tf.where(hits, tf.constant(MIN_FLOAT, block.dtype), block)
            parts.append(tf.reduce_logsumexp(block, axis=1))
        return tf.reduce_logsumexp(tf.stack(parts, axis=1), axis=1) - label

    def _corrected_per_example(self, inputs: LossInputs) -> tf.Tensor:
        logits, labels, kept = self.candidate_columns(inputs)
        weight = self.log_q_weight
        positive_log_q = tf.cast(inputs.negatives[0].positive_log_q, logits.dtype)
        # The label column holds s+ - strength * log Q+; the positive is not drawn, so it is not corrected.
        positive = tf.reduce_sum(logits * labels, axis=1) + weight * positive_log_q
        negative = tf.logical_and(kept, labels <= 0)
        draws = tf.cast(_draws_per_row(inputs), logits.dtype)
        # log(M - Q+): the expected number of draws that are not the positive; Q+ <= M for a probability.
        others = tf.math.log(tf.maximum(draws - tf.exp(positive_log_q), 1e-6))
        shifted = tf.where(negative, logits + weight * others[:, tf.newaxis], tf.fill(tf.shape(logits), MIN_FLOAT))
        log_sum = tf.reduce_logsumexp(shifted, axis=1)
        count = tf.reduce_sum(tf.cast(negative, logits.dtype), axis=1)
        has_negative = count > 0
        log_rest = log_sum - tf.math.log(tf.maximum(count, 1.0))
        misclassified = tf.stop_gradient(tf.math.sigmoid(log_rest - positive))
        per_row = misclassified * (log_sum - positive)
        return tf.where(has_negative, per_row, tf.zeros_like(per_row))


class FullSoftmax(SampledSoftmax):
    """The exact softmax over the whole catalogue (``AllItems``), computed without the generic columns.

    The same loss as ``SampledSoftmax`` over ``AllItems`` with accidental hits removed,
    ``logsumexp(s+, s_j for every other item j) - s+`` with ``s = q . d / temperature``, but from one
    ``[batch, items]`` block of logits and its log-sum-exp: the generic path builds labels, masks
    and a concatenated copy of that block, each as large as the logits, which at tens of thousands
    of items is most of a step's time. Anything else (in-batch positives, several blocks, hard
    negatives, a log-Q weight) goes the generic way.
    """

    def per_example(self, inputs: LossInputs) -> tf.Tensor:
        if (inputs.includes_batch_positives or len(inputs.negatives) != 1 or self.num_hard_negatives is not None
                or inputs.negative_embeddings[0].shape.rank != 2 or self.log_q_weight):
            return super().per_example(inputs)
        q, positive_ids = inputs.queries, tf.cast(inputs.positive_ids, tf.int64)
        negatives = inputs.negatives[0]
        head = tf.reduce_sum(q * inputs.positives, axis=1)
        block = candidate_scores(q, inputs.negative_embeddings[0], self.score_dtype)
        if self.temperature != 1.0:
            head, block = head / self.temperature, block / self.temperature
        if self.remove_hits:  # the positive's own column, and with own_items a row's other items
            hits = tf.equal(negatives.ids[tf.newaxis, :], positive_ids[:, tf.newaxis])
            if inputs.own_items is not None:
                hits = tf.logical_or(hits, own_item_hits(inputs.own_items, negatives.ids))
            block = tf.where(hits, tf.constant(MIN_FLOAT, block.dtype), block)
        return tf.math.reduce_logsumexp(tf.stack([head, tf.math.reduce_logsumexp(block, axis=1)], axis=1),
                                        axis=1) - head


class NegativeSampling(RetrievalLoss):
    """Binary logistic loss, word2vec skip-gram negative sampling (Mikolov et al., 2013).

    ``-log sigmoid(s+) - sum_j log sigmoid(-s_j)`` over the positive and each
    sampled negative (summed, as word2vec does for its k negatives). With
    ``log_q_weight = 0`` (word2vec) it learns a shifted PMI; subtracting log Q
    (the expected count, i.e. log(k Q)) makes it noise-contrastive estimation
    (Gutmann & Hyvärinen 2010; Mnih & Teh 2012). Removed accidental hits and
    padded columns have logits near -inf and so add nothing.
    """

    def per_example(self, inputs: LossInputs) -> tf.Tensor:
        logits, labels = self.logits_and_labels(inputs)
        signs = 2.0 * labels - 1.0  # +1 positive, -1 negative
        return tf.reduce_sum(tf.nn.softplus(-signs * logits), axis=1)


class CosineContrastive(RetrievalLoss):
    """SimpleX's cosine contrastive loss (CCL; Mao et al., CIKM 2021), on L2-normalised towers.

    Per row, with ``s+`` the cosine of the row's positive and ``s_j`` those of its
    kept negatives ``N`` (the candidates the sampler gives, less accidental hits
    and padding)::

        relu(1 - s+) + negative_weight * (1 / |N|) * sum_{j in N} relu(s_j - margin)

    This is the authors' ``CosineContrastiveLoss`` (reczoo/RecBox,
    ``recbox/core/pytorch/losses/cosine_contrastive_loss.py``): ``negative_weight``
    multiplies the *mean* over the row's negatives (their code sums instead only
    when ``negative_weight`` is unset; their configs set 150-250 with margin 0.9).
    The scores are raw cosines: no temperature and no log-Q correction. The
    authors' sampler keeps accidental hits (``ignore_pos_items: False``) and
    divides by the number drawn; here, with ``remove_accidental_hits``, a
    negative equal to the row's positive is left out of the sum and of ``|N|``,
    and a row with no kept negative has only its positive term.

    Args:
      margin: negatives with a cosine above it are pushed down.
      negative_weight: weight of the negatives' mean.
      remove_accidental_hits, num_hard_negatives, reduction: as ``RetrievalLoss``.
    """

    def __init__(
        self,
        *,
        margin: float = 0.9,
        negative_weight: float = 150.0,
        remove_accidental_hits: bool = True,
        num_hard_negatives: int | None = None,
        reduction: str = "mean",
        score_dtype: str = "float32",
        name: str | None = None,
    ):
        super().__init__(
            temperature=1.0,
            log_q_weight=0.0,
            remove_accidental_hits=remove_accidental_hits,
            num_hard_negatives=num_hard_negatives,
            reduction=reduction,
            score_dtype=score_dtype,
            name=name,
        )
        if not -1.0 <= margin < 1.0:
            raise ValueError(f"margin must be in [-1, 1) (a cosine), got {margin}")
        if negative_weight < 0:
            raise ValueError(f"negative_weight must be non-negative, got {negative_weight}")
        self.margin = float(margin)
        self.negative_weight = float(negative_weight)

    def per_example(self, inputs: LossInputs) -> tf.Tensor:
        scores, labels, kept = self.candidate_columns(inputs)
        negative = tf.cast(kept, scores.dtype) * (1.0 - labels)
        positive_loss = tf.nn.relu(1.0 - tf.reduce_sum(scores * labels, axis=1))
        # where, not a product: masked columns hold MIN_FLOAT-sized scores.
        pushed = tf.where(negative > 0, tf.nn.relu(scores - self.margin), tf.zeros_like(scores))
        count = tf.reduce_sum(negative, axis=1)
        negative_mean = tf.reduce_sum(pushed, axis=1) / tf.maximum(count, 1.0)
        return positive_loss + self.negative_weight * negative_mean


class BilateralSoftmax(RetrievalLoss):
    """The bilateral softmax loss of BSL (Wu et al., ICDE 2024, arXiv 2312.12882).

    Per row, with ``l+`` the row's positive logit and ``l_j`` the logits of its
    kept negatives ``N`` (``score / tau1``, less ``log_q_weight * log Q``)::

        -l+ + tau2 * log sum_{j in N} exp(l_j)
        = -log( exp(s+ / tau1) / (sum_{j in N} exp(s_j / tau1)) ** tau2 )    (no log-Q)

    This is the authors' per-row formula (junkangwu/BSL, ``utils/losses.py``,
    class ``BSL``, ``mode="reweight"``, the one their README documents):
    ``tau1`` is their ``temperature``, ``tau2`` their ``temperature_2``, the
    exponent of the negatives' sum, i.e. a weight on the negatives' log-sum-exp.
    The positive is not in the sum; ``tau2 = 1`` is their softmax loss (SL).
    Their ``mode="multi"`` (their MF runs) differs in two ways not reproduced
    here: the mean instead of the sum of the negatives' ``exp`` (a constant
    ``tau2 * log |N|`` per row, the same gradient), and each row's
    ``exp(s+ / tau1)`` averaged over the batch's rows of the same user, which
    needs user ids a loss here does not get. Accidental hits and padding are
    left out of ``N``; a row with no kept negative has loss 0 (its sum is empty).

    Args:
      temperature: ``tau1``, divides every score.
      negative_temperature: ``tau2``, multiplies the negatives' log-sum-exp.
      log_q_weight, remove_accidental_hits, num_hard_negatives, reduction: as ``RetrievalLoss``.
    """

    def __init__(self, *, negative_temperature: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        if negative_temperature <= 0:
            raise ValueError(f"negative_temperature must be positive, got {negative_temperature}")
        self.negative_temperature = float(negative_temperature)

    def per_example(self, inputs: LossInputs) -> tf.Tensor:
        logits, labels, kept = self.candidate_columns(inputs)
        negative = tf.logical_and(kept, labels <= 0)
        positive_logit = tf.reduce_sum(logits * labels, axis=1)
        negative_logits = tf.where(negative, logits, tf.fill(tf.shape(logits), tf.cast(MIN_FLOAT, logits.dtype)))
        log_sum = tf.reduce_logsumexp(negative_logits, axis=1)
        has_negative = tf.reduce_any(negative, axis=1)
        per_row = -positive_logit + self.negative_temperature * log_sum
        return tf.where(has_negative, per_row, tf.zeros_like(per_row))


class GeneralizedBinaryCrossEntropy(RetrievalLoss):
    """gBCE, the generalised binary cross-entropy of gSASRec (Petrov & Macdonald, RecSys 2023).

    Per row, with ``s+`` the positive's logit, ``N`` the row's kept negatives (drawn uniformly;
    accidental hits and padding removed) and ``sigma`` the logistic function::

        loss = -(1 / (|N| + 1)) * (log(sigma(s+) ** beta) + sum_{j in N} log(1 - sigma(s_j)))
             =  (beta * softplus(-s+) + sum_{j in N} softplus(s_j)) / (|N| + 1)
        beta = alpha * (t * (1 - 1/alpha) + 1/alpha),   alpha = num_negatives / (num_items - 1)

    (``gbce_beta``; the paper's equations, and the authors' README and code, asash/gsasrec:
    ``Readme.md``, ``recommenders/sequential/models/sasrec/sasrec.py``). The authors compute the
    positive term through a transformed logit ``log(1 / (sigma(s+) ** -beta - 1))`` fed to plain BCE
    in float64; that equals ``beta * softplus(-s+)``, which is computed here directly. Their BCE
    divides by the number of terms, hence the mean over the positive and the kept negatives.
    ``t = 0`` is plain BCE (``beta = 1``); ``t = 1`` gives ``beta = alpha``.

    Logits are ``score / temperature``. No log-Q correction: the negatives are uniform, and ``beta``
    is the loss's own account of the sampling rate. A drawn negative equal to the row's positive
    (and with ``own_items`` any of the row's items) is removed when ``remove_accidental_hits``, so a
    row's negatives are uniform over the other items, as ``alpha``'s ``num_items - 1`` assumes.

    Args:
      num_negatives: ``k``, uniform draws a row (the sampler's ``num_negatives``).
      num_items: ``|I|``, the catalogue's size (tower indices 1..num_items).
      calibration: ``t`` in [0, 1].
      temperature, remove_accidental_hits, reduction: as ``RetrievalLoss``.
    """

    def __init__(self, *, num_negatives: int, num_items: int, calibration: float = 0.75, **kwargs):
        kwargs.setdefault("log_q_weight", 0.0)
        super().__init__(**kwargs)
        if self.log_q_weight:
            raise ValueError(f"gBCE's negatives are uniform and it corrects nothing: log_q_weight must be 0, "
                             f"got {self.log_q_weight}")
        if self.num_hard_negatives is not None:
            raise ValueError("gBCE's beta assumes uniform negatives; num_hard_negatives keeps the top ones")
        self.beta = gbce_beta(num_negatives, num_items, calibration)
        self.num_negatives, self.num_items, self.calibration = int(num_negatives), int(num_items), float(calibration)

    def per_example(self, inputs: LossInputs) -> tf.Tensor:
        logits, labels, kept = self.candidate_columns(inputs)
        negative = tf.logical_and(kept, labels <= 0)
        # where, not a product: removed columns hold MIN_FLOAT-sized logits.
        positive_logit = tf.reduce_sum(tf.where(labels > 0, logits, tf.zeros_like(logits)), axis=1)
        pushed = tf.where(negative, tf.nn.softplus(logits), tf.zeros_like(logits))
        terms = 1.0 + tf.reduce_sum(tf.cast(negative, logits.dtype), axis=1)
        return (self.beta * tf.nn.softplus(-positive_logit) + tf.reduce_sum(pushed, axis=1)) / terms


def _weighted_log_q(log_q: tf.Tensor, weight: float) -> tuple[tf.Tensor, tf.Tensor]:
    """``(weight * log_q, padding)`` of a block of negatives: padded columns (log_q = MASKED_LOG_Q,
    as the samplers write it in float32) stay masked whatever the weight; no real log expected count
    comes near it."""
    padding = log_q >= MASKED_LOG_Q
    return tf.where(padding, log_q, weight * log_q), padding


def _hits(candidate_ids: tf.Tensor, positive_ids: tf.Tensor, own_items: OwnItems | None) -> tf.Tensor:
    """Bool ``[batch, candidates]``: candidates (``[candidates]`` shared or ``[batch, candidates]``)
    that are the row's positive item (``positive_ids``, int64 ``[batch]``) or, with ``own_items``, one
    of its own items."""
    hits = tf.equal(tf.cast(candidate_ids, tf.int64), positive_ids[:, tf.newaxis])
    if own_items is not None:
        hits = tf.logical_or(hits, own_item_hits(own_items, candidate_ids))
    return hits


def _draws_per_row(inputs: LossInputs) -> tf.Tensor:
    """``[batch_size]`` int32: the draws behind each row's candidates, ``M``, whose expected counts are the log Qs.

    The batch's positives when they are candidates (every replica's, each one draw from the in-batch
    distribution), plus each block's columns that are not padding.
    """
    batch_size = tf.shape(inputs.queries)[0]
    draws = tf.zeros([batch_size], tf.int32)
    if inputs.includes_batch_positives:
        candidates = inputs.positives if inputs.batch_candidates is None else inputs.batch_candidates.ids
        draws += tf.shape(candidates)[0]
    for negatives in inputs.negatives:
        real = tf.cast(negatives.log_q < MASKED_LOG_Q, tf.int32)
        count = tf.reduce_sum(real, axis=-1)
        draws += count if negatives.per_query else tf.fill([batch_size], count)
    return draws


def _check_inputs(inputs: LossInputs) -> None:
    if inputs.queries.shape.rank != 2 or inputs.positives.shape.rank != 2:
        raise ValueError(
            "queries and positives must be [batch_size, dim], got "
            f"{inputs.queries.shape} and {inputs.positives.shape}"
        )
    if len(inputs.negatives) != len(inputs.negative_embeddings):
        raise ValueError(
            f"{len(inputs.negatives)} negatives blocks but {len(inputs.negative_embeddings)} embedding blocks"
        )
    if not inputs.negatives:
        raise ValueError("at least one Negatives block is required (it carries positive_log_q)")
    for negatives, embeddings in zip(inputs.negatives, inputs.negative_embeddings):
        if embeddings.shape.rank != negatives.ids.shape.rank + 1:
            raise ValueError(
                f"negative embeddings {embeddings.shape} do not match negative ids {negatives.ids.shape}: "
                "expected [num, dim] for [num] ids or [batch, num, dim] for [batch, num] ids"
            )
