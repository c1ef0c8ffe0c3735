"""report.md, the PNG plots and the Markdown tables."""

import json

import numpy as np
import pytest

from retrieval.config import BaselinesConfig, DataConfig, EvaluationConfig, SplitConfig, SyntheticConfig
from retrieval.data import ITEM, load_dataset
from retrieval.evaluation import build_eval_set, evaluate_against_baselines, format_table, summary_table, write_report
from retrieval.evaluation.report import PLOT_FILES, headline_k
from retrieval.index import ItemIndex

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def results():
    dataset = load_dataset(
        DataConfig(synthetic=SyntheticConfig(n_users=200, n_items=150, mean_clicks_per_user=20, seed=1)),
        SplitConfig(kind="temporal"),
    )
    catalogue = dataset.items[ITEM].astype(str).tolist()
    config = EvaluationConfig(ks=(5, 10, 50), baselines=BaselinesConfig(rankers=("popularity",)))
    eval_set = build_eval_set(dataset.train, dataset.test, catalogue, config)
    rng = np.random.default_rng(0)
    index = ItemIndex.build(catalogue, rng.normal(size=(len(catalogue), 8)).astype(np.float32))
    queries = rng.normal(size=(len(eval_set.user_ids), 8)).astype(np.float32)
    metrics = evaluate_against_baselines(index, queries, eval_set, dataset.train, config)
    metrics["data"] = dataset.summary()
    return json.loads(json.dumps(metrics))  # what metrics.json holds, as re-read by pipelines


def test_report_and_plots_are_written(tmp_path, results):
    written = write_report(tmp_path, results, title="Test run")
    assert {p.name for p in written} == {"report.md", *PLOT_FILES.values()}
    for name in PLOT_FILES.values():
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# Test run")
    assert "## Model vs baselines at k = 10" in report  # the evaluated k closest to 20
    assert "| model | " in report and "| popularity | " in report
    assert "## By user activity" in report and "| 10-29 |" in report
    assert "min(|relevant|, k)" in report  # the recall convention is stated
    assert f"{results['model']['recall@10']:.4f}" in report
    for name in PLOT_FILES.values():
        assert f"]({name})" in report


def test_no_plots_when_asked(tmp_path, results):
    written = write_report(tmp_path, results, plots=False)
    assert [p.name for p in written] == ["report.md"]
    assert "![" not in (tmp_path / "report.md").read_text()


def test_tables(results):
    table = format_table(results, metrics=("recall", "coverage")).splitlines()
    assert table[0] == "| metric | model | popularity |"
    assert [line.split(" | ")[0] for line in table[2:]] == [
        "| recall@5", "| recall@10", "| recall@50", "| coverage@5", "| coverage@10", "| coverage@50"
    ]
    summary = summary_table(results, 50).splitlines()
    assert summary[0].startswith("| ranker | recall@50 | ndcg@50 |")
    assert summary[3].startswith(f"| popularity | {results['popularity']['recall@50']:.4f} |")
    assert headline_k([10, 20, 50]) == 20 and headline_k([5, 50]) == 5 and headline_k([30]) == 30


def test_a_run_with_early_stopping_gets_a_training_section_and_curve(tmp_path, results):
    training = {
        "epochs": 2, "max_epochs": 30, "loss": [6.1, 5.7],
        "early_stopping": {"best_epoch": 2, "epochs_run": 4, "val_recall@20": [0.1, 0.2, 0.19, 0.18],
                           "selection_loss": [6.2, 5.8, 5.6, 5.5], "refit": "initial",
                           "message": "early stopping: best epoch 2 of 4 run (val_recall@20 0.2000); retraining "
                                      "from the initial weights on all training clicks for 2 epochs"},
    }
    written = write_report(tmp_path, {**results, "training": training})
    assert (tmp_path / "training.png").read_bytes().startswith(PNG_MAGIC)
    assert tmp_path / "training.png" in written
    report = (tmp_path / "report.md").read_text()
    assert ("## Training\n\nThe served weights trained 2 epochs (at most 30), final loss 5.7000. Early stopping: "
            "best epoch 2 of 4 run (val_recall@20 0.2000); retraining from the initial weights on all training "
            "clicks for 2 epochs.") in report
    assert "](training.png)" in report
    assert "## Training" not in (write_report(tmp_path, results) and (tmp_path / "report.md").read_text())


def test_the_training_plot_keeps_the_refits_loss_apart_from_the_selection_runs_recall(tmp_path):
    from retrieval.evaluation.report import plot_training, training_panels

    stopping = {"best_epoch": 2, "epochs_run": 4, "val_recall@20": [0.1, 0.2, 0.19, 0.18],
                "selection_loss": [6.2, 5.8, 5.6, 5.5], "refit": "initial", "message": "m"}
    refit = {"epochs": 2, "max_epochs": 30, "loss": [6.1, 5.7], "early_stopping": stopping}
    selection, served = training_panels(refit)
    # The selection panel: the selection run's own loss beside its recall; the refit's loss alone in its own.
    assert (selection.loss, selection.recall, selection.best_epoch) == ([6.2, 5.8, 5.6, 5.5], [0.1, 0.2, 0.19, 0.18], 2)
    assert selection.recall_label == "val_recall@20 (validation)" and "Selection" in selection.title
    assert (served.loss, served.recall) == ([6.1, 5.7], None) and served.title == "Refit (from initial, served)"
    kept = {**refit, "loss": [6.2, 5.8], "early_stopping": {**stopping, "refit": "none"}}
    assert [p.title for p in training_panels(kept)] == ["Selection run (early stopping)"]
    (plain,) = training_panels({"epochs": 3, "max_epochs": 3, "loss": [3.0, 2.0, 1.0], "early_stopping": None})
    assert (plain.loss, plain.recall) == ([3.0, 2.0, 1.0], None)
    for training in (refit, kept):
        assert plot_training(training, tmp_path / "t.png").read_bytes().startswith(PNG_MAGIC)
