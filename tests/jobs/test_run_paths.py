"""A run names its data files by absolute paths: it re-evaluates from any working directory."""

import gzip
import os

import pytest
import yaml

from retrieval.config import SyntheticConfig, load_config, with_absolute_data_paths
from retrieval.data import generate_clicks


def test_data_paths_become_absolute_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(None, [
        "data.clicks.path=logs/../logs/clicks.csv.gz",
        "data.item_features.path=items.csv",
        f"data.user_features.path={tmp_path}/users.csv",  # absolute already: kept
        "data.movielens_dir=ml",
    ])
    absolute = with_absolute_data_paths(config).data
    assert absolute.clicks.path == os.path.join(str(tmp_path), "logs", "clicks.csv.gz")
    assert absolute.item_features.path == os.path.join(str(tmp_path), "items.csv")
    assert absolute.user_features.path == f"{tmp_path}/users.csv"
    assert absolute.movielens_dir == os.path.join(str(tmp_path), "ml")
    assert absolute.clicks.format == config.data.clicks.format  # nothing else changes
    assert with_absolute_data_paths(load_config(None)) == load_config(None)  # no files: the same config


@pytest.mark.slow
def test_a_run_on_a_relative_compressed_log_re_evaluates_from_another_directory(tmp_path, monkeypatch):
    from retrieval.jobs import evaluate_bundle, train_evaluate_export

    clicks, _, _ = generate_clicks(SyntheticConfig(n_users=150, n_items=80, mean_clicks_per_user=12, seed=3))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "clicks.csv.gz").write_bytes(gzip.compress(clicks.to_csv(index=False).encode()))
    monkeypatch.chdir(tmp_path)
    config = load_config(None, ["data.clicks.path=data/clicks.csv.gz", "train.epochs=1", "train.verbose=0",
                                "run.name=rel", f"run.output_dir={tmp_path / 'runs'}", "evaluation.plots=false"])
    assert config.data.source == "files"
    result = train_evaluate_export(config)
    written = yaml.safe_load((result.directory / "config.yaml").read_text())
    assert written["data"]["clicks"]["path"] == str(tmp_path / "data" / "clicks.csv.gz")
    assert written["data"]["source"] == "files"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    again = evaluate_bundle(result.directory.resolve())
    assert again["model"]["users"] == result.metrics["model"]["users"] > 0
    assert again["model"]["recall@20"] == pytest.approx(result.metrics["model"]["recall@20"], abs=1e-9)
