"""The training loop: one ``tf.function`` step over a click source's batches, for every run.

Every training run of the project (in memory or streamed, the early-stopping
selection and the final run, one device or a ``tf.distribute`` strategy) goes
through ``train_epochs``. It is a plain loop rather than Keras ``fit``: the
cost of a step is the model's own (with ``lazy_adam`` or ``adagrad`` it does
not grow with the ID tables), checkpoints land at any step with the exact data
position, and the logs are the mean of each epoch's steps.

Under ``ParameterServerStrategy`` the same loop runs on the chief: it reads the
batches and schedules each step on a worker through the strategy's
``ClusterCoordinator``, reading the steps' values (the loss) at the end of the
epoch and before a checkpoint, so logs, early stopping and checkpoints work
as on one device.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import tensorflow as tf

from retrieval.common.errors import UserError
from retrieval.model import TwoTowerModel
from retrieval.training.checkpoints import TrainingCheckpoint, TrainingState
from retrieval.training.parameter_server import ClusterError, chief_coordinator
from retrieval.training.runtime import worker_count
from retrieval.training.sources import ClickSource, FrameClicks, StreamedClicks
from retrieval.training.worker_input import WorkerFedClicks

log = logging.getLogger("retrieval")

EpochHook = Callable[[int, dict], "bool | None"]


def verbosity(setting: int | str) -> int:
    """``train.verbose`` as a level: 0 silent, 1 a progress line every few seconds, 2 a line an epoch."""
    if setting == "auto":
        return 1 if sys.stdout.isatty() else 2
    return int(setting)


class RunLogs:
    """A run's per-epoch logs: ``<run>_log.csv`` (``epoch`` then every logged key, sorted) and
    TensorBoard scalars ``epoch_<key>`` at step = epoch under ``tensorboard/<run>``.

    ``run``: ``"train"`` (the run whose weights are served) or ``"selection"`` (the
    early-stopping run before a refit, with its validation recall per epoch).
    """

    def __init__(self, log_dir: str | Path, run: str = "train"):
        self.csv_path = Path(log_dir) / f"{run}_log.csv"
        self._writer = tf.summary.create_file_writer(str(Path(log_dir) / "tensorboard" / run))

    def write(self, history: dict[str, list[float]], new_epochs: range) -> None:
        """Rewrite ``train_log.csv`` from ``history``; add the scalars of ``new_epochs``."""
        keys = sorted(history)
        epochs = max((len(values) for values in history.values()), default=0)
        with open(self.csv_path, "w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(["epoch", *keys])
            for epoch in range(epochs):
                writer.writerow([epoch, *(_cell(history[key], epoch) for key in keys)])
        with self._writer.as_default():
            for key in keys:
                for epoch in new_epochs:
                    if epoch < len(history[key]):
                        tf.summary.scalar(f"epoch_{key}", history[key][epoch], step=epoch)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> RunLogs:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _cell(values: list[float], epoch: int) -> float | str:
    return values[epoch] if epoch < len(values) else "NA"


class _Progress:
    """Progress lines: clicks/s, mean loss so far and an ETA for the run."""

    EVERY_SECONDS = 15.0

    def __init__(self, level: int, source: ClickSource, epochs: int, start: TrainingState, say=print,
                 eta_bound: bool = False):
        self.level, self.source, self.epochs, self.say = level, source, epochs, say
        # Early stopping ends the run at an epoch nobody knows in advance (often a fraction of ``epochs``):
        # a run ETA would be a bound many times the real time, so only the current epoch's end is given.
        self.run_eta = not eta_bound
        self.remaining = max(epochs * source.steps_per_epoch - start.steps, 0)
        self.done = 0
        self.started = self.last = time.perf_counter()

    def step(self, state: TrainingState, settled: int, steps: int = 1) -> None:
        """After ``steps`` steps (one call); ``settled``: the epoch's steps whose values are in ``state.epoch_sums``."""
        self.done += steps
        if self.level != 1:
            return
        now = time.perf_counter()
        if now - self.last < self.EVERY_SECONDS:
            return
        self.last = now
        rate = self.done / (now - self.started)
        clicks = rate * self.source.batch_size
        # Scheduled steps (ParameterServerStrategy) are read at the epoch's end: no loss before then.
        loss = f"loss {state.epoch_sums.get('loss', 0.0) / settled:.4f}, " if settled else ""
        left = self.remaining - self.done if self.run_eta else self.source.steps_per_epoch - state.batch
        self.say(
            f"epoch {state.epoch + 1}/{self.epochs} step {state.batch}/{self.source.steps_per_epoch}: "
            f"{clicks:,.0f} clicks/s, {loss}{'ETA' if self.run_eta else 'epoch ETA'} {_duration(left / rate)}"
        )

    def epoch(self, epoch: int, logs: dict[str, float], timing: dict[str, float]) -> None:
        if self.level == 0:
            return
        # The loss and what hooks add (validation recall); the regularization terms are in train_log.csv.
        shown = ", ".join(
            f"{key} {value:.4f}" for key, value in logs.items() if key not in ("regularization_loss", "total_loss")
        )
        elapsed = time.perf_counter() - self.started
        eta = (self.remaining - self.done) * elapsed / max(self.done, 1)
        self.say(
            f"epoch {epoch + 1}/{self.epochs}: {timing['epoch_seconds']:.0f}s, "
            f"{timing['clicks_per_second']:,.0f} clicks/s, {shown}"
            + (f", ETA {_duration(eta)}" if self.run_eta and self.done < self.remaining else "")
        )


