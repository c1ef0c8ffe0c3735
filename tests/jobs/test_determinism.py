"""Determinism: the same config and seed give the same numbers, run after run.

Two full jobs (early stopping, refit, a sampler with its own RNG, the popularity and ALS
baselines, checkpoints on) must write identical metrics.json numbers: the data order is a
pure function of (seed, epoch), TensorFlow runs with op determinism, and every random
source is seeded from the config. A different training seed must change the model's
numbers (so the equality is not that of a model that ignores its seed) and leave the
baselines, which do not depend on it, alone.
"""

import json
from pathlib import Path

import pytest

import retrieval  # noqa: F401
from retrieval.config import load_config
from retrieval.jobs import train_evaluate_export

OVERRIDES = [
    "data.synthetic.n_users=150",
    "data.synthetic.n_items=80",
    "data.synthetic.mean_clicks_per_user=15",
    "model.embedding_dim=16",
    "model.loss.negatives=mixed",
    "model.loss.mixed_corpus=log_uniform",
    "model.loss.num_negatives=8",
    "model.loss.streaming.num_buckets=1024",
    "train.epochs=3",
    "train.batch_size=64",
    "train.verbose=0",
    "train.validation_fraction=0.1",
    "train.checkpoint_every_steps=10",
    "evaluation.ks=[10,20]",
    "evaluation.plots=false",
    "evaluation.baselines.rankers=[popularity,als]",
    "evaluation.baselines.als.iterations=3",
    "export.topk_model=false",
]

pytestmark = pytest.mark.slow


def _metrics(tmp_path, name, *extra):
    run = [f"run.output_dir={tmp_path}", f"run.name={name}"]
    config = load_config("configs/default.yaml", [*OVERRIDES, *run, *extra])
    result = train_evaluate_export(config)
    return json.loads((result.directory / "metrics.json").read_text())


def test_same_config_twice_gives_identical_metrics(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # configs/default.yaml
    first, second = _metrics(tmp_path, "first"), _metrics(tmp_path, "second")
    assert set(first) >= {"model", "popularity", "als"}
    for ranker in ("model", "popularity", "als"):
        assert first[ranker] == second[ranker], ranker  # every recall@k / NDCG@k ..., exactly
    assert first["final_train_loss"] == second["final_train_loss"]
    assert first["counts"] == second["counts"]

    other = _metrics(tmp_path, "other-seed", "train.seed=8")
    assert other["model"]["recall@20"] != first["model"]["recall@20"] or other["final_train_loss"] != first[
        "final_train_loss"
    ]
    assert other["popularity"] == first["popularity"]
