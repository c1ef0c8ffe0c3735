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


# The stationary generator's frames (SMALL_SEED3 and the defaults) as produced before the log could
# change over time: sha256 over pandas' row hashes and the column names, computed by the code of that time.
STATIONARY_DIGESTS = {
    "defaults": "8d99a30d2da95b6f8fc674acf1ac85cc9de81a62bd10cd0ebcdab045dfdcfad2",
    "small seed 3": "6124fe675f90a3ee85a517ca0aa2cb558f7732a71f7e858fe0c22d5c0bca63fc",
}
CHURN = SyntheticConfig(
    n_users=1000, n_items=500, n_clusters=10, mean_clicks_per_user=30, days=70, periods=10,
    new_items_per_period=0.05, retired_items_per_period=0.05, popularity_drift=0.3, taste_drift=0.1,
)


def frames_digest(frames):
    import hashlib

    digest = hashlib.sha256()
    for frame in frames:
        digest.update(pd.util.hash_pandas_object(frame, index=True).to_numpy().tobytes())
        digest.update(str(list(frame.columns)).encode())
    return digest.hexdigest()


def test_one_period_is_the_stationary_log_unchanged():
    small = SyntheticConfig(n_users=1000, n_items=500, n_clusters=10, mean_clicks_per_user=30, seed=3)
    assert frames_digest(generate_clicks(SyntheticConfig())) == STATIONARY_DIGESTS["defaults"]
    assert frames_digest(generate_clicks(small)) == STATIONARY_DIGESTS["small seed 3"]


@pytest.fixture(scope="module")
def churn():
    clicks, items, users = generate_clicks(CHURN)
    period_length = CHURN.days * 86400 // CHURN.periods  # 7 days: a whole number of seconds here
    clicks = clicks.assign(period=(clicks[TIME] - START) // period_length)
    return clicks, items, users


def test_churn_launches_items_each_period_and_retired_items_are_never_clicked_after(churn):
    clicks, items, _ = churn
    assert clicks["period"].between(0, CHURN.periods - 1).all() and clicks["period"].nunique() == CHURN.periods
    per_period = round(CHURN.new_items_per_period * CHURN.n_items)
    launched = items["launch_period"].value_counts().sort_index()
    assert launched.loc[1:].tolist() == [per_period] * (CHURN.periods - 1)
    assert launched.loc[0] == CHURN.n_items - per_period * (CHURN.periods - 1)
    # No click before its item's launch, none in or after its retirement period.
    joined = clicks.merge(items[[ITEM, "launch_period", "retire_period"]], on=ITEM, how="left", validate="m:1")
    assert (joined["period"] >= joined["launch_period"]).all()
    assert (joined["period"] < joined["retire_period"]).all()
    # Items are first clicked in every period, launched items among them, and the launched items are
    # clicked in the period they arrive.
    first = joined.groupby(ITEM).agg(first=("period", "min"), launch=("launch_period", "first"))
    for period in range(1, CHURN.periods):
        newcomers = first[first["launch"] == period]
        assert (newcomers["first"] >= period).all()
        assert (newcomers["first"] == period).sum() >= per_period // 3, period
    # Retirement: about retired_items_per_period of the live items each period, and each retired item's
    # last click comes before it.
    retired = items[items["retire_period"] < CHURN.periods]
    assert 0.5 * CHURN.retired_items_per_period * CHURN.n_items * (CHURN.periods - 1) < len(retired)
    last = joined[joined[ITEM].isin(retired[ITEM])].groupby(ITEM)["period"].max()
    assert (last < retired.set_index(ITEM).loc[last.index, "retire_period"]).all()


def test_popularity_drift_moves_which_items_are_clicked():
    def rank_correlation_first_last(drift):
        cfg = CHURN.model_copy(update={"new_items_per_period": 0.0, "retired_items_per_period": 0.0,
                                       "taste_drift": 0.0, "popularity_drift": drift})
        truth = synthetic_truth(cfg)
        first, last = truth.period_popularity[0], truth.period_popularity[-1]
        live = first > 0
        ranks = [np.argsort(np.argsort(x[live])) for x in (first, last)]
        return np.corrcoef(*ranks)[0, 1]

    assert rank_correlation_first_last(0.0) == pytest.approx(1.0)
    assert rank_correlation_first_last(0.5) < 0.8


def test_taste_drift_moves_secondary_clusters_only():
    truth = synthetic_truth(CHURN)
    clusters = truth.period_user_clusters
    assert clusters.shape == (CHURN.periods, CHURN.n_users, 2)
    assert (clusters[:, :, 0] == clusters[0, :, 0]).all()  # the primary taste stays
    assert (clusters[:, :, 1] != clusters[:, :, 0]).all()
    moved = (clusters[1:, :, 1] != clusters[:-1, :, 1]).mean(axis=1)
    assert (abs(moved - CHURN.taste_drift) < 0.04).all(), moved


@pytest.mark.parametrize(
    "update,named",
    [
        ({"taste_drift": 0.1}, "taste_drift"),
        ({"popularity_drift": 0.5}, "popularity_drift"),
        ({"periods": 5, "new_items_per_period": 0.25}, "new_items_per_period"),
        ({"periods": 91}, "periods"),
    ],
)
def test_churn_settings_that_cannot_hold_are_refused_naming_the_key(update, named):
    from retrieval.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=named):
        load_config(None, [f"data.synthetic.{key}={value}" for key, value in update.items()])
