"""A worker or ps task of a parameter-server cluster: ``python -m retrieval.training.cluster``.

Reads this process's task from TF_CONFIG (``{"cluster": {...}, "task": {"type": "worker"|"ps",
"index": i}}``), starts its ``tf.distribute.Server`` on the task's address and serves until
killed. A ``worker`` runs the training steps the chief schedules; a ``ps`` task holds its
shards of the variables (the ID tables' row ranges, the other variables whole). The chief runs
the job itself (``python -m pipelines.train`` with TF_CONFIG task type ``chief``);
``pipelines/local_cluster.py`` starts all of them on one machine. With ``--data-dispatcher
HOST:PORT`` a worker also runs a tf.data worker, to read the training batches itself
(``train.parameter_server.input: workers``, ``retrieval.training.worker_input``).

Which interfaces a task listens on: TensorFlow's gRPC server binds its port on every interface
whatever TF_CONFIG's host, which only names the task to its peers, and it runs any op a peer
sends, unauthenticated. So once started, a task given a loopback address that listens beyond
loopback (``retrieval.training.interfaces.check_listening``, from /proc/net/tcp and tcp6, Linux)
stops with one line saying so, unless started with ``--allow-all-interfaces``
(``pipelines.local_cluster`` passes it): then it warns and serves. A task given a non-loopback
address warns when it listens on more than that address; where /proc cannot be read it warns
that it cannot check.
"""

from __future__ import annotations

import argparse
import logging
import sys

import tensorflow as tf

from retrieval.common.errors import entry_point
from retrieval.training.interfaces import ALLOW_ALL_INTERFACES, check_listening
from retrieval.training.parameter_server import ClusterError, read_tf_config
from retrieval.training.worker_input import start_data_worker

TASK_KINDS = ("worker", "ps")


def start_task() -> tf.distribute.Server:
    """Start this process's ``tf.distribute.Server`` (gRPC) for its TF_CONFIG task; it serves in the
    background until the process ends (``Server.join`` waits for that).

    Raises:
      ClusterError: TF_CONFIG is unset, or its task is not a worker or ps task of its cluster.
    """
    cluster, task = read_tf_config()
    kind, index = task.get("type"), int(task.get("index", 0))
    if kind not in TASK_KINDS:
        raise ClusterError(
            f"TF_CONFIG task type {kind!r}: python -m retrieval.training.cluster runs a worker or ps task; "
            "the chief runs the job (python -m pipelines.train)"
        )
    if not 0 <= index < len(cluster.get(kind, [])):
        raise ClusterError(f"TF_CONFIG task {kind} {index} is not in its cluster: {cluster}")
    return tf.distribute.Server(
        tf.train.ClusterSpec(cluster), job_name=kind, task_index=index, protocol="grpc", start=True
    )


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="retrieval.training.cluster",
        description="Run this process's TF_CONFIG worker or ps task of a parameter-server cluster until killed.",
    )
    parser.add_argument(ALLOW_ALL_INTERFACES, action="store_true",
                        help="serve although TF_CONFIG gives this task a loopback address and TensorFlow's gRPC "
                        "server listens on every interface (it cannot bind one): only with the port closed to "
                        "other machines; without it such a task stops with an error")
    parser.add_argument("--data-dispatcher", default=None, metavar="HOST:PORT",
                        help="a worker task also runs a tf.data worker registered with the chief's dispatcher "
                        "there, so it can read the training batches itself (train.parameter_server.input: "
                        "workers, data_dispatcher_port PORT); ignored by a ps task")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    server = start_task()
    cluster, task = read_tf_config()
    kind, index = task["type"], int(task.get("index", 0))
    refusal = check_listening(f"TF_CONFIG task {kind} {index}", cluster[kind][index], args.allow_all_interfaces)
    if refusal is not None:
        raise ClusterError(refusal)
    if args.data_dispatcher and read_tf_config()[1].get("type") == "worker":
        start_data_worker(args.data_dispatcher)
    server.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
