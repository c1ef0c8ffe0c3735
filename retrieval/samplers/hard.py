"""Hard negatives mined from a FAISS index over the current doc embeddings.

Every ``refresh_every`` training steps the whole vocabulary is re-embedded by
the doc tower and put in an exact inner-product FAISS index; each step, every
query takes the ``num_negatives`` highest-scoring items of that (slightly
stale) index that are neither its positive nor an item the user clicked in
training (those are not negatives, they are unlabelled positives).

How this interacts with the log-Q correction: a mined item is not a random
draw; given the query and the index it is in the candidate set with
certainty, so its inclusion probability is 1 and ``log_q = 0``. The other
candidates (in-batch or corpus-sampled) keep their own log Q. The softmax over
the union is then no longer an unbiased estimate of the full softmax: the
hard negatives are deliberately over-represented to sharpen the boundary near
the positive, and the correction of the sampled part still removes its
popularity bias. Mined items are not popularity-corrected (they were chosen
by score, not by popularity), which is why the index is over the model's own
scores and not a popularity prior.
"""

from __future__ import annotations

import faiss
import numpy as np
import tensorflow as tf

from retrieval.samplers.base import MASKED_LOG_Q, Negatives


class UserHistory:
    """Each user's training items as a CSR structure.

    Args:
      user_rows: int ``[num_clicks]`` user row of each click, 0..num_users-1
        (-1 = unknown user, skipped).
      item_ids: int ``[num_clicks]`` tower index of each click's item.
      num_users: number of user rows.
    """

    def __init__(self, user_rows, item_ids, num_users: int):
        user_rows = np.asarray(user_rows, dtype=np.int64)
        item_ids = np.asarray(item_ids, dtype=np.int64)
        if user_rows.shape != item_ids.shape or user_rows.ndim != 1:
            raise ValueError(
                f"user_rows {user_rows.shape} and item_ids {item_ids.shape} must be equal 1-D shapes"
            )
        keep = user_rows >= 0
        pairs = np.unique(np.stack([user_rows[keep], item_ids[keep]], axis=1), axis=0)
        self.offsets = np.concatenate([[0], np.cumsum(np.bincount(pairs[:, 0], minlength=num_users))])
        self.items = pairs[:, 1]
        self.num_users = int(num_users)

    def of(self, user_row: int) -> np.ndarray:
        """Tower indices the user clicked (empty for an unknown user, row -1)."""
        if user_row < 0 or user_row >= self.num_users:
            return self.items[:0]
        return self.items[self.offsets[user_row] : self.offsets[user_row + 1]]


