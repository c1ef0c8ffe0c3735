"""What the model hands a loss for one batch, and the cross-replica gathering of in-batch candidates.

``LossInputs`` (queries, positives, negatives blocks, weights),
``BatchCandidates`` (the in-batch candidate columns when they span several
``tf.distribute`` replicas) and ``gather_across_replicas``, which builds them.
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from retrieval.common.replicas import across_replicas, replica_row_offset, replicas_in_step
from retrieval.samplers import Negatives


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


class OwnItems(NamedTuple):
    """Items that are never a row's negatives: its group's items (a sequence's window of a user's items).

    Attributes:
      ids: int64 ``[groups, width]`` tower indices of each group's items, ``-1`` padded.
      group: int ``[batch_size]`` the group of each row.
    """

    ids: tf.Tensor
    group: tf.Tensor


def own_item_hits(own: OwnItems, candidate_ids: tf.Tensor) -> tf.Tensor:
    """Bool ``[batch_size, num_candidates]``: the candidates among each row's group's items.

    A binary search of each group's sorted items: ``[groups, num_candidates]`` work and memory for
    candidates the batch shares (the whole catalogue of a full softmax included), not
    ``[batch_size, width, num_candidates]``.

    Args:
      own: the rows' groups and their items.
      candidate_ids: ``[num_candidates]`` shared or ``[batch_size, num_candidates]`` per row.
    """
    ids = tf.cast(candidate_ids, tf.int64)
    owned = tf.sort(tf.cast(own.ids, tf.int64), axis=1)
    if ids.shape.rank == 1:
        shared = tf.broadcast_to(ids[tf.newaxis, :], [tf.shape(owned)[0], tf.shape(ids)[0]])
        return tf.gather(_sorted_rows_contain(owned, shared), own.group)
    return _sorted_rows_contain(tf.gather(owned, own.group), ids)


def _sorted_rows_contain(rows: tf.Tensor, values: tf.Tensor) -> tf.Tensor:
    """``values[r, c]`` in ``rows[r]`` (sorted ascending), bool ``[R, C]``."""
    at = tf.minimum(tf.searchsorted(rows, values, side="left"), tf.shape(rows)[1] - 1)
    return tf.equal(tf.gather(rows, at, batch_dims=1), values)


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
      own_items: items that are no row's negatives beyond its own positive (a
        sequence's other items); with ``remove_accidental_hits`` they are masked
        like accidental hits. None = only the positive.
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
    own_items: OwnItems | None = None


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
