"""Click sources: where the training loop's batches come from, one epoch at a time.

Two implementations of one interface (``ClickSource``): ``FrameClicks``, a
click frame (or feature-tower training examples) held in memory, and
``StreamedClicks``, Parquet/CSV shards read with pyarrow
(``retrieval.data.streaming``). Either way epoch ``e`` visits every training
example once in an order fixed by ``(seed, e)``: two runs with the same seed
see the same batches, and a run resumed at (epoch e, batch b) continues with
exactly the batches an uninterrupted run trains on there.

Under ``train.distribute: multi_worker`` a ``StreamedClicks`` is read by each
worker on its own shards (``StreamedClicks.worker_epoch``); a ``FrameClicks``
is held whole by every worker and its global batches are split over them.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pandas as pd
import tensorflow as tf

from retrieval.data import ITEM, TIME, USER, WEIGHT, DataError, click_keys, epoch_order
from retrieval.data.streaming import ClickBatch, ClickLog, ClickShards, Plan, train_batches
from retrieval.features import ExampleJoin, feature_arrays
from retrieval.features.histories import ClickHistories


class ClickSource(Protocol):
    """Training batches by epoch.

    Attributes:
      batch_size: rows a batch (the last batch of an epoch may hold fewer).
      steps_per_epoch: batches in one epoch (an upper bound for a capped stream).
      rows: training examples in one epoch.
      reads_own_shards: under ``multi_worker`` each worker reads its own part of the log
        (``StreamedClicks.worker_epoch``); False: every worker makes the whole epoch and keeps
        its share of each global batch.
    """

    batch_size: int
    steps_per_epoch: int
    rows: int

    @property
    def reads_own_shards(self) -> bool: ...

    def epoch(self, epoch: int, skip_batches: int = 0) -> tf.data.Dataset:
        """Epoch ``epoch``'s batches less its first ``skip_batches``: dicts of ``[batch]`` tensors
        (``user_id``, ``item_id`` tf.string, ``weight`` tf.float32, and every other column's feature)."""
        ...

    def check_epoch(self) -> None:
        """Raise the error that ended the epoch just iterated early, if one did (call after each epoch).

        A source that reads its files while ``tf.data`` iterates (``StreamedClicks``)
        cannot raise there: TensorFlow would wrap the error in a ``tf.errors``
        one and log its Python traceback. Such a source ends the epoch at the
        error and keeps it for this call.
        """
        ...


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
    """Batches in one epoch of ``num_examples`` rows (the last one may be smaller)."""
    return -(-int(num_examples) // int(batch_size))


class FrameClicks:
    """A click frame in memory as a ``ClickSource``.

    ``clicks`` is a click log or the training examples of feature towers
    (``retrieval.features.training_examples``): other columns become batch
    features as ``feature_arrays`` converts them (strings, numbers, tuples of
    strings -> [batch, width]). Epoch ``e`` visits the rows in
    ``retrieval.data.shuffle.epoch_order(keys, seed, e)``, ``keys`` a hash of
    each click's user, item, weight and timestamp (``click_keys``, computed
    once: 8 bytes a click), so in-batch negatives differ between epochs and
    the order is a function of the clicks, not of their place in the frame: a
    ``StreamedClicks`` whose buffer holds the same clicks yields the same
    batches. With ``shuffle=False`` the rows keep the frame's order.
    """

    reads_own_shards = False

    def __init__(self, clicks: pd.DataFrame, batch_size: int, *, seed: int, shuffle: bool = True):
        if clicks.empty:
            raise ValueError("cannot train on an empty click log")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.batch_size, self.seed, self.shuffle = int(batch_size), int(seed), shuffle
        self.rows = len(clicks)
        self.steps_per_epoch = steps_per_epoch(self.rows, self.batch_size)
        columns = {
            **feature_arrays(clicks, [name for name in clicks.columns if name not in (USER, ITEM, WEIGHT)]),
            USER: clicks[USER].astype(str).to_numpy(dtype=object),
            ITEM: clicks[ITEM].astype(str).to_numpy(dtype=object),
            WEIGHT: (clicks[WEIGHT] if WEIGHT in clicks else pd.Series(1.0, index=clicks.index))
            .to_numpy(dtype=np.float32),
        }
        self._columns = {name: tf.constant(values) for name, values in columns.items()}
        self._keys = None
        if shuffle:  # the click's content: ids, weight and (a tower may read it) timestamp
            times = clicks[TIME].to_numpy() if TIME in clicks else None
            self._keys = click_keys(columns[USER], columns[ITEM], columns[WEIGHT], times)

    def epochs(self, start_epoch: int, epochs: int, skip_batches: int = 0) -> tf.data.Dataset:
        """Epochs ``start_epoch .. start_epoch + epochs - 1`` back to back, less the first ``skip_batches``."""
        if epochs <= 0 or start_epoch < 0 or skip_batches < 0:
            raise ValueError(
                "need epochs > 0, start_epoch >= 0, skip_batches >= 0; "
                f"got {epochs}, {start_epoch}, {skip_batches}"
            )
        rows = tf.range(self.rows, dtype=tf.int64)
        seed, batch_size, keys, columns = self.seed, self.batch_size, self._keys, self._columns

        def epoch_rows(epoch):
            if keys is None:
                return tf.data.Dataset.from_tensor_slices(rows).batch(batch_size)
            # Computed when the epoch starts (one argsort), so only one epoch's order is held.
            order = tf.numpy_function(lambda e: epoch_order(keys, seed, int(e)), [epoch], tf.int64, stateful=False)
            order = tf.ensure_shape(order, [self.rows])
            return tf.data.Dataset.from_tensor_slices(order).batch(batch_size)

        dataset = tf.data.Dataset.range(start_epoch, start_epoch + epochs).flat_map(epoch_rows).skip(skip_batches)
        dataset = dataset.map(
            lambda index: {name: tf.gather(values, index) for name, values in columns.items()},
            num_parallel_calls=tf.data.AUTOTUNE,  # order is kept (deterministic by default)
        )
        return dataset.prefetch(tf.data.AUTOTUNE)

    def epoch(self, epoch: int, skip_batches: int = 0) -> tf.data.Dataset:
        return self.epochs(epoch, 1, skip_batches)

    @property
    def columns(self) -> dict[str, tf.Tensor]:
        """Every column, ``[rows, ...]`` tensors held in memory: batch ``b`` of epoch ``e`` is their
        rows ``epoch_rows(e)[b * batch_size : (b + 1) * batch_size]``."""
        return dict(self._columns)

    def epoch_rows(self, epoch: int) -> tf.Tensor:
        """The rows of epoch ``epoch`` in the order ``epoch`` visits them, ``[rows]`` int64."""
        if self._keys is None:
            return tf.range(self.rows, dtype=tf.int64)
        return tf.constant(epoch_order(self._keys, self.seed, epoch), tf.int64)

    def check_epoch(self) -> None:
        """Nothing to raise: the batches are in memory."""


class SequenceClicks:
    """Users' training clicks in time order as a ``ClickSource`` of sequences (``train.examples: sequences``).

    An example is a window of ``length + 1`` of a user's clicks, newest first, as a ``history``
    of the ``length`` items before the newest (``[batch, length]``, "" padded) and the next item
    after each of them (``item_id`` ``[batch, length]``: position ``p`` holds the item clicked
    right after ``history[p]``, "" where ``history[p]`` is padding). A query tower's state at
    position ``p`` (``towers.PositionStates``: it sees ``history[p:]``) is trained on
    ``item_id[p]``, every position of every window in one pass (SASRec's all-positions
    objective). ``windows``: ``"all"`` cuts each user's whole sequence into windows
    (``ClickHistories.windows``), so every click but a user's first is a target once; ``"latest"``
    keeps only each user's last window (SASRec's truncation: a user's clicks older than ``length``
    are never targets). A user needs two training clicks. Epoch ``e`` visits the windows in an
    order drawn from ``(seed, e)``; ``weight`` is 1 at every position.

    Attributes:
      rows: windows an epoch; positions: (query state, next item) pairs an epoch.
    """

    reads_own_shards = False

    def __init__(self, histories: ClickHistories, history_name: str, length: int, batch_size: int, *, seed: int,
                 windows: str = "all"):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if windows == "all":
            users, cut = histories.windows(length)
        elif windows == "latest":
            users = histories.user_ids
            cut = histories.latest(users, length + 1)
        else:
            raise ValueError(f"windows must be 'all' or 'latest', got {windows!r}")
        keep = cut[:, 1] != ""  # a single click has no history to predict it from
        if not keep.any():
            raise ValueError("no user has two training clicks: no sequence to train on")
        cut, users = cut[keep], users[keep]
        history, targets = cut[:, 1:], cut[:, :-1].copy()
        targets[history == ""] = ""
        self.history_name, self.batch_size, self.seed = history_name, int(batch_size), int(seed)
        self.rows, self.positions = len(users), int((history != "").sum())
        self.steps_per_epoch = steps_per_epoch(self.rows, self.batch_size)
        self._columns = {
            USER: tf.constant(users.astype(str).astype(object)),
            history_name: tf.constant(history),
            ITEM: tf.constant(targets),
            WEIGHT: tf.ones(targets.shape, tf.float32),
        }

    def epoch(self, epoch: int, skip_batches: int = 0) -> tf.data.Dataset:
        order = np.random.default_rng([self.seed, epoch]).permutation(self.rows)
        columns = self._columns
        dataset = tf.data.Dataset.from_tensor_slices(order).batch(self.batch_size).skip(skip_batches)
        dataset = dataset.map(lambda rows: {name: tf.gather(values, rows) for name, values in columns.items()})
        return dataset.prefetch(tf.data.AUTOTUNE)

    def check_epoch(self) -> None:
        """Nothing to raise: the sequences are in memory."""


class StreamedClicks:
    """The training clicks of Parquet/CSV shards, streamed, as a ``ClickSource``.

    Batches come from ``retrieval.data.streaming.train_batches`` (shard order
    permuted from ``(seed, epoch)``, then a bounded buffer put in the order
    ``FrameClicks`` gives the same clicks); with ``shuffle_buffer >= train_rows``
    they are ``FrameClicks``' batches of the training clicks, batch for batch.
    Skipped batches are dropped before they become tensors, or are joined.

    Under ``MultiWorkerMirroredStrategy`` with several workers each worker reads
    only its own shards (``worker_epoch``), cut into exactly as many batches
    as every other worker's, so the collectives of each step meet.

    A shard that cannot be read mid-epoch (deleted, rewritten, a bad value)
    ends the epoch's dataset there; ``check_epoch`` raises its ``DataError``
    (one line naming the shard) for the loop, outside ``tf.data``.

    Args:
      shards, plan: the shards and the split that marks their test rows.
      train_rows: training clicks (``StreamCounts.train_rows``).
      max_batches: end each epoch after this many batches (None = all).
      join: feature towers' inputs joined onto each batch (``retrieval.features.ExampleJoin``);
        None = the clicks' ids and weights only (ID towers).
    """

    def __init__(
        self,
        shards: ClickLog,
        plan: Plan,
        batch_size: int,
        *,
        shuffle_buffer: int,
        seed: int,
        train_rows: int,
        max_batches: int | None = None,
        join: ExampleJoin | None = None,
    ):
        if train_rows <= 0:
            raise ValueError("cannot train on an empty click log")
        self.shards, self.plan = shards, plan
        self.batch_size, self.shuffle_buffer, self.seed = int(batch_size), int(shuffle_buffer), int(seed)
        self.rows = int(train_rows)
        self.max_batches, self.join = max_batches, join
        self._whole_epoch = steps_per_epoch(self.rows, self.batch_size)
        self.steps_per_epoch = self._whole_epoch if max_batches is None else min(self._whole_epoch, int(max_batches))
        self._worker_rows: dict[tuple[str, ...], int] = {}
        self._read_error: DataError | None = None

    @property
    def reads_own_shards(self) -> bool:
        return self.shards.reads_own_shards

    def epoch(self, epoch: int, skip_batches: int = 0) -> tf.data.Dataset:
        join = self.join

        def generate():
            batches = train_batches(
                self.shards, self.plan, self.batch_size, shuffle_buffer=self.shuffle_buffer, seed=self.seed,
                epoch=epoch, with_time=join is not None and join.needs_time,
            )
            batches = itertools.islice(batches, skip_batches, self.max_batches)
            yield from self._until_read_error(batches if join is None else map(join.batch, batches))

        return tf.data.Dataset.from_generator(generate, output_signature=self._signature()).prefetch(2)

    def check_epoch(self) -> None:
        error, self._read_error = self._read_error, None
        if error is not None:
            raise error

    def _until_read_error(self, batches: Iterator[dict[str, np.ndarray]]) -> Iterator[dict[str, np.ndarray]]:
        """``batches``, ending at a ``DataError``, which is kept for ``check_epoch``."""
        self._read_error = None
        try:
            yield from batches
        except DataError as error:
            self._read_error = error

    def _signature(self) -> dict[str, tf.TensorSpec]:
        if self.join is None:
            return {
                USER: tf.TensorSpec([None], tf.string),
                ITEM: tf.TensorSpec([None], tf.string),
                WEIGHT: tf.TensorSpec([None], tf.float32),
            }
        return {name: tf.TensorSpec(spec.shape, spec.dtype) for name, spec in self.join.specs.items()}

    def worker_files(self, worker: int, workers: int) -> tuple[str, ...]:
        """The shards worker ``worker`` of ``workers`` reads: every ``workers``-th of the sorted
        list from its ``worker``-th (the same every epoch, disjoint, together all of them)."""
        if len(self.shards.files) < workers:
            raise ValueError(
                f"train.distribute=multi_worker: each of the {workers} workers reads its own shards, but the "
                f"click log has {len(self.shards.files)} shard file(s); split it into at least {workers} files"
            )
        return self.shards.files[worker::workers]

    def worker_epoch(self, epoch: int, skip_batches: int, context: tf.distribute.InputContext) -> tf.data.Dataset:
        """This worker's share of epoch ``epoch`` (for ``strategy.distribute_datasets_from_function``).

        Worker ``context.input_pipeline_id`` streams the training clicks of its
        shards (``worker_files``) through ``train_batches`` (shuffled from
        ``(seed, epoch)`` as a single worker's stream is) and cuts them into
        ``steps_per_epoch`` x its local replicas per-replica batches of as even
        sizes as its row count allows: every worker has the same number of
        steps whatever its shards hold (a worker out of batches would leave
        the others waiting in a collective), every training click is in one
        step of the epoch, and a step's global batch holds about
        ``rows / steps_per_epoch`` (<= ``batch_size``) rows.
        ``skip_batches`` counts steps, as ``TrainingState.batch`` does.

        Raises:
          ValueError: fewer shards than workers, or a worker's shards hold
            fewer training clicks than the epoch has per-replica batches.
        """
        worker, workers = context.input_pipeline_id, context.num_input_pipelines
        replicas = context.num_replicas_in_sync // workers
        files = self.worker_files(worker, workers)
        rows = self._rows_of(files)
        parts = self._whole_epoch * replicas
        if rows < parts:
            raise ValueError(
                f"train.distribute=multi_worker: worker {worker}'s shards hold {rows} training clicks, fewer than "
                f"the {parts} batches an epoch gives it ({self._whole_epoch} steps x {replicas} replica(s)); use "
                "fewer workers, a larger train.batch_size or shards of more even sizes"
            )
        sizes = [rows // parts + (1 if part < rows % parts else 0) for part in range(parts)]
        if not isinstance(self.shards, ClickShards):  # distributed_epoch asks reads_own_shards first
            raise ValueError("a log held in memory is not read per worker: every worker takes its share of each batch")
        fields = {field.name: getattr(self.shards, field.name) for field in dataclasses.fields(self.shards)}
        shards = _WorkerShards(**{**fields, "files": files}, whole=self.shards.files)
        join = self.join

        def generate():
            batches = train_batches(
                shards, self.plan, sizes[0], shuffle_buffer=self.shuffle_buffer, seed=self.seed, epoch=epoch,
                with_time=join is not None and join.needs_time,
            )
            cut = itertools.islice(_cut(batches, sizes), skip_batches * replicas, self.steps_per_epoch * replicas)
            yield from self._until_read_error(cut if join is None else map(join.batch, cut))

        return tf.data.Dataset.from_generator(generate, output_signature=self._signature()).prefetch(2)

    def _rows_of(self, files: tuple[str, ...]) -> int:
        """Training clicks in ``files`` (one pass over them, the first time)."""
        if files not in self._worker_rows:
            self._worker_rows[files] = sum(
                int(np.count_nonzero(~self.plan.is_test(batch) & ~self.plan.drops(batch)))
                for batch in self.shards.scan(files)
            )
        return self._worker_rows[files]


@dataclass(frozen=True)
class _WorkerShards(ClickShards):
    """Some of the log's shards (``files``), read as the whole log's (``whole``) reads them: a
    click's row key, which split plans use, is its shard's place in the whole list."""

    whole: tuple[str, ...] = ()

    def batches(self, file: str) -> Iterator[ClickBatch]:
        return ClickShards.batches(dataclasses.replace(self, files=self.whole), file)


def _cut(batches: Iterator[dict[str, np.ndarray]], sizes: Sequence[int]) -> Iterator[dict[str, np.ndarray]]:
    """The rows of ``batches``, in order, as batches of ``sizes`` rows (which must add up to all of them)."""
    held: list[dict[str, np.ndarray]] = []
    count = 0
    for size in sizes:
        while count < size:
            part = next(batches, None)
            if part is None:
                raise ValueError(f"the stream ended {size - count} rows short of a batch of {size}")
            held.append(part)
            count += len(part[USER])
        columns = {name: np.concatenate([part[name] for part in held]) for name in held[0]}
        yield {name: values[:size] for name, values in columns.items()}
        count -= size
        held = [{name: values[size:] for name, values in columns.items()}] if count else []
