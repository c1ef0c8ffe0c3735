"""A seeded synthetic click log with popularity skew and latent taste clusters.

The generative story, chosen so that a collaborative model has something to
learn that global popularity cannot capture, while popularity stays a sensible
baseline:

- Items get Zipf popularity ``1 / rank ** popularity_exponent`` over a random
  ranking, and each belongs to one of ``n_clusters`` taste clusters (balanced
  sizes). About 3% of items are cold: zero popularity, so they are never
  clicked, yet they are in the catalogue (as new items are in production).
- Each user has a primary and a secondary cluster. A click comes from the
  user's clusters with probability ``taste_strength`` (primary 70% of those),
  the item drawn by popularity within the cluster; otherwise it is drawn by
  popularity from the whole catalogue.
- A repeated (user, item) click is redrawn (3 rounds), so about 1 click in 6
  is a repeat, from heavy users who exhausted their clusters' popular items.
- Users arrive at different times during the first 95% of ``days`` and click
  uniformly from arrival to the end, so a temporal split has mostly returning
  users and a few (about 2%) unseen in training.
- Features correlate with the clusters but noisily: an item's ``category``
  names its cluster 85% of the time, titles mix cluster-specific and generic
  words, prices and ages have per-cluster means.

With ``periods > 1`` the log changes over time, for benchmarks of model updates
(``benchmarks/bench_freshness.py``): ``days`` is cut into equal periods and at
the start of each period after the first, ``new_items_per_period`` of the
catalogue is launched (never clicked before), ``retired_items_per_period`` of
the live items retire (never clicked again), every item's log-popularity takes
a Gaussian random-walk step of ``popularity_drift`` and ``taste_drift`` of the
users move their secondary cluster elsewhere. Each click is drawn from its own
period's live popularity and tastes. A launched item draws its popularity rank
like any other, so some are hits. ``periods: 1`` (the default) is the
stationary log above, its output unchanged.

Everything is vectorised numpy; one seed gives identical frames.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import pandas as pd

from retrieval.config import SyntheticConfig
from retrieval.data.schema import ITEM, TIME, USER, WEIGHT

START = int(datetime(2026, 1, 1, tzinfo=timezone.utc).timestamp())
_DAY = 86_400
_COLD_SHARE = 0.03
_PRIMARY_SHARE = 0.7
_ARRIVAL_WINDOW = 0.95  # users arrive during the first 95% of the period
_REDRAWS = 3  # rounds of redrawing repeated (user, item) clicks
_CLICKS_SIGMA = 0.5  # spread of per-user activity (lognormal)
_CATEGORY_NOISE = 0.15
_PRICE_MISSING = 0.02
_WORDS_PER_CLUSTER = 4
_GENERIC_WORDS = 60
_SYLLABLES = np.array(["ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi", "pe", "sa", "do", "ri"])
_COUNTRIES = np.array(["US", "DE", "FR", "GB", "BR", "IN", "JP", "ES"])
_COUNTRY_SHARE = np.array([0.35, 0.15, 0.12, 0.1, 0.1, 0.08, 0.06, 0.04])


@dataclass(frozen=True)
class SyntheticTruth:
    """The latent structure behind a synthetic log (for tests and oracles).

    Attributes:
        item_cluster: ``[n_items]`` cluster of each item.
        popularity: ``[n_items]`` probability of each item under global
            sampling in the first period; sums to 1, exactly 0 for cold items
            (and for items not yet launched).
        user_clusters: ``[n_users, 2]`` primary and secondary cluster of each
            user in the first period.
        period_popularity: ``[periods, n_items]`` the same per period: 0 outside
            an item's live periods; row 0 is ``popularity``.
        period_user_clusters: ``[periods, n_users, 2]``; row 0 is ``user_clusters``.
        launch_period: ``[n_items]`` first period an item may be clicked in (0 for
            the starting catalogue).
        retire_period: ``[n_items]`` first period it is no longer clicked in
            (``periods`` for items never retired).
    """

    item_cluster: np.ndarray
    popularity: np.ndarray
    user_clusters: np.ndarray
    period_popularity: np.ndarray
    period_user_clusters: np.ndarray
    launch_period: np.ndarray
    retire_period: np.ndarray

    def at(self, period: int) -> SyntheticTruth:
        """The truth of one period, as a stationary log's (``popularity``, ``user_clusters`` of ``period``)."""
        return dataclasses.replace(
            self, popularity=self.period_popularity[period], user_clusters=self.period_user_clusters[period]
        )


def synthetic_truth(cfg: SyntheticConfig) -> SyntheticTruth:
    """The latent clusters and popularity that ``generate_clicks(cfg)`` uses."""
    return _draw_truth(cfg, np.random.default_rng(_streams(cfg.seed)[0]))


