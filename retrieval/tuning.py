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
"""

from __future__ import annotations

import csv
import fcntl
import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import optuna
import yaml
from optuna.trial import FrozenTrial, TrialState

from retrieval.config import Config, ConfigError
from retrieval.jobs import train_evaluate_export

log = logging.getLogger("retrieval")

STUDY_NAME = "tune"
STUDY_FILE = "study.db"
RUNS_DIR = "runs"

# What every trial sets on top of the base config: they change what a trial costs, where it writes
# and which part scores it, not the settings searched, so best.yaml leaves them out (the base
# config's values stay there). The baselines are scored once by `make train`, not per trial; a
# killed trial is tried again from the start, so it writes no checkpoints. `trial_settings` adds
# split.evaluate_on: validation where the config splits the log itself.
TRIAL_SETTINGS: dict[str, Any] = {
    "evaluation.baselines.rankers": [],
    "evaluation.plots": False,
    "train.checkpoint_every_seconds": 0,
    "train.checkpoint_every_steps": 0,
    "run.overwrite": True,
}


def trial_settings(base: Config) -> dict[str, Any]:
    """``TRIAL_SETTINGS``, plus ``split.evaluate_on: validation`` unless ``base.split.kind`` is ``none``.

    Selecting settings by their score on the test part would overfit them to it (the test figure of
    the best config would be biased upwards), so a trial is scored on a validation part carved from
    the training part. With ``split.kind: none`` the given ``data.test_clicks`` is what the user
    chose to score on (a validation file when tuning), and there is no split to repeat.
    """
    settings = dict(TRIAL_SETTINGS)
    if base.split.kind != "none":
        settings["split.evaluate_on"] = "validation"
    return settings


def scored_on(base: Config) -> str:
    """In words, which clicks score the trials of ``base`` (for logs and the CLI)."""
    if base.split.kind == "none":
        return "the given data.test_clicks (split.kind: none): pass a validation file there, not the test file"
    return (f"a validation part: the training part of the {base.split.kind} split, split again the same way "
            "(split.evaluate_on: validation); the test part is never read")


class TuneError(ValueError):
    """A study cannot run as asked (bad metric, another process, a resume with another config)."""


class SearchSpaceError(TuneError):
    """The search space file is invalid; the message names the file and the key."""


@dataclass(frozen=True)
class Param:
    """One searched config key.

    Attributes:
      key: dotted config key, e.g. ``model.temperature``.
      type: ``float`` and ``int`` search ``[low, high]`` (``log``: uniformly in log space; ``step``:
        a grid), ``categorical`` picks one of ``choices`` (bool, int, float or str).
    """

    key: str
    type: Literal["float", "int", "categorical"]
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: tuple[Any, ...] = ()

    def suggest(self, trial: optuna.Trial) -> Any:
        """The trial's value of this key (recorded in the study under ``key``)."""
        if self.type == "categorical":
            return trial.suggest_categorical(self.key, list(self.choices))
        assert self.low is not None and self.high is not None  # __post_init__ checked them
        if self.type == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.key, float(self.low), float(self.high), step=self.step, log=self.log)

    def contains(self, value: Any) -> bool:
        """Whether ``value`` is a point of this key's space (the base config's value may not be)."""
        if self.type == "categorical":
            return any(type(value) is type(choice) and value == choice for choice in self.choices)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.type == "int" and not float(value).is_integer():
            return False
        assert self.low is not None and self.high is not None
        if not self.low <= value <= self.high:
            return False
        return self.step is None or math.isclose(((value - self.low) / self.step) % 1, 0, abs_tol=1e-9)

    def endpoints(self) -> list[Any]:
        """Values checked against the config before any training: the bounds, or every choice."""
        if self.type == "categorical":
            return list(self.choices)
        assert self.low is not None and self.high is not None
        if self.type == "int":
            return [int(self.low), int(self.high)]
        return [float(self.low), float(self.high)]

    def to_dict(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"type": self.type}
        if self.type == "categorical":
            spec["choices"] = list(self.choices)
        else:
            spec.update(low=self.low, high=self.high, log=self.log)
            if self.step is not None:
                spec["step"] = self.step
        return spec


_SPEC_KEYS = {"float": {"type", "low", "high", "log", "step"}, "int": {"type", "low", "high", "log", "step"},
              "categorical": {"type", "choices"}}


