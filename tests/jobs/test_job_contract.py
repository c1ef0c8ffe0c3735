"""Job-level behaviour that must not depend on the click source: one log, read in memory and streamed.

Each test runs ``jobs.train_evaluate_export`` on the same small Parquet log both ways
(``data.out_of_core`` false and true) and asserts the same behaviour of both.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from retrieval.config import SplitConfig, SyntheticConfig, load_config
from retrieval.data import ITEM, USER, split_clicks
from retrieval.data.synthetic import generate_clicks
from retrieval.jobs import train as jobs  # the module whose names the tests patch

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["in_memory", "streamed"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """A small synthetic log as three Parquet shards in one folder, and whole beside it (``log.parquet``)."""
    clicks, _, _ = generate_clicks(SyntheticConfig(n_users=150, n_items=80, mean_clicks_per_user=10, seed=3))
    folder = tmp_path_factory.mktemp("log") / "shards"
    folder.mkdir()
    for i, rows in enumerate(np.array_split(np.arange(len(clicks)), 3)):
        clicks.iloc[rows].to_parquet(folder / f"part-{i}.parquet", index=False)
    clicks.to_parquet(folder.parent / "log.parquet", index=False)
    return folder


def _config(shards: Path, tmp_path: Path, source: str, *extra: str):
    where = [f"data.clicks.path={shards.parent / 'log.parquet'}"]
    if source == "streamed":
        where = [f"data.clicks.path={shards}/*.parquet", "data.out_of_core=true"]
    return load_config(ROOT / "configs/default.yaml", [
        "data.source=files", *where,
        "split.kind=temporal", "split.test_fraction=0.2",
        "model.embedding_dim=8", "train.batch_size=256", "train.verbose=0", "train.checkpoint_every_seconds=0",
        "evaluation.baselines.rankers=[popularity]", "evaluation.plots=false", "export.topk_model=false",
        f"run.output_dir={tmp_path / 'runs'}", "run.name=contract", *extra,
    ])


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
def test_a_model_the_index_cannot_rank_is_refused_before_training(shards, tmp_path, monkeypatch, source):
    def no_training(*args, **kwargs):
        raise AssertionError("trained a model that cannot be served")

    monkeypatch.setattr(jobs, "fit", no_training)
    config = _config(shards, tmp_path, source, "model.loss.kind=hierarchical_softmax", "model.normalize=false")
    with pytest.raises(ValueError, match="cannot be served from the FAISS index"):
        jobs.train_evaluate_export(config)
    assert not (tmp_path / "runs" / "contract").exists()


@pytest.fixture(scope="module")
def runs(shards, tmp_path_factory) -> dict[str, tuple[dict, list[tuple[int, float]], Path]]:
    """Each source's run with early stopping: its metrics, what the epoch hook saw, its directory."""
    out = {}
    for source in SOURCES:
        seen: list[tuple[int, float]] = []
        config = _config(shards, tmp_path_factory.mktemp(source), source, "train.epochs=3",
                         "train.validation_fraction=0.1", "train.early_stopping_patience=5", "train.refit=false")
        result = jobs.train_evaluate_export(
            config, on_epoch_end=lambda epoch, logs, seen=seen: seen.append((epoch, logs["val_recall@20"]))
        )
        out[source] = (result.metrics, seen, result.directory)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
