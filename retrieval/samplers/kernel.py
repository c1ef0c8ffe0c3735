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
O(D^2); a draw costs O(D^2 log n), against O(n D) for the softmax itself.
Leaves hold small buckets of items; the last step samples directly among the
items of the last internal node (O(bucket D)).

Everything is vectorised numpy with no per-node Python loop: the statistics are
flat arrays in heap order; all draws of a batch descend one level at a time,
each level costing one matrix product (near the root) or one gathered dot
product per distinct (query, node) pair (deeper); an update of r changed rows
touches only their ancestors, level by level (O(r D^2 log n)), so a model
trained with sparse updates keeps its tree current for a fraction of a rebuild.

The node statistics (building, updates, exact probabilities) live in
``kernel_tree`` (``KernelTreeStatistics``); this module holds the walk that
samples from them (``QuadraticKernelTree``) and the TensorFlow ``KernelSampler``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from retrieval.common.replicas import replicas_in_step
from retrieval.samplers.base import Negatives, Sampler
from retrieval.samplers.kernel_tree import KernelTreeStatistics

# A level's left-child masses come from one matrix product over every (query, node) of the level
# while that grid has at most this many entries per distinct pair the draws need (measured:
# benchmarks/bench_kernel.py --part curve; a per-pair gather is memory-bound, BLAS is not).
_GRID_FACTOR = 16
# In the leaf buckets, multiply whole buckets with the queries that reached them when the draws reach
# each bucket from at least this many distinct queries on average; else gather one bucket per pair.
_BUCKET_GRID_PAIRS = 16


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