def _param(source: str, key: str, spec: Any) -> Param:
    where = f"search space {source}: {key}"
    if not isinstance(spec, dict):
        raise SearchSpaceError(f"{where}: expected a mapping such as {{type: float, low: 0.01, high: 1}}, got {spec!r}")
    kind = spec.get("type")
    if kind not in _SPEC_KEYS:
        raise SearchSpaceError(f"{where}: type must be one of float, int, categorical, got {kind!r}")
    unknown = sorted(set(spec) - _SPEC_KEYS[kind])
    if unknown:
        valid = sorted(_SPEC_KEYS[kind])
        raise SearchSpaceError(f"{where}: unknown field(s) {unknown} for type {kind}; valid: {valid}")
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise SearchSpaceError(f"{where}: categorical needs a non-empty list of choices, got {choices!r}")
        bad = [c for c in choices if c is not None and not isinstance(c, (bool, int, float, str))]
        if bad:
            raise SearchSpaceError(f"{where}: choices must be bool, int, float or str, got {bad[0]!r}")
        return Param(key, "categorical", choices=tuple(choices))
    step, log_scale = spec.get("step"), spec.get("log", False)
    number = int if kind == "int" else (int, float)
    for name, value in (("low", spec.get("low")), ("high", spec.get("high")), ("step", step)):
        if (value is not None or name != "step") and (isinstance(value, bool) or not isinstance(value, number)):
            raise SearchSpaceError(f"{where}: {name} must be {'an integer' if kind == 'int' else 'a number'}, "
                                   f"got {value!r}")
    cast = int if kind == "int" else float
    low, high = cast(spec["low"]), cast(spec["high"])
    if not isinstance(log_scale, bool):
        raise SearchSpaceError(f"{where}: log must be true or false, got {log_scale!r}")
    if low > high:
        raise SearchSpaceError(f"{where}: low ({low}) is above high ({high})")
    if log_scale and (low <= 0 or step is not None):
        raise SearchSpaceError(f"{where}: log needs low > 0 and no step, got low={low}, step={step}")
    if step is not None and step <= 0:
        raise SearchSpaceError(f"{where}: step must be positive, got {step}")
    return Param(key, kind, low=low, high=high, log=log_scale, step=step)


def load_space(path: str | Path, base: Config) -> list[Param]:
    """Read a search space (YAML: ``config.key: {type, low/high/log/step or choices}``) and check it.

    Every key must be a config key, and each bound or choice must give a valid config when set on
    ``base``, so a typo fails here, before any training.

    Raises:
      SearchSpaceError: naming the file, the key and what is wrong with it.
    """
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SearchSpaceError(f"search space file not found: {path}") from None
    except yaml.YAMLError as error:
        raise SearchSpaceError(f"search space {path}: not valid YAML: {error}") from None
    if not isinstance(raw, dict) or not raw:
        raise SearchSpaceError(f"search space {path}: expected a non-empty mapping of config keys, got {raw!r}")
    space = [_param(str(path), str(key), spec) for key, spec in raw.items()]
    base_raw = base.to_dict()
    for param in space:
        if param.key.startswith("run.") or param.key in trial_settings(base):
            raise SearchSpaceError(f"search space {path}: {param.key} is set by every trial and cannot be searched")
        if param.key.startswith("split."):
            raise SearchSpaceError(
                f"search space {path}: {param.key} cannot be searched: the split decides which clicks score a "
                "trial, so trials with different values would not be compared on the same clicks"
            )
        for value in param.endpoints():
            try:
                Config.from_dict(with_values(base_raw, {param.key: value}), source=f"{param.key}={value!r}")
            except ConfigError as error:
                raise SearchSpaceError(
                    f"search space {path}: key {param.key!r} (value {value!r}) does not give a valid config:\n{error}"
                ) from None
    return space


def with_values(raw: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """A copy of the config dict ``raw`` with each dotted key of ``values`` set (sections created).

    Raises:
      ConfigError: a key passes through a value that is not a section (``train.epochs.x``).
    """
    result = json.loads(json.dumps(raw))
    for key, value in values.items():
        node = result
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if child is None:  # an optional section left unset (data.clicks: null)
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"{key}: {part!r} is not a section")
            node = child
        node[parts[-1]] = value
    return result


def value_at(raw: dict[str, Any], key: str) -> Any:
    """The value of dotted ``key`` in the config dict ``raw`` (None where a section is missing)."""
    node: Any = raw
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


@dataclass(frozen=True)
class TuneSettings:
    """How a study runs (the CLI flags of pipelines/tune.py).

    Attributes:
      metric: the job's ``model`` metric to maximise; its k must be in ``evaluation.ks``.
      seed: seed of the TPE sampler.
      keep_bundles: keep each trial's run directory under ``runs/``.
      pruner_startup_trials: finished trials before the median rule prunes anything.
      pruner_warmup_epochs: epochs of a trial before it can be pruned.
      baseline_trial: a new study's first trial takes the base config's values (those inside
        the space), so the best config found is never worse than the base on the measured metric.
      timeout: stop starting trials after this many seconds (None = no limit).
    """

    metric: str = "recall@20"
    seed: int = 0
    keep_bundles: bool = False
    pruner_startup_trials: int = 3
    pruner_warmup_epochs: int = 1
    baseline_trial: bool = True
    timeout: float | None = None


