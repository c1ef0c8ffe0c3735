"""Losses and logit transforms.

Every sampled loss here scores a batch of queries against candidates and
corrects the logits for how the candidates were sampled:
``logit / temperature - log Q``. That correction (Bengio & Senecal 2008; Jean
et al. 2015; Yi et al., RecSys 2019) removes the popularity bias that in-batch
or sampled negatives would otherwise bake into the model: popular items appear
as negatives more often, so without it they are pushed down too hard. ``log Q``
is the log expected count of the candidate in the batch's candidate set, as
the samplers (``retrieval.samplers``) return it.

Pure functions first (logits first, as ``tf.nn``):
  ``correct_log_q``, ``remove_accidental_hits``, ``mine_hard_negatives``,
  ``candidate_scores``, ``softmax_cross_entropy``, ``weighted_mean``,
  ``HuffmanTree`` and ``hierarchical_log_probability``; ``gather_across_replicas``
  (in-batch negatives over every ``tf.distribute`` replica).
Then the loss classes, one method each (``per_example``) on a base that
validates and reduces:
  ``SampledSoftmax`` (in-batch, corpus-sampled, mixed, full: the sampler decides),
  ``NegativeSampling`` (word2vec SGNS; NCE when log Q is subtracted),
  ``HierarchicalSoftmax`` (Huffman tree over items; Morin & Bengio 2005, Mikolov et al. 2013).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from retrieval.samplers import MASKED_LOG_Q, Negatives, across_replicas, replica_row_offset, replicas_in_step

# As TFRS: large enough to remove a column from a softmax, small enough that
# adding a logit to it stays finite.
MIN_FLOAT = float(np.finfo(np.float32).min / 100.0)
MAX_FLOAT = float(np.finfo(np.float32).max / 100.0)


# -- pure functions -------------------------------------------------------------


def correct_log_q(logits: tf.Tensor, log_q: tf.Tensor) -> tf.Tensor:
    """``logits - log_q``: the sampled-softmax correction.

    Args:
      logits: ``[batch_size, num_candidates]``.
      log_q: log expected count of each candidate, broadcastable to ``logits``
        (``[num_candidates]`` shared or ``[batch_size, num_candidates]``).
    """
    return logits - tf.cast(log_q, logits.dtype)


def remove_accidental_hits(
    logits: tf.Tensor, labels: tf.Tensor, candidate_ids: tf.Tensor, positive_ids: tf.Tensor | None = None
) -> tf.Tensor:
    """Push negatives that are the row's own positive item out of the softmax.

    A candidate column whose id equals the row's positive id, and which is not
    the label column itself, gets ``MIN_FLOAT`` added (as TFRS and
    ``tf.nn.sampled_softmax_loss`` do), so it carries no probability and no gradient.

    Args:
      logits: ``[batch_size, num_candidates]``.
      labels: ``[batch_size, num_candidates]`` one-hot (all zero for a block of
        negatives only; then ``positive_ids`` is required).
      candidate_ids: ``[num_candidates]`` shared or ``[batch_size, num_candidates]``.
      positive_ids: ``[batch_size]``; None = the id at each row's label column.
    """
    labels = tf.cast(labels, logits.dtype)
    candidate_ids = tf.cast(candidate_ids, tf.int64)
    if positive_ids is None:
        label_column = tf.math.argmax(labels, axis=1)
        if candidate_ids.shape.rank == 1:
            positive_ids = tf.gather(candidate_ids, label_column)
        else:
            positive_ids = tf.gather(candidate_ids, label_column, batch_dims=1)
    positive_ids = tf.cast(positive_ids, tf.int64)
    duplicate = tf.cast(tf.equal(candidate_ids, positive_ids[:, tf.newaxis]), logits.dtype) - labels
    return logits + tf.maximum(duplicate, 0.0) * MIN_FLOAT


def mine_hard_negatives(logits: tf.Tensor, labels: tf.Tensor, k: int) -> tuple[tf.Tensor, tf.Tensor]:
    """Keep each row's positive and its ``k`` highest-scoring negatives (TFRS ``num_hard_negatives``).

    Args:
      logits: ``[batch_size, num_candidates]`` (already corrected and hit-removed).
      labels: ``[batch_size, num_candidates]`` one-hot.
      k: negatives kept per row; all are kept when there are fewer.

    Returns:
      ``(logits, labels)``, each ``[batch_size, min(k + 1, num_candidates)]``.
    """
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    labels = tf.cast(labels, logits.dtype)
    keep = tf.minimum(k + 1, tf.shape(logits)[1])
    _, columns = tf.math.top_k(logits + labels * MAX_FLOAT, k=keep, sorted=False)
    return tf.gather(logits, columns, batch_dims=1), tf.gather(labels, columns, batch_dims=1)


def candidate_scores(queries: tf.Tensor, candidates: tf.Tensor) -> tf.Tensor:
    """Dot products ``[batch_size, num_candidates]``.

    Args:
      queries: ``[batch_size, dim]``.
      candidates: ``[num_candidates, dim]`` shared or ``[batch_size, num_candidates, dim]`` per query.
    """
    if candidates.shape.rank == 2:
        return tf.linalg.matmul(queries, candidates, transpose_b=True)
    if candidates.shape.rank == 3:
        return tf.einsum("bd,bcd->bc", queries, candidates)
    raise ValueError(f"candidates must be [num, dim] or [batch, num, dim], got shape {candidates.shape}")


def softmax_cross_entropy(logits: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    """Per-example cross-entropy ``[batch_size]`` of one-hot ``labels`` under ``softmax(logits)``."""
    return tf.nn.softmax_cross_entropy_with_logits(labels=tf.cast(labels, logits.dtype), logits=logits)


def weighted_mean(
    per_example: tf.Tensor, sample_weight: tf.Tensor | None = None, global_batch_size=None
) -> tf.Tensor:
    """``sum(w * loss) / batch_size`` (Keras ``SUM_OVER_BATCH_SIZE``), so the
    learning rate does not depend on the batch size.

    With ``global_batch_size`` (rows over every replica of a ``tf.distribute``
    strategy) it is this replica's share of the global mean,
    ``tf.nn.compute_average_loss``: the replicas' shares, and their gradients
    (which tf-keras optimizers sum), add up to the single-device values.
    """
    if sample_weight is not None:
        per_example = per_example * tf.cast(sample_weight, per_example.dtype)
    if global_batch_size is None:
        global_batch_size = tf.shape(per_example)[0]
    return tf.reduce_sum(per_example) / tf.cast(global_batch_size, per_example.dtype)


@dataclass(frozen=True)
class HuffmanTree:
    """A Huffman tree over items, built from training frequency (word2vec's tree).

    Frequent items get short paths, so the expected path length is minimal
    under the training distribution. Internal nodes are numbered
    ``0 .. num_items - 2``; going left at a node multiplies an item's probability
    by ``sigmoid(s)``, going right by ``sigmoid(-s)``, ``s`` being the node's
    score, so the leaves' probabilities sum to 1 for any scores.

    Attributes:
      nodes: int32 ``[num_items + 1, depth]``: internal node at each step of the
        path from the root to tower index i (row 0, OOV, is empty); padded with 0.
      signs: float32 ``[num_items + 1, depth]``: +1 left, -1 right, 0 padding.
    """

    nodes: np.ndarray
    signs: np.ndarray

    @property
    def num_items(self) -> int:
        return self.nodes.shape[0] - 1

    @property
    def num_internal(self) -> int:
        return self.num_items - 1

    @property
    def depth(self) -> int:
        return self.nodes.shape[1]

    def path_length(self) -> np.ndarray:
        """Steps from the root to each tower index. [num_items + 1] int."""
        return np.count_nonzero(self.signs, axis=1)

    @classmethod
    def from_counts(cls, counts) -> HuffmanTree:
        """Build the tree over tower indices 1..V from ``counts`` ``[V + 1]`` (entry 0 ignored)."""
        counts = np.asarray(counts, dtype=np.float64)
        if counts.ndim != 1 or counts.size < 3:
            raise ValueError(
                f"counts must be [num_items + 1] with at least 2 items, got shape {counts.shape}"
            )
        if np.any(counts[1:] < 0) or not np.all(np.isfinite(counts)):
            raise ValueError("counts must be finite and non-negative")
        num_items = counts.size - 1
        # Heap entries: (weight, tie-breaker, node); node >= 0 is internal, < 0 is leaf -(index).
        heap = [(counts[i], i, -i) for i in range(1, num_items + 1)]
        heapq.heapify(heap)
        # parent / sign of every leaf (by tower index) and internal node; the root has parent -1.
        leaf_parent = np.full(num_items + 1, -1, dtype=np.int64)
        leaf_sign = np.zeros(num_items + 1, dtype=np.float32)
        node_parent = np.full(max(num_items - 1, 1), -1, dtype=np.int64)
        node_sign = np.zeros(max(num_items - 1, 1), dtype=np.float32)
        for internal in range(num_items - 1):
            weight = 0.0
            for child_sign in (1.0, -1.0):  # the lighter child goes left
                child_weight, _, child = heapq.heappop(heap)
                weight += child_weight
                if child >= 0:
                    node_parent[child], node_sign[child] = internal, child_sign
                else:
                    leaf_parent[-child], leaf_sign[-child] = internal, child_sign
            heapq.heappush(heap, (weight, num_items + 1 + internal, internal))
        # Walk every leaf up to the root at once, one level per iteration (leaf-to-root order).
        steps_nodes, steps_signs = [], []
        node, sign = leaf_parent[1:].copy(), leaf_sign[1:].copy()
        while np.any(node >= 0):
            steps_nodes.append(np.where(node >= 0, node, 0))
            steps_signs.append(np.where(node >= 0, sign, 0.0))
            up = node >= 0
            sign = np.where(up, node_sign[np.maximum(node, 0)], 0.0)
            node = np.where(up, node_parent[np.maximum(node, 0)], -1)
        up_nodes, up_signs = np.stack(steps_nodes, axis=1), np.stack(steps_signs, axis=1)
        # Reverse each row's used prefix so paths read root-to-leaf, padding at the end.
        lengths = np.count_nonzero(up_signs, axis=1)
        depth = up_nodes.shape[1]
        column = np.arange(depth)[None, :]
        source = np.where(column < lengths[:, None], lengths[:, None] - 1 - column, column)
        nodes = np.zeros((num_items + 1, depth), dtype=np.int32)
        signs = np.zeros((num_items + 1, depth), dtype=np.float32)
        nodes[1:] = np.take_along_axis(up_nodes, source, axis=1)
        signs[1:] = np.take_along_axis(up_signs, source, axis=1)
        return cls(nodes, signs)


def hierarchical_log_probability(node_scores: tf.Tensor, signs: tf.Tensor) -> tf.Tensor:
    """log P(item | query) = sum over the item's path of log sigmoid(sign * score).

    Args:
      node_scores: ``[..., depth]`` score of the query at each node of the item's path.
      signs: ``[..., depth]`` +1 (left) / -1 (right), 0 for padding (contributes nothing).

    Returns:
      ``[...]`` log-probabilities.
    """
    signs = tf.cast(signs, node_scores.dtype)
    terms = tf.where(signs != 0, tf.math.log_sigmoid(signs * node_scores), tf.zeros_like(node_scores))
    return tf.reduce_sum(terms, axis=-1)


# -- loss classes ----------------------------------------------------------------


class BatchCandidates(NamedTuple):
    """The in-batch candidate columns when they are more than this batch's positives.

    Under a ``tf.distribute`` strategy with several replicas every replica's
    positives are candidates of every query (``gather_across_replicas``).

    Attributes:
      embeddings: ``[num_candidates, dim]`` doc embeddings of the global batch's positives.
      ids: int64 ``[num_candidates]`` their tower indices.
      log_q: ``[num_candidates]`` their log expected counts (``Negatives.positive_log_q``).
      row_offset: int32 scalar: row i's positive is column ``row_offset + i``.
    """

    embeddings: tf.Tensor
    ids: tf.Tensor
    log_q: tf.Tensor
    row_offset: tf.Tensor


class LossInputs(NamedTuple):
    """What the model hands a loss for one batch.

    Attributes:
      queries: ``[batch_size, dim]`` query embeddings.
      positives: ``[batch_size, dim]`` doc embeddings of the rows' positives.
      positive_ids: int64 ``[batch_size]`` tower indices of the positives.
      negatives: one ``Negatives`` per candidate source (the sampler's, then
        e.g. mined hard negatives); the first one's ``positive_log_q`` is used.
      negative_embeddings: doc embeddings of each ``negatives[j].ids``:
        ``[num, dim]`` shared or ``[batch_size, num, dim]`` per query.
      includes_batch_positives: the sampler's ``includes_batch_positives``.
      sample_weight: ``[batch_size]`` or None.
      batch_candidates: the in-batch candidates when they span several
        replicas; None = this batch's positives (row i's label is column i).
      global_batch_size: rows over every replica, the denominator of the mean
        (the loss is then this replica's share); None = ``batch_size``.
    """

    queries: tf.Tensor
    positives: tf.Tensor
    positive_ids: tf.Tensor
    negatives: tuple[Negatives, ...]
    negative_embeddings: tuple[tf.Tensor, ...]
    includes_batch_positives: bool
    sample_weight: tf.Tensor | None = None
    batch_candidates: BatchCandidates | None = None
    global_batch_size: tf.Tensor | None = None


def gather_across_replicas(inputs: LossInputs) -> LossInputs:
    """Cross-replica in-batch negatives: every query scores the positives of the whole global batch.

    Inside ``strategy.run`` with several replicas each replica holds
    ``B_r`` rows of the global batch of ``B = sum B_r``. TFRS scores a query
    against its own replica's positives only; here the positives' embeddings,
    ids and log Q are all-gathered (replica order, so the candidate columns are
    the global batch in order), local row i's label is column ``offset + i``,
    and the mean is taken over ``B`` (this replica's share of the global loss).
    ``all_gather``'s gradient sums every replica's gradient of the gathered
    rows and hands each replica its own rows, so each doc tower learns from
    every query. The samplers' ``positive_log_q`` must already be
    ``log(B * p)`` with the global ``B`` (``InBatchSampler`` and
    ``MixedSampler`` do so). Corpus negatives are not gathered: each replica
    scores its own draws.

    With one replica, or outside ``strategy.run``, ``inputs`` is returned as is.
    """
    if replicas_in_step() == 1:
        return inputs
    offset, total = replica_row_offset(tf.shape(inputs.queries)[0])
    candidates = None
    if inputs.includes_batch_positives:
        candidates = BatchCandidates(
            embeddings=across_replicas(inputs.positives),
            ids=across_replicas(tf.cast(inputs.positive_ids, tf.int64)),
            log_q=across_replicas(tf.stop_gradient(inputs.negatives[0].positive_log_q)),
            row_offset=offset,
        )
    return inputs._replace(batch_candidates=candidates, global_batch_size=total)


class RetrievalLoss(tf.keras.layers.Layer):
    """Base class: validates the inputs, asks ``per_example`` for ``[batch_size]`` losses, reduces.

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
    """

    def __init__(
        self,
        *,
        temperature: float = 1.0,
        log_q_weight: float = 1.0,
        remove_accidental_hits: bool = True,
        num_hard_negatives: int | None = None,
        reduction: str = "mean",
        name: str | None = None,
    ):
        super().__init__(name=name)
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
        q, positive_ids = inputs.queries, tf.cast(inputs.positive_ids, tf.int64)
        weight = self.log_q_weight
        positive_log_q = inputs.negatives[0].positive_log_q
        batch_size = tf.shape(q)[0]
        if inputs.includes_batch_positives and inputs.batch_candidates is not None:
            batch = inputs.batch_candidates
            head = candidate_scores(q, batch.embeddings) / self.temperature
            head = correct_log_q(head, weight * batch.log_q[tf.newaxis, :])
            head_labels = tf.one_hot(
                batch.row_offset + tf.range(batch_size), tf.shape(batch.ids)[0], dtype=head.dtype
            )
            if self.remove_hits:
                head = remove_accidental_hits(head, head_labels, batch.ids, positive_ids)
        elif inputs.includes_batch_positives:
            head = candidate_scores(q, inputs.positives) / self.temperature
            head = correct_log_q(head, weight * positive_log_q[tf.newaxis, :])
            head_labels = tf.eye(batch_size, dtype=head.dtype)
            if self.remove_hits:
                head = remove_accidental_hits(head, head_labels, positive_ids)
        else:
            head = tf.reduce_sum(q * inputs.positives, axis=1, keepdims=True) / self.temperature
            head = correct_log_q(head, weight * positive_log_q[:, tf.newaxis])
            head_labels = tf.ones_like(head)
        logits, labels = [head], [head_labels]
        for negatives, embeddings in zip(inputs.negatives, inputs.negative_embeddings):
            block = candidate_scores(q, embeddings) / self.temperature
            # Masked columns (log_q = MASKED_LOG_Q, as the samplers write it in float32) stay masked
            # whatever the weight; no real log expected count comes near it.
            block = correct_log_q(
                block, tf.where(negatives.log_q >= MASKED_LOG_Q, negatives.log_q, weight * negatives.log_q)
            )
            if self.remove_hits:
                block = remove_accidental_hits(block, tf.zeros_like(block), negatives.ids, positive_ids)
            logits.append(block)
            labels.append(tf.zeros_like(block))
        logits, labels = tf.concat(logits, axis=1), tf.concat(labels, axis=1)
        if self.num_hard_negatives is not None:
            logits, labels = mine_hard_negatives(logits, labels, self.num_hard_negatives)
        return logits, labels


class SampledSoftmax(RetrievalLoss):
    """Softmax cross-entropy over the positive and the sampled candidates, log-Q corrected.

    The sampler decides what this is: in-batch softmax (``InBatchSampler``),
    sampled softmax (``CorpusSampler``; equals ``tf.nn.sampled_softmax_loss``
    given the same draws), mixed negatives (``MixedSampler``), or the exact
    full softmax (``AllItems`` with accidental hits removed).
    """

    def per_example(self, inputs: LossInputs) -> tf.Tensor:
        logits, labels = self.logits_and_labels(inputs)
        return softmax_cross_entropy(logits, labels)


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


class HierarchicalSoftmax(RetrievalLoss):
    """Hierarchical softmax over a Huffman tree of items (Morin & Bengio 2005; word2vec).

    The loss owns one vector per internal node; ``P(item | query)`` is the
    product of ``sigmoid(+-query . node / temperature)`` along the item's path,
    so a step costs O(depth) instead of O(corpus) and the probabilities over all
    items sum to exactly 1. It is a comparison loss for ID doc towers: the item
    "embedding" is its path, not a vector, so the doc tower is not trained and
    the model cannot be served from a FAISS inner-product index;
    ``item_scores`` returns the exact per-item log-probabilities instead.
    Negatives and log Q are not used.

    Args:
      tree: the ``HuffmanTree`` over tower indices.
      dim: embedding size of the query tower.
      temperature: node scores are divided by it.
    """

    def __init__(
        self, tree: HuffmanTree, dim: int, *, temperature: float = 1.0, name: str = "hierarchical_softmax"
    ):
        super().__init__(temperature=temperature, log_q_weight=0.0, remove_accidental_hits=False, name=name)
        self.tree = tree
        self._nodes = tf.constant(tree.nodes, tf.int32)
        self._signs = tf.constant(tree.signs, tf.float32)
        # word2vec starts node vectors at zero: every item starts at 2^-depth.
        self.node_embeddings = self.add_weight(
            name="node_embeddings", shape=(tree.num_internal, dim), initializer="zeros", trainable=True
        )

    def log_probability(self, queries: tf.Tensor, item_ids: tf.Tensor) -> tf.Tensor:
        """log P(item_ids[b] | queries[b]) ``[batch_size]``; only the path nodes enter."""
        nodes = tf.gather(self._nodes, item_ids)
        signs = tf.gather(self._signs, item_ids)
        vectors = tf.gather(self.node_embeddings, nodes)  # [batch, depth, dim]
        scores = tf.einsum("bd,bld->bl", queries, vectors) / self.temperature
        return hierarchical_log_probability(scores, signs)

    def per_example(self, inputs: LossInputs) -> tf.Tensor:
        return -self.log_probability(inputs.queries, tf.cast(inputs.positive_ids, tf.int32))

    def item_scores(
        self, queries: tf.Tensor, item_embeddings: tf.Tensor = None, chunk: int = 256
    ) -> tf.Tensor:
        """Exact log P(item | query) for every tower index ``[num_queries, num_items + 1]``; OOV is -inf."""
        del item_embeddings
        outputs = []
        for start in range(0, int(queries.shape[0]), chunk):
            q = queries[start : start + chunk]
            node_scores = tf.linalg.matmul(q, self.node_embeddings, transpose_b=True) / self.temperature
            path_scores = tf.gather(node_scores, self._nodes, axis=1)  # [chunk, items + 1, depth]
            signs = tf.broadcast_to(self._signs, tf.shape(path_scores))
            outputs.append(hierarchical_log_probability(path_scores, signs))
        scores = tf.concat(outputs, axis=0) if outputs else tf.zeros([0, self.tree.num_items + 1])
        oov = tf.one_hot(0, self.tree.num_items + 1, on_value=-np.inf, off_value=0.0)
        return scores + oov


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
