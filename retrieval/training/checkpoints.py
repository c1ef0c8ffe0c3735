"""Checkpoints of a training run: every variable, the data position and the logs so far."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import tensorflow as tf

from retrieval.common.arrays import write_faiss_index
from retrieval.common.atomic import atomic_file
from retrieval.model import TwoTowerModel
from retrieval.training.runtime import gather_workers, worker_count


@dataclass
class TrainingState:
    """Where a training run is, in numbers a checkpoint can hold exactly.

    Attributes:
      epoch: the epoch being trained (0-based); ``batch`` of its batches are done.
      steps: training steps done in all epochs.
      history: per finished epoch, the mean over its batches of each value the
        model's ``train_step`` logs, plus what epoch-end hooks add (validation recall).
      epoch_sums: the sums of those values over the current epoch's batches so far.
      selection: the early-stopping selection's result (``fit``), kept so a resumed
        run does not repeat it.
      timing: per finished epoch, ``epoch_seconds`` and ``clicks_per_second`` (wall
        time, input included) and ``hook_seconds`` (the epoch-end hooks after it): kept apart
        from ``history``, which is a pure function of the seed.
    """

    epoch: int = 0
    batch: int = 0
    steps: int = 0
    history: dict[str, list[float]] = field(default_factory=dict)
    epoch_sums: dict[str, float] = field(default_factory=dict)
    selection: dict[str, list[float]] = field(default_factory=dict)
    timing: dict[str, list[float]] = field(default_factory=dict)


def _quiet_checkpoint_saves(record: logging.LogRecord) -> bool:
    """Drops TensorFlow's INFO line of every checkpoint save ("Sharding callback duration")."""
    return not record.getMessage().startswith("Sharding callback duration")