def generate_clicks(cfg: SyntheticConfig) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Generate a click log with item and user features.

    Args:
        cfg: Sizes, skew, taste strength, period and seed.

    Returns:
        ``(clicks, items, users)``:

        - clicks: canonical frame (``user_id``, ``item_id``, ``timestamp``,
          ``weight`` = 1.0) sorted by time, so each user's clicks are in order;
          at least 3 clicks per user.
        - items: every catalogue item, cold ones included: ``item_id``,
          ``category`` (str, e.g. ``"c07"``), ``price`` (float, a few NaN),
          ``title`` (str); with ``periods > 1`` also ``launch_period`` and
          ``retire_period`` (int64, ``SyntheticTruth``'s), a period being
          ``days / periods`` long from 2026-01-01.
        - users: ``user_id``, ``age`` (int64), ``country`` (str),
          ``signup_day`` (int64, days since 2026-01-01).

        Ids look like ``"u0042"`` and ``"i0007"``.
    """
    truth_seed, click_seed, feature_seed = _streams(cfg.seed)
    truth = _draw_truth(cfg, np.random.default_rng(truth_seed))
    rng = np.random.default_rng(click_seed)

    # Poisson around a lognormal rate: most users near the mean, a heavy tail.
    rate = cfg.mean_clicks_per_user * rng.lognormal(-_CLICKS_SIGMA**2 / 2, _CLICKS_SIGMA, cfg.n_users)
    counts = np.maximum(3, rng.poisson(rate))
    user = np.repeat(np.arange(cfg.n_users), counts)
    span = cfg.days * _DAY
    if cfg.periods == 1:
        # The stationary log's draws, in their original order: its output never changes.
        item = _draw_items(truth, user, cfg.taste_strength, rng)
        arrival = rng.integers(0, max(1, int(_ARRIVAL_WINDOW * span)), cfg.n_users)
        time = arrival[user] + (rng.random(len(user)) * (span - arrival[user])).astype(np.int64)
    else:
        # Times first: each click's item comes from its own period's catalogue and tastes.
        arrival = rng.integers(0, max(1, int(_ARRIVAL_WINDOW * span)), cfg.n_users)
        time = arrival[user] + (rng.random(len(user)) * (span - arrival[user])).astype(np.int64)
        item = _draw_items(truth, user, cfg.taste_strength, rng, period_of(time, span, cfg.periods))
    order = np.lexsort((user, time))
    user, item, time = user[order], item[order], time[order]

    user_ids, item_ids = _ids("u", cfg.n_users), _ids("i", cfg.n_items)
    clicks = pd.DataFrame(
        {
            USER: user_ids[user],
            ITEM: item_ids[item],
            TIME: START + time,
            WEIGHT: np.ones(len(user), dtype=np.float32),
        }
    )
    features = np.random.default_rng(feature_seed)
    items = _item_features(truth, item_ids, features)
    if cfg.periods > 1:
        items["launch_period"] = truth.launch_period.astype(np.int64)
        items["retire_period"] = truth.retire_period.astype(np.int64)
    users = _user_features(truth, user_ids, arrival // _DAY, features)
    return clicks, items, users


def period_of(seconds: np.ndarray, span: int, periods: int) -> np.ndarray:
    """The period (0 .. periods - 1) of times ``seconds`` after the log's start, ``span`` seconds cut
    into ``periods`` equal parts (a time at a boundary belongs to the later period)."""
    return np.minimum(np.asarray(seconds, dtype=np.int64) * periods // span, periods - 1)


def period_starts(cfg: SyntheticConfig) -> np.ndarray:
    """``[periods + 1]`` Unix times: each period's first second and the log's end (as clicks' timestamps)."""
    span = cfg.days * _DAY
    return START + -(-np.arange(cfg.periods + 1, dtype=np.int64) * span // cfg.periods)


def _streams(seed: int) -> list[np.random.SeedSequence]:
    # Independent streams: changing how features are drawn never changes the clicks.
    return np.random.SeedSequence(seed).spawn(3)


def _draw_truth(cfg: SyntheticConfig, rng: np.random.Generator) -> SyntheticTruth:
    n_clusters = min(cfg.n_clusters, cfg.n_items)  # no empty clusters
    item_cluster = rng.permutation(np.arange(cfg.n_items) % n_clusters)
    rank = rng.permutation(cfg.n_items) + 1
    weight = rank.astype(np.float64) ** -cfg.popularity_exponent
    n_cold = int(round(_COLD_SHARE * cfg.n_items)) if cfg.n_items > 1 else 0
    weight[rng.choice(cfg.n_items, n_cold, replace=False)] = 0.0
    primary = rng.integers(0, n_clusters, cfg.n_users)
    # Secondary differs from primary: shift by 1..n_clusters-1 (same if only one cluster).
    shift = rng.integers(1, n_clusters, cfg.n_users) if n_clusters > 1 else np.zeros(cfg.n_users, int)
    secondary = (primary + shift) % n_clusters
    clusters = np.stack([primary, secondary], axis=1)
    if cfg.periods == 1:
        popularity = weight / weight.sum()
        return SyntheticTruth(item_cluster, popularity, clusters, popularity[None], clusters[None],
                              np.zeros(cfg.n_items, np.int64), np.ones(cfg.n_items, np.int64))
    # After the stationary draws, so the starting catalogue, its ranks and the users' clusters are the same.
    launch, retire = _lifetimes(cfg, rng)
    log_weight = np.log(np.where(weight > 0, weight, 1.0))
    steps = rng.normal(0.0, cfg.popularity_drift, (cfg.periods - 1, cfg.n_items))
    walk = np.concatenate([np.zeros((1, cfg.n_items)), np.cumsum(steps, axis=0)])
    period = np.arange(cfg.periods)[:, None]
    live = (launch[None] <= period) & (period < retire[None]) & (weight[None] > 0)
    period_weight = np.where(live, np.exp(log_weight[None] + walk), 0.0)
    total = period_weight.sum(axis=1, keepdims=True)
    if (total == 0).any():
        raise ValueError(f"period {int(np.flatnonzero(total[:, 0] == 0)[0])} of the synthetic log has no live item: "
                         "lower data.synthetic.retired_items_per_period")
    period_clusters = [clusters]
    for _ in range(1, cfg.periods):
        moved = period_clusters[-1].copy()
        movers = np.flatnonzero(rng.random(cfg.n_users) < cfg.taste_drift)
        if n_clusters > 2 and len(movers):
            # A new secondary cluster, other than both current ones: shift by 1..n_clusters-1 from the
            # primary, skipping the old secondary's shift.
            old_shift = (moved[movers, 1] - moved[movers, 0]) % n_clusters
            shift = rng.integers(1, n_clusters - 1, len(movers))
            shift = np.where(shift >= old_shift, shift + 1, shift)
            moved[movers, 1] = (moved[movers, 0] + shift) % n_clusters
        period_clusters.append(moved)
    popularity = period_weight / total
    return SyntheticTruth(item_cluster, popularity[0], clusters, popularity, np.stack(period_clusters),
                          launch, retire)


def _lifetimes(cfg: SyntheticConfig, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``(launch_period, retire_period)`` [n_items]: ``new_items_per_period`` of n_items launched at each
    period after the first, ``retired_items_per_period`` of the live ones retired there."""
    per_period = int(round(cfg.new_items_per_period * cfg.n_items))
    launch = np.zeros(cfg.n_items, np.int64)
    newcomers = rng.permutation(cfg.n_items)[: per_period * (cfg.periods - 1)]
    launch[newcomers] = np.repeat(np.arange(1, cfg.periods), per_period)
    retire = np.full(cfg.n_items, cfg.periods, np.int64)
    for period in range(1, cfg.periods):
        live = np.flatnonzero((launch < period) & (retire == cfg.periods))
        leaving = int(round(cfg.retired_items_per_period * len(live)))
        retire[rng.choice(live, leaving, replace=False)] = period
    return launch, retire


def _draw_items(
    truth: SyntheticTruth,
    user: np.ndarray,
    taste_strength: float,
    rng: np.random.Generator,
    period: np.ndarray | None = None,
) -> np.ndarray:
    """One item per click of ``user``; ``period`` [clicks] draws each from its period's truth (None: the first)."""

    def draw(cluster: np.ndarray, rows: np.ndarray | slice) -> np.ndarray:
        if period is None:
            return _sample(truth, cluster, rng)
        return _sample_by_period(truth, cluster, period[rows], rng)

    side = np.where(rng.random(len(user)) < _PRIMARY_SHARE, 0, 1)
    taste = rng.random(len(user)) < taste_strength
    clusters = truth.user_clusters[user, side] if period is None else truth.period_user_clusters[period, user, side]
    cluster = np.where(taste, clusters, -1)
    item = draw(cluster, slice(None))
    # Users rarely click the same item twice (and evaluation usually excludes
    # training items), so redraw repeats a few times; what remains are heavy
    # users who exhausted their clusters' popular items.
    n_items = len(truth.popularity)
    for _ in range(_REDRAWS):
        first = np.unique(user * n_items + item, return_index=True)[1]
        repeat = np.ones(len(item), dtype=bool)
        repeat[first] = False
        if not repeat.any():
            break
        item[repeat] = draw(cluster[repeat], repeat)
    return item


def _sample_by_period(
    truth: SyntheticTruth, cluster: np.ndarray, period: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """``_sample`` for clicks of several periods: each period's clicks from that period's popularity."""
    item = np.empty(len(cluster), np.int64)
    for p in np.unique(period).tolist():
        rows = np.flatnonzero(period == p)
        item[rows] = _sample(truth.at(p), cluster[rows], rng)
    return item


def _sample(truth: SyntheticTruth, cluster: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One item per click: by popularity within ``cluster``, or globally where it is -1."""
    item = rng.choice(len(truth.popularity), len(cluster), p=truth.popularity)
    # Group taste clicks by cluster: one vectorised draw per cluster.
    taste = np.flatnonzero(cluster >= 0)
    taste = taste[np.argsort(cluster[taste], kind="stable")]
    n_clusters = truth.user_clusters.max() + 1
    bounds = np.concatenate([[0], np.cumsum(np.bincount(cluster[taste], minlength=n_clusters))])
    for c in range(n_clusters):
        rows = taste[bounds[c] : bounds[c + 1]]
        members = np.flatnonzero(truth.item_cluster == c)
        mass = truth.popularity[members]
        if len(rows) and mass.sum() > 0:  # a cluster of only cold items keeps global draws
            item[rows] = rng.choice(members, len(rows), p=mass / mass.sum())
    return item


def _ids(prefix: str, n: int) -> np.ndarray:
    # A fixed width (at least 4 digits) keeps ids stable across sizes and sorting in order.
    width = max(4, len(str(n - 1)))
    return np.array([f"{prefix}{i:0{width}d}" for i in range(n)])


def _spell(codes: np.ndarray, min_syllables: int) -> list[str]:
    words = []
    for code in codes.tolist():
        syllables: list[str] = []
        while code or len(syllables) < min_syllables:
            code, digit = divmod(code, len(_SYLLABLES))
            syllables.append(_SYLLABLES[digit])
        words.append("".join(syllables))
    return words


def _item_features(truth: SyntheticTruth, item_ids: np.ndarray, rng: np.random.Generator) -> pd.DataFrame:
    n_items, own = len(item_ids), truth.item_cluster
    n_clusters = own.max() + 1
    noisy = rng.random(n_items) < _CATEGORY_NOISE
    category = np.where(noisy, rng.integers(0, n_clusters, n_items), own)
    width = max(2, len(str(n_clusters - 1)))
    names = np.array([f"c{c:0{width}d}" for c in range(n_clusters)])

    cluster_price = rng.normal(np.log(20.0), 0.5, n_clusters)
    price = np.round(rng.lognormal(cluster_price[own], 0.5), 2)
    price[rng.random(n_items) < _PRICE_MISSING] = np.nan

    # Generic words have 2 syllables, cluster words at least 3: the sets never overlap.
    generic = np.array(_spell(rng.choice(len(_SYLLABLES) ** 2, _GENERIC_WORDS, replace=False), 2))
    n_topic = _WORDS_PER_CLUSTER * n_clusters
    topic = np.array(_spell(rng.choice(max(len(_SYLLABLES) ** 3, n_topic), n_topic, replace=False), 3))
    topic = topic.reshape(n_clusters, _WORDS_PER_CLUSTER)
    words = np.where(
        rng.random((n_items, 4)) < 0.4,
        topic[own[:, None], rng.integers(0, _WORDS_PER_CLUSTER, (n_items, 4))],
        generic[rng.integers(0, _GENERIC_WORDS, (n_items, 4))],
    )
    length = rng.integers(2, 5, n_items)
    title = [" ".join(row[:k]) for row, k in zip(words.tolist(), length.tolist())]
    return pd.DataFrame({ITEM: item_ids, "category": names[category], "price": price, "title": title})


def _user_features(
    truth: SyntheticTruth, user_ids: np.ndarray, signup_day: np.ndarray, rng: np.random.Generator
) -> pd.DataFrame:
    primary = truth.user_clusters[:, 0]
    cluster_age = rng.uniform(22, 55, primary.max() + 1)
    age = np.clip(np.round(rng.normal(cluster_age[primary], 8)), 16, 80).astype(np.int64)
    country = rng.choice(_COUNTRIES, len(user_ids), p=_COUNTRY_SHARE)
    return pd.DataFrame(
        {USER: user_ids, "age": age, "country": country, "signup_day": signup_day.astype(np.int64)}
    )
