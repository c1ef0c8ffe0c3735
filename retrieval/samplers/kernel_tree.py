"""The node statistics of the quadratic-kernel tree: built, updated and summed in numpy.

``KernelTreeStatistics`` holds, in heap order, every internal node's
``sum d_i d_i^T`` (packed upper triangles) and item count over a binary tree
of the item embeddings; builds them bottom-up, one vectorised level at a
time; updates only the ancestors of changed rows; and gives the exact kernel
values, partition function and log-probabilities that the sampler's walk
(``retrieval.samplers.kernel.QuadraticKernelTree.sample``) draws from.
"""

from __future__ import annotations

import numpy as np


class KernelTreeStatistics:
    """Divide-and-conquer tree of ``sum d d^T`` for kernel sampling.

    Storage is flat numpy, in heap order (node ``k``'s children are ``2k + 1``
    and ``2k + 2``): the internal nodes' sums as packed upper triangles
    (``D (D + 1) / 2`` entries) in float64, with a float32 mirror that the walk
    reads; the items themselves (float64, and a float32 mirror), zero-padded to
    ``num_leaves * leaf_size`` rows. Leaves keep no sums: the walk reads the
    items of the last internal node's two leaves directly (``2 * leaf_size * D``
    multiply-adds, about what one packed sum costs), which halves the memory.

    Args:
      embeddings: [num_items, dim] item (doc) embeddings.
      alpha: kernel scale; larger follows the model's logits more sharply.
      leaf_size: items per leaf bucket.
      max_chunk: (query, node) pairs evaluated at once deep in the tree (bounds
        the walk's scratch memory to about ``max_chunk * (dim^2 / 2 + 2 * leaf_size * dim)``
        floats).
    """

    def __init__(self, embeddings: np.ndarray, *, alpha: float = 100.0, leaf_size: int = 32, max_chunk: int = 256):
        if alpha <= 0:
            raise ValueError(f"alpha must be positive, got {alpha}")
        if leaf_size <= 0:
            raise ValueError(f"leaf_size must be positive, got {leaf_size}")
        if max_chunk <= 0:
            raise ValueError(f"max_chunk must be positive, got {max_chunk}")
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
        self._upper = np.triu_indices(self.dim)
        # Padding rows are zero vectors outside every count: they add nothing to any sum, and the
        # walk gives them weight 0.
        self.items = np.zeros((self.num_leaves * self.leaf_size, self.dim))
        self.items[: self.num_items] = embeddings
        self._items32 = self.items.astype(np.float32)
        leaf_counts = np.clip(self.num_items - np.arange(self.num_leaves) * self.leaf_size, 0, self.leaf_size)
        self.counts = np.zeros(2 * self.num_leaves - 1)
        self.counts[self.num_leaves - 1 :] = leaf_counts
        self._stats = np.zeros((self.num_leaves - 1, len(self._upper[0])))
        self._stats32 = np.zeros(self._stats.shape, dtype=np.float32)
        for level in range(self.depth - 1, -1, -1):  # bottom-up, one vectorised level at a time
            nodes = np.arange(2**level - 1, 2 ** (level + 1) - 1)
            self.counts[nodes] = self.counts[2 * nodes + 1] + self.counts[2 * nodes + 2]
        if self.depth:
            self._recompute(np.arange(self.num_leaves // 2 - 1, self.num_leaves - 1))

    def update(self, rows: np.ndarray, embeddings: np.ndarray) -> None:
        """Replace the embeddings of ``rows`` [r] by ``embeddings`` [r, dim].

        Only the ancestors of the r rows change, and only they are recomputed:
        the lowest internal nodes above the rows from their items, then each
        level above as the sum of its two children, one vectorised step per
        level. Cost O(min(r, n / leaf) * leaf * D^2) for the lowest level plus
        O(r * D^2 * log n) above it, and no rounding drift: the result equals a
        ``refresh`` from the same embeddings.
        """
        rows = np.asarray(rows, dtype=np.int64)
        embeddings = np.asarray(embeddings, dtype=np.float64)
        if embeddings.shape != (len(rows), self.dim):
            raise ValueError(f"embeddings must be [{len(rows)}, {self.dim}], got {embeddings.shape}")
        if len(np.unique(rows)) != len(rows) or rows.min(initial=0) < 0 or rows.max(initial=0) >= self.num_items:
            raise ValueError("rows must be unique item rows in [0, num_items)")
        if not np.all(np.isfinite(embeddings)):
            raise ValueError("embeddings contain NaN or inf")
        self.items[rows] = embeddings
        self._items32[rows] = embeddings
        if self.depth:
            self._recompute(np.unique(rows // (2 * self.leaf_size)) + self.num_leaves // 2 - 1)

    def _recompute(self, lowest: np.ndarray) -> None:
        """Recompute the sums of ``lowest`` (sorted nodes of the lowest internal level) from their
        items, then of all their ancestors."""
        block = 2 * self.leaf_size  # items under one lowest internal node
        buckets = self.items.reshape(-1, block, self.dim)
        first = self.num_leaves // 2 - 1
        packed = self._upper[0] * self.dim + self._upper[1]
        # Small blocks into reused buffers (a [nodes, D, D] temporary at 1M items would not fit, and
        # fresh large temporaries cost page faults): measured 2-4x faster than 1024-node blocks.
        chunk = 128
        rows = np.empty((chunk, block, self.dim))
        squares = np.empty((chunk, self.dim, self.dim))
        values = np.empty((chunk, len(packed)))
        for start in range(0, len(lowest), chunk):
            nodes = lowest[start : start + chunk]
            size = len(nodes)
            np.take(buckets, nodes - first, axis=0, out=rows[:size])
            np.matmul(rows[:size].transpose(0, 2, 1), rows[:size], out=squares[:size])
            np.take(squares[:size].reshape(size, -1), packed, axis=1, out=values[:size])
            self._stats[nodes] = values[:size]
        self._stats32[lowest] = self._stats[lowest]
        nodes = lowest
        while len(nodes) and nodes[0] > 0:
            nodes = np.unique((nodes - 1) // 2)
            self._stats[nodes] = self._stats[2 * nodes + 1] + self._stats[2 * nodes + 2]
            self._stats32[nodes] = self._stats[nodes]

    @property
    def sums(self) -> np.ndarray:
        """Every node's ``sum d d^T``, [num_nodes, dim, dim] float64, unpacked (for inspection:
        it materialises O(num_nodes * dim^2) floats; the walk never uses it)."""
        sums = np.zeros((2 * self.num_leaves - 1, self.dim, self.dim))
        upper_i, upper_j = self._upper
        internal = self.num_leaves - 1
        sums[:internal, upper_i, upper_j] = self._stats
        sums[:internal, upper_j, upper_i] = self._stats
        buckets = self.items.reshape(self.num_leaves, self.leaf_size, self.dim)
        sums[internal:] = np.matmul(buckets.transpose(0, 2, 1), buckets)
        return sums

    # -- probabilities ----------------------------------------------------------

    def partition(self, queries: np.ndarray) -> np.ndarray:
        """Z(q) = sum_i K(q, d_i) for each query. [num_queries]."""
        queries = self._check_queries(queries)
        if self.depth == 0:
            return self.kernel(queries, np.broadcast_to(np.arange(self.num_items), (len(queries), self.num_items))).sum(
                axis=1
            )
        upper_i, upper_j = self._upper
        root = np.zeros((self.dim, self.dim))
        root[upper_i, upper_j] = self._stats[0]  # upper triangle only: q^T U q with U's
        root[upper_j, upper_i] += self._stats[0]  # off-diagonal doubled equals q^T S q
        root[np.diag_indices(self.dim)] /= 2
        return self.alpha * np.einsum("bd,bd->b", queries @ root, queries) + self.counts[0]

    def kernel(self, queries: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """K(q_b, d_{ids[b, j]}). queries [B, dim], ids [B, m] -> [B, m]."""
        queries = self._check_queries(queries)
        dots = np.einsum("bd,bmd->bm", queries, self.items[np.asarray(ids, dtype=np.int64)])
        return self.alpha * dots**2 + 1.0

    def log_prob(self, queries: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Exact log K(q, d_id) / Z(q). queries [B, dim], ids [B, m] -> [B, m]."""
        return np.log(self.kernel(queries, ids)) - np.log(self.partition(queries))[:, None]

    def _check_queries(self, queries: np.ndarray) -> np.ndarray:
        queries = np.asarray(queries, dtype=np.float64)
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise ValueError(f"queries must be [num_queries, {self.dim}], got {queries.shape}")
        return queries
