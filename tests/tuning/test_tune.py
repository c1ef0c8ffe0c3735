"""Tuning (retrieval/tuning/, pipelines/tune.py): a checked search space, a study that resumes
without redoing trials, pruning on the per-epoch validation recall, and a best config that loads."""

import csv
import json
from pathlib import Path

import numpy as np
import optuna
import pytest

import retrieval  # noqa: F401
import retrieval.tuning
from pipelines import tune as tune_cli
from retrieval.config import load_config
from retrieval.data import TIME, load_dataset
from retrieval.jobs import train_evaluate_export
from retrieval.tuning import (
    STUDY_NAME,
    Param,
    SearchSpaceError,
    TuneError,
    TuneSettings,
    _open_study,
    load_space,
    run_study,
    storage_url,
    trial_settings,
    value_at,
)

ROOT = Path(__file__).resolve().parents[2]
# A tiny synthetic log: a trial (early stopping over 2 epochs, refit, index, evaluation, export)
# takes ~10 s on a busy 2-core machine.
TINY = [
    "data.synthetic.n_users=200",
    "data.synthetic.n_items=150",
    "data.synthetic.mean_clicks_per_user=20",
    "train.epochs=2",
    "train.batch_size=256",
    "train.verbose=0",
    "index.tune_queries=50",
    "model.temperature=0.2",  # a number, so that the float space below holds the baseline trial's value
]
SPACE = "model.temperature: {type: float, low: 0.05, high: 0.5, log: true}\n" \
        "train.learning_rate: {type: float, low: 0.002, high: 0.05, log: true}\n"


def _base(*extra):
    return load_config(ROOT / "configs/default.yaml", [*TINY, *extra])


def _space_file(tmp_path, text=SPACE):
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return path


def _trials_csv(study_dir):
    with open(study_dir / "trials.csv") as handle:
        return list(csv.DictReader(handle))


def _tune(tmp_path, study_dir, trials, *extra):
    argv = ["--config", str(ROOT / "configs/default.yaml"), "--trials", str(trials),
            "--space", str(_space_file(tmp_path)), "--study-dir", str(study_dir)]
    return tune_cli.main([*argv, *(arg for kv in TINY for arg in ("--set", kv)), *extra])


@pytest.mark.slow
def test_tune_writes_every_trial_and_a_best_config_then_resumes_without_redoing_trials(tmp_path):
    study_dir = tmp_path / "study"
    assert _tune(tmp_path, study_dir, 3) == 0
    first = _trials_csv(study_dir)
    assert [row["number"] for row in first] == ["0", "1", "2"]
    assert all(row["state"] in ("COMPLETE", "PRUNED") for row in first)
    assert first[0]["baseline"] == "True"  # the base config's own values come first
    assert float(first[0]["model.temperature"]) == _base().model.temperature
    complete = [row for row in first if row["state"] == "COMPLETE"]
    best_row = max(complete, key=lambda row: float(row["value"]))

    best = load_config(study_dir / "best.yaml")  # a full config make train accepts
    summary = json.loads((study_dir / "best.json").read_text())
    assert summary["trial"] == int(best_row["number"])
    assert summary["value"] == pytest.approx(float(best_row["value"]))
    for key in ("model.temperature", "train.learning_rate"):
        assert value_at(best.to_dict(), key) == pytest.approx(float(best_row[key]))
    # Everything else is the base config, without the trials' own settings (no baselines, no checkpoints).
    assert best.evaluation.baselines.rankers == _base().evaluation.baselines.rankers
    assert best.train.checkpoint_every_steps == _base().train.checkpoint_every_steps
    assert best.data == _base().data
    assert not any((study_dir / "runs").iterdir())  # bundles deleted once read

    # A process killed mid-trial leaves it running; the next invocation fails it and does not count it.
    optuna.load_study(study_name=STUDY_NAME, storage=storage_url(study_dir)).ask()
    assert _tune(tmp_path, study_dir, 4) == 0
    second = _trials_csv(study_dir)
    assert [{k: row[k] for k in first[0]} for row in second[:3]] == first  # finished trials not redone
    assert len(second) == 5
    assert second[3]["state"] == "FAIL"  # the interrupted one, not counted
    assert second[4]["state"] in ("COMPLETE", "PRUNED") and second[4]["retry_of"] == "3"

    # Asking for no more than it has runs nothing.
    assert _tune(tmp_path, study_dir, 4) == 0
    assert len(_trials_csv(study_dir)) == 5