def _duration(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class TrainingDiverged(UserError, ValueError):
    """A training step's loss was NaN or infinite: the weights it updated are lost.

    A user error (one line and status 2 from an entry point): the message names the
    learning rate and the feature values to change.

    Raised at that step, before anything saves its state, so the run's
    checkpoints (if any) hold only steps with a finite loss; the job deletes
    them, since training again with the same config diverges again.
    """


def _stop_if_diverged(values: dict[str, float], state: TrainingState, epochs: int, model: TwoTowerModel) -> None:
    """Raise ``TrainingDiverged`` when a value the step logged (loss, regularization) is not finite."""
    bad = {key: value for key, value in values.items() if not math.isfinite(value)}
    if bad:
        raise _diverged(", ".join(f"{key} {value}" for key, value in sorted(bad.items())), state, epochs, model)


def _save_finite(checkpoint: TrainingCheckpoint, state: TrainingState, epochs: int, model: TwoTowerModel) -> None:
    """``checkpoint.save(state)`` unless a weight is NaN or infinite (``TrainingDiverged`` then).

    A step with a finite loss can still overflow the weights it updates; the next step's loss would
    show it, but a checkpoint of those weights would already be on disk. A save reads every
    variable anyway, so checking them first costs one more pass, at saves only.
    """
    for variable in model.trainable_variables:
        if not bool(tf.reduce_all(tf.math.is_finite(variable))):
            raise _diverged(f"the weights of {variable.name} are no longer finite", state, epochs, model)
    checkpoint.save(state)


def _diverged(what: str, state: TrainingState, epochs: int, model: TwoTowerModel) -> TrainingDiverged:
    try:
        rate = f" (now {float(model.optimizer.learning_rate):g})"
    except (AttributeError, TypeError, ValueError):  # no optimizer, or a schedule
        rate = ""
    # A save at an epoch's last step comes after the epoch's logs, when the state points at the next epoch.
    where = f"end of epoch {state.epoch}/{epochs}" if state.batch == 0 else (
        f"epoch {state.epoch + 1}/{epochs}, batch {state.batch}")
    return TrainingDiverged(
        f"training diverged at step {state.steps} ({where}): "
        f"{what}; lower train.learning_rate{rate}, or check the numeric feature values (huge or "
        "heavy-tailed values: scale them or set log: true on the feature)"
    )


def step_function(model: TwoTowerModel, input_signature: list | None = None,
                  from_iterator: bool = False) -> Callable[[Any], dict]:
    """One training step of ``model`` (compiled with its optimizer) under the current strategy.

    Each replica runs ``model.train_step`` on its share of the global batch;
    their logged values are shares of the global ones and are summed, as
    tf-keras does off TPU. ``input_signature``: traced once for it (None: a
    trace per new batch shape). ``from_iterator``: the step takes an iterator and trains on its
    next batch (a per-worker iterator under ``ClusterCoordinator``: ``WorkerFedClicks``).
    """
    strategy = tf.distribute.get_strategy()

    @tf.function(input_signature=input_signature)
    def step(batch):
        if from_iterator:
            batch = next(batch)
        logs = strategy.run(model.train_step, args=(batch,))
        # One value at a time: MultiWorkerMirroredStrategy.reduce takes no nested structure.
        return {key: strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None) for key, value in logs.items()}

    return step


