"""Hierarchical softmax: a Huffman tree over items and the loss that walks it.

``HuffmanTree`` (word2vec's tree, built from training frequency),
``hierarchical_log_probability`` (the sum of log sigmoids along an item's
path) and ``HierarchicalSoftmax`` (Morin & Bengio 2005; Mikolov et al. 2013),
a comparison loss for ID doc towers.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from retrieval.losses.inputs import LossInputs
from retrieval.losses.sampled import RetrievalLoss


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

    scores_by_dot_product = False

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
