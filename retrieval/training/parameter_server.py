"""ParameterServerStrategy, first slice: the two ID towers' tables sharded over the ``ps`` tasks.

What runs: the strategy from a cluster resolver (TF_CONFIG by default) with a
partitioner that shards only the ID tables (``table_partitioner``), and the
model built under its scope so each table is a ``ShardedVariable`` of disjoint
row ranges on the ps tasks. What does not yet: scheduling the training step
through ``ClusterCoordinator`` (``train_parameter_server`` raises "not yet").
"""

from __future__ import annotations

from collections.abc import Iterable

import tensorflow as tf

from retrieval.config import ParameterServerConfig


def table_partitioner(table_shapes: Iterable[tuple[int, int]], config: ParameterServerConfig):
    """A ``variable_partitioner`` that shards variables of the ID tables' shapes along rows.

    A partitioner sees only a shape, not a name; other variables (the streaming
    log-Q estimator's hash arrays, which are scatter-updated and cannot be
    ShardedVariables) must stay whole, so only the tables' ``(rows, dim)`` shapes
    are split, by ``MinSizePartitioner(min_shard_bytes, max_shards)``.
    """
    shapes = {tuple(int(n) for n in shape) for shape in table_shapes}
    base = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=config.min_shard_bytes, max_shards=config.max_shards
    )

    def partition(shape, dtype, axis=0):
        if tuple(shape.as_list()) not in shapes:
            return [1] * shape.rank
        return base(shape, dtype, axis)

    return partition


def parameter_server_strategy(
    table_shapes: Iterable[tuple[int, int]],
    config: ParameterServerConfig,
    resolver: tf.distribute.cluster_resolver.ClusterResolver | None = None,
) -> tf.distribute.ParameterServerStrategy:
    """The strategy over ``resolver``'s cluster (None: ``TFConfigClusterResolver``, i.e. TF_CONFIG),
    sharding the tables of ``table_shapes`` (``[(rows, dim)]``) with ``table_partitioner``."""
    resolver = resolver or tf.distribute.cluster_resolver.TFConfigClusterResolver()
    return tf.distribute.ParameterServerStrategy(
        resolver, variable_partitioner=table_partitioner(table_shapes, config)
    )


def table_bytes(rows: int, dim: int, optimizer_slots: int) -> int:
    """Bytes of one float32 table and its optimizer slots: ``rows x dim x 4 x (1 + slots)``."""
    return rows * dim * 4 * (1 + optimizer_slots)


def train_parameter_server(*args, **kwargs):
    """Not yet: scheduling the training step through ``ClusterCoordinator`` stalled in-process."""
    raise NotImplementedError(
        "train.distribute: parameter_server is not yet trainable: the tables shard over the ps tasks "
        "(parameter_server_strategy), but scheduling the step through ClusterCoordinator is not yet wired"
    )