class TrainingCheckpoint:
    """Saves a training run every ``every_steps`` steps; restores it on a resume.

    ``ckpt-<step>``, a ``tf.train.Checkpoint``, holds every variable training
    changes: the model (towers, loss variables, the sampler with its log-Q
    estimator's variables (``StreamingFrequency``) and a corpus sampler's
    ``tf.random.Generator`` state, the hard-negative miner's step) and the
    optimizer with its slots and iteration count. ``state-<step>.json`` beside
    it holds the ``TrainingState`` (data position, logs so far, running sums of
    the current epoch), and ``miner-<step>.faiss`` the hard-negative miner's
    FAISS index (numpy state). Both are written (and renamed into place) before
    the checkpoint, and ``tf.train.CheckpointManager`` (the last two kept)
    points at a checkpoint only once it is completely written, so a kill at any
    moment leaves the previous one usable.

    Under ``MultiWorkerMirroredStrategy`` this is tf.distribute's multi-worker
    checkpointing (as Keras ``BackupAndRestore`` does it): every worker saves,
    at the same steps (saving reads ``SyncOnRead`` variables, a collective; a
    save due by time is agreed between the workers), the chief into
    ``directory`` and the others into a temporary directory deleted after each
    save, so one copy lands; every worker restores from ``directory``, which
    must therefore be one path they all read (a shared file system). The
    state and miner files are the chief's. A restore checks that every worker
    found the same checkpoint.

    Args:
      directory: the checkpoint directory (created).
      model, optimizer: what is trained; the optimizer must be built.
      every_seconds: a save is due once this many seconds passed since the last
        save (or since this object was made); None = not by time.
      every_steps: a save is due every this many steps; None = not by steps.
    """

    def __init__(
        self,
        directory: str | Path,
        model: TwoTowerModel,
        optimizer,
        *,
        every_seconds: float | None = None,
        every_steps: int | None = None,
    ):
        if not every_seconds and not every_steps:
            raise ValueError("a checkpoint needs every_seconds or every_steps")
        if (every_seconds or 0) < 0 or (every_steps or 0) < 0:
            raise ValueError(f"intervals must be positive, got {every_seconds} s and {every_steps} steps")
        self.directory = Path(directory)
        self.every_seconds, self.every_steps = every_seconds or None, every_steps or None
        self._last_save = time.monotonic()
        self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        self._miner = getattr(model, "miner", None)
        self._checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=self._step)
        self._manager = tf.train.CheckpointManager(self._checkpoint, str(self.directory), max_to_keep=2)
        strategy = tf.distribute.get_strategy()
        self._workers = worker_count(strategy)
        self._chief = self._workers == 1 or bool(strategy.extended.should_checkpoint)
        logging.getLogger("absl").addFilter(_quiet_checkpoint_saves)
        self._saved_step = -1

    @property
    def latest(self) -> str | None:
        """Path prefix of the newest checkpoint, or None."""
        return self._manager.latest_checkpoint

    def due(self, state: TrainingState) -> bool:
        """Whether ``state`` (just after a step) is one to save."""
        if state.steps == self._saved_step:
            return False
        by_steps = self.every_steps is not None and state.steps % self.every_steps == 0
        if self.every_seconds is None:
            return by_steps
        by_time = time.monotonic() - self._last_save >= self.every_seconds
        if self._workers > 1:  # the workers' clocks differ; they must save at the same step
            by_time = any(gather_workers(int(by_time)))
        return by_steps or by_time

    def restore(self) -> TrainingState | None:
        """Restore the newest checkpoint's variables and return its state; None without one."""
        path = self._manager.latest_checkpoint
        if self._workers > 1:
            found = gather_workers(-1 if path is None else int(path.rsplit("-", 1)[1]))
            if len(set(found)) > 1:
                raise ValueError(
                    f"the workers found different checkpoints in {self.directory} (steps {found}, -1 = none): "
                    "under train.distribute=multi_worker train.checkpoint_dir must be one directory every "
                    "worker reads (the chief writes it)"
                )
        if path is None:
            return None
        self._checkpoint.restore(path).assert_existing_objects_matched()
        step = int(self._step.numpy())
        saved = json.loads((self.directory / f"state-{step}.json").read_text())
        if self._miner is not None and saved.pop("miner_index"):
            self._miner.index = faiss.read_index(str(self.directory / f"miner-{step}.faiss"))
        saved.pop("miner_index", None)
        self._saved_step = step
        return TrainingState(**saved)

    def save(self, state: TrainingState) -> None:
        """Write a checkpoint of the variables now and ``state`` (numbered by its step), unless
        that step has one."""
        step = state.steps
        if step == self._saved_step:
            return
        self._step.assign(step)
        if not self._chief:  # every worker saves (a collective); one copy lands, the chief's
            temporary = tempfile.mkdtemp(prefix="retrieval-workertemp-")
            try:
                tf.train.CheckpointManager(self._checkpoint, temporary, max_to_keep=1).save(checkpoint_number=step)
            finally:
                shutil.rmtree(temporary, ignore_errors=True)
            self._saved_step, self._last_save = step, time.monotonic()
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            miner_index = self._miner is not None and self._miner.index is not None
            if self._miner is not None and miner_index:
                with atomic_file(self.directory / f"miner-{step}.faiss") as partial:
                    write_faiss_index(self._miner.index, partial)
            saved = {**dataclasses.asdict(state), "miner_index": miner_index}
            with atomic_file(self.directory / f"state-{step}.json") as partial:
                partial.write_text(json.dumps(saved))
            self._manager.save(checkpoint_number=step)
        except BaseException:  # a full disk, Ctrl-C: the previous checkpoint stays the one to resume from
            self._discard(step)
            raise
        self._saved_step, self._last_save = step, time.monotonic()
        kept = {path.rsplit("-", 1)[1] for path in self._manager.checkpoints}
        for side in [*self.directory.glob("state-*.json"), *self.directory.glob("miner-*.faiss")]:
            if side.stem.split("-", 1)[1] not in kept:
                side.unlink()

    def _discard(self, step: int) -> None:
        """Delete what a failed save of ``step`` left: TensorFlow's ``ckpt-<step>_temp/`` (its shards
        before they are merged), a partly merged ``ckpt-<step>.*`` and the side files. Not when the
        ``checkpoint`` file already names ``ckpt-<step>`` (the save failed after it was complete)."""
        latest = tf.train.latest_checkpoint(str(self.directory))
        if latest is not None and Path(latest).name == f"ckpt-{step}":
            return
        for path in self.directory.glob(f"ckpt-{step}_temp*"):
            shutil.rmtree(path, ignore_errors=True)
        for path in [*self.directory.glob(f"ckpt-{step}.*"), *self.directory.glob(f".*-{step}.*.tmp"),
                     self.directory / f"state-{step}.json", self.directory / f"miner-{step}.faiss"]:
            path.unlink(missing_ok=True)


def write_weights(checkpoint: tf.train.Checkpoint, prefix: str | Path) -> None:
    """``checkpoint.write(prefix)`` by every worker, one copy landing at ``prefix`` (the chief's;
    the others write to a temporary directory, deleted after), as ``TrainingCheckpoint`` saves."""
    strategy = tf.distribute.get_strategy()
    if worker_count(strategy) == 1 or strategy.extended.should_checkpoint:
        checkpoint.write(str(prefix))
        return
    temporary = tempfile.mkdtemp(prefix="retrieval-workertemp-")
    try:
        checkpoint.write(str(Path(temporary) / Path(prefix).name))
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