def steps_function(model: TwoTowerModel, dtypes: dict[str, tf.DType]) -> Callable[[Any, tf.Tensor], dict]:
    """Up to ``count`` training steps of ``model`` in one call, on one device (``train.steps_per_execution``).

    ``run(iterator, count)`` trains on the next ``count`` batches of ``iterator`` in a graph loop
    and returns each logged value per step, ``{key: [steps]}`` (``dtypes``: the keys and dtypes
    ``model.train_step`` logs), fewer than ``count`` when the iterator ends first. The steps are
    ``step_function``'s, one after the other, without a return to Python between them.
    """

    @tf.function
    def run(iterator, count):
        arrays = {key: tf.TensorArray(dtype, size=0, dynamic_size=True, element_shape=tf.TensorShape([]))
                  for key, dtype in dtypes.items()}
        done = tf.constant(0)
        for _ in tf.range(count):
            batch = iterator.get_next_as_optional()
            if not batch.has_value():
                break
            logs = model.train_step(batch.get_value())
            arrays = {key: array.write(done, logs[key]) for key, array in arrays.items()}
            done += 1
        return {key: array.stack() for key, array in arrays.items()}

    return run


def resident_steps_function(model: TwoTowerModel, columns: dict[str, tf.Tensor], batch_size: int,
                            dtypes: dict[str, tf.DType]) -> Callable[[tf.Tensor, tf.Tensor, tf.Tensor], dict]:
    """``steps_function`` over batches cut inside the graph from ``columns`` held in memory (a
    ``FrameClicks``'s): ``run(rows, first_batch, count)`` trains on batches ``first_batch`` ..
    ``first_batch + count - 1`` of the epoch whose row order is ``rows`` (``FrameClicks.epoch_rows``),
    the same batches ``FrameClicks.epoch`` yields, with no input pipeline between the steps."""

    @tf.function
    def run(rows, first_batch, count):
        arrays = {key: tf.TensorArray(dtype, size=0, dynamic_size=True, element_shape=tf.TensorShape([]))
                  for key, dtype in dtypes.items()}
        total = tf.shape(rows, out_type=tf.int64)[0]
        done = tf.constant(0)
        for _ in tf.range(count):
            start = (first_batch + tf.cast(done, tf.int64)) * batch_size
            if start >= total:
                break
            index = rows[start : tf.minimum(start + batch_size, total)]
            logs = model.train_step({name: tf.gather(values, index) for name, values in columns.items()})
            arrays = {key: array.write(done, logs[key]) for key, array in arrays.items()}
            done += 1
        return {key: array.stack() for key, array in arrays.items()}

    return run


