"""The synthetic click log: determinism, shape, skew, clusters and learnability."""

import numpy as np
import pandas as pd
import pytest

from retrieval.config import SplitConfig, SyntheticConfig
from retrieval.data import ITEM, TIME, USER, WEIGHT, generate_clicks, split_clicks, synthetic_truth
from retrieval.data.synthetic import START

SMALL = SyntheticConfig(n_users=1000, n_items=500, n_clusters=10, mean_clicks_per_user=30)


@pytest.fixture(scope="module")
def small():
    return generate_clicks(SMALL)


def positions(ids):
    """'u0042' -> 42: generated ids encode their latent index."""
    return ids.str[1:].astype(int).to_numpy()


def test_same_seed_same_frames_and_another_seed_differs(small):
    for first, again in zip(small, generate_clicks(SMALL)):
        pd.testing.assert_frame_equal(first, again)
    other, _, _ = generate_clicks(SMALL.model_copy(update={"seed": 1}))
    assert not other[ITEM].head(100).equals(small[0][ITEM].head(100))


def test_canonical_frames(small):
    clicks, items, users = small
    assert list(clicks.columns) == [USER, ITEM, TIME, WEIGHT]
    assert clicks[TIME].dtype == np.int64 and clicks[WEIGHT].dtype == np.float32
    assert (clicks[WEIGHT] == 1).all()
    assert items.columns.tolist() == [ITEM, "category", "price", "title"]
    assert users.columns.tolist() == [USER, "age", "country", "signup_day"]
    assert len(items) == SMALL.n_items and items[ITEM].is_unique
    assert len(users) == SMALL.n_users and users[USER].is_unique
    assert set(clicks[ITEM]) <= set(items[ITEM]) and set(clicks[USER]) == set(users[USER])


def test_clicks_per_user(small):
    counts = small[0].groupby(USER).size()
    assert counts.min() >= 3
    assert abs(counts.mean() - SMALL.mean_clicks_per_user) < 0.1 * SMALL.mean_clicks_per_user
    assert counts.std() > 5  # users differ in activity


def test_timestamps_span_the_period_in_order(small):
    clicks, _, users = small
    times = clicks[TIME].to_numpy()
    assert times.min() >= START == 1767225600  # 2026-01-01T00:00:00Z
    assert times.max() < START + SMALL.days * 86400
    assert (np.diff(times) >= 0).all()  # the log is in time order, so every user's clicks are
    first_day = (clicks.groupby(USER)[TIME].min() - START) // 86400
    signup_day = users.set_index(USER)["signup_day"]
    assert (first_day >= signup_day.loc[first_day.index]).all()
    assert users["signup_day"].std() > 10  # users arrive at different times


def test_zipf_skew_and_its_exponent():
    def top_fifth_share(exponent):
        clicks, _, _ = generate_clicks(SMALL.model_copy(update={"popularity_exponent": exponent}))
        counts = clicks[ITEM].value_counts().to_numpy()
        return counts[: SMALL.n_items // 5].sum() / counts.sum()

    assert top_fifth_share(1.0) > 0.5  # the top 20% of items get most clicks
    assert top_fifth_share(0.0) < 0.35  # no skew: close to a fair 20%


def test_click_counts_follow_latent_popularity(small):
    truth = synthetic_truth(SMALL)
    counts = np.bincount(positions(small[0][ITEM]), minlength=SMALL.n_items)
    ranks = [np.argsort(np.argsort(x)) for x in (counts, truth.popularity)]
    assert np.corrcoef(*ranks)[0, 1] > 0.8  # Spearman correlation


def test_cold_items_are_in_the_catalogue_but_never_clicked(small):
    clicks, items, _ = small
    cold = np.flatnonzero(synthetic_truth(SMALL).popularity == 0)
    assert len(cold) == round(0.03 * SMALL.n_items)
    clicked = set(positions(clicks[ITEM]))
    assert not clicked & set(cold.tolist())
    assert set(positions(items[ITEM])) >= set(cold.tolist())


@pytest.mark.parametrize("taste_strength,low,high", [(0.8, 0.8, 0.9), (0.0, 0.1, 0.35)])
def test_clicks_concentrate_in_the_users_clusters(taste_strength, low, high):
    cfg = SMALL.model_copy(update={"taste_strength": taste_strength})
    clicks, _, _ = generate_clicks(cfg)
    truth = synthetic_truth(cfg)
    user, item = positions(clicks[USER]), positions(clicks[ITEM])
    in_taste = (truth.item_cluster[item][:, None] == truth.user_clusters[user]).any(axis=1)
    # taste_strength of clicks from the user's 2 clusters, plus global draws that land there.
    assert low < in_taste.mean() < high
    assert (truth.user_clusters[:, 0] != truth.user_clusters[:, 1]).all()


def test_features_correlate_noisily_with_clusters(small):
    _, items, users = small
    truth = synthetic_truth(SMALL)
    own = np.array([f"c{c:02d}" for c in truth.item_cluster])
    assert 0.8 < (items["category"].to_numpy() == own).mean() < 0.92  # 85% + lucky noise
    assert 0 < items["price"].isna().sum() < 0.06 * SMALL.n_items
    assert (items["price"].dropna() > 0).all()
    words = items["title"].str.split().str.len()
    assert words.between(2, 4).all()
    # Items of one cluster share topic words; titles across clusters rarely do.
    cluster_of_word = {}
    for title, cluster in zip(items["title"], truth.item_cluster):
        for word in title.split():
            cluster_of_word.setdefault(word, set()).add(cluster)
    single_cluster_words = [w for w, c in cluster_of_word.items() if len(c) == 1]
    assert len(single_cluster_words) >= SMALL.n_clusters * 2
    assert users["age"].between(16, 80).all() and users["country"].nunique() > 3


def recall_at_k(scores, seen, test_user, test_item, k=20):
    scores = np.where(seen, -np.inf, scores)  # as evaluation does: never recommend training items
    top = np.argpartition(-scores, k, axis=1)[:, :k]
    hit = np.zeros(scores.shape, dtype=bool)
    np.put_along_axis(hit, top, True, axis=1)
    return hit[test_user, test_item].mean()


def test_taste_clusters_make_the_log_learnable():
    """With the default config, item-item co-occurrence (a collaborative method) must
    clearly beat popularity, and popularity clearly beat chance, on the temporal split.
    Seeds 0-4 give recall@20 of 0.12-0.13 (popularity) vs 0.35-0.37 (item-item)."""
    cfg = SyntheticConfig()
    train, test = split_clicks(generate_clicks(cfg)[0], SplitConfig(kind="temporal"))
    test = test[test[USER].isin(train[USER])]
    n_users, n_items = cfg.n_users, cfg.n_items
    clicked = np.zeros((n_users, n_items), dtype=np.float32)
    np.add.at(clicked, (positions(train[USER]), positions(train[ITEM])), 1.0)
    seen = clicked > 0
    popularity = np.broadcast_to(clicked.sum(axis=0), clicked.shape)
    binary = seen.astype(np.float32)
    cooccurrence = binary.T @ binary
    norm = np.sqrt(np.diag(cooccurrence)) + 1e-9
    similarity = cooccurrence / norm[:, None] / norm[None, :]
    np.fill_diagonal(similarity, 0.0)
    user, item = positions(test[USER]), positions(test[ITEM])
    pop = recall_at_k(popularity, seen, user, item)
    item_item = recall_at_k(clicked @ similarity, seen, user, item)
    chance = 20 / n_items
    assert pop > 3 * chance
    assert item_item > 2.5 * pop, (item_item, pop)
