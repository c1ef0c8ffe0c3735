"""Process-wide training setup: seeds, op determinism and the tf.distribute strategy."""

from __future__ import annotations

import functools
import json
import os

import tensorflow as tf

from retrieval.config import TrainConfig


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and TensorFlow and make TF ops deterministic."""
    tf.keras.utils.set_random_seed(seed)
    tf.config.experimental.enable_op_determinism()


def distribution_strategy(config: TrainConfig) -> tf.distribute.Strategy:
    """The ``tf.distribute`` strategy of ``config.distribute``.

    Build the model under its ``scope()`` (its variables, the optimizer's
    slots and the samplers' state are created there); the training loop
    (``retrieval.training.loop``) then splits each batch of
    ``config.batch_size`` rows (the *global* batch) over the replicas, and the
    model gathers in-batch negatives across them.

    - ``none``: the default strategy (one device; its scope does nothing);
    - ``mirrored``: ``MirroredStrategy`` over every local GPU, or else every
      logical CPU device (one on a plain machine);
    - ``multi_worker``: ``MultiWorkerMirroredStrategy``, the cluster and this
      process's task read from the ``TF_CONFIG`` environment variable. Create it
      at the start of the program, before other TensorFlow work;
    - ``parameter_server``: not here (a ValueError): its partitioner needs the ID tables'
      shapes, so the job builds it after reading the data
      (``retrieval.training.parameter_server.cluster_strategy``).

    A process gets one strategy of each kind, reused by later calls: a second
    MirroredStrategy over the same devices reuses the first one's collective
    instance keys, and its all-gathers then fail with a shape mismatch.
    """
    if config.distribute == "none":
        return tf.distribute.get_strategy()
    if config.distribute == "parameter_server":
        # Its partitioner needs the ID tables' shapes, known only once the data is read.
        raise ValueError(
            "train.distribute: parameter_server builds its strategy from the ID tables' shapes, after the "
            "data is read: retrieval.training.parameter_server.cluster_strategy (the job calls it)"
        )
    if config.distribute == "multi_worker" and not os.environ.get("TF_CONFIG"):
        raise ValueError(
            "train.distribute='multi_worker' reads the cluster from the TF_CONFIG environment variable, "
            'which is not set; e.g. TF_CONFIG=\'{"cluster": {"worker": ["host1:12345", "host2:12345"]}, '
            '"task": {"type": "worker", "index": 0}}\' on the first worker'
        )
    return _process_strategy(config.distribute)


@functools.cache
def _process_strategy(kind: str) -> tf.distribute.Strategy:
    if kind == "mirrored":
        devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
        return tf.distribute.MirroredStrategy([device.name for device in devices])
    if kind == "multi_worker":
        return tf.distribute.MultiWorkerMirroredStrategy()
    raise ValueError(f"unknown train.distribute {kind!r}; valid: none, mirrored, multi_worker")


def worker_count(strategy: tf.distribute.Strategy | None = None) -> int:
    """Processes training together: the TF_CONFIG cluster's workers (and chief) under
    ``MultiWorkerMirroredStrategy``, else 1."""
    strategy = strategy or tf.distribute.get_strategy()
    resolver = getattr(strategy, "cluster_resolver", None)
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or resolver is None:
        return 1
    cluster = resolver.cluster_spec().as_dict()
    return len(cluster.get("chief", [])) + len(cluster.get("worker", []))


def cluster_task() -> tuple[str, int, bool]:
    """This process's task in the ``TF_CONFIG`` cluster: ``(type, index, is_chief)``.

    The chief is the ``chief`` task, or worker 0 of a cluster without one, as
    ``MultiWorkerMirroredStrategy`` decides (``strategy.extended.should_checkpoint``);
    without ``TF_CONFIG`` the process is alone and its own chief. Readable
    before the strategy exists (the job locks its checkpoint directory first).
    """
    cluster, task = tf_config()
    kind, index = str(task.get("type", "worker")), int(task.get("index", 0))
    return kind, index, kind == "chief" or (kind == "worker" and index == 0 and not cluster.get("chief"))


def tf_config() -> tuple[dict[str, list[str]], dict]:
    """``(cluster, task)`` of the ``TF_CONFIG`` environment variable; two empty dicts when it is unset.

    Raises:
      ValueError: it is set but not JSON.
    """
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return {}, {}
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ValueError(f"TF_CONFIG is not JSON: {error}") from None
    return dict(parsed.get("cluster") or {}), dict(parsed.get("task") or {})


def gather_workers(value: int) -> list[int]:
    """``value`` of every replica of the current strategy, in replica order (a collective:
    every worker must call it at the same point); ``[value]`` without a strategy."""
    if not tf.distribute.has_strategy():
        return [int(value)]
    gather = _gatherer(tf.distribute.get_strategy())
    return [int(v) for v in gather(tf.constant(value, tf.int64)).numpy()]


@functools.cache
def _gatherer(strategy: tf.distribute.Strategy):
    """One traced all-gather per strategy (a trace is bound to the strategy it ran under)."""

    @tf.function
    def gather(value):
        return strategy.gather(strategy.run(lambda: tf.reshape(value, [1])), axis=0)

    return gather
