"""Workers that read the training batches themselves (``train.parameter_server.input: workers``).

By default the chief of a parameter-server cluster reads every batch and sends it with the step it
schedules (``retrieval.training.loop``): the click sources are Python generators (pyarrow,
pandas), which a remote worker cannot run, and one Python process then bounds the throughput.
With ``input: workers`` the chief reads the source once, writes its batches as TFRecord files
(``stage_batches``: one ``tf.train.Example`` a batch, each column a serialized tensor), and the
workers read those files through the tf.data service: the chief runs its dispatcher
(``data_dispatcher``), each worker task a tf.data worker (``python -m retrieval.training.cluster
--data-dispatcher HOST:PORT``), and every worker's dataset
(``ClusterCoordinator.create_per_worker_dataset``) reads in ``distributed_epoch`` mode from its
own tf.data worker (``target_workers="LOCAL"``). The dispatcher hands each staged file to one
tf.data worker at a time, so the workers read disjoint files, a faster worker more of them, and
every staged batch's rows once a pass. A scheduled step takes the next batch of the worker it
runs on; the chief sends no data.

What differs from the chief's batches: an epoch is ``steps_per_epoch`` steps of the stream, which
goes over the staged rows again and again (each pass the files in another order, rows shuffled in
a buffer of ``SHUFFLE_BATCHES`` batches); where an epoch ends mid-pass its last batches may hold
rows of the next pass. A resumed run starts a new pass: the data position of a checkpoint is not
restored (the weights, the optimizer and the step count are).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import tensorflow as tf

from retrieval.config import ParameterServerConfig
from retrieval.training.interfaces import check_listening
from retrieval.training.parameter_server import ClusterError, read_tf_config
from retrieval.training.sources import ClickSource

log = logging.getLogger("retrieval")

# Rows are shuffled across this many batches as the workers read them (the staged files already hold
# the source's shuffled epoch 0): larger mixes more, and each worker's buffer holds that many batches.
SHUFFLE_BATCHES = 16

_dispatchers: dict[int, tf.data.experimental.service.DispatchServer] = {}


def data_dispatcher(port: int) -> tf.data.experimental.service.DispatchServer:
    """The tf.data service dispatcher on ``port`` of this chief, started the first time (the job starts it
    before reading the data, so the workers register meanwhile)."""
    if port not in _dispatchers:
        _dispatchers[port] = tf.data.experimental.service.DispatchServer(
            tf.data.experimental.service.DispatcherConfig(port=port)
        )
        # It binds every interface (its config takes a port only): a warning names the port when this
        # chief's TF_CONFIG address is narrower.
        cluster, task = read_tf_config() if os.environ.get("TF_CONFIG") else ({}, {})
        if cluster.get("chief"):
            chief = cluster["chief"][int(task.get("index", 0)) if task.get("type") == "chief" else 0]
            check_listening("the tf.data dispatcher", f"{chief.rsplit(':', 1)[0]}:{port}",
                            allow_all_interfaces=True)
    return _dispatchers[port]


def wait_for_data_workers(dispatcher: tf.data.experimental.service.DispatchServer, expected: int,
                          timeout: float = 120.0) -> None:
    """Wait until the ``expected`` worker tasks have registered their tf.data workers with ``dispatcher``.

    Raises:
      ClusterError: they have not after ``timeout`` seconds (a worker started without ``--data-dispatcher``,
        or with another address).
    """
    deadline = time.monotonic() + timeout
    # The dispatcher's count of registered workers has no public accessor; TensorFlow's own tests read it so.
    while (registered := dispatcher._num_workers()) < expected:
        if time.monotonic() > deadline:
            raise ClusterError(
                f"train.parameter_server.input: workers: {registered} of the {expected} worker tasks registered a "
                f"tf.data worker with this chief's dispatcher ({dispatcher._address}) in {timeout:.0f} s; start each "
                "worker with python -m retrieval.training.cluster --data-dispatcher CHIEF_HOST:PORT "
                "(train.parameter_server.data_dispatcher_port)"
            )
        time.sleep(0.2)


def start_data_worker(dispatcher: str) -> threading.Thread:
    """Start a tf.data worker in this worker task (TF_CONFIG), registered with the dispatcher at
    ``dispatcher`` (``HOST:PORT``), listening on a free port of this task's host.

    In a daemon thread, which holds it until the process ends: a tf.data worker waits for its
    dispatcher to answer before it serves, and the chief starts the dispatcher after its tasks.
    """
    cluster, task = read_tf_config()
    host = cluster[task["type"]][int(task.get("index", 0))].rsplit(":", 1)[0]
    config = tf.data.experimental.service.WorkerConfig(dispatcher_address=dispatcher, worker_address=f"{host}:%port%")

    def serve() -> None:
        tf.data.experimental.service.WorkerServer(config).join()

    thread = threading.Thread(target=serve, name="tf.data worker", daemon=True)
    thread.start()
    return thread


def stage_batches(batches: tf.data.Dataset, directory: Path, files: int) -> list[str]:
    """Write ``batches`` (dicts of tensors) into ``files`` TFRecord files under ``directory`` (batch
    ``b`` into file ``b % files``), one ``tf.train.Example`` a batch whose feature ``<column>``
    holds ``tf.io.serialize_tensor`` of that column; the files' paths (``read_staged`` reads them)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [str(directory / f"batches-{part:05d}-of-{files:05d}.tfrecord") for part in range(files)]
    writers = [tf.io.TFRecordWriter(path) for path in paths]
    try:
        for number, batch in enumerate(batches):
            example = tf.train.Example(features=tf.train.Features(feature={
                name: tf.train.Feature(bytes_list=tf.train.BytesList(value=[tf.io.serialize_tensor(values).numpy()]))
                for name, values in batch.items()
            }))
            writers[number % files].write(example.SerializeToString())
    finally:
        for writer in writers:
            writer.close()
    return paths