def storage_url(study_dir: str | Path) -> str:
    """The SQLAlchemy URL of the study's SQLite file."""
    return f"sqlite:///{(Path(study_dir) / STUDY_FILE).resolve()}"


def _flat(raw: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _comparable(config: Config) -> dict[str, Any]:
    """The base config as the study records it: ``run`` (where outputs go) may change on resume."""
    return _flat({k: v for k, v in config.to_dict().items() if k != "run"})


@contextmanager
def _study_lock(study_dir: Path) -> Iterator[None]:
    with open(study_dir / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TuneError(f"another tune process is running the study in {study_dir}") from None
        yield


def _open_study(study_dir: Path, base: Config, space: list[Param], settings: TuneSettings) -> optuna.Study:
    """Create or load the study; check a resumed one was started with the same base config and space."""
    study = optuna.create_study(
        storage=optuna.storages.RDBStorage(storage_url(study_dir)),
        study_name=STUDY_NAME,
        direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=settings.seed),
        pruner=optuna.pruners.MedianPruner(
            n_startup_trials=settings.pruner_startup_trials, n_warmup_steps=settings.pruner_warmup_epochs
        ),
        load_if_exists=True,
    )
    recorded = {
        "base_config": _comparable(base),
        "space": {p.key: p.to_dict() for p in space},
        "metric": settings.metric,
    }
    for name, value in recorded.items():
        before = study.user_attrs.get(name)
        if before is None:
            study.set_user_attr(name, value)
        elif before != value:
            if isinstance(value, dict):
                changed = sorted(k for k in {*before, *value} if before.get(k) != value.get(k))
                what = f"differs at {', '.join(changed[:8])}"
            else:
                what = f"was {before!r}, now {value!r}"
            raise TuneError(
                f"the study in {study_dir} was started with another {name.replace('_', ' ')} ({what}); "
                "rerun with the same --config, --set and --space to continue it, or choose another --study-dir"
            )
    return study


def _recover_interrupted(study: optuna.Study) -> None:
    """Trials still running belong to a killed process: fail them and queue their values again."""
    interrupted = list(study.user_attrs.get("interrupted", []))
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        log.warning("trial %d was left running by a killed process: marked failed, its values queued again",
                    trial.number)
        study.tell(trial.number, state=TrialState.FAIL)
        interrupted.append(trial.number)
        study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})
    study.set_user_attr("interrupted", interrupted)


def finished_trials(study: optuna.Study) -> list[FrozenTrial]:
    """Trials that count towards ``--trials``: complete, pruned, or failed for a reason of their own
    (an invalid combination of values), not because the process running them was killed."""
    interrupted = set(study.user_attrs.get("interrupted", []))
    done = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    return [t for t in study.get_trials(deepcopy=False, states=done) if t.number not in interrupted]


def _objective(
    base: Config, space: list[Param], study_dir: Path, settings: TuneSettings
) -> Callable[[optuna.Trial], float]:
    base_raw = base.to_dict()
    other = "ndcg@" + settings.metric.split("@")[1]

    def objective(trial: optuna.Trial) -> float:
        values = {param.key: param.suggest(trial) for param in space}
        run = {"run.output_dir": str(study_dir / RUNS_DIR), "run.name": f"trial-{trial.number:04d}"}
        config = Config.from_dict(
            with_values(base_raw, {**trial_settings(base), **run, **values}), source=f"trial {trial.number}: {values}"
        )

        def report(epoch: int, logs: dict) -> None:
            recall = (logs or {}).get(f"val_recall@{config.train.validation_k}")
            if recall is None:
                return
            trial.report(float(recall), epoch)
            if trial.should_prune():
                raise optuna.TrialPruned(f"validation recall {recall:.4f} at epoch {epoch + 1} is below the median")

        log.info("trial %d: %s", trial.number, json.dumps(values))
        try:
            result = train_evaluate_export(config, config_name="tune", on_epoch_end=report)
        finally:
            directory = study_dir / RUNS_DIR / f"trial-{trial.number:04d}"
            if not settings.keep_bundles:
                shutil.rmtree(directory, ignore_errors=True)
        model = result.metrics["model"]
        trial.set_user_attr("job_seconds", round(result.seconds, 2))
        if other in model:
            trial.set_user_attr(other, model[other])
        return float(model[settings.metric])

    return objective