def test_the_epoch_hook_sees_each_early_stopping_epoch(runs, source):
    """``make tune`` prunes trials through this hook, on streamed logs as on loaded ones."""
    _, seen, _ = runs[source]
    assert [epoch for epoch, _ in seen] == [0, 1, 2]
    assert all(0.0 <= recall <= 1.0 for _, recall in seen)


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
def test_the_run_says_how_training_went(runs, source):
    """metrics.json, report.md and TensorBoard say which epoch early stopping chose and how many ran."""
    metrics, seen, directory = runs[source]
    training = metrics["training"]
    stopping = training["early_stopping"]
    recalls = [recall for _, recall in seen]
    assert stopping["val_recall@20"] == pytest.approx(recalls)
    assert stopping["best_epoch"] == 1 + int(np.argmax(recalls)) and stopping["refit"] == "none"
    assert training["epochs"] == len(recalls) == 3 and training["max_epochs"] == 3
    report = (directory / "report.md").read_text()
    assert "## Training" in report and f"best epoch {stopping['best_epoch']} of 3 run" in report
    assert not (directory / "training.png").exists()  # evaluation.plots: false
    import tensorflow as tf

    events = list((directory / "tensorboard" / "evaluation").iterdir())
    steps = {value.step for event in events for value in tf.compat.v1.train.summary_iterator(str(event))
             if value.summary.value}
    assert steps == {training["epochs"]}  # the last epoch trained, not train.epochs


@pytest.mark.slow
@pytest.mark.parametrize("source", [*SOURCES, "given_test_file"])
def test_early_stopping_on_the_test_clicks_selects_the_epoch_whose_weights_score_its_figure(
    shards, tmp_path, caplog, source
):
    """``train.validation_part: test``: early stopping watches the test clicks of every test user (the split's
    test part, or the given test file's clicks) and trains on every training click, so the best epoch's
    validation recall and NDCG are the evaluation's own figures of the weights it keeps, computed the other way
    (ExactTopK per click against the FAISS index per user: with one test click a user the two means agree)."""
    split = ["split.kind=leave_last_k", "split.k=1"]
    if source == "given_test_file":  # each user's last click in a file of its own, as the LightGCN splits come
        clicks = pd.read_parquet(shards.parent / "log.parquet").sort_values("timestamp", kind="stable")
        last = clicks.groupby(USER).tail(1)
        clicks.drop(last.index).to_parquet(tmp_path / "train.parquet", index=False)
        last.to_parquet(tmp_path / "test.parquet", index=False)
        split = ["split.kind=none", f"data.clicks.path={tmp_path / 'train.parquet'}",
                 f"data.test_clicks={{path: {tmp_path / 'test.parquet'}}}"]
    config = _config(shards, tmp_path, "in_memory" if source == "given_test_file" else source, *split,
                     "train.epochs=4", "train.validation_part=test", "train.validation_fraction=0.1",
                     "train.validation_users=null", "data.stream.max_test_users=null",
                     "train.early_stopping_patience=4", "train.refit=false", "train.learning_rate=0.05")
    with caplog.at_level("INFO", logger="retrieval"):
        metrics = jobs.train_evaluate_export(config).metrics
    stopping, model = metrics["training"]["early_stopping"], metrics["model"]
    best = stopping["best_epoch"] - 1
    assert stopping["epochs_run"] == 4 and model["users"] == metrics["counts"]["evaluated_users"] > 0
    assert stopping["val_recall@20"][best] == pytest.approx(model["recall@20"], abs=1e-6)
    assert stopping["val_ndcg@20"][best] == pytest.approx(model["ndcg@20"], abs=1e-6)
    assert len(set(stopping["val_recall@20"])) > 1  # the epochs differ: the equality picks one of them
    # Nothing carved out: the selection trains on every training click.
    assert f"early stopping: {metrics['data']['train_clicks']} fit-part clicks" in caplog.text


def _shape(value):
    """The keys of nested dicts, with each leaf's type: what a reader of metrics.json relies on."""
    if isinstance(value, dict):
        return {key: _shape(inner) for key, inner in value.items()}
    return type(value).__name__ if value is not None else "null"


