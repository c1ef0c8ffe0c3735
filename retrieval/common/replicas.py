"""tf.distribute helpers: one global batch over several replicas.

A step under a ``tf.distribute`` strategy runs once per replica, each on its
share of the global batch. Losses and samplers that must see the whole global
batch (in-batch negatives, the row offset of a replica's positives, the batch
size in an expected count) ask these functions; on one device, or in the
cross-replica context, each is the identity.
"""

from __future__ import annotations

import tensorflow as tf


def _replica_context():
    """The replica context when a ``tf.distribute`` strategy runs several replicas, else None."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    return context


def replicas_in_step() -> int:
    """Replicas of the ``tf.distribute`` step running now: inside ``strategy.run`` its
    ``num_replicas_in_sync``, else (one device, cross-replica context) 1."""
    context = _replica_context()
    return 1 if context is None else context.num_replicas_in_sync


def across_replicas(values: tf.Tensor) -> tf.Tensor:
    """Every replica's ``values`` concatenated along axis 0, in replica order.

    Inside ``strategy.run`` with several replicas this is
    ``ReplicaContext.all_gather(values, axis=0)`` (replicas may hold different
    numbers of rows; gradients flow back to each replica's own rows); anywhere
    else (one device, cross-replica context) it is ``values``.

    Args:
      values: ``[rows, ...]`` this replica's part.

    Returns:
      ``[sum of rows over replicas, ...]``.
    """
    context = _replica_context()
    return values if context is None else context.all_gather(values, axis=0)


def replica_row_offset(batch_size) -> tuple[tf.Tensor, tf.Tensor]:
    """``(offset, global_batch_size)``: where this replica's rows start in the global batch, and its size.

    The global batch is every replica's rows in replica order (``across_replicas``);
    on one device ``(0, batch_size)``.

    Args:
      batch_size: int32 scalar, this replica's rows.
    """
    batch_size = tf.cast(batch_size, tf.int32)
    context = _replica_context()
    if context is None:
        return tf.constant(0, tf.int32), batch_size
    sizes = context.all_gather(tf.reshape(batch_size, [1]), axis=0)
    return tf.reduce_sum(sizes[: context.replica_id_in_sync_group]), tf.reduce_sum(sizes)


def global_batch_size(batch_size) -> tf.Tensor:
    """The batch size summed over replicas (``batch_size`` itself on one device), int32 scalar.

    In-batch candidates are the positives of the whole global batch (the model
    gathers them across replicas), so their expected count is ``B_global * p``.
    """
    return replica_row_offset(batch_size)[1]
