"""Baselines (popularity, implicit ALS) and the model-vs-baselines comparison."""

import numpy as np
import pandas as pd
import pytest

from retrieval.config import (
    ALSConfig,
    BaselinesConfig,
    ConfigError,
    DataConfig,
    EvaluationConfig,
    SplitConfig,
    SyntheticConfig,
    load_config,
)
from retrieval.data import ITEM, USER, load_dataset
from retrieval.evaluation import (
    BASELINES,
    EvalSet,
    als_ranking,
    baseline_ranking,
    build_eval_set,
    ease_ranking,
    ease_weights,
    evaluate_against_baselines,
    fit_als,
    popularity_ranking,
    popularity_ranking_from_counts,
    ranking_metrics,
)
from retrieval.index import ItemIndex

SMALL = SyntheticConfig(n_users=500, n_items=300, mean_clicks_per_user=30, seed=3)


@pytest.fixture(scope="module")
def synthetic():
    dataset = load_dataset(DataConfig(synthetic=SMALL), SplitConfig(kind="temporal", test_fraction=0.2))
    catalogue = dataset.items[ITEM].astype(str).tolist()
    eval_set = build_eval_set(dataset.train, dataset.test, catalogue, EvaluationConfig())
    return dataset, catalogue, eval_set


def _clicks(pairs):
    return pd.DataFrame(pairs, columns=[USER, ITEM]).astype(str)


def test_popularity_by_hand_masks_ties_and_padding():
    train = _clicks([("a", "x"), ("b", "x"), ("b", "y"), ("c", "z"), ("c", "y"), ("c", "x")])
    test = _clicks([("a", "y"), ("b", "w")])
    catalogue = ["w", "x", "y", "z"]  # w has no training click
    eval_set = build_eval_set(train, test, catalogue, EvaluationConfig())
    ranked = popularity_ranking(train, catalogue, eval_set, depth=4)
    # counts: x 3, y 2, z 1, w 0. a clicked x; b clicked x and y (masked).
    # Ties at 0 clicks would be broken by catalogue order; b's list runs out after z, w.
    assert ranked.tolist() == [[2, 3, 0, -1], [3, 0, -1, -1]]
    # Ties: catalogue order, whatever the counts around them.
    one_user = EvalSet(np.array(["u"]), [np.array([0])], [np.array([2])])
    tied = popularity_ranking_from_counts(np.array([1, 3, 1, 0, 3, 1]), one_user, depth=5)
    assert tied.tolist() == [[1, 4, 0, 5, 3]]  # row 2 (a tie at 1) is the user's own click


def test_als_is_seeded_covers_the_catalogue_and_masks_like_the_model(synthetic):
    dataset, catalogue, eval_set = synthetic
    config = BaselinesConfig(als=ALSConfig(factors=16, iterations=5, seed=7))
    first = fit_als(dataset.train, catalogue, config.als)
    again = fit_als(dataset.train, catalogue, config.als)
    np.testing.assert_array_equal(first.item_factors, again.item_factors)
    assert first.item_factors.shape == (len(catalogue), 16)
    cold = ~pd.Index(catalogue).isin(set(dataset.train[ITEM]))
    assert cold.any() and not first.item_factors[cold].any()  # zero rows, like the model's OOV row
    assert first.item_factors[~cold].any(axis=1).all()

    ranked = als_ranking(dataset.train, catalogue, eval_set, 30, config)
    # Reference: a dense argsort of the same scores with training items set to -inf.
    scores = first.users(eval_set.user_ids) @ first.item_factors.T
    for row, masked in enumerate(eval_set.exclude):
        scores[row, masked] = -np.inf
    expected = np.argsort(-scores, axis=1, kind="stable")[:, :30]
    agree = (ranked == expected).mean()
    assert agree > 0.999, agree  # float32 near-ties may swap neighbours
    for row, masked in zip(ranked, eval_set.exclude):
        assert not set(row) & set(masked)


def test_als_clearly_beats_popularity_on_synthetic_data(synthetic):
    dataset, catalogue, eval_set = synthetic
    depth = 20
    als = ranking_metrics(als_ranking(dataset.train, catalogue, eval_set, depth), eval_set.relevant, [depth])
    popular = ranking_metrics(popularity_ranking(dataset.train, catalogue, eval_set, depth), eval_set.relevant, [depth])
    assert als["users"] == popular["users"] > 100
    assert als["recall@20"] > 1.5 * popular["recall@20"], (als["recall@20"], popular["recall@20"])
    assert als["ndcg@20"] > 1.5 * popular["ndcg@20"]


