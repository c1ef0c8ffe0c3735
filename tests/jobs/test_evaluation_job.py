"""The job's evaluation outputs: report, plots, TensorBoard logs, and re-evaluating the bundle."""

import json
from pathlib import Path

import pytest
import tensorflow as tf

import retrieval  # noqa: F401
from pipelines import evaluate as evaluate_cli
from retrieval.evaluation.report import PLOT_FILES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(trained_bundle):
    """The shared small synthetic run (tests/conftest.py): every ranker of the default config (model,
    popularity, ALS) at the default cut-offs, plots and TensorBoard logs on."""
    return trained_bundle.result


def _scalars(directory: Path) -> dict[str, float]:
    values = {}
    for path in directory.glob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                values[value.tag] = float(tf.make_ndarray(value.tensor))
    return values


def test_run_directory_has_report_plots_and_all_rankers(run):
    names = {p.name for p in run.directory.iterdir()}
    assert {"metrics.json", "report.md", *PLOT_FILES.values(), "tensorboard"} <= names
    metrics = json.loads((run.directory / "metrics.json").read_text())
    assert [name for name in metrics if isinstance(metrics[name], dict) and "users" in metrics[name]] == [
        "model", "popularity", "als"
    ]
    assert set(metrics["segments"]) == {"model", "popularity", "als"}
    manifest = json.loads((run.directory / "manifest.json").read_text())
    assert set(manifest["metrics"]) == {"model", "popularity", "als", "counts"}
    assert "| als |" in (run.directory / "report.md").read_text()


def test_tensorboard_has_training_loss_and_final_metrics(run):
    train = _scalars(run.directory / "tensorboard" / "train")
    assert "epoch_loss" in train
    final = _scalars(run.directory / "tensorboard" / "evaluation")
    assert final["model/recall@20"] == pytest.approx(run.metrics["model"]["recall@20"])
    assert final["als/ndcg@10"] == pytest.approx(run.metrics["als"]["ndcg@10"])


def test_pipelines_evaluate_writes_a_separate_report(trained_bundle_copy, capsys):
    run = trained_bundle_copy.result  # the re-evaluation is written into the run directory
    assert evaluate_cli.main(["--run", str(run.directory), "--set", "evaluation.baselines.rankers=[popularity]"]) == 0
    out = run.directory / "reevaluated"
    again = json.loads((out / "metrics.json").read_text())
    assert again["model"]["recall@20"] == pytest.approx(run.metrics["model"]["recall@20"], abs=1e-9)
    assert "als" not in again
    assert (out / "report.md").exists() and (out / PLOT_FILES["recall"]).exists()
    assert "| recall@20 |" in capsys.readouterr().out