def write_outputs(study: optuna.Study, study_dir: Path, base: Config, space: list[Param]) -> None:
    """``trials.csv`` (every trial) and, once a trial completed, ``best.yaml`` and ``best.json``."""
    trials = study.get_trials(deepcopy=False)
    extra = sorted({k for t in trials for k in t.user_attrs})
    columns = ["number", "state", "value", "seconds", *extra, "val_recall_by_epoch", *(p.key for p in space)]
    partial = study_dir / ".trials.csv.tmp"
    with open(partial, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for t in trials:
            seconds = (
                round((t.datetime_complete - t.datetime_start).total_seconds(), 2)
                if t.datetime_complete and t.datetime_start else ""
            )
            steps = [round(t.intermediate_values[s], 6) for s in sorted(t.intermediate_values)]
            writer.writerow([
                # A pruned trial has no value of the metric (Optuna stores its last validation recall there).
                t.number, t.state.name, t.value if t.state == TrialState.COMPLETE else "", seconds,
                *(t.user_attrs.get(k, "") for k in extra), json.dumps(steps) if steps else "",
                *(t.params.get(p.key, "") for p in space),
            ])
    partial.replace(study_dir / "trials.csv")
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        return
    best = study.best_trial
    config = Config.from_dict(with_values(base.to_dict(), best.params), source=f"best trial {best.number}")
    metric = study.user_attrs.get("metric", "value")
    header = (
        f"# Best of {len(complete)} complete trials (of {len(trials)}) in {study_dir}: trial {best.number}, "
        f"{metric} = {best.value:.6f}\n# searched: {json.dumps(best.params)}\n"
        "# The base config with these values; `make train CONFIG=<this file>` trains it.\n"
    )
    (study_dir / "best.yaml").write_text(header + yaml.safe_dump(config.to_dict(), sort_keys=False), encoding="utf-8")
    summary = {"trial": best.number, "value": best.value, "metric": metric, "params": best.params,
               "complete_trials": len(complete), "trials": len(trials)}
    (study_dir / "best.json").write_text(json.dumps(summary, indent=2) + "\n")


def run_study(
    base: Config, space: list[Param], study_dir: str | Path, trials: int, settings: TuneSettings | None = None
) -> optuna.Study:
    """Run (or continue) the study in ``study_dir`` until it has ``trials`` finished trials.

    Args:
      base: the config every trial starts from.
      space: the searched keys (``load_space``).
      study_dir: the study folder (created).
      trials: finished trials wanted in total, counting those of earlier invocations.
      settings: metric, sampler seed, pruning, bundles.

    Raises:
      TuneError: the metric's k is not in ``base.evaluation.ks``, the study in ``study_dir`` was
        started with another base config, space or metric, or another process is running it.
    """
    settings = settings or TuneSettings()
    if trials < 1:
        raise TuneError(f"trials must be at least 1, got {trials}")
    name, _, k = settings.metric.partition("@")
    if name not in ("recall", "ndcg", "hit_rate", "precision", "mrr", "tail_recall") or not k.isdigit():
        raise TuneError(f"metric must look like recall@20 (recall, ndcg, hit_rate, precision, mrr, tail_recall), "
                        f"got {settings.metric!r}")
    if int(k) not in base.evaluation.ks:
        raise TuneError(f"metric {settings.metric} needs {k} in evaluation.ks, got {list(base.evaluation.ks)}")
    if base.train.validation_fraction <= 0:
        log.warning("train.validation_fraction=0: no per-epoch validation recall, so no trial is pruned")
    study_dir = Path(study_dir)
    study_dir.mkdir(parents=True, exist_ok=True)
    with _study_lock(study_dir):
        study = _open_study(study_dir, base, space, settings)
        _recover_interrupted(study)
        if settings.baseline_trial and not study.get_trials(deepcopy=False):
            raw = base.to_dict()
            inside = {p.key: value_at(raw, p.key) for p in space if p.contains(value_at(raw, p.key))}
            study.enqueue_trial(inside, user_attrs={"baseline": True})
        done = len(finished_trials(study))
        remaining = trials - done
        started = time.perf_counter()
        if remaining > 0:
            log.info("study %s: %d finished trials, running %d more, each scored on %s",
                     study_dir, done, remaining, scored_on(base))
            study.optimize(
                _objective(base, space, study_dir, settings),
                n_trials=remaining,
                timeout=settings.timeout,
                catch=(ConfigError,),  # an invalid combination of values fails that trial only
                callbacks=[lambda s, _: write_outputs(s, study_dir, base, space)],
            )
        else:
            log.info("study %s already has %d finished trials (asked for %d): nothing to run", study_dir, done, trials)
        write_outputs(study, study_dir, base, space)
        log.info("%d trials in %.0f s", max(remaining, 0), time.perf_counter() - started)
    return study
