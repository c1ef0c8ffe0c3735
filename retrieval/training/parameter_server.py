"""``train.distribute: parameter_server``: the ID tables sharded over the ``ps`` tasks, the step
scheduled on the ``worker`` tasks by the chief.

The cluster (TF_CONFIG): one ``chief`` (the process running the job), ``worker`` tasks that run
the training step, ``ps`` tasks that hold the variables; each worker and ps task runs a
``tf.distribute.Server`` and waits (``retrieval.training.cluster``). The chief builds the
strategy once the data is read (``cluster_strategy``: the tables' shapes come from the
vocabularies), the model under its scope, and the loop (``retrieval.training.loop``) schedules
each batch through the strategy's ``ClusterCoordinator`` (``chief_coordinator``). The batches
come from the chief (the click sources are Python generators, which a remote worker cannot
run), or with ``train.parameter_server.input: workers`` from files the chief stages once and the
workers read themselves (``retrieval.training.worker_input``). Validation, indexing and export
read the trained weights on the chief, from a copy in towers built without the strategy
(``copy_towers``), so a bundle does not depend on how it was trained.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable

import tensorflow as tf

from retrieval.common.errors import UserError
from retrieval.config import Config, ParameterServerConfig
from retrieval.training.interfaces import check_listening
from retrieval.training.runtime import tf_config


class ClusterError(UserError, RuntimeError):
    """The TF_CONFIG cluster is missing, malformed for a parameter-server run, or lost a task."""


def table_partitioner(table_shapes: Iterable[tuple[int, int]], config: ParameterServerConfig):
    """A ``variable_partitioner`` that shards variables of the ID tables' shapes along rows.

    A partitioner sees only a shape, not a name; other variables (the streaming
    log-Q estimator's hash arrays, which are scatter-updated and cannot be
    ShardedVariables) must stay whole, so only the tables' ``(rows, dim)`` shapes
    are split, by ``MinSizePartitioner(min_shard_bytes, max_shards)``. The
    optimizer's slots of a table have its shape and are sharded alike.
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


def id_table_shapes(users: int, items: int, dim: int) -> list[tuple[int, int]]:
    """The ID towers' tables: ``(users + 1, dim)`` and ``(items + 1, dim)`` (row 0 is the OOV row).

    Tables of another width (a feature tower's categorical features with their own
    ``embedding_dim``) are not in the list and stay whole.
    """
    return [(int(users) + 1, int(dim)), (int(items) + 1, int(dim))]


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


def cluster_strategy(
    table_shapes: Iterable[tuple[int, int]], config: ParameterServerConfig
) -> tf.distribute.ParameterServerStrategy:
    """``parameter_server_strategy`` over the TF_CONFIG cluster, for the chief (``check_cluster`` first).

    The strategy starts the chief's own gRPC server, on every interface whatever TF_CONFIG's host
    (``retrieval.training.interfaces``): a warning names its port when it listens beyond that host.
    """
    check_cluster()
    strategy = parameter_server_strategy(table_shapes, config)
    cluster, task = read_tf_config()
    index = int(task.get("index", 0))
    check_listening(f"TF_CONFIG task chief {index}", cluster["chief"][index], allow_all_interfaces=True)
    return strategy


def check_cluster() -> None:
    """Check that TF_CONFIG names a parameter-server cluster and this process its chief (the job calls
    it before reading the data, so a wrong cluster fails at once).

    Raises:
      ClusterError: TF_CONFIG is unset, lacks a ``chief``, ``worker`` or ``ps`` task, or names this
        process as another task than the chief (workers and ps tasks run
        ``python -m retrieval.training.cluster`` instead).
    """
    cluster, task = read_tf_config()
    missing = [kind for kind in ("chief", "worker", "ps") if not cluster.get(kind)]
    if missing:
        raise ClusterError(
            f"train.distribute: parameter_server needs a TF_CONFIG cluster with chief, worker and ps tasks; "
            f"it has no {', '.join(missing)} task (python -m pipelines.local_cluster starts one on this machine)"
        )
    if task.get("type") != "chief":
        raise ClusterError(
            f"TF_CONFIG names this process task {task.get('type')!r}: under train.distribute: parameter_server "
            "the job runs on the chief; worker and ps tasks run python -m retrieval.training.cluster"
        )


def with_estimator_shards(config: Config) -> Config:
    """``config`` with ``model.loss.streaming.num_shards`` 0 (auto) set to ``train.parameter_server.max_shards``,
    so the streaming log-Q estimator is spread over the ps tasks as the tables are. From the config, not
    the cluster: a checkpoint restores onto another number of ps tasks only with the same variables."""
    streaming = config.model.loss.streaming
    if streaming.num_shards:
        return config
    shards = config.train.parameter_server.max_shards
    loss = config.model.loss.model_copy(update={"streaming": streaming.model_copy(update={"num_shards": shards})})
    return config.model_copy(update={"model": config.model.model_copy(update={"loss": loss})})


def read_tf_config() -> tuple[dict[str, list[str]], dict]:
    """``(cluster, task)`` of the TF_CONFIG environment variable (ClusterError if unset or not JSON)."""
    if not os.environ.get("TF_CONFIG"):
        raise ClusterError(
            "a parameter-server cluster (train.distribute: parameter_server) is read from the TF_CONFIG "
            "environment variable, which is not set (python -m pipelines.local_cluster sets it for a cluster "
            "on this machine)"
        )
    try:
        return tf_config()
    except ValueError as error:
        raise ClusterError(str(error)) from None


def chief_coordinator(
    strategy: tf.distribute.Strategy | None = None,
) -> tf.distribute.coordinator.ClusterCoordinator | None:
    """The ``ClusterCoordinator`` of the current (or given) strategy when it is a
    ``ParameterServerStrategy``, else None. One per strategy (TensorFlow keeps it on the strategy)."""
    if strategy is None:
        if not tf.distribute.has_strategy():
            return None
        strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, tf.distribute.ParameterServerStrategy):
        return None
    return tf.distribute.coordinator.ClusterCoordinator(strategy)


def copy_towers(trained, plain) -> None:
    """Copy ``trained``'s two towers (sharded variables on the ps tasks) into ``plain``'s (the same
    towers built without the strategy, on this process).

    Through a checkpoint of the towers, which holds each sharded table as one whole tensor, so
    the copy matches by object path, not by variable order (``get_weights`` lists the shards).
    """
    with tempfile.TemporaryDirectory(prefix="retrieval-towers-") as directory:
        prefix = os.path.join(directory, "towers")
        tf.train.Checkpoint(query=trained.query_tower, doc=trained.doc_tower).write(prefix)
        status = tf.train.Checkpoint(query=plain.query_tower, doc=plain.doc_tower).read(prefix)
        status.assert_existing_objects_matched()


def table_bytes(rows: int, dim: int, optimizer_slots: int) -> int:
    """Bytes of one float32 table and its optimizer slots: ``rows x dim x 4 x (1 + slots)``."""
    return rows * dim * 4 * (1 + optimizer_slots)