class FaissHardNegativeMiner(tf.Module):
    """Per-query hard negatives from a periodically rebuilt FAISS index.

    Args:
      num_negatives: hard negatives per query, ``k``.
      refresh_every: rebuild the index every this many training steps (the first
        call always builds it).
      history: the users' training items, excluded from their negatives; None
        excludes only the positive.
      factory: FAISS index factory string (``"Flat"`` = exact).
    """

    def __init__(
        self,
        num_negatives: int,
        refresh_every: int,
        history: UserHistory | None = None,
        factory: str = "Flat",
        name: str = "hard_negative_miner",
    ):
        super().__init__(name=name)
        if num_negatives <= 0:
            raise ValueError(f"num_negatives must be positive, got {num_negatives}")
        if refresh_every <= 0:
            raise ValueError(f"refresh_every must be positive, got {refresh_every}")
        self.num_negatives = int(num_negatives)
        self.refresh_every = int(refresh_every)
        self.history = history
        self.factory = factory
        self.index: faiss.Index | None = None
        self.rebuilds = 0
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")

    # -- numpy side (runs inside tf.py_function) ---------------------------------

    def rebuild(self, item_embeddings: np.ndarray) -> None:
        """Index ``item_embeddings`` ``[num_items + 1, dim]`` (row 0, OOV, is left out)."""
        item_embeddings = np.ascontiguousarray(np.asarray(item_embeddings, np.float32)[1:])
        index = faiss.index_factory(item_embeddings.shape[1], self.factory, faiss.METRIC_INNER_PRODUCT)
        if not index.is_trained:
            index.train(item_embeddings)
        index.add(item_embeddings)
        self.index = index
        self.rebuilds += 1

    def mine(self, queries: np.ndarray, positive_ids: np.ndarray, user_rows: np.ndarray) -> np.ndarray:
        """Top-k items per query, minus the positive and the user's clicks.

        Args:
          queries: ``[batch_size, dim]`` float32.
          positive_ids: ``[batch_size]`` tower indices.
          user_rows: ``[batch_size]`` rows of ``history`` (-1 = unknown).

        Returns:
          int64 ``[batch_size, num_negatives]`` tower indices; 0 where fewer than
          k items were left (the loss masks those columns).
        """
        if self.index is None:
            raise RuntimeError("the hard-negative index has not been built; call rebuild() first")
        k = self.num_negatives
        positive_ids = np.asarray(positive_ids, np.int64)
        user_rows = np.asarray(user_rows, np.int64)
        clicks = 0
        if self.history is not None:
            known = (user_rows >= 0) & (user_rows < self.history.num_users)
            sizes = np.zeros(len(user_rows), np.int64)
            rows_known = user_rows[known]
            sizes[known] = self.history.offsets[rows_known + 1] - self.history.offsets[rows_known]
            clicks = int(sizes.max(initial=0))
        depth = min(self.index.ntotal, k + 1 + clicks)
        _, rows = self.index.search(np.ascontiguousarray(queries, np.float32), depth)
        found = np.where(rows >= 0, rows + 1, 0)  # FAISS row r holds tower index r + 1
        drop = (found == 0) | (found == positive_ids[:, None])
        if self.history is not None and clicks:
            # (query, item) pairs of the search results that are the user's clicks.
            query_of = np.repeat(np.arange(len(found)), sizes)
            click_items = np.concatenate(
                [self.history.of(int(u)) for u in rows_known] or [np.zeros(0, np.int64)]
            )
            width = self.index.ntotal + 2  # (query, item) -> one integer key
            drop |= np.isin(np.arange(len(found))[:, None] * width + found, query_of * width + click_items)
        # Stable partition: kept columns first, in score order.
        order = np.argsort(drop, axis=1, kind="stable")[:, :k]
        result = np.take_along_axis(np.where(drop, 0, found), order, axis=1)
        if result.shape[1] < k:
            result = np.pad(result, ((0, 0), (0, k - result.shape[1])))
        return result.astype(np.int64)

    # -- TensorFlow side ----------------------------------------------------------

    def sample(
        self, positive_ids: tf.Tensor, queries: tf.Tensor, user_rows: tf.Tensor, embed_catalogue
    ) -> Negatives:
        """Mined negatives for a batch; refreshes the index every ``refresh_every`` calls.

        Args:
          positive_ids: int64 ``[batch_size]``.
          queries: ``[batch_size, dim]`` query embeddings (no gradient flows here).
          user_rows: int64 ``[batch_size]`` rows of ``history``.
          embed_catalogue: zero-argument callable returning ``[num_items + 1, dim]``
            doc embeddings of every tower index; called only on refresh steps.

        Returns:
          ``Negatives`` with per-query ids ``[batch_size, num_negatives]`` and
          ``log_q = 0`` (inclusion probability 1); padded columns get a huge log Q.
        """

        def refresh():
            embeddings = tf.stop_gradient(embed_catalogue())
            return tf.py_function(lambda e: (self.rebuild(e.numpy()), 0)[1], [embeddings], Tout=tf.int64)

        token = tf.cond(
            tf.equal(tf.math.floormod(self.step, self.refresh_every), 0),
            refresh,
            lambda: tf.constant(0, tf.int64),
        )
        with tf.control_dependencies([token]):
            ids = tf.py_function(
                lambda q, p, u: self.mine(q.numpy(), p.numpy(), u.numpy()),
                [tf.stop_gradient(queries), positive_ids, user_rows],
                Tout=tf.int64,
            )
        with tf.control_dependencies([ids]):
            self.step.assign_add(1)
        ids = tf.ensure_shape(ids, [None, self.num_negatives])
        log_q = tf.where(ids > 0, 0.0, MASKED_LOG_Q)
        return Negatives(ids=ids, log_q=log_q, positive_log_q=tf.zeros(tf.shape(positive_ids), tf.float32))