def test_comparison_ranks_the_model_exactly_and_runs_the_configured_baselines(synthetic):
    dataset, catalogue, eval_set = synthetic
    rng = np.random.default_rng(0)
    items = rng.normal(size=(len(catalogue), 8)).astype(np.float32)
    queries = rng.normal(size=(len(eval_set.user_ids), 8)).astype(np.float32)
    index = ItemIndex.build(catalogue, items)
    config = EvaluationConfig(ks=(5, 20), baselines=BaselinesConfig(rankers=("als", "popularity")))
    results = evaluate_against_baselines(index, queries, eval_set, dataset.train, config)
    assert list(results)[:3] == ["model", "als", "popularity"]
    assert {"segments", "reference", "seconds", "counts"} <= set(results)

    scores = queries @ items.T
    for row, masked in enumerate(eval_set.exclude):
        scores[row, masked] = -np.inf
    expected = ranking_metrics(np.argsort(-scores, axis=1)[:, :20], eval_set.relevant, [5, 20])
    for key, value in expected.items():
        assert results["model"][key] == pytest.approx(value), key
    segments = results["segments"]["model"]
    assert sum(s["users"] for s in segments.values()) == results["model"]["users"]
    counts = dataset.train[ITEM].value_counts().reindex(catalogue, fill_value=0).to_numpy()
    boundary = np.sort(counts)[::-1][int(np.ceil(0.2 * len(catalogue))) - 1]
    assert results["reference"]["tail_items"] == int(np.sum((counts < boundary) | (counts == 0)))

    only_model = evaluate_against_baselines(
        index, queries, eval_set, dataset.train, EvaluationConfig(ks=(5,), baselines=BaselinesConfig(rankers=()))
    )
    assert [name for name in only_model if "users" in only_model[name]] == ["model"]


def test_unknown_or_repeated_baselines_are_named():
    assert set(BASELINES) == {"popularity", "als"}
    with pytest.raises(ValueError, match="unknown baseline 'bpr'; valid: popularity, als"):
        baseline_ranking("bpr", None, [], None, 10, BaselinesConfig())
    with pytest.raises(ConfigError, match=r"evaluation\.baselines\.rankers"):
        load_config(None, ["evaluation.baselines.rankers=[popularity, bpr]"])
    with pytest.raises(ConfigError, match="names a ranker twice"):
        load_config(None, ["evaluation.baselines.rankers=[als, als]"])
    with pytest.raises(ConfigError, match="activity_edges must be increasing"):
        load_config(None, ["evaluation.activity_edges=[10, 5]"])
    config = load_config(None, ["evaluation.baselines.als.factors=8", "evaluation.baselines.rankers=[als]"])
    assert config.evaluation.baselines.als.factors == 8 and config.evaluation.baselines.rankers == ("als",)


def test_ease_weights_match_per_item_ridge_regressions_and_rank_like_the_model():
    # EASE's closed form B = I - P / diag(P) equals, column by column, the ridge regression of
    # item j's clicks on the other items' clicks (the diagonal constraint drops item j).
    train = _clicks([("a", "x"), ("a", "y"), ("b", "y"), ("b", "z"), ("c", "x"), ("c", "z"), ("c", "y"),
                     ("d", "w"), ("d", "x"), ("a", "x")])  # a->x twice counts once
    catalogue = ["w", "x", "y", "z", "v"]  # v has no training click
    l2 = 0.7
    X = np.zeros((4, 5))
    for user, item in train.itertuples(index=False):
        X["abcd".index(user), catalogue.index(item)] = 1.0
    expected = np.zeros((5, 5))
    for j in range(5):
        others = [i for i in range(5) if i != j]
        A = X[:, others]
        expected[others, j] = np.linalg.solve(A.T @ A + l2 * np.eye(4), A.T @ X[:, j])
    B = ease_weights(train, catalogue, l2)
    assert B.shape == (5, 5)
    np.testing.assert_allclose(B, expected, atol=1e-5)

    test = _clicks([("a", "z"), ("b", "x"), ("e", "y")])  # e has no training click: a zero query
    eval_set = build_eval_set(train, test, catalogue, EvaluationConfig())
    ranked = ease_ranking(train, catalogue, eval_set, depth=5, l2=l2)
    for u, user in enumerate(eval_set.user_ids):
        scores = X["abcd".index(user)] @ expected if user in "abcd" else np.zeros(5)
        allowed = [r for r in np.argsort(-scores, kind="stable") if r not in set(eval_set.exclude[u])]
        got = [r for r in ranked[u] if r >= 0]
        assert sorted(got) == sorted(allowed)  # every unclicked item, own clicks masked
        np.testing.assert_allclose(scores[got], np.sort(scores[allowed])[::-1], atol=1e-5)  # best first


def test_ease_refuses_a_non_positive_l2_and_unknown_items():
    train = _clicks([("a", "x")])
    with pytest.raises(ValueError, match="l2 must be > 0"):
        ease_weights(train, ["x"], 0.0)
    with pytest.raises(ValueError, match="outside the catalogue"):
        ease_weights(train, ["y"], 1.0)
