"""Hyper-parameter search over config keys with Optuna: a declared space, pruning, a resumable study.

``python -m pipelines.tune --config configs/default.yaml --trials 20`` (``make tune``). Each trial
is the main job (``jobs.train_evaluate_export``) on the base config with the trial's values; its
value is the job's ``model`` metric (``recall@20`` by default) on a validation part, never on the
test part: with a temporal, random or leave_last_k split every trial sets
``split.evaluate_on: validation``, so it drops the test part, splits the training part again the
same way and trains on the rest (``retrieval.data.splits.split_validation``); with
``split.kind: none`` the given ``data.test_clicks`` is scored, so give a validation file there
(``make bench-public`` gives ``valid.txt``). Trials are sampled by TPE (Bergstra et al., NeurIPS 2011) and
stopped early by the median rule (Golovin et al., KDD 2017: Google Vizier) on the validation recall
that early stopping computes after each epoch (``train.validation_fraction > 0``).

The study folder holds:

- ``study.db``: the Optuna study (SQLite). The same command again continues it: ``--trials N`` is
  the total number of finished trials wanted, so finished trials are never redone; a trial left
  running by a killed process is marked failed and its values are tried again first.
- ``trials.csv``: every trial (number, state, value: the metric of a complete trial, seconds,
  per-epoch validation recall, the searched values).
- ``best.yaml``: the base config with the best trial's values, a complete config for
  ``make train CONFIG=<study>/best.yaml`` (its ``split.evaluate_on`` is the base config's own, so
  that run trains on the whole training part and is scored on the test part); ``best.json`` its
  trial, value and values.
- ``runs/``: each trial's run directory, deleted once its metrics are read (``keep_bundles``
  keeps them).

The package's modules: ``space`` (the search space file, ``Param``, what every trial sets, the
dotted-key helpers and the errors), ``study`` (the Optuna study: resume, trials, pruning,
``trials.csv`` and ``best.yaml``). The job a trial runs, ``train_evaluate_export``, is read through
this package at call time, so replacing it here (as tests do) takes effect.
"""

from retrieval.jobs import train_evaluate_export
from retrieval.tuning.space import (
    TRIAL_SETTINGS,
    Param,
    SearchSpaceError,
    TuneError,
    load_space,
    scored_on,
    trial_settings,
    value_at,
    with_values,
)
from retrieval.tuning.study import (
    RUNS_DIR,
    STUDY_FILE,
    STUDY_NAME,
    TuneSettings,
    _open_study,
    finished_trials,
    run_study,
    storage_url,
    write_outputs,
)

__all__ = [
    "RUNS_DIR",
    "STUDY_FILE",
    "STUDY_NAME",
    "TRIAL_SETTINGS",
    "Param",
    "SearchSpaceError",
    "TuneError",
    "TuneSettings",
    "_open_study",
    "finished_trials",
    "load_space",
    "run_study",
    "scored_on",
    "storage_url",
    "train_evaluate_export",
    "trial_settings",
    "value_at",
    "with_values",
    "write_outputs",
]