def read_staged(files: tf.data.Dataset, element_spec: dict[str, tf.TensorSpec]) -> tf.data.Dataset:
    """The batches of the staged files ``files`` (a dataset of paths), file after file, as ``element_spec``."""
    features = {name: tf.io.FixedLenFeature([], tf.string) for name in element_spec}

    def parse(record):
        serialized = tf.io.parse_single_example(record, features)
        return {name: tf.ensure_shape(tf.io.parse_tensor(serialized[name], spec.dtype), spec.shape)
                for name, spec in element_spec.items()}

    return files.interleave(tf.data.TFRecordDataset, cycle_length=1).map(parse)


def staged_dataset(paths: list[str], element_spec: dict[str, tf.TensorSpec], batch_size: int) -> tf.data.Dataset:
    """The staged files' rows as an endless stream of ``batch_size`` batches (the files in a new order
    each pass, rows shuffled across ``SHUFFLE_BATCHES`` batches), before the tf.data service."""
    files = tf.data.Dataset.from_tensor_slices(paths).shuffle(len(paths))
    rows = read_staged(files, element_spec).unbatch()
    return rows.shuffle(SHUFFLE_BATCHES * batch_size).batch(batch_size).repeat()


class WorkerFedClicks:
    """A ``ClickSource`` whose batches the workers read (``train.parameter_server.input: workers``):
    ``source``'s epoch 0 staged under ``directory``, served by the dispatcher at ``dispatcher``.

    ``steps_per_epoch``, ``batch_size`` and ``rows`` are ``source``'s. The loop schedules
    ``worker_steps``, one per-worker iterator a step, with ``step_function(..., from_iterator=True)``.
    """

    reads_own_shards = True

    def __init__(self, source: ClickSource, directory: Path, dispatcher: str, files: int):
        self.batch_size, self.steps_per_epoch, self.rows = source.batch_size, source.steps_per_epoch, source.rows
        batches = source.epoch(0)
        self.element_spec = batches.element_spec
        log.info("staging the training batches for the workers in %d files under %s", files, directory)
        self.paths = stage_batches(batches, directory, files)
        source.check_epoch()  # a shard unreadable while staging: its DataError
        self._dispatcher = dispatcher
        self._job = f"retrieval-{uuid.uuid4().hex}"  # this source's stream: every worker reads the one job
        self._iterator = None

    def epoch(self, epoch: int, skip_batches: int = 0) -> tf.data.Dataset:
        """The stream the workers read, as one dataset (on this process: for tests and inspection)."""
        return staged_dataset(self.paths, self.element_spec, self.batch_size).take(self.steps_per_epoch - skip_batches)

    def worker_steps(self, coordinator: tf.distribute.coordinator.ClusterCoordinator,
                     skip_batches: int = 0) -> Iterator:
        """One epoch's steps less ``skip_batches``: the per-worker iterator over the stream (created on
        the workers the first time), once a step."""
        if self._iterator is None:
            paths, spec, batch_size, service, job = (self.paths, self.element_spec, self.batch_size,
                                                     self._dispatcher, self._job)

            def per_worker_dataset():
                return staged_dataset(paths, spec, batch_size).apply(tf.data.experimental.service.distribute(
                    "distributed_epoch", service=service, job_name=job, target_workers="LOCAL"))

            self._iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset))
        return itertools.repeat(self._iterator, self.steps_per_epoch - skip_batches)

    def check_epoch(self) -> None:
        """Nothing to raise: the staged files were read once, by ``stage_batches``."""


@contextlib.contextmanager
def fed_by(source: ClickSource, config: ParameterServerConfig | None):
    """``source`` as the loop reads it: unchanged, or (``config.input == "workers"``) a
    ``WorkerFedClicks`` of it, its staged files deleted on exit."""
    if config is None or config.input != "workers":
        yield source
        return
    dispatcher = data_dispatcher(config.data_dispatcher_port)
    # The parameter-server strategy's own cluster (its public cluster_resolver is None on the chief).
    resolver = tf.distribute.get_strategy()._cluster_resolver
    wait_for_data_workers(dispatcher, resolver.cluster_spec().num_tasks("worker"))
    parent = Path(config.staging_dir) if config.staging_dir else None
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="retrieval-worker-input-", dir=parent))
    try:
        yield WorkerFedClicks(source, directory, dispatcher.target, config.staged_files)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