@pytest.mark.slow
def test_metrics_have_one_shape_whatever_the_source(runs):
    """``metrics.json`` is read by reports, ``make tune`` and benchmarks: the same keys from both."""
    (in_memory, _, _), (streamed, _, _) = runs["in_memory"], runs["streamed"]
    assert _shape(in_memory) == _shape(streamed)
    assert {"data", "derived", "final_train_loss", "timing", "model", "popularity", "counts"} <= set(in_memory)
    assert in_memory["data"]["source"] != streamed["data"]["source"]  # each says where its clicks came from
    assert in_memory["counts"] == streamed["counts"]


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
def test_the_training_clicks_are_coded_once_for_every_stage_that_needs_them(shards, tmp_path, monkeypatch, source):
    """Mined negatives, ALS and the bundle's seen items read one coding of the training clicks:
    one pass over the log, not one per stage."""
    from retrieval.serving import Bundle

    calls = []
    scan_pairs = jobs.scan_pairs
    monkeypatch.setattr(jobs, "scan_pairs", lambda *args: calls.append(1) or scan_pairs(*args))
    config = _config(shards, tmp_path, source, "train.epochs=1", "train.validation_fraction=0",
                     "model.loss.hard_negatives=mined", "model.loss.num_hard_negatives=2",
                     "evaluation.baselines.rankers=[popularity, als]")
    result = jobs.train_evaluate_export(config)
    assert len(calls) == 1
    assert {"model", "popularity", "als"} <= set(result.metrics)
    # The seen items recoded from the shared pairs are each user's training items.
    clicks = pd.read_parquet(shards.parent / "log.parquet")
    train, _ = split_clicks(clicks, SplitConfig(kind="temporal", test_fraction=0.2))
    bundle = Bundle.load(result.directory)
    item_ids = np.asarray(bundle.index.item_ids, dtype=object)
    for user, items in train.groupby(USER)[ITEM]:
        assert set(item_ids[bundle.seen_items.rows_of(user)]) == set(items), user


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
def test_removing_user_items_hands_the_model_each_users_training_items(shards, tmp_path, monkeypatch, source):
    """``model.remove_user_items`` reads the same coding of the training clicks as mined negatives,
    from a streamed log as from a loaded one."""
    handed = {}
    build_model = jobs.build_model
    monkeypatch.setattr(jobs, "build_model",
                        lambda config, stats, **kwargs: handed.update(kwargs, stats=stats) or build_model(
                            config, stats, **kwargs))
    config = _config(shards, tmp_path, source, "train.epochs=1", "train.validation_fraction=0",
                     "model.remove_user_items=true")
    result = jobs.train_evaluate_export(config)
    assert np.isfinite(result.metrics["final_train_loss"])
    clicks = pd.read_parquet(shards.parent / "log.parquet")
    train, _ = split_clicks(clicks, SplitConfig(kind="temporal", test_fraction=0.2))
    history, stats = handed["user_history"], handed["stats"]
    users, items = np.asarray(stats.users.ids, dtype=object), np.asarray(stats.items.ids, dtype=object)
    coded = {users[row]: set(items[history.of(row) - 1]) for row in range(history.num_users)}
    assert coded == train.groupby(USER)[ITEM].agg(set).to_dict()


@pytest.mark.slow
def test_a_sequence_job_streams_a_click_table_and_trains_as_in_memory(shards, tmp_path):
    """``train.examples: sequences`` from a timestamped click table: the windows come from the training
    clicks coded in memory (``ClickHistories``) however the log is read, so both sources train the same
    model and report the same metrics."""
    sequence = ["split.kind=leave_last_k", "split.k=1", "towers.query.features=[]",
                "towers.query.history={length: 6, pooling: transformer}", "train.examples=sequences",
                "train.epochs=2", "train.batch_size=16", "train.validation_fraction=0.1", "train.refit=false"]
    metrics = {source: jobs.train_evaluate_export(_config(shards, tmp_path / source, source, *sequence)).metrics
               for source in SOURCES}
    assert metrics["streamed"]["model"] == pytest.approx(metrics["in_memory"]["model"], abs=1e-6)
    assert metrics["streamed"]["data"]["test_clicks"] == metrics["in_memory"]["data"]["test_clicks"] > 100
    assert metrics["streamed"]["final_train_loss"] == pytest.approx(metrics["in_memory"]["final_train_loss"])