class QuadraticKernelTree(KernelTreeStatistics):
    """Divide-and-conquer tree of ``sum d d^T`` with exact sampling from the kernel.

    ``sample`` walks the node statistics of ``KernelTreeStatistics`` (storage,
    building, updates and exact probabilities; the arguments are its) from the
    root, all draws of a batch one level at a time.
    """

    # -- sampling ---------------------------------------------------------------

    def sample(self, queries: np.ndarray, num_draws: int, rng: np.random.Generator) -> KernelDraws:
        """Draw ``num_draws`` items per query, with replacement, from K(q, .)/Z(q).

        Exact up to float32 rounding of the tree's node masses (~1e-7 relative,
        far below sampling noise); the returned ``log_prob`` is exact (float64).

        Every draw of every query descends one level at a time, all together:
        at each level the left child's kernel mass is computed once per
        distinct (query, node) pair (one matrix product over the whole level
        near the root, where the pairs cover most of the grid; deeper, one
        packed dot product per pair), and each draw goes left with probability
        K(left) / K(node). At the last internal level the draws pick an item
        of the node's two leaves directly, from the items' kernel values.

        Args:
          queries: [num_queries, dim].
          num_draws: draws per query, ``m``.
          rng: the random generator (the only source of randomness).

        Returns:
          ``KernelDraws`` ``[num_queries, num_draws]``; the draws of a row are independent.
        """
        queries = self._check_queries(queries)
        if num_draws <= 0:
            raise ValueError(f"num_draws must be positive, got {num_draws}")
        num_queries = len(queries)
        outer = self._outer(queries)
        owner = np.repeat(np.arange(num_queries), num_draws)  # the query of each draw
        node = np.zeros(len(owner), dtype=np.int64)  # its current node, in heap order
        final = max(self.depth - 1, 0)  # the level whose nodes' items are drawn from directly
        mass = np.zeros(len(owner))
        if final > 0:
            mass = (self.alpha * (outer @ self._stats32[0]).astype(np.float64) + self.counts[0])[owner]
        for level in range(final):
            left = 2 * node + 1
            left_mass = self.alpha * self._left_quadratic(outer, owner, node - (2**level - 1), level)
            left_mass += self.counts[left]
            # A subtree of padding only (count 0) has mass exactly 0: never let rounding of
            # mass - left_mass send draws there. Elsewhere mass >= count >= 1, rounding is negligible.
            right_mass = np.where(self.counts[left + 1] > 0, np.maximum(mass - left_mass, 0.0), 0.0)
            go_left = rng.random(len(owner)) * (left_mass + right_mass) < left_mass
            node = np.where(go_left, left, left + 1)
            mass = np.where(go_left, left_mass, right_mass)
        ids = self._draw_in_buckets(queries, owner, node - (2**final - 1), final, rng)
        ids = ids.reshape(num_queries, num_draws)
        return KernelDraws(ids, self.log_prob(queries, ids))

    def _left_quadratic(self, outer: np.ndarray, owner: np.ndarray, index: np.ndarray, level: int) -> np.ndarray:
        """``q^T S q`` of the left child of each draw's node (``index`` within ``level``), float64."""
        width = 2**level
        first_left = 2 * width - 1  # heap index of the first node of level + 1
        if width <= _GRID_FACTOR:  # every query has a pair: the grid below wins whatever the pairs
            grid = outer @ self._stats32[first_left : first_left + 2 * width : 2].T
            return grid[owner, index].astype(np.float64)
        pairs, inverse = np.unique(owner * width + index, return_inverse=True)
        pair_owner, pair_index = np.divmod(pairs, width)
        if len(outer) * width <= _GRID_FACTOR * len(pairs):
            # The distinct pairs cover much of the (query, node) grid: one matrix product over the
            # level's left children is faster than gathering per pair (BLAS vs memory-bound gathers).
            grid = outer @ self._stats32[first_left : first_left + 2 * width : 2].T
            values = grid[pair_owner, pair_index]
        else:
            values = np.empty(len(pairs), dtype=np.float32)
            lefts = first_left + 2 * pair_index
            for start in range(0, len(pairs), self.max_chunk):
                part = slice(start, start + self.max_chunk)
                values[part] = np.einsum("pk,pk->p", self._stats32[lefts[part]], outer[pair_owner[part]])
        return values.astype(np.float64)[inverse.reshape(-1)]

    def _draw_in_buckets(
        self, queries: np.ndarray, owner: np.ndarray, index: np.ndarray, level: int, rng: np.random.Generator
    ) -> np.ndarray:
        """One item row per draw, from the items under node ``index`` of ``level``, by kernel value."""
        width = 2**level
        bucket = self.leaf_size * 2 ** (self.depth - level)  # items under one node of the level
        pairs, inverse = np.unique(owner * width + index, return_inverse=True)
        inverse = inverse.reshape(-1)
        pair_owner, pair_index = np.divmod(pairs, width)
        buckets = self._items32.reshape(width, bucket, self.dim)
        queries32 = queries.astype(np.float32)
        cumulative = np.empty((len(pairs), bucket))
        if len(pairs) >= _BUCKET_GRID_PAIRS * width:
            # Many queries per bucket: take the pairs bucket by bucket, and multiply the few buckets
            # of a chunk with the chunk's queries in one product (a little extra arithmetic, but
            # each bucket's items are read once per chunk instead of once per pair).
            order = np.argsort(pair_index, kind="stable")
            chunk = max(1, 4 * _BUCKET_GRID_PAIRS)
            for start in range(0, len(pairs), chunk):
                part = order[start : start + chunk]
                bucket_ids, bucket_slot = np.unique(pair_index[part], return_inverse=True)
                query_ids, query_slot = np.unique(pair_owner[part], return_inverse=True)
                grid = buckets[bucket_ids].reshape(-1, self.dim) @ queries32[query_ids].T
                dots = grid.reshape(len(bucket_ids), bucket, len(query_ids))[bucket_slot, :, query_slot]
                cumulative[part] = self.alpha * dots.astype(np.float64) ** 2 + 1.0
        else:
            for start in range(0, len(pairs), self.max_chunk):
                part_ = slice(start, start + self.max_chunk)
                dots = np.matmul(buckets[pair_index[part_]], queries32[pair_owner[part_], :, None])[:, :, 0]
                cumulative[part_] = self.alpha * dots.astype(np.float64) ** 2 + 1.0
        valid = np.minimum(self.num_items - pair_index * bucket, bucket)  # padding rows weigh nothing
        cumulative[np.arange(bucket) >= valid[:, None]] = 0.0
        np.cumsum(cumulative, axis=1, out=cumulative)
        per_draw = cumulative[inverse]
        target = rng.random(len(owner)) * per_draw[:, -1]
        slot = np.minimum((per_draw <= target[:, None]).sum(axis=1), valid[inverse] - 1)
        ids: np.ndarray = index * bucket + slot
        return ids

    def _outer(self, queries: np.ndarray) -> np.ndarray:
        # q^T S q == <vec(q q^T), vec(S)>, and S is symmetric: the upper triangle with the
        # off-diagonal weighted 2 holds the same inner product in D(D+1)/2 entries instead of D^2.
        # float32, C-contiguous [num_queries, D(D+1)/2]: what the walk multiplies with the float32 sums.
        upper_i, upper_j = self._upper
        weight = np.where(upper_i == upper_j, 1.0, 2.0).astype(np.float32)
        squares = queries.astype(np.float32)[:, :, None] * queries.astype(np.float32)[:, None, :]
        outer = np.take(squares.reshape(len(queries), -1), upper_i * self.dim + upper_j, axis=1)
        outer *= weight
        return np.ascontiguousarray(outer)


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

    A refresh is incremental: it compares the catalogue with the embeddings the tree
    holds and updates only the changed rows' ancestors (``QuadraticKernelTree.update``),
    which is what sparse or lazy optimiser updates leave (the batch's rows); when every
    row moved (dense Adam, a normalising tower) that costs what a rebuild costs.
    ``update_rows`` is the same update for a caller that knows which rows it changed.

    Args:
      num_items: vocabulary size V (tower indices 1..V).
      num_samples: draws per query, ``m``.
      alpha: kernel scale on the raw tower dot product.
      leaf_size: items per leaf bucket of the tree.
      refresh_steps: refresh the tree every this many calls (and build it whenever there is none,
        e.g. after restoring ``step`` from a checkpoint; the numpy tree and generator are not
        checkpointed, so a resumed run draws differently from an uninterrupted one).
      seed: seed of the numpy generator (draws are deterministic given it).
    """

    includes_batch_positives = False
    supports_replicas = False  # the numpy tree and generator live on the host

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
        self.refreshes = 0  # refresh() calls
        self.rebuilds = 0  # ... that built a new tree
        self.rows_updated = 0  # rows updated incrementally, by refresh() or update_rows()
        self._built_from: np.ndarray | None = None  # the item rows the tree holds, as refresh() got them
        self._oov: np.ndarray | None = None  # the OOV row's embedding at the last refresh (a positive may be OOV)
        self._rng = np.random.default_rng(seed)
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")

    # -- numpy side (runs inside tf.numpy_function) --------------------------------

    def refresh(self, item_embeddings: np.ndarray) -> None:
        """Bring the tree up to ``item_embeddings`` ``[num_items + 1, dim]`` (row 0, OOV, left out).

        Builds it on the first call; afterwards updates the rows that changed since the
        last refresh (``QuadraticKernelTree.update``).
        """
        item_embeddings = np.asarray(item_embeddings)  # no float64 copy of the whole catalogue
        if item_embeddings.ndim != 2 or len(item_embeddings) != self.num_items + 1:
            raise ValueError(
                f"item_embeddings must be [num_items + 1 = {self.num_items + 1}, dim], "
                f"got {item_embeddings.shape}"
            )
        items = item_embeddings[1:]
        built_from = self._built_from
        same_rows = built_from is not None and (built_from.shape, built_from.dtype) == (items.shape, items.dtype)
        if self.tree is None or built_from is None or not same_rows:
            self.tree = QuadraticKernelTree(items, alpha=self.alpha, leaf_size=self.leaf_size)
            self._built_from = np.array(items)
            self.rebuilds += 1
        else:
            # Rows that differ from what the tree holds (exact comparison: a row any update
            # touched differs, one no update touched is bit-identical). When every row moved
            # (dense Adam, a normalising tower) this is a rebuild at the same cost.
            changed = np.flatnonzero(np.any(items != built_from, axis=1))
            self.tree.update(changed, items[changed])
            built_from[changed] = items[changed]
            self.rows_updated += len(changed)
        self._oov = np.asarray(item_embeddings[0], dtype=np.float64)
        self.refreshes += 1

    def update_rows(self, ids: np.ndarray, embeddings: np.ndarray) -> None:
        """Update the tree for tower indices ``ids`` [r] whose embeddings are now ``embeddings`` [r, dim].

        For a caller that knows which rows its (sparse) update touched: no scan of the
        catalogue. Index 0 (OOV) updates the OOV row only; repeated ids must carry equal rows.
        """
        if self.tree is None or self._built_from is None:
            raise RuntimeError("the kernel tree has not been built; call refresh() first")
        ids = np.asarray(ids, dtype=np.int64)
        embeddings = np.asarray(embeddings, dtype=np.float64)
        if ids.ndim != 1 or embeddings.shape != (len(ids), self.tree.dim):
            raise ValueError(
                f"ids must be [r] and embeddings [r, {self.tree.dim}], got {ids.shape} and {embeddings.shape}"
            )
        if ids.min(initial=0) < 0 or ids.max(initial=0) > self.num_items:
            raise ValueError(f"ids must be tower indices in [0, {self.num_items}]")
        ids, first = np.unique(ids, return_index=True)
        embeddings = embeddings[first]
        if ids.size and ids[0] == 0:
            self._oov = embeddings[0]
            ids, embeddings = ids[1:], embeddings[1:]
        self.tree.update(ids - 1, embeddings)
        self._built_from[ids - 1] = embeddings
        self.rows_updated += len(ids)

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
        """Per-query kernel draws; refreshes the tree every ``refresh_steps`` calls.

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
