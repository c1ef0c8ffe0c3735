"""The Optuna study: opening and resuming it, running trials, pruning, and writing its outputs.

``run_study`` runs (or continues) the study in a folder until it has the number of finished trials
asked for: ``study.db`` (SQLite) holds it, a lock keeps a second process out, a resumed study must
have been started with the same base config, space and metric, and trials a killed process left
running are marked failed and their values queued again. Each trial runs the main job on the base
config with its values (``TuneSettings``: metric, TPE seed, median-rule pruning on the per-epoch
validation recall, bundles kept or not); after each trial ``write_outputs`` rewrites ``trials.csv``
and, once a trial completed, ``best.yaml`` and ``best.json``.
"""

from __future__ import annotations

import csv
import json
import logging
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.trial import FrozenTrial, TrialState

import retrieval.tuning
from retrieval.common.atomic import atomic_file
from retrieval.common.lock import exclusive_lock
from retrieval.config import Config, ConfigError
from retrieval.training import TrainingDiverged
from retrieval.tuning.space import Param, TuneError, scored_on, trial_settings, value_at, with_values

log = logging.getLogger("retrieval")

STUDY_NAME = "tune"
STUDY_FILE = "study.db"
RUNS_DIR = "runs"


@dataclass(frozen=True)
class TuneSettings:
    """How a study runs (the CLI flags of pipelines/tune.py).

    Attributes:
      metric: the job's ``model`` metric to maximise; its k must be in ``evaluation.ks``.
      seed: seed of the TPE sampler.
      keep_bundles: keep each trial's run directory under ``runs/``.
      pruner_startup_trials: finished trials before the median rule prunes anything (1: from the second
        trial on, against the first; a 3-trial study prunes nothing at 3).
      pruner_warmup_epochs: epochs of a trial before it can be pruned.
      baseline_trial: a new study's first trial takes the base config's values (those inside
        the space), so the best config found is never worse than the base on the measured metric.
      timeout: stop starting trials after this many seconds (None = no limit).
    """

    metric: str = "recall@20"
    seed: int = 0
    keep_bundles: bool = False
    pruner_startup_trials: int = 1
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


def _study_lock(study_dir: Path) -> AbstractContextManager[None]:
    return exclusive_lock(
        study_dir / ".lock", held=lambda: TuneError(f"another tune process is running the study in {study_dir}")
    )


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
            # Read through the package (retrieval/tuning/__init__.py), where tests replace it.
            result = retrieval.tuning.train_evaluate_export(config, config_name="tune", on_epoch_end=report)
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
    with atomic_file(study_dir / "trials.csv") as partial, open(partial, "w", newline="") as handle:
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
                # An invalid combination of values, or one that trains to a NaN loss, fails that trial only.
                catch=(ConfigError, TrainingDiverged),
                callbacks=[lambda s, _: write_outputs(s, study_dir, base, space)],
            )
        else:
            log.info("study %s already has %d finished trials (asked for %d): nothing to run", study_dir, done, trials)
        write_outputs(study, study_dir, base, space)
        log.info("%d trials in %.0f s", max(remaining, 0), time.perf_counter() - started)
    return study
