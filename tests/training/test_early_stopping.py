"""Early stopping: the validation part is carved like the test split, its recall is computed
exactly, and fit stops, picks the best epoch and refits."""

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

import retrieval  # noqa: F401
from retrieval.config import ModelConfig, SplitConfig, TrainConfig
from retrieval.features import FeatureStatistics
from retrieval.model import build_model
from retrieval.training import ValidationRecall, fit, seed_everything, validation_split


def _clicks(seed=0, users=60, items=40, clicks=2400):
    rng = np.random.default_rng(seed)
    user = rng.integers(0, users, clicks)
    # Users of one taste group click items of that group: learnable in a few epochs.
    item = (user % 4) * (items // 4) + np.minimum(rng.zipf(1.5, clicks), items // 4) - 1
    return pd.DataFrame(
        {
            "user_id": [f"u{u}" for u in user],
            "item_id": [f"i{i}" for i in item],
            "timestamp": np.arange(clicks) * 10,
            "weight": np.ones(clicks, np.float32),
        }
    )


def test_validation_part_is_the_latest_clicks_on_a_temporal_split():
    train = _clicks()
    fit_part, validation = validation_split(train, 0.1, SplitConfig(kind="temporal"))
    assert len(validation) == pytest.approx(0.1 * len(train), abs=2)
    assert fit_part["timestamp"].max() < validation["timestamp"].min()
    random_fit, random_validation = validation_split(train.drop(columns="timestamp"), 0.1, None)
    # Each click by a seeded hash: Binomial(n, 0.1), within 5 standard deviations.
    assert abs(len(random_validation) - 0.1 * len(train)) < 5 * (0.1 * 0.9 * len(train)) ** 0.5
    assert len(random_fit) + len(random_validation) == len(train)


def test_validation_recall_equals_brute_force():
    train = _clicks(1)
    fit_part, validation = validation_split(train, 0.2, None)
    stats = FeatureStatistics.from_training_clicks(train)
    seed_everything(1)
    model = build_model(ModelConfig(embedding_dim=8), stats)
    watch = ValidationRecall(model, validation, fit_part, k=5, patience=1)
    recall = watch.recall(batch_size=37)  # several batches
    # Brute force: score every vocabulary item, mask the user's fit-part clicks.
    items = list(stats.items.ids)
    item_vectors = model.doc_tower({"item_id": tf.constant(items)}).numpy()
    seen = fit_part.groupby("user_id")["item_id"].agg(set)
    hits = []
    for user, item in zip(validation["user_id"], validation["item_id"]):
        if item in seen.get(user, set()):
            continue  # a repeat of a fit-part click is not a validation target
        scores = model.query_tower({"user_id": tf.constant([user])}).numpy()[0] @ item_vectors.T
        scores[[items.index(i) for i in seen.get(user, set())]] = -np.inf
        hits.append(np.sum(scores > scores[items.index(item)]) < 5)
    assert recall == pytest.approx(np.mean(hits))
    assert len(watch.validation) == len(hits)


def test_validation_recall_of_a_hierarchical_softmax_ranks_by_its_log_probabilities():
    """Not a dot product: every item scored by ``item_scores``, in blocks bounded by ``max_scores``."""
    train = _clicks(3)
    fit_part, validation = validation_split(train, 0.2, None)
    stats = FeatureStatistics.from_training_clicks(train)
    seed_everything(3)
    model = build_model(ModelConfig(embedding_dim=8, loss={"kind": "hierarchical_softmax"}), stats)
    assert not model.servable_by_dot_product
    watch = ValidationRecall(model, validation, fit_part, k=5, patience=1)
    items = list(stats.items.ids)
    seen = fit_part.groupby("user_id")["item_id"].agg(set)
    hits = []
    for user, item in zip(validation["user_id"], validation["item_id"]):
        if item in seen.get(user, set()):
            continue
        scores = model.item_scores(model.query_tower({"user_id": tf.constant([user])})).numpy()[0, 1:]
        scores[[items.index(i) for i in seen.get(user, set())]] = -np.inf
        hits.append(np.sum(scores > scores[items.index(item)]) < 5)
    # A score budget of 3 catalogue rows: batches of 3 clicks.
    assert watch.recall(max_scores=3 * (model.num_items + 1)) == pytest.approx(np.mean(hits))
    assert watch.recall() == pytest.approx(np.mean(hits))


@pytest.mark.slow
def test_fit_stops_early_and_refits_for_the_best_number_of_epochs():
    train = _clicks(2)
    stats = FeatureStatistics.from_training_clicks(train)
    config = TrainConfig(
        epochs=25,
        batch_size=256,
        learning_rate=0.05,
        validation_fraction=0.2,
        early_stopping_patience=1,
        verbose=0,
    )
    seed_everything(0)
    model = build_model(ModelConfig(embedding_dim=8), stats)
    history = fit(model, train, config)
    recalls, best = history["val_recall@20"], int(history["best_epoch"][0])
    assert len(recalls) < 25  # it stopped
    assert recalls[best - 1] == max(recalls)
    assert len(recalls) == best + 1  # patience 1: one epoch without improvement
    assert len(history["loss"]) == best  # the refit on all training clicks
    assert len(history["selection_loss"]) == len(recalls)


@pytest.mark.slow
def test_without_refit_the_best_weights_are_kept():
    train = _clicks(3)
    stats = FeatureStatistics.from_training_clicks(train)
    config = TrainConfig(
        epochs=6, batch_size=256, learning_rate=0.05, validation_fraction=0.2, refit=False, verbose=0
    )
    seed_everything(0)
    model = build_model(ModelConfig(embedding_dim=8), stats)
    history = fit(model, train, config)
    fit_part, validation = validation_split(train, 0.2, None)
    again = ValidationRecall(model, validation, fit_part, k=20, patience=1).recall()
    assert again == pytest.approx(max(history["val_recall@20"]))


@pytest.mark.slow
def test_a_refit_from_the_best_weights_trains_on_from_them():
    """``refit_from: best``: the final run starts from the best epoch's weights (its first loss is
    that of a trained model, below the first epoch's from scratch) for ``refit_epochs`` epochs."""
    train = _clicks(4)
    stats = FeatureStatistics.from_training_clicks(train)
    common = dict(epochs=8, batch_size=256, learning_rate=0.05, validation_fraction=0.2,
                  early_stopping_patience=2, verbose=0)
    runs = {}
    for start in ("initial", "best"):
        seed_everything(0)
        model = build_model(ModelConfig(embedding_dim=8), stats)
        runs[start] = fit(model, train, TrainConfig(**common, refit_from=start, refit_epochs=2))
    scratch, onward = runs["initial"], runs["best"]
    assert onward["best_epoch"] == scratch["best_epoch"] and onward["val_recall@20"] == scratch["val_recall@20"]
    assert len(scratch["loss"]) == int(scratch["best_epoch"][0]) and len(onward["loss"]) == 2
    assert onward["loss"][0] < scratch["loss"][0] - 0.1  # it did not start again from the initial weights


@pytest.mark.slow
def test_the_selection_logs_its_own_epochs_and_says_what_it_chose(tmp_path):
    """Before a refit the selection run is a run of its own: its CSV and TensorBoard run hold the
    validation recall per epoch, one line says what was chosen, and the summary records it."""
    from retrieval.training import training_summary

    train = _clicks(2)
    config = TrainConfig(epochs=25, batch_size=256, learning_rate=0.05, validation_fraction=0.2,
                         early_stopping_patience=1, verbose=0)
    seed_everything(0)
    model = build_model(ModelConfig(embedding_dim=8), FeatureStatistics.from_training_clicks(train))
    lines: list[str] = []
    history = fit(model, train, config, log_dir=tmp_path, say=lines.append)
    best, recalls = int(history["best_epoch"][0]), history["val_recall@20"]
    selection = pd.read_csv(tmp_path / "selection_log.csv")
    np.testing.assert_allclose(selection["val_recall@20"], recalls)
    assert len(pd.read_csv(tmp_path / "train_log.csv")) == best  # the refit: its own log
    assert list((tmp_path / "tensorboard" / "selection").iterdir())
    said = [line for line in lines if line.startswith("early stopping:")]
    assert said == [f"early stopping: best epoch {best} of {len(recalls)} run (val_recall@20 "
                    f"{recalls[best - 1]:.4f}); retraining from the initial weights on all training clicks "
                    f"for {best} epochs"]
    summary = training_summary(config, history)
    assert summary["epochs"] == best and summary["max_epochs"] == 25
    assert summary["early_stopping"]["best_epoch"] == best
    assert summary["early_stopping"]["val_recall@20"] == pytest.approx(recalls)
    assert summary["early_stopping"]["refit"] == "initial"


def _brute_force_ranks(model, validation, fit_part, stats) -> list[int]:
    """Each validation click's 0-based rank among every item, the user's fit-part items masked (numpy)."""
    items = list(stats.items.ids)
    item_vectors = model.doc_tower({"item_id": tf.constant(items)}).numpy()
    seen = fit_part.groupby("user_id")["item_id"].agg(set)
    ranks = []
    for user, item in zip(validation["user_id"], validation["item_id"]):
        if item in seen.get(user, set()):
            continue
        scores = model.query_tower({"user_id": tf.constant([user])}).numpy()[0] @ item_vectors.T
        scores[[items.index(i) for i in seen.get(user, set())]] = -np.inf
        ranks.append(int(np.sum(scores > scores[items.index(item)])))
    return ranks


def test_validation_ndcg_is_the_mean_discounted_gain_of_each_click_within_the_top_k():
    train = _clicks(1)
    fit_part, validation = validation_split(train, 0.2, None)
    stats = FeatureStatistics.from_training_clicks(train)
    seed_everything(1)
    model = build_model(ModelConfig(embedding_dim=8), stats)
    ranks = np.array(_brute_force_ranks(model, validation, fit_part, stats))
    gains = np.where(ranks < 5, 1.0 / np.log2(ranks + 2.0), 0.0)
    assert 0 < np.sum(ranks < 5) < len(ranks)  # hits and misses both
    watch = ValidationRecall(model, validation, fit_part, k=5, patience=1, metric="ndcg")
    recall, ndcg = watch.measure(batch_size=37)
    assert recall == pytest.approx(np.mean(ranks < 5))
    assert ndcg == pytest.approx(gains.mean())
    assert watch.key == "val_ndcg@5"


def test_early_stopping_on_ndcg_keeps_the_epoch_of_the_best_ndcg_not_of_the_best_recall():
    train = _clicks(1)
    fit_part, validation = validation_split(train, 0.2, None)
    stats = FeatureStatistics.from_training_clicks(train)
    seed_everything(1)
    model = build_model(ModelConfig(embedding_dim=8), stats)
    readings = iter([(0.30, 0.10), (0.35, 0.09), (0.32, 0.12), (0.31, 0.11)])  # (recall, NDCG) an epoch
    by_ndcg = ValidationRecall(model, validation, fit_part, k=5, patience=2, metric="ndcg")
    by_recall = ValidationRecall(model, validation, fit_part, k=5, patience=2)
    for epoch, reading in enumerate(readings):
        by_ndcg.measure = by_recall.measure = lambda reading=reading: reading  # type: ignore[method-assign]
        logs: dict = {}
        stop_ndcg, stop_recall = by_ndcg(epoch, logs), by_recall(epoch, logs)
        assert logs == {"val_recall@5": reading[0], "val_ndcg@5": reading[1]}  # both logged either way
    assert (by_ndcg.best_epoch, by_recall.best_epoch) == (3, 2)
    assert (stop_ndcg, stop_recall) == (False, True)  # two epochs past recall's best, one past NDCG's
    with pytest.raises(ValueError, match="validation metric must be one of recall, ndcg, got 'mrr'"):
        ValidationRecall(model, validation, fit_part, k=5, patience=1, metric="mrr")


def test_a_resumed_selection_takes_up_the_watched_metric():
    train = _clicks(1)
    fit_part, validation = validation_split(train, 0.2, None)
    stats = FeatureStatistics.from_training_clicks(train)
    model = build_model(ModelConfig(embedding_dim=8), stats)
    watch = ValidationRecall(model, validation, fit_part, k=5, patience=2, metric="ndcg")
    watch.resume({"val_recall@5": [0.3, 0.35, 0.32], "val_ndcg@5": [0.10, 0.09, 0.12]})
    assert watch.best_epoch == 3 and watch.recalls == [0.3, 0.35, 0.32]


def test_each_epochs_hook_time_is_timed_apart_from_its_training_time():
    """``timing['hook_seconds']``: the epoch-end hooks' own time (validation), which ``epoch_seconds`` (the
    training throughput's time) leaves out: a hook that sleeps 0.3 s shows in it."""
    import time

    train = _clicks(4)
    stats = FeatureStatistics.from_training_clicks(train)
    config = TrainConfig(epochs=2, batch_size=256, validation_fraction=0, verbose=0)
    runs = {}
    for pause in (0.0, 0.3):
        seed_everything(0)
        timing: dict[str, list[float]] = {}
        fit(build_model(ModelConfig(embedding_dim=8), stats), train, config, timing=timing,
            epoch_hooks=[lambda epoch, logs, pause=pause: time.sleep(pause)])
        runs[pause] = timing
    assert len(runs[0.3]["hook_seconds"]) == len(runs[0.3]["epoch_seconds"]) == 2
    assert all(0.3 <= seconds < 5 for seconds in runs[0.3]["hook_seconds"])
    assert all(seconds < 0.3 for seconds in runs[0.0]["hook_seconds"])
