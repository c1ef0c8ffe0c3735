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
A query's m draws walk down together, splitting binomially at each node, so
the cost is per distinct (query, node) pair, at most O(m D^2 log n).

Everything is vectorised over all draws of a batch (no per-item Python loops);
the tree is plain numpy so it can be refreshed from the current doc
embeddings every N training steps, or updated incrementally for a few rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from retrieval.samplers.base import Negatives, Sampler, replicas_in_step

# Evaluate a whole (distinct queries x distinct nodes) grid with one matrix product when it has at
# most this many entries per (query, node) pair actually needed.
_GRID_FACTOR = 16
# ... and evaluate every node (every item at the leaves) for every query when there are at most this
# many (query, node) entries.
_FULL_GRID = 1 << 20


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
      max_chunk: (query, node) pairs evaluated at once deep in the tree (bounds
        memory to about ``2 * max_chunk * dim^2`` floats).
    """

    def __init__(self, embeddings: np.ndarray, *, alpha: float = 100.0, leaf_size: int = 32, max_chunk: int = 1024):
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
        self._packed_sums: np.ndarray | None = None  # upper triangles of self.sums, built on the first draw
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
        self._packed_sums = None

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
        """Draw ``num_draws`` items per query, with replacement, from K(q, .)/Z(q).

        Exact up to float32 rounding of the tree's node masses (~1e-7 relative,
        far below sampling noise); the returned ``log_prob`` is exact (float64).

        The draws of one query walk down the tree together: at each node the
        ``n`` draws that reached it split binomially between the children
        (``Binomial(n, K(left) / K(node))``) and, at a leaf, multinomially
        between its items. That is the same distribution as ``n`` independent
        walks, but the work is per distinct (query, node) pair instead of per
        draw, which matters once ``num_draws`` is large: near the root every
        draw of a query shares one pair.

        Args:
          queries: [num_queries, dim].
          num_draws: draws per query, ``m``.
          rng: the random generator (the only source of randomness).

        Returns:
          ``KernelDraws`` ``[num_queries, num_draws]``, each row in random order.
        """
        queries = self._check_queries(queries)
        if num_draws <= 0:
            raise ValueError(f"num_draws must be positive, got {num_draws}")
        num_queries = len(queries)
        outer, flat_sums = self._packed(queries)
        # Small trees: every node's kernel mass for every query in one matrix product, then
        # the walk only looks values up.
        every_node = None
        if num_queries * len(flat_sums) <= _FULL_GRID:
            every_node = (outer @ flat_sums.T).astype(np.float64)
        # One entry per (query, node) pair that some draws reached: owner query, node, draws, K(node).
        owner = np.arange(num_queries)
        node = np.zeros(num_queries, dtype=np.int64)
        count = np.full(num_queries, num_draws, dtype=np.int64)
        mass = self.alpha * (outer @ flat_sums[0]).astype(np.float64) + self.counts[0]
        for _ in range(self.depth):
            left = 2 * node + 1
            if every_node is not None:
                quadratic = every_node[owner, left]
            else:
                quadratic = self._quadratic(outer, flat_sums, owner, left)
            left_mass = self.alpha * quadratic + self.counts[left]
            # A subtree of padding only (count 0) has mass exactly 0: never let rounding of
            # mass - left_mass send draws there. Elsewhere mass >= count >= 1, rounding is negligible.
            right_mass = np.where(self.counts[left + 1] > 0, np.maximum(mass - left_mass, 0.0), 0.0)
            to_left = rng.binomial(count, left_mass / (left_mass + right_mass))
            owner = np.concatenate([owner, owner])
            node = np.concatenate([left, left + 1])
            count = np.concatenate([to_left, count - to_left])
            mass = np.concatenate([left_mass, right_mass])
            kept = count > 0
            owner, node, count, mass = owner[kept], node[kept], count[kept], mass[kept]
        # Inside the leaf buckets: split each pair's draws multinomially over its items' kernel values.
        leaf = node - (self.num_leaves - 1)
        queries_at, query_slot = np.unique(owner, return_inverse=True)
        leaves, leaf_slot = np.unique(leaf, return_inverse=True)
        if num_queries * self.num_items <= _FULL_GRID * 8:  # every item's dot product, one product
            flat_items = self.buckets.reshape(-1, self.dim)
            every_item = (queries @ flat_items.T).reshape(num_queries, self.num_leaves, self.leaf_size)
            dots = every_item[owner, leaf]
        elif len(queries_at) * len(leaves) <= _GRID_FACTOR * len(owner):
            grid = (queries[queries_at] @ self.buckets[leaves].reshape(-1, self.dim).T).reshape(
                len(queries_at), len(leaves), self.leaf_size
            )
            dots = grid[query_slot.reshape(-1), leaf_slot.reshape(-1)]
        else:
            dots = np.einsum("pd,pbd->pb", queries[owner], self.buckets[leaf])
        weights = np.where(self.bucket_valid[leaf], self.alpha * dots**2 + 1.0, 0.0)
        per_item = rng.multinomial(count, weights / weights.sum(axis=1, keepdims=True))
        items = (leaf[:, None] * self.leaf_size + np.arange(self.leaf_size)).ravel()
        ids: np.ndarray = np.repeat(items, per_item.ravel())
        query_of = np.repeat(np.repeat(owner, self.leaf_size), per_item.ravel())
        ids = ids[np.argsort(query_of, kind="stable")].reshape(num_queries, num_draws)
        ids = rng.permuted(ids, axis=1)  # draws are exchangeable; do not leave them sorted by leaf
        return KernelDraws(ids, self.log_prob(queries, ids))

    def _packed(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # q^T S q == <vec(q q^T), vec(S)>, and S is symmetric: the upper triangle with the
        # off-diagonal weighted 2 holds the same inner product in D(D+1)/2 entries instead of D^2.
        # Both are float32: the walk is memory-bound, and a node's mass is then exact to ~1e-7
        # relative, far below sampling noise; log_prob (hence log Q) stays exact in float64.
        upper_i, upper_j = np.triu_indices(self.dim)
        if self._packed_sums is None:
            self._packed_sums = np.ascontiguousarray(self.sums[:, upper_i, upper_j], dtype=np.float32)
        weight = np.where(upper_i == upper_j, 1.0, 2.0)
        return (queries[:, upper_i] * queries[:, upper_j] * weight).astype(np.float32), self._packed_sums

    def _quadratic(
        self, outer: np.ndarray, flat_sums: np.ndarray, owner: np.ndarray, nodes: np.ndarray
    ) -> np.ndarray:
        # One matrix product between the distinct queries' packed outer products and the distinct
        # nodes is fastest while that grid is not much larger than the pairs actually needed (a
        # gathered per-pair product is memory-bound, ~10-30x slower per entry than BLAS); beyond,
        # compute each pair alone, in chunks of max_chunk pairs to bound memory.
        queries, query_slot = np.unique(owner, return_inverse=True)
        distinct, node_slot = np.unique(nodes, return_inverse=True)
        if len(queries) * len(distinct) <= _GRID_FACTOR * len(owner):
            rows = outer if len(queries) == len(outer) else outer[queries]  # often every query: no copy
            grid = rows @ flat_sums[distinct].T
            return grid[query_slot.reshape(-1), node_slot.reshape(-1)].astype(np.float64)
        result = np.empty(len(owner))
        for start in range(0, len(owner), self.max_chunk):
            part = slice(start, start + self.max_chunk)
            result[part] = np.einsum("pk,pk->p", outer[owner[part]], flat_sums[nodes[part]])
        return result

    def _check_queries(self, queries: np.ndarray) -> np.ndarray:
        queries = np.asarray(queries, dtype=np.float64)
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise ValueError(f"queries must be [num_queries, {self.dim}], got {queries.shape}")
        return queries


class KernelSampler(Sampler):
    """Per-query negatives drawn from a quadratic kernel of the current model (Blanc & Rendle 2018).

    Every query draws ``num_samples`` items with replacement from
    ``p(i | q) = K(q, d_i) / sum_j K(q, d_j)``, ``K(q, d) = alpha (q . d)^2 + 1``,
    over the doc embeddings of tower indices ``1..num_items`` (the OOV row 0 is
    never drawn). The tree over the embeddings is rebuilt from
    ``embed_catalogue()`` every ``refresh_steps`` calls of ``sample`` during
    training (the first call always builds it); between refreshes the proposal
    is a little stale, which keeps the estimate consistent because ``log_q``
    is the stale proposal's own, exact probability.

    ``log_q`` is the log expected count ``log(m p(i | q))`` (``samplers.base``);
    each row's positive is a column of its own with ``positive_log_q = log(m p(pos | q))``
    (``includes_batch_positives = False``, as ``tf.nn.sampled_softmax_loss``).

    Only full rebuilds: with Adam or a normalising tower every item embedding moves
    every step, so ``QuadraticKernelTree.update`` (O(rows D^2 log n)) would not be
    cheaper than a rebuild on this schedule.

    Args:
      num_items: vocabulary size V (tower indices 1..V).
      num_samples: draws per query, ``m``.
      alpha: kernel scale on the raw tower dot product.
      leaf_size: items per leaf bucket of the tree.
      refresh_steps: rebuild the tree every this many calls (and whenever there is none,
        e.g. after restoring ``step`` from a checkpoint; the numpy tree and generator are not
        checkpointed, so a resumed run draws differently from an uninterrupted one).
      seed: seed of the numpy generator (draws are deterministic given it).
    """

    includes_batch_positives = False

    def __init__(
        self,
        num_items: int,
        num_samples: int,
        *,
        alpha: float = 100.0,
        leaf_size: int = 32,
        refresh_steps: int = 100,
        seed: int = 0,
        name: str = "kernel",
    ):
        super().__init__(name=name)
        sizes = (("num_items", num_items), ("num_samples", num_samples), ("refresh_steps", refresh_steps))
        for key, value in sizes:
            if value <= 0:
                raise ValueError(f"{key} must be positive, got {value}")
        if alpha <= 0:
            raise ValueError(f"alpha must be positive, got {alpha}")
        if leaf_size <= 0:
            raise ValueError(f"leaf_size must be positive, got {leaf_size}")
        self.num_items = int(num_items)
        self.num_samples = int(num_samples)
        self.alpha = float(alpha)
        self.leaf_size = int(leaf_size)
        self.refresh_steps = int(refresh_steps)
        self.tree: QuadraticKernelTree | None = None
        self.refreshes = 0
        self._oov = None  # the OOV row's embedding at the last refresh (a positive may be OOV)
        self._rng = np.random.default_rng(seed)
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")

    # -- numpy side (runs inside tf.numpy_function) --------------------------------

    def refresh(self, item_embeddings: np.ndarray) -> None:
        """Rebuild the tree from ``item_embeddings`` ``[num_items + 1, dim]`` (row 0, OOV, left out)."""
        item_embeddings = np.asarray(item_embeddings, dtype=np.float64)
        if item_embeddings.ndim != 2 or len(item_embeddings) != self.num_items + 1:
            raise ValueError(
                f"item_embeddings must be [num_items + 1 = {self.num_items + 1}, dim], "
                f"got {item_embeddings.shape}"
            )
        if self.tree is None or self.tree.dim != item_embeddings.shape[1]:
            self.tree = QuadraticKernelTree(item_embeddings[1:], alpha=self.alpha, leaf_size=self.leaf_size)
        else:
            self.tree.refresh(item_embeddings[1:])
        self._oov = item_embeddings[0]
        self.refreshes += 1

    def draw(
        self, queries: np.ndarray, positive_ids: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Draws for a batch from the current tree.

        Args:
          queries: ``[batch_size, dim]`` query embeddings.
          positive_ids: ``[batch_size]`` tower indices of the rows' positives.

        Returns:
          ``(ids, log_q, positive_log_q)``: int64 ``[batch_size, num_samples]`` tower
          indices (never 0), float32 ``log(m p(ids | q))`` of the same shape, and
          float32 ``[batch_size]`` ``log(m p(positive | q))``.
        """
        if self.tree is None:
            raise RuntimeError("the kernel tree has not been built; call refresh() first")
        queries = np.asarray(queries, dtype=np.float64)
        positive_ids = np.asarray(positive_ids, dtype=np.int64)
        log_m = np.log(self.num_samples)
        draws = self.tree.sample(queries, self.num_samples, self._rng)
        # The positive's probability under the same (stale) proposal; an OOV positive (id 0)
        # has the OOV row's kernel value, which the tree does not hold.
        in_tree = np.maximum(positive_ids - 1, 0)[:, None]
        kernel = self.tree.kernel(queries, in_tree)[:, 0]
        oov = self.alpha * (queries @ self._oov) ** 2 + 1.0
        kernel = np.where(positive_ids > 0, kernel, oov)
        positive_log_q = log_m + np.log(kernel) - np.log(self.tree.partition(queries))
        return (
            draws.ids + 1,
            (log_m + draws.log_prob).astype(np.float32),
            positive_log_q.astype(np.float32),
        )

    # -- TensorFlow side -------------------------------------------------------------

    def sample(
        self,
        positive_ids: tf.Tensor,
        queries: tf.Tensor | None = None,
        embed_catalogue: Callable[[], tf.Tensor] | None = None,
    ) -> Negatives:
        """Per-query kernel draws; rebuilds the tree every ``refresh_steps`` calls.

        Args:
          positive_ids: int64 ``[batch_size]``.
          queries: ``[batch_size, dim]`` query embeddings (required; no gradient flows here).
          embed_catalogue: zero-argument callable returning ``[num_items + 1, dim]``
            doc embeddings of every tower index (required); called only on refresh steps.

        Returns:
          ``Negatives`` with ids ``[batch_size, num_samples]``, their ``log_q`` and ``positive_log_q``.
        """
        if queries is None or embed_catalogue is None:
            raise ValueError("KernelSampler.sample needs the batch's queries and embed_catalogue")
        if replicas_in_step() > 1:
            raise ValueError(
                "model.loss.negatives='kernel' is not yet supported with several tf.distribute replicas"
            )
        positive_ids = tf.cast(positive_ids, tf.int64)

        def refresh():
            embeddings = tf.stop_gradient(embed_catalogue())
            return tf.numpy_function(lambda e: np.int64(self.refresh(e) or 0), [embeddings], tf.int64)

        # Also build when there is no tree off the schedule: a step variable restored from a
        # checkpoint does not bring the (numpy) tree with it.
        missing = tf.numpy_function(lambda: np.bool_(self.tree is None), [], tf.bool)
        token = tf.cond(
            tf.logical_or(tf.equal(tf.math.floormod(self.step, self.refresh_steps), 0), missing),
            refresh,
            lambda: tf.constant(0, tf.int64),
        )
        with tf.control_dependencies([token]):
            ids, log_q, positive_log_q = tf.numpy_function(
                self.draw, [tf.stop_gradient(queries), positive_ids], [tf.int64, tf.float32, tf.float32]
            )
        with tf.control_dependencies([ids]):
            self.step.assign_add(1)
        ids = tf.ensure_shape(ids, [None, self.num_samples])
        log_q = tf.ensure_shape(log_q, [None, self.num_samples])
        positive_log_q = tf.ensure_shape(positive_log_q, [None])
        return Negatives(ids=ids, log_q=log_q, positive_log_q=positive_log_q)