class _Executions:
    """A run's calls of the step: each call's logged values, one dict a step.

    One step a call (``step_function``; scheduled on a worker under a ``ClusterCoordinator``),
    or with ``per_call > 1`` on one device up to that many (``steps_function``): a call then ends
    at the epoch's end and at a step ``checkpoint.every_steps`` names, so step-based saves land
    where they would with one step a call. Every step of such a run is the graph loop's: where a
    call ends changes no value, so a resumed run's steps are bit for bit the uninterrupted one's.
    A ``FrameClicks`` is then read in the graph loop itself (``resident_steps_function``): its
    columns are in memory, and each call cuts its batches from them with no ``tf.data`` pipeline.
    """

    def __init__(self, model: TwoTowerModel, source: ClickSource, per_call: int,
                 coordinator: tf.distribute.coordinator.ClusterCoordinator | None):
        self.model, self.source, self.coordinator = model, source, coordinator
        self.per_call = per_call if coordinator is None and not tf.distribute.has_strategy() else 1
        self._step: Callable[[Any], dict] | None = None
        self._steps: Callable[..., dict] | None = None

    def epoch(self, batches, state: TrainingState, checkpoint: TrainingCheckpoint | None):
        """The calls of one epoch's ``batches`` (``distributed_epoch``), from ``state`` on; the
        caller advances ``state`` by each call's steps before asking for the next."""
        if self.per_call == 1:
            yield from self._single_steps(batches)
            return
        if self._steps is None:
            # No variable may be created inside a graph loop: the optimizer's slots are made now
            # (as a checkpoint restore makes them: zeros), and a trace of the step shows what it logs.
            self.model.optimizer.build(self.model.trainable_variables)
            logged = tf.function(self.model.train_step).get_concrete_function(batches.element_spec).structured_outputs
            dtypes = {key: value.dtype for key, value in logged.items()}
            if isinstance(self.source, FrameClicks):
                self._steps = resident_steps_function(self.model, self.source.columns, self.source.batch_size, dtypes)
            else:
                self._steps = steps_function(self.model, dtypes)
        steps = self._steps
        if isinstance(self.source, FrameClicks):
            rows = self.source.epoch_rows(state.epoch)

            def run(count):
                return steps(rows, tf.constant(state.batch, tf.int64), count)
        else:
            iterator = iter(batches)

            def run(count):
                return steps(iterator, count)
        while True:
            count = min(self.per_call, self.source.steps_per_epoch - state.batch)
            every = checkpoint.every_steps if checkpoint is not None else None
            if every:
                count = min(count, every - state.steps % every)
            if count <= 0:
                return
            values = {key: value.numpy() for key, value in run(tf.constant(count)).items()}
            done = len(next(iter(values.values())))
            if done:
                yield [{key: value[i] for key, value in values.items()} for i in range(done)]
            if done < count:  # the epoch ended early (a stream cut by a read error)
                return

    def _single_steps(self, batches):
        if self._step is None:
            # Several workers trace once, for any batch shape: a trace per new shape would come at other
            # steps on workers whose batches differ (their own shards), and a worker tracing its
            # collectives alone waits for its peers.
            self._step = step_function(self.model, [batches.element_spec] if worker_count() > 1 else None,
                                       from_iterator=isinstance(self.source, WorkerFedClicks))
        step = self._step
        for batch in batches:
            yield [step(batch) if self.coordinator is None else self.coordinator.schedule(step, args=(batch,))]


def distributed_epoch(source: ClickSource, epoch: int, skip_batches: int = 0):
    """Epoch ``epoch`` of ``source`` (less its first ``skip_batches`` steps) as the loop iterates it
    under the current strategy.

    Without a strategy, ``source.epoch``; under ``ParameterServerStrategy`` too: the chief reads
    the batches and schedules each one on a worker (``train_epochs``), unless the workers read them
    (a ``WorkerFedClicks``: the per-worker iterator once a step, ``WorkerFedClicks.worker_steps``).
    Under another, each replica gets its share of every global batch: with several workers a
    ``StreamedClicks`` is read by each worker on its own shards (``StreamedClicks.worker_epoch``, through
    ``distribute_datasets_from_function``); otherwise every worker makes the
    whole epoch and ``experimental_distribute_dataset`` splits each global batch
    over the replicas (under ``multi_worker`` each worker keeps its part): a
    ``FrameClicks``, or a ``StreamedClicks`` of a log held in memory (``ClickTable``).
    """
    coordinator = chief_coordinator() if tf.distribute.has_strategy() else None
    if isinstance(source, WorkerFedClicks):
        if coordinator is None:
            raise ValueError("batches staged for the workers (train.parameter_server.input: workers) are read by "
                             "a parameter-server cluster's workers: train under its strategy")
        return source.worker_steps(coordinator, skip_batches)
    if not tf.distribute.has_strategy() or coordinator is not None:
        return source.epoch(epoch, skip_batches=skip_batches)
    strategy = tf.distribute.get_strategy()
    if isinstance(source, StreamedClicks) and source.reads_own_shards and worker_count(strategy) > 1:
        return strategy.distribute_datasets_from_function(
            lambda context: source.worker_epoch(epoch, skip_batches, context)
        )
    return strategy.experimental_distribute_dataset(source.epoch(epoch, skip_batches=skip_batches))


