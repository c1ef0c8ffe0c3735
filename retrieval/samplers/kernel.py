"""Exact sampling from a quadratic kernel over items, per query.

Blanc & Rendle, "Adaptive Sampled Softmax with Kernel Based Sampling", ICML
2018. Sampled softmax is unbiased only when the proposal is the softmax
itself; a proposal that tracks the model needs far fewer negatives. The
quadratic kernel ``K(q, d) = alpha * (q . d)^2 + 1`` is positive, tracks
large |logits|, and its sum over any set S of items is cheap in kernel space:

    sum_{i in S} K(q, d_i) = alpha * q^T (sum_{i in S} d_i d_i^T) q + |S|

So a binary tree over the items whose nodes store ``sum d_i d_i^T`` (D x D)
and a count lets us sample *exactly* from ``K(q, .) / sum K(q, .)``: walk from
the root, going left with probability K(left) / K(node). Each step costs
O(D^2); a draw costs O(D^2 log n). Leaves hold small buckets of items, where
the last step samples directly from the bucket's kernel values (O(bucket D)).

Everything is vectorised over all draws of a batch (no per-item Python loops);
the tree is plain numpy so it can be refreshed from the current doc
embeddings every N training steps, or updated incrementally for a few rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KernelDraws:
    """Draws for a batch of queries.

    Attributes:
      ids: [num_queries, num_draws] int64 item rows, drawn with replacement.
      log_prob: [num_queries, num_draws] float64, log of the per-draw
        probability K(q, d_id) / sum_i K(q, d_i). The expected count of an item
        in m draws is m * prob (add log m for a sampled-softmax log Q).
    """

    ids: np.ndarray
    log_prob: np.ndarray


class QuadraticKernelTree:
    """Divide-and-conquer tree of ``sum d d^T`` for kernel sampling.

    Args:
      embeddings: [num_items, dim] item (doc) embeddings.
      alpha: kernel scale; larger follows the model's logits more sharply.
      leaf_size: items per leaf bucket.
      max_chunk: draws walked down the tree at once (bounds memory to about
        ``max_chunk * dim^2`` floats).
    """

    def __init__(self, embeddings: np.ndarray, *, alpha: float = 100.0, leaf_size: int = 32, max_chunk: int = 4096):
        if alpha <= 0:
            raise ValueError(f"alpha must be positive, got {alpha}")
        if leaf_size <= 0:
            raise ValueError(f"leaf_size must be positive, got {leaf_size}")
        self.alpha = float(alpha)
        self.leaf_size = int(leaf_size)
        self.max_chunk = int(max_chunk)
        self.refresh(embeddings)

    # -- building -------------------------------------------------------------

    def refresh(self, embeddings: np.ndarray) -> None:
        """Rebuild every node sum from ``embeddings`` [num_items, dim]."""
        embeddings = np.asarray(embeddings, dtype=np.float64)
        if embeddings.ndim != 2 or embeddings.shape[0] == 0:
            raise ValueError(f"embeddings must be [num_items, dim] with num_items > 0, got {embeddings.shape}")
        if not np.all(np.isfinite(embeddings)):
            raise ValueError("embeddings contain NaN or inf")
        self.num_items, self.dim = embeddings.shape
        num_buckets = -(-self.num_items // self.leaf_size)
        self.depth = int(np.ceil(np.log2(num_buckets))) if num_buckets > 1 else 0
        self.num_leaves = 2**self.depth
        padded = np.zeros((self.num_leaves * self.leaf_size, self.dim))
        padded[: self.num_items] = embeddings
        # Buckets: [num_leaves, leaf_size, dim]; padding rows are zero vectors
        # with a zero count, so they add nothing to any sum.
        self.buckets = padded.reshape(self.num_leaves, self.leaf_size, self.dim)
        self.bucket_valid = (np.arange(self.num_leaves * self.leaf_size) < self.num_items).reshape(
            self.num_leaves, self.leaf_size
        )
        num_nodes = 2 * self.num_leaves - 1
        self.sums = np.zeros((num_nodes, self.dim, self.dim))
        self.counts = np.zeros(num_nodes)
        first_leaf = self.num_leaves - 1
        self.sums[first_leaf:] = np.einsum("lbd,lbe->lde", self.buckets, self.buckets)
        self.counts[first_leaf:] = self.bucket_valid.sum(axis=1)
        for level in range(self.depth - 1, -1, -1):  # bottom-up, one vectorised level at a time
            nodes = np.arange(2**level - 1, 2 ** (level + 1) - 1)
            self.sums[nodes] = self.sums[2 * nodes + 1] + self.sums[2 * nodes + 2]
            self.counts[nodes] = self.counts[2 * nodes + 1] + self.counts[2 * nodes + 2]

    def update(self, rows: np.ndarray, embeddings: np.ndarray) -> None:
        """Replace the embeddings of ``rows`` [r] by ``embeddings`` [r, dim].

        Only the r leaf-to-root paths change: O(r * D^2 * log n), cheaper than
        ``refresh`` when few items moved.
        """
        rows = np.asarray(rows, dtype=np.int64)
        embeddings = np.asarray(embeddings, dtype=np.float64)
        if embeddings.shape != (len(rows), self.dim):
            raise ValueError(f"embeddings must be [{len(rows)}, {self.dim}], got {embeddings.shape}")
        if len(np.unique(rows)) != len(rows) or rows.min(initial=0) < 0 or rows.max(initial=0) >= self.num_items:
            raise ValueError("rows must be unique item rows in [0, num_items)")
        leaf, slot = np.divmod(rows, self.leaf_size)
        old = self.buckets[leaf, slot]
        delta = np.einsum("rd,re->rde", embeddings, embeddings) - np.einsum("rd,re->rde", old, old)
        self.buckets[leaf, slot] = embeddings
        node = leaf + self.num_leaves - 1
        for _ in range(self.depth + 1):
            np.add.at(self.sums, node, delta)
            node = (node - 1) // 2

    # -- probabilities ----------------------------------------------------------

    def partition(self, queries: np.ndarray) -> np.ndarray:
        """Z(q) = sum_i K(q, d_i) for each query. [num_queries]."""
        queries = self._check_queries(queries)
        return self.alpha * np.einsum("qd,de,qe->q", queries, self.sums[0], queries) + self.counts[0]

    def kernel(self, queries: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """K(q_b, d_{ids[b, j]}). queries [B, dim], ids [B, m] -> [B, m]."""
        queries = self._check_queries(queries)
        leaf, slot = np.divmod(np.asarray(ids, dtype=np.int64), self.leaf_size)
        dots = np.einsum("bd,bmd->bm", queries, self.buckets[leaf, slot])
        return self.alpha * dots**2 + 1.0

    def log_prob(self, queries: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Exact log K(q, d_id) / Z(q). queries [B, dim], ids [B, m] -> [B, m]."""
        return np.log(self.kernel(queries, ids)) - np.log(self.partition(queries))[:, None]

    # -- sampling ---------------------------------------------------------------

    def sample(self, queries: np.ndarray, num_draws: int, rng: np.random.Generator) -> KernelDraws:
        """Draw ``num_draws`` items per query, with replacement, exactly from K(q, .)/Z(q)."""
        queries = self._check_queries(queries)
        if num_draws <= 0:
            raise ValueError(f"num_draws must be positive, got {num_draws}")
        owner = np.repeat(np.arange(len(queries)), num_draws)
        ids = np.empty(owner.size, dtype=np.int64)
        for start in range(0, owner.size, self.max_chunk):
            chunk = owner[start : start + self.max_chunk]
            ids[start : start + len(chunk)] = self._descend(queries[chunk], rng)
        ids = ids.reshape(len(queries), num_draws)
        return KernelDraws(ids, self.log_prob(queries, ids))

    def _descend(self, queries: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        # q^T M q == <vec(q q^T), vec(M)>: one matrix product per level between the
        # distinct queries' outer products and the distinct nodes they stand at is
        # far faster than gathering a D x D matrix for every draw.
        distinct, owner = np.unique(queries, axis=0, return_inverse=True)
        owner = owner.reshape(-1)
        outer = np.einsum("qd,qe->qde", distinct, distinct).reshape(len(distinct), -1)
        flat_sums = self.sums.reshape(len(self.sums), -1)
        node = np.zeros(len(queries), dtype=np.int64)
        mass = self.alpha * (outer @ flat_sums[0])[owner] + self.counts[0]
        for _ in range(self.depth):
            left = 2 * node + 1
            nodes, slot = np.unique(left, return_inverse=True)
            quadratic = outer @ flat_sums[nodes].T  # [distinct queries, distinct nodes]
            left_mass = self.alpha * quadratic[owner, slot.reshape(-1)] + self.counts[left]
            go_left = rng.random(len(queries)) * mass < left_mass
            node = np.where(go_left, left, left + 1)
            mass = np.where(go_left, left_mass, mass - left_mass)
        # Inside the leaf bucket: sample directly from the items' kernel values.
        leaf = node - (self.num_leaves - 1)
        dots = np.einsum("sd,sbd->sb", queries, self.buckets[leaf])
        weights = np.where(self.bucket_valid[leaf], self.alpha * dots**2 + 1.0, 0.0)
        cumulative = np.cumsum(weights, axis=1)
        pick = (rng.random(len(queries)) * cumulative[:, -1])[:, None] >= cumulative
        slot = np.minimum(pick.sum(axis=1), self.leaf_size - 1)
        return leaf * self.leaf_size + slot

    def _check_queries(self, queries: np.ndarray) -> np.ndarray:
        queries = np.asarray(queries, dtype=np.float64)
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise ValueError(f"queries must be [num_queries, {self.dim}], got {queries.shape}")
        return queries