@pytest.mark.slow
def test_a_trial_below_the_median_is_pruned_after_its_first_epoch(tmp_path):
    study_dir = tmp_path / "study"
    study_dir.mkdir()
    study = optuna.create_study(storage=storage_url(study_dir), study_name=STUDY_NAME, direction="maximize")
    study.enqueue_trial({"train.learning_rate": 0.05})  # learns: its first-epoch recall sets the median
    study.enqueue_trial({"train.learning_rate": 1e-7})  # does not move from its random init
    space = load_space(_space_file(tmp_path, "train.learning_rate: {type: float, low: 1.0e-7, high: 0.1, log: true}"),
                       _base("train.epochs=3", "train.early_stopping_patience=3"))
    settings = TuneSettings(pruner_startup_trials=1, pruner_warmup_epochs=0)
    run_study(_base("train.epochs=3", "train.early_stopping_patience=3"), space, study_dir, 2, settings)

    good, bad = optuna.load_study(study_name=STUDY_NAME, storage=storage_url(study_dir)).trials
    assert good.state.name == "COMPLETE" and len(good.intermediate_values) == 3
    assert bad.state.name == "PRUNED"
    assert list(bad.intermediate_values) == [0]  # stopped after its first epoch, not after three
    assert bad.intermediate_values[0] < good.intermediate_values[0]
    rows = _trials_csv(study_dir)
    assert [row["state"] for row in rows] == ["COMPLETE", "PRUNED"]
    assert float(rows[0]["value"]) == pytest.approx(good.value) and rows[1]["value"] == ""
    assert json.loads(rows[1]["val_recall_by_epoch"]) == [pytest.approx(bad.intermediate_values[0], abs=1e-6)]
    assert json.loads((study_dir / "best.json").read_text())["trial"] == 0
    assert not any((study_dir / "runs").iterdir())