@dataclasses.dataclass
class _Pending:
    """A step run or scheduled: its position and its logged values (tensors, or a ``RemoteValue``
    of them under a ``ClusterCoordinator``)."""

    batch: int
    steps: int
    outputs: Any


@contextlib.contextmanager
def _cluster_errors(state: TrainingState):
    """A lost ps task (``UnavailableError`` and kin out of the coordinator, or out of a read of the
    variables on the chief: a save, the validation recall) as a ``ClusterError``."""
    try:
        yield
    except (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError) as error:
        first = (str(error).strip().splitlines() or [""])[0][:200]
        raise ClusterError(
            f"the parameter-server cluster failed by step {state.steps} ({type(error).__name__}: {first}); "
            "start its tasks again and re-run the job with the same run.name: it resumes from the last checkpoint"
        ) from error


def _settle(pending: list[_Pending], state: TrainingState, epochs: int, model: TwoTowerModel) -> int:
    """Read the values of the ``pending`` steps (waiting for scheduled ones) into ``state.epoch_sums``,
    stopping at the first that diverged; empty ``pending`` and return how many were read.

    Raises:
      TrainingDiverged: a step's loss or regularization was not finite.
    """
    count = len(pending)
    for done in pending:
        outputs: Any = done.outputs.fetch() if hasattr(done.outputs, "fetch") else done.outputs
        values = {key: float(value) for key, value in outputs.items()}
        # before any save: a NaN state is never checkpointed
        _stop_if_diverged(values, dataclasses.replace(state, batch=done.batch, steps=done.steps), epochs, model)
        for key, value in values.items():
            state.epoch_sums[key] = state.epoch_sums.get(key, 0.0) + value
    pending.clear()
    return count


def train_epochs(
    model: TwoTowerModel,
    source: ClickSource,
    epochs: int,
    *,
    state: TrainingState | None = None,
    checkpoint: TrainingCheckpoint | None = None,
    logs: RunLogs | None = None,
    hooks: Sequence[EpochHook] = (),
    verbose: int | str = 2,
    say: Callable[[str], None] = print,
    eta_bound: bool = False,
    steps_per_execution: int = 1,
) -> TrainingState:
    """Train ``model`` (compiled with its optimizer) on ``source`` up to the end of epoch ``epochs``.

    Args:
      model: the model; run under the strategy scope it was built in.
      source: the training batches (``FrameClicks`` or ``StreamedClicks``).
      epochs: the last epoch (1-based) to train.
      state: where to start (a restored checkpoint's state); None = the beginning.
      checkpoint: saves the variables and the state every ``every_steps`` steps
        (a save due on an epoch's last step waits for that epoch's logs).
      logs: where each finished epoch's values go (``train_log.csv``, TensorBoard).
      hooks: called as ``hook(epoch, logs)`` (0-based epoch) after each epoch,
        in order, on one dict they may add to (early stopping adds its
        validation recall); a hook returning True stops training after that
        epoch, and one that raises abandons it.
      verbose: ``train.verbose``; ``say`` prints the lines.
      eta_bound: early stopping may stop the run at any epoch: the lines give no run ETA, only the epoch's end.
      steps_per_execution: steps a call of the step runs on one device (``train.steps_per_execution``,
        ``steps_function``); the same steps, values and checkpoints by steps as one step a call.

    Returns:
      The final state; its ``history`` holds, per epoch, the mean over the
      epoch's batches of every value ``train_step`` logs (``loss``,
      ``regularization_loss``, ``total_loss``) and what the hooks added; its
      ``timing`` the wall time of each epoch.

    Under ``ParameterServerStrategy`` (``chief_coordinator``) each batch is scheduled on a worker
    and the steps' values are read at the end of the epoch and before each checkpoint, which
    therefore holds every step scheduled before it; a step's divergence is found then.

    Raises:
      DataError: the source could not read a file mid-epoch (``ClickSource.check_epoch``).
      ClusterError: under ``ParameterServerStrategy``, a ps task is gone.
    """
    state = state if state is not None else TrainingState()
    progress = _Progress(verbosity(verbose), source, epochs, state, say, eta_bound)
    if logs is not None and state.history:
        logs.write(state.history, range(state.epoch))  # a resumed run's directory starts with the epochs before it
    if steps_per_execution < 1:
        raise ValueError(f"train.steps_per_execution must be at least 1, got {steps_per_execution}")
    coordinator = chief_coordinator()
    executions = _Executions(model, source, steps_per_execution, coordinator)
    # A lost worker's steps are rescheduled by the coordinator; a lost ps task fails the run.
    with _cluster_errors(state) if coordinator is not None else contextlib.nullcontext():
        _train(model, source, epochs, state, checkpoint, logs, hooks, progress, coordinator, executions)
    return state


