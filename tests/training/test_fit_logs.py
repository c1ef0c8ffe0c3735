"""fit's log writers (train and selection runs) are closed however fit ends: returning, or raising mid-run."""

import numpy as np
import pandas as pd
import pytest

import retrieval  # noqa: F401
from retrieval.config import ModelConfig, TrainConfig
from retrieval.features import FeatureStatistics
from retrieval.model import build_model
from retrieval.training import fit, seed_everything
from retrieval.training.loop import RunLogs


class Interrupted(Exception):
    pass


@pytest.fixture
def closed(monkeypatch):
    """The names of the CSV logs whose writers were closed, in order (one entry per close)."""
    names: list[str] = []
    close = RunLogs.close

    def recording_close(self):
        names.append(self.csv_path.name)
        close(self)

    monkeypatch.setattr(RunLogs, "close", recording_close)
    return names


def _fit(tmp_path, hooks=(), **train):
    rng = np.random.default_rng(0)
    clicks = pd.DataFrame({"user_id": [f"u{u}" for u in rng.integers(0, 30, 300)],
                           "item_id": [f"i{i}" for i in rng.integers(0, 20, 300)]})
    seed_everything(3)
    model = build_model(ModelConfig(embedding_dim=4), FeatureStatistics.from_training_clicks(clicks))
    config = TrainConfig(**{"epochs": 2, "batch_size": 64, "verbose": 0, "checkpoint_every_seconds": 0, **train})
    return fit(model, clicks, config, log_dir=tmp_path, epoch_hooks=hooks, say=lambda line: None)


def _raise_on_call(number):
    calls = []

    def hook(epoch, logs):
        calls.append(epoch)
        if len(calls) == number:
            raise Interrupted(f"epoch hook call {number}")

    return hook


def test_a_finished_fit_closes_each_log_once(tmp_path, closed):
    _fit(tmp_path, validation_fraction=0.2, refit=True, early_stopping_patience=1)
    assert sorted(closed) == ["selection_log.csv", "train_log.csv"]
    assert (tmp_path / "train_log.csv").is_file() and (tmp_path / "selection_log.csv").is_file()


def test_an_error_in_the_only_run_closes_its_log(tmp_path, closed):
    with pytest.raises(Interrupted):
        _fit(tmp_path, hooks=[_raise_on_call(1)], validation_fraction=0)
    assert closed == ["train_log.csv"]


@pytest.mark.parametrize("call", [1, 3], ids=["in-the-selection", "in-the-refit"])
def test_an_error_in_either_run_closes_both_logs(tmp_path, closed, call):
    # validation_fraction with refit: a selection run (2 epochs, patience 2 so both run) then the refit;
    # hook call 1 is the selection's first epoch, call 3 the refit's first.
    with pytest.raises(Interrupted):
        _fit(tmp_path, hooks=[_raise_on_call(call)], validation_fraction=0.2, refit=True, early_stopping_patience=2)
    assert sorted(closed) == ["selection_log.csv", "train_log.csv"]