def test_a_space_with_an_unknown_key_fails_naming_it_before_any_training(tmp_path, capsys):
    space = _space_file(tmp_path, SPACE + "model.temprature: {type: float, low: 0.1, high: 0.3}\n")
    study_dir = tmp_path / "study"
    assert tune_cli.main(["--trials", "1", "--space", str(space), "--study-dir", str(study_dir)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and "\n" not in error
    assert "model.temprature" in error and "unknown key" in error
    assert not study_dir.exists()  # nothing was started


@pytest.mark.parametrize(
    "text, match",
    [
        ("model.loss.negatives: {type: categorical, choices: [in_batch, bogus]}", "model.loss.negatives.*'bogus'"),
        ("train.epochs.x: {type: int, low: 1, high: 3}", "train.epochs.x"),
        ("model.temperature: {type: float, low: 0.5, high: 0.1}", "model.temperature: low"),
        ("model.temperature: {type: float, low: 0, high: 1, log: true}", "log needs low > 0"),
        ("model.temperature: {type: normal, low: 0, high: 1}", "type must be one of"),
        ("model.temperature: {type: float, low: 0.1, high: 1, spread: 2}", "unknown field.*spread"),
        ("run.name: {type: categorical, choices: [a, b]}", "run.name is set by every trial"),
        ("split.evaluate_on: {type: categorical, choices: [test, validation]}",
         "split.evaluate_on is set by every trial"),
        ("split.test_fraction: {type: float, low: 0.1, high: 0.3}", "split.test_fraction cannot be searched"),
        ("[1, 2]", "expected a non-empty mapping"),
    ],
)
def test_bad_search_spaces_are_refused_with_the_key(tmp_path, text, match):
    with pytest.raises(SearchSpaceError, match=match):
        load_space(_space_file(tmp_path, text), _base())


def test_shipped_space_is_valid_and_holds_the_default_values():
    base = load_config(ROOT / "configs/default.yaml")
    space = load_space(ROOT / "configs/tune_space.yaml", base)
    assert {p.key for p in space} >= {"model.temperature", "train.learning_rate", "train.batch_size"}
    # The default's values lie inside the space, so the baseline trial is the default itself.
    assert all(p.contains(value_at(base.to_dict(), p.key)) for p in space)


def test_param_contains():
    grid = Param("train.batch_size", "int", low=256, high=4096, step=256)
    assert grid.contains(1024) and not grid.contains(1000) and not grid.contains(8192)
    assert not grid.contains(True)
    choice = Param("model.embedding_dim", "categorical", choices=(32, 64))
    assert choice.contains(64) and not choice.contains(64.0) and not choice.contains(128)


def test_resuming_with_another_base_config_names_the_difference(tmp_path):
    space = load_space(_space_file(tmp_path), _base())
    _open_study(tmp_path, _base(), space, TuneSettings())
    _open_study(tmp_path, _base("run.name=elsewhere"), space, TuneSettings())  # where outputs go may change
    with pytest.raises(TuneError, match="model.embedding_dim"):
        _open_study(tmp_path, _base("model.embedding_dim=32"), space, TuneSettings())
    with pytest.raises(TuneError, match="metric"):
        _open_study(tmp_path, _base(), space, TuneSettings(metric="ndcg@20"))


def test_metric_must_be_computed_by_the_job(tmp_path):
    space = load_space(_space_file(tmp_path), _base())
    with pytest.raises(TuneError, match="needs 25 in evaluation.ks"):
        run_study(_base(), space, tmp_path / "s", 1, TuneSettings(metric="recall@25"))


GIVEN_FILES = ["data.source=files", "data.clicks={path: train.txt}", "data.test_clicks={path: valid.txt}"]


def test_trials_evaluate_on_validation_unless_the_test_log_is_given():
    for kind in ("temporal", "random", "leave_last_k"):
        assert trial_settings(_base(f"split.kind={kind}"))["split.evaluate_on"] == "validation"
    given = trial_settings(_base(*GIVEN_FILES, "split.kind=none"))
    assert "split.evaluate_on" not in given  # the given file is what the user chose to score on


@pytest.mark.slow
def test_trials_are_scored_on_the_validation_part_of_the_training_part(tmp_path, monkeypatch):
    base = _base()
    assert base.split.kind == "temporal" and base.split.evaluate_on == "test"
    # The parts, computed here from the outer split: the latest test_fraction of the training clicks.
    outer = load_dataset(base.data, base.split)
    times = outer.train[TIME].to_numpy()
    cut = np.quantile(times, 1 - base.split.test_fraction, method="lower")
    validation = outer.train[times > cut]
    assert 0 < len(validation) != len(outer.test)

    seen = []

    def recording(config, **kwargs):
        result = train_evaluate_export(config, **kwargs)
        seen.append((config, result.metrics))
        return result

    monkeypatch.setattr(retrieval.tuning, "train_evaluate_export", recording)
    study_dir = tmp_path / "study"
    run_study(base, load_space(_space_file(tmp_path), base), study_dir, 1)
    (config, metrics), = seen
    assert config.split.evaluate_on == "validation"
    assert metrics["data"]["evaluated_on"] == "validation"
    assert metrics["data"]["test_clicks"] == len(validation)
    assert metrics["data"]["test_users"] == validation["user_id"].nunique()
    assert metrics["data"]["train_clicks"] == len(outer.train) - len(validation)
    # best.yaml is for `make train`: the base config's own evaluation part.
    assert load_config(study_dir / "best.yaml").split.evaluate_on == "test"


def test_a_search_space_key_given_twice_is_refused(tmp_path):
    text = ("train.learning_rate: {type: float, low: 1.0e-4, high: 0.1}\n"
            "train.learning_rate: {type: float, low: 1.0e-3, high: 0.1}\n")
    with pytest.raises(SearchSpaceError, match=r"duplicate key 'train.learning_rate': set on line 1 and again on"):
        load_space(_space_file(tmp_path, text), _base())


def test_trials_skip_the_refit_and_the_default_pruner_acts_from_the_second_trial(tmp_path, monkeypatch):
    """A stand-in job reports fixed per-epoch recalls: with the default settings the second trial,
    below the first at its second epoch, is pruned there, and no trial is refit."""
    from retrieval.jobs import RunResult

    recalls = iter([[0.10, 0.20, 0.30], [0.01, 0.02, 0.03], [0.20, 0.30, 0.40]])
    seen = []

    def job(config, *, config_name, on_epoch_end):
        seen.append(config)
        curve = next(recalls)
        for epoch, recall in enumerate(curve):
            on_epoch_end(epoch, {f"val_recall@{config.train.validation_k}": recall})
        return RunResult(tmp_path / "unused", {"model": {"recall@20": curve[-1], "ndcg@20": 0.0}}, 1.0)

    monkeypatch.setattr(retrieval.tuning, "train_evaluate_export", job)
    base = _base("train.epochs=3")
    assert base.train.refit  # the base refits; its trials do not
    study = run_study(base, load_space(_space_file(tmp_path), base), tmp_path / "study", 3)
    assert [config.train.refit for config in seen] == [False, False, False]
    assert [t.state.name for t in study.trials] == ["COMPLETE", "PRUNED", "COMPLETE"]
    assert list(study.trials[1].intermediate_values) == [0, 1]  # warm-up: its first epoch is never pruned
    assert load_config(tmp_path / "study" / "best.yaml").train.refit  # best.yaml trains as the base does
    assert trial_settings(base)["train.refit"] is False


def test_train_best_refits_only_the_best_config_once_the_study_ends(tmp_path, monkeypatch, capsys):
    import retrieval.jobs
    from retrieval.jobs import RunResult

    trained = []

    def job(config, *, config_name, on_epoch_end=None):
        trained.append((config_name, config.train.refit, config.split.evaluate_on))
        recall = 0.1 * len(trained)
        return RunResult(tmp_path / config_name, {"model": {"users": 5, "recall@20": recall, "ndcg@20": recall}}, 1.0)

    monkeypatch.setattr(retrieval.tuning, "train_evaluate_export", job)
    monkeypatch.setattr(retrieval.jobs, "train_evaluate_export", job)
    assert _tune(tmp_path, tmp_path / "study", 2, "--train-best") == 0
    assert trained == [("tune", False, "validation"), ("tune", False, "validation"), ("tune-best", True, "test")]
    assert "best config trained:" in capsys.readouterr().out