def _train(
    model: TwoTowerModel,
    source: ClickSource,
    epochs: int,
    state: TrainingState,
    checkpoint: TrainingCheckpoint | None,
    logs: RunLogs | None,
    hooks: Sequence[EpochHook],
    progress: _Progress,
    coordinator: tf.distribute.coordinator.ClusterCoordinator | None,
    executions: _Executions,
) -> None:
    """``train_epochs``'s loop, advancing ``state`` (see there)."""
    while state.epoch < epochs:
        started, first_batch, settled = time.perf_counter(), state.batch, state.batch
        save_at_epoch_end = False
        model.reset_metrics()
        batches = distributed_epoch(source, state.epoch, state.batch)
        pending: list[_Pending] = []  # steps whose values are not read yet
        for call in executions.epoch(batches, state, checkpoint):
            for outputs in call:
                state.batch += 1
                state.steps += 1
                pending.append(_Pending(state.batch, state.steps, outputs))
            due = checkpoint is not None and checkpoint.due(state)
            # One device reads each step's values at once; the coordinator's steps run on the workers
            # meanwhile and are read at the end of the epoch, or before a checkpoint (which must hold
            # every step scheduled so far).
            if coordinator is None or (due and state.batch != source.steps_per_epoch):
                settled += _settle(pending, state, epochs, model)
            progress.step(state, settled, len(call))
            if checkpoint is not None and due:
                if state.batch == source.steps_per_epoch:
                    save_at_epoch_end = True
                else:
                    _save_finite(checkpoint, state, epochs, model)
        settled += _settle(pending, state, epochs, model)
        source.check_epoch()  # a shard unreadable mid-epoch: its DataError, raised out here
        if state.batch == 0:
            raise ValueError("the training data yielded no batch")
        seconds = time.perf_counter() - started
        clicks = min(state.batch * source.batch_size, source.rows) - first_batch * source.batch_size
        epoch_logs = {key: total / state.batch for key, total in state.epoch_sums.items()}
        stop = False
        for hook in hooks:
            stop = bool(hook(state.epoch, epoch_logs)) or stop
        # The hooks' own time (early stopping's validation pass, best-weight copies): part of the epoch's
        # wall time, kept apart from the training time the throughput is of.
        timing = {"epoch_seconds": seconds, "clicks_per_second": clicks / max(seconds, 1e-9),
                  "hook_seconds": time.perf_counter() - started - seconds}
        for record, values in ((state.history, epoch_logs), (state.timing, timing)):
            for key, value in values.items():
                record.setdefault(key, []).append(float(value))
        progress.epoch(state.epoch, epoch_logs, timing)
        state.epoch, state.batch, state.epoch_sums = state.epoch + 1, 0, {}
        if logs is not None:
            logs.write(state.history, range(state.epoch - 1, state.epoch))
        if save_at_epoch_end and checkpoint is not None:
            _save_finite(checkpoint, state, epochs, model)
        if stop:
            break
