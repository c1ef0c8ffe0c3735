"""A whole training run: the early-stopping selection, then the final run, checkpointed."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pandas as pd
import tensorflow as tf

from retrieval.config import SplitConfig, TrainConfig
from retrieval.model import TwoTowerModel
from retrieval.towers import IdDropout
from retrieval.training.checkpoints import TrainingCheckpoint, TrainingState, write_weights
from retrieval.training.early_stopping import ValidationData, ValidationRecall
from retrieval.training.loop import EpochHook, RunLogs, train_epochs
from retrieval.training.optimizers import make_optimizer
from retrieval.training.runtime import seed_everything
from retrieval.training.sources import ClickSource, FrameClicks
from retrieval.training.worker_input import fed_by

log = logging.getLogger("retrieval")

SELECTION = "selection"  # the early-stopping selection's checkpoints, under the run's checkpoint directory


def fit(
    model: TwoTowerModel,
    train: pd.DataFrame | ClickSource,
    config: TrainConfig,
    *,
    log_dir: Path | None = None,
    split: SplitConfig | None = None,
    checkpoint_dir: Path | None = None,
    on_epoch_end: Callable[[int, dict], None] | None = None,
    epoch_hooks: Sequence[EpochHook] = (),
    say: Callable[[str], None] = print,
    timing: dict[str, list[float]] | None = None,
    validation: ValidationData | None = None,
    prepare_optimizer: Callable[[tf.keras.optimizers.Optimizer], None] | None = None,
) -> dict[str, list[float]]:
    """Train ``model`` on the training clicks; return the per-epoch history.

    With ``config.validation_fraction > 0`` the number of epochs is chosen by
    early stopping on a validation part carved from ``train`` the way ``split``
    carves the test part (``validation_split``); see ``select_epochs``.

    With ``checkpoint_dir`` and ``config.checkpoint_every_seconds`` (or
    ``checkpoint_every_steps``) the training state is saved there as it goes (``TrainingCheckpoint``), and a call that
    finds a checkpoint (the same job started again after being killed)
    resumes from it: weights, optimizer slots, sampler state, data position
    and the logs so far, so it ends with the weights an uninterrupted run
    ends with. The early-stopping selection is checkpointed alike, in
    ``checkpoint_dir/selection`` (``select_epochs``); once it is done its result
    is in the final run's checkpoint and a resume does not repeat it.

    Args:
      model: a built two-tower model; call under the strategy scope it was built in.
      train: training click frame (canonical columns), training examples
        holding every tower input (``retrieval.features.training_examples``),
        or a ``ClickSource`` (``StreamedClicks``; early stopping then needs ``validation``).
      config: optimiser, epochs, batch size, seed, checkpoint interval.
      log_dir: if given, each epoch's values go to ``train_log.csv`` there and to
        TensorBoard event files under ``tensorboard/train``; an early-stopping selection
        followed by a refit logs its own epochs (validation recall included) to
        ``selection_log.csv`` and ``tensorboard/selection``.
      split: how the test part was split (the validation part is carved alike);
        None = temporal when the clicks have timestamps, else random.
      checkpoint_dir: where to save and look for checkpoints; None = none.
      on_epoch_end: called as ``on_epoch_end(epoch, logs)`` (0-based epoch) after each epoch of the
        early-stopping selection run, ``logs`` holding ``val_recall@<validation_k>`` and ``val_ndcg@<validation_k>``;
        it may raise to
        stop training (pipelines/tune.py prunes trials this way). Not called without early stopping.
      epoch_hooks: called as ``hook(epoch, logs)`` after every epoch of every run, the early-stopping
        selection's (before ``on_epoch_end``) and the final one's; one that raises abandons training
        (the job checks this way that the shards it streams did not change).
      say: prints progress lines (``config.verbose`` says how many).
      timing: if given, filled with the final run's ``epoch_seconds``,
        ``clicks_per_second`` and ``hook_seconds`` (validation included) per epoch
        (kept out of the history, which is a pure function of the seed).
      validation: the early-stopping data; None = carved from ``train`` (a frame) by
        ``validation_split``.
      prepare_optimizer: called with the new optimizer before training (and before a resume restores
        its checkpoint over it): a warm start fills its slots with the parent's
        (``retrieval.training.warm_start.carry_optimizer``).
    """
    seed_everything(config.seed)
    source = FrameClicks(train, config.batch_size, seed=config.seed) if isinstance(train, pd.DataFrame) else train
    optimizer = make_optimizer(config)
    if prepare_optimizer is not None:
        prepare_optimizer(optimizer)
    checkpoint, state, selection_dir = None, None, None
    if checkpoint_dir is not None and config.checkpoints:
        if config.validation_fraction > 0:
            selection_dir = Path(checkpoint_dir) / SELECTION
        if config.validation_fraction == 0 or config.refit:  # without a refit the selection run is the training run
            optimizer.build(model.trainable_variables)  # slots exist before a restore fills them
            checkpoint = TrainingCheckpoint(
                checkpoint_dir, model, optimizer,
                every_seconds=config.checkpoint_every_seconds, every_steps=config.checkpoint_every_steps,
            )
            state = checkpoint.restore()
    # Every log writer opened below is closed when fit ends, returning or raising: one stack holds them all.
    with ExitStack() as stack:
        logs = stack.enter_context(RunLogs(log_dir)) if log_dir is not None else None
        epochs, selection = config.epochs, dict[str, list[float]]()
        if checkpoint is not None and state is not None:
            if state.selection:
                epochs = _refit_epochs(config, int(state.selection["best_epoch"][0]))
                log.info("early-stopping selection was done before the checkpoint (best epoch %d): not repeated",
                         epochs)
            log.info("resuming from step %d (epoch %d/%d, batch %d/%d) of %s",
                     state.steps, state.epoch + 1, epochs, state.batch, source.steps_per_epoch, checkpoint.latest)
            if _has_dropout(model):
                log.warning(
                    "the towers use dropout, whose random masks are not checkpointed (TF stateful random ops): "
                    "the resumed run is statistically, not bit for bit, the uninterrupted one"
                )
        elif config.validation_fraction > 0:
            if validation is None:
                if not isinstance(train, pd.DataFrame):
                    raise ValueError(
                        f"train.validation_fraction={config.validation_fraction} (early stopping) on a ClickSource "
                        "needs its ValidationData (the job carves it from the shards with plan_validation)"
                    )
                validation = ValidationData.from_frame(
                    train, config.validation_fraction, config.batch_size, config.seed, split
                )
            hooks = [*epoch_hooks, *([] if on_epoch_end is None else [on_epoch_end])]
            # Without a refit the selection run is the training run: it gets the logs.
            # A refit from the best weights goes on with the selection's optimizer: fresh Adam moments
            # would make its first steps as large as training from scratch.
            onward = optimizer if config.refit and config.refit_from == "best" else None
            selection_logs = logs
            if config.refit and log_dir is not None:
                selection_logs = stack.enter_context(RunLogs(log_dir, "selection"))
            best, selection = select_epochs(model, validation, config, hooks, selection_logs, say,
                                            checkpoint_dir=selection_dir, timing=None if config.refit else timing,
                                            optimizer=onward)
            epochs = _refit_epochs(config, best)
            say(selection_summary(config, selection))
            if not config.refit:
                return selection
            state = TrainingState(selection=selection)
            if checkpoint is not None:
                checkpoint.save(state)  # the state the final run starts from: a resume need not repeat the selection
        model.compile(optimizer=optimizer)
        with fed_by(source, config.parameter_server) as batches:
            state = train_epochs(model, batches, epochs, state=state, checkpoint=checkpoint, logs=logs,
                                 hooks=epoch_hooks, verbose=config.verbose, say=say,
                                 steps_per_execution=config.steps_per_call)
        if checkpoint is not None:
            checkpoint.save(state)  # the end state: a job killed after training does not train again
        if timing is not None:
            timing.update(state.timing)
        return {**state.selection, **state.history}


def select_epochs(
    model: TwoTowerModel,
    validation: ValidationData,
    config: TrainConfig,
    hooks: list | None = None,
    logs: RunLogs | None = None,
    say: Callable[[str], None] = print,
    checkpoint_dir: Path | None = None,
    timing: dict[str, list[float]] | None = None,
    optimizer: tf.keras.optimizers.Optimizer | None = None,
) -> tuple[int, dict[str, list[float]]]:
    """Early stopping: train on the fit part, watch ``ValidationRecall``, pick the best epoch.

    With ``config.refit`` and ``refit_from: initial`` the model is put back to
    its initial weights (the caller retrains on all of ``train`` for the
    returned number of epochs); otherwise it keeps the best epoch's weights
    (which ``refit_from: best`` trains on from there).

    With ``checkpoint_dir`` the run is checkpointed there (``TrainingCheckpoint``,
    the final run's interval) and a call that finds a checkpoint resumes it,
    the validation recalls so far coming back with its state; without a refit
    each new best epoch's weights are written to ``checkpoint_dir/best``.
    ``timing``, if given, gets the run's ``epoch_seconds``, ``clicks_per_second`` and ``hook_seconds``.
    ``optimizer``: the one to train with (a refit from the best weights goes on with its moments);
    None = a new one.

    Returns:
      ``(best_epoch, history)``, the history holding the selection run's
      ``selection_loss`` and ``val_recall@k`` per epoch and ``best_epoch``
      (without a refit, also everything the selection run logged).
    """
    restart = config.refit and config.refit_from == "initial"  # else the run keeps the best weights
    # Before a restore: the weights the seed built, where a refit starts (a copy of every table,
    # so only when there is one).
    initial = model.get_weights() if restart else None
    # Without checkpoints the best epoch's weights are copied in memory; with them, saved beside them.
    watch = ValidationRecall(model, validation.validation, validation.fit_clicks, config.validation_k,
                             config.early_stopping_patience, keep_weights=not restart and checkpoint_dir is None,
                             metric=config.validation_metric)
    all_hooks: list = [watch]
    optimizer = optimizer or make_optimizer(config)
    checkpoint, state = None, None
    best = tf.train.Checkpoint(model=model)
    best_prefix = str(Path(checkpoint_dir or ".") / "best" / "weights")
    if checkpoint_dir is not None:
        optimizer.build(model.trainable_variables)  # slots exist before a restore fills them
        checkpoint = TrainingCheckpoint(checkpoint_dir, model, optimizer, every_seconds=config.checkpoint_every_seconds,
                                        every_steps=config.checkpoint_every_steps)
        state = checkpoint.restore()
        if state is not None:
            watch.resume(state.history)
            log.info("early-stopping selection resumed (%d epochs done, best so far: epoch %d)",
                     state.epoch, watch.best_epoch)
        if not restart:

            def save_best(epoch: int, logs: dict) -> None:
                if watch.best_epoch == epoch + 1:
                    write_weights(best, best_prefix)  # one copy under multi_worker (the chief's)

            all_hooks.append(save_best)
    all_hooks += hooks or []
    model.compile(optimizer=optimizer)
    if state is None or not watch.stopped:  # a selection killed after its last epoch is not trained again
        with fed_by(validation.fit_source, config.parameter_server) as batches:
            state = train_epochs(model, batches, config.epochs, state=state, checkpoint=checkpoint,
                                 logs=logs, hooks=all_hooks, verbose=config.verbose, say=say, eta_bound=True,
                                 steps_per_execution=config.steps_per_call)
    if timing is not None:
        timing.update(state.timing)
    if initial is not None:
        model.set_weights(initial)
    elif watch.best_weights is not None:
        model.set_weights(watch.best_weights)
    elif watch.best_epoch != len(watch.values):  # the last epoch is the best: its weights are the model's
        best.read(best_prefix).assert_existing_objects_matched()
    seed_everything(config.seed)
    return watch.best_epoch, {
        **({} if config.refit else state.history),
        "selection_loss": state.history["loss"],
        **watch.keys,
        "best_epoch": [float(watch.best_epoch)],
    }


def training_summary(config: TrainConfig, history: dict[str, list[float]]) -> dict[str, Any]:
    """What the run trained, for ``metrics.json`` and the report (``fit``'s history, plain numbers).

    ``epochs`` and ``loss`` are those of the run whose weights are served; ``early_stopping``
    (None without it) the selection: its best epoch, its validation recall and loss per epoch,
    and what followed (``refit``: ``"initial"``, ``"best"`` or ``"none"``).
    """
    summary: dict[str, Any] = {
        "epochs": len(history["loss"]),
        "max_epochs": config.epochs,
        "loss": [float(value) for value in history["loss"]],
        "early_stopping": None,
    }
    key = f"val_recall@{config.validation_k}"
    if key in history:
        ndcg = f"val_ndcg@{config.validation_k}"
        summary["early_stopping"] = {
            "best_epoch": int(history["best_epoch"][0]),
            "epochs_run": len(history[key]),
            "metric": config.validation_metric,
            key: [float(value) for value in history[key]],
            **({ndcg: [float(value) for value in history[ndcg]]} if ndcg in history else {}),
            "selection_loss": [float(value) for value in history["selection_loss"]],
            "refit": config.refit_from if config.refit else "none",
            "message": selection_summary(config, history),
        }
    return summary


def selection_summary(config: TrainConfig, selection: dict[str, list[float]]) -> str:
    """One line saying what early stopping chose and what training does next (``select_epochs``'s history)."""
    best = int(selection["best_epoch"][0])
    key = f"val_{config.validation_metric}@{config.validation_k}"
    values = selection[key]
    line = f"early stopping: best epoch {best} of {len(values)} run ({key} {values[best - 1]:.4f})"
    if not config.refit:
        return line + "; keeping its weights"
    if config.refit_from == "best":
        return line + f"; training on from its weights on all training clicks for {config.refit_epochs} epochs"
    return line + f"; retraining from the initial weights on all training clicks for {best} epochs"


def _refit_epochs(config: TrainConfig, best_epoch: int) -> int:
    """Epochs of the final run after the selection: the best number from the initial weights,
    ``refit_epochs`` from the best weights."""
    return best_epoch if config.refit_from == "initial" else config.refit_epochs


def _has_dropout(model: tf.keras.Model) -> bool:
    return any(
        isinstance(layer, (tf.keras.layers.Dropout, IdDropout)) and float(layer.rate) > 0
        for layer in model.submodules
        if isinstance(layer, tf.keras.layers.Layer)
    )
