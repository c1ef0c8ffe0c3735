"""KernelSampler (Blanc & Rendle) wired into training, against brute-force kernel probabilities."""

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

import retrieval  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)
from retrieval.config import Config, ConfigError, SyntheticConfig, load_config
from retrieval.data import ITEM, USER, generate_clicks
from retrieval.features import FeatureStatistics
from retrieval.model import build_model
from retrieval.model.parts import build_sampler
from retrieval.samplers import KernelSampler
from retrieval.training import FrameClicks, seed_everything, train_epochs
from retrieval.training.loop import step_function


def _brute_probability(queries, catalogue, alpha):
    """p(i | q) over tower indices 0..V with the OOV row 0 excluded: [B, V + 1], column 0 = 0."""
    kernel = alpha * (queries @ catalogue.T) ** 2 + 1.0
    kernel[:, 0] = 0.0
    return kernel / kernel.sum(axis=1, keepdims=True)


def _catalogue(rng, num_items, dim):
    embeddings = rng.normal(size=(num_items + 1, dim)) / np.sqrt(dim)
    embeddings[0] = 0.0  # the ID tower's zero OOV row
    return embeddings


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_log_q_is_log_m_times_the_brute_force_kernel_probability(seed):
    rng = np.random.default_rng(seed)
    num_items, dim, m, alpha = 23, 5, 7, 4.0
    catalogue = _catalogue(rng, num_items, dim)
    queries = rng.normal(size=(6, dim))
    positives = np.array([1, 5, 23, 0, 7, 12])  # one OOV positive (0): its kernel uses the OOV row
    sampler = KernelSampler(num_items, m, alpha=alpha, leaf_size=4, refresh_steps=10, seed=seed)
    negatives = sampler.sample(
        tf.constant(positives, tf.int64), queries=tf.constant(queries, tf.float32),
        embed_catalogue=lambda: tf.constant(catalogue, tf.float32),
    )
    ids = negatives.ids.numpy()
    assert ids.shape == (6, m) and negatives.per_query
    assert ids.min() >= 1 and ids.max() <= num_items  # OOV (0) is never drawn
    # The sampler sees float32 tower outputs; compare in that precision.
    q32, c32 = queries.astype(np.float32).astype(np.float64), catalogue.astype(np.float32).astype(np.float64)
    probability = _brute_probability(q32, c32, alpha)
    np.testing.assert_allclose(
        negatives.log_q.numpy(),
        np.log(m * np.take_along_axis(probability, ids, axis=1)),
        rtol=1e-5,
        atol=1e-5,
    )
    # An OOV positive's probability is K(q, OOV row) / Z: the OOV row is never drawn (not in Z),
    # but the positive column still needs its proposal value.
    partition = (alpha * (q32 @ c32[1:].T) ** 2 + 1.0).sum(axis=1)
    positive_kernel = alpha * np.einsum("bd,bd->b", q32, c32[positives]) ** 2 + 1.0
    np.testing.assert_allclose(
        negatives.positive_log_q.numpy(), np.log(m * positive_kernel / partition), rtol=1e-5, atol=1e-5
    )
    assert negatives.positive_log_q.numpy()[3] == pytest.approx(np.log(m / partition[3]), rel=1e-5)


def test_drawn_tower_indices_follow_the_kernel_distribution():
    # Guards the tree-row -> tower-index shift: frequencies of tower index i must match p(i | q).
    rng = np.random.default_rng(7)
    num_items, dim, m, alpha = 30, 4, 20_000, 6.0
    catalogue = _catalogue(rng, num_items, dim) * 3
    queries = rng.normal(size=(2, dim))
    sampler = KernelSampler(num_items, m, alpha=alpha, leaf_size=4, seed=3)
    ids = sampler.sample(
        tf.constant([1, 2], tf.int64), queries=tf.constant(queries, tf.float32),
        embed_catalogue=lambda: tf.constant(catalogue, tf.float32),
    ).ids.numpy()
    expected = _brute_probability(
        queries.astype(np.float32).astype(np.float64), catalogue.astype(np.float32).astype(np.float64), alpha
    )
    for row in range(2):
        observed = np.bincount(ids[row], minlength=num_items + 1)
        assert observed[0] == 0
        _, p_value = stats.chisquare(observed[1:], expected[row, 1:] * m)
        assert p_value > 1e-3, p_value
        # A shift by one tower index would fail.
        shifted = np.roll(expected[row, 1:], 1)
        assert stats.chisquare(observed[1:], shifted / shifted.sum() * m)[1] < 1e-6


def test_refresh_follows_the_schedule():
    rng = np.random.default_rng(0)
    num_items, dim = 40, 3
    table = tf.Variable(_catalogue(rng, num_items, dim), dtype=tf.float32)
    sampler = KernelSampler(num_items, 4, alpha=2.0, leaf_size=4, refresh_steps=3)
    positives = tf.constant([1, 2], tf.int64)
    queries = tf.constant(rng.normal(size=(2, dim)), tf.float32)
    snapshots = []
    for step in range(7):
        table.assign(_catalogue(rng, num_items, dim))
        snapshots.append(table.numpy().astype(np.float64))
        sampler.sample(positives, queries=queries, embed_catalogue=lambda: table.read_value())
        built_at = step - step % 3  # refreshed on steps 0, 3, 6
        assert sampler.refreshes == step // 3 + 1
        current = snapshots[built_at][1:]
        np.testing.assert_allclose(sampler.tree.sums[0], current.T @ current, rtol=1e-6, atol=1e-6)
        assert sampler.tree.counts[0] == num_items


def _tiny_clicks():
    clicks, _, _ = generate_clicks(SyntheticConfig(n_users=150, n_items=60, mean_clicks_per_user=12, seed=1))
    return clicks[[USER, ITEM]].astype(str).reset_index(drop=True)


def _full_softmax_loss(model, clicks) -> float:
    """Exact mean -log softmax over every vocabulary item (numpy), at the model's temperature."""
    queries = model.query_tower({USER: tf.constant(clicks[USER].to_numpy(dtype=object))}).numpy()
    items = model.embed_catalogue().numpy()[1:]
    logits = queries @ items.T / model.objective.temperature
    rows = model.item_index(tf.constant(clicks[ITEM].to_numpy(dtype=object))).numpy() - 1
    log_partition = np.logaddexp.reduce(logits, axis=1)
    return float(np.mean(log_partition - logits[np.arange(len(rows)), rows]))


def _kernel_model(clicks, refresh_steps=3):
    config = load_config(
        None,
        [
            "model.embedding_dim=8",
            "model.loss.kind=softmax",
            "model.loss.negatives=kernel",
            "model.loss.num_negatives=16",
            "model.loss.log_q_source=static",
            "model.loss.kernel.alpha=50",
            "model.loss.kernel.leaf_size=8",
            f"model.loss.kernel.refresh_steps={refresh_steps}",
        ],
    )
    seed_everything(0)
    stats_ = FeatureStatistics.from_training_clicks(clicks)
    model = build_model(config.model, stats_)
    model.compile(optimizer=tf.keras.optimizers.Adam(0.05))
    return model


@pytest.mark.slow
def test_a_tiny_model_trains_with_kernel_negatives():
    clicks = _tiny_clicks()
    model = _kernel_model(clicks, refresh_steps=3)
    assert isinstance(model.sampler, KernelSampler)
    before = _full_softmax_loss(model, clicks)
    history = train_epochs(model, FrameClicks(clicks, 128, seed=0), 4, verbose=0).history
    losses = history["loss"]
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0]
    after = _full_softmax_loss(model, clicks)
    assert after < before - 0.2, (before, after)  # the exact objective improved, not just the sampled one
    steps = 4 * -(-len(clicks) // 128)
    assert model.sampler.refreshes == -(-steps // 3)


@pytest.mark.slow
def test_training_refreshes_the_tree_from_the_current_embeddings():
    clicks = _tiny_clicks()
    model = _kernel_model(clicks, refresh_steps=4)
    batches = FrameClicks(clicks, 64, seed=0).epoch(0)
    step = step_function(model)
    for batch in batches.take(4):  # steps 0..3: one refresh, at step 0
        step(batch)
    assert model.sampler.refreshes == 1
    current = model.embed_catalogue().numpy().astype(np.float64)[1:]
    stale = model.sampler.tree.sums[0]
    assert not np.allclose(stale, current.T @ current, atol=1e-4)  # the model moved since step 0
    for batch in batches.skip(4).take(1):  # step 4: refreshed before its update
        step(batch)
    assert model.sampler.refreshes == 2
    np.testing.assert_allclose(model.sampler.tree.sums[0], current.T @ current, rtol=1e-5, atol=1e-6)


def test_build_sampler_reads_the_kernel_section():
    config = load_config(
        None,
        [
            "model.loss.negatives=kernel",
            "model.loss.num_negatives=32",
            "model.loss.kernel.alpha=7.5",
            "model.loss.kernel.leaf_size=16",
            "model.loss.kernel.refresh_steps=9",
        ],
    )
    sampler = build_sampler(config.model.loss, np.array([0, 3, 1, 2]))
    assert isinstance(sampler, KernelSampler)
    settings = (sampler.num_items, sampler.num_samples, sampler.alpha, sampler.leaf_size, sampler.refresh_steps)
    assert settings == (3, 32, 7.5, 16, 9)
    assert Config.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    "override,key",
    [
        ("model.loss.kernel.alpha=0", "model.loss.kernel.alpha"),
        ("model.loss.kernel.leaf_size=-1", "model.loss.kernel.leaf_size"),
        ("model.loss.kernel.refresh_steps=0", "model.loss.kernel.refresh_steps"),
        ("model.loss.kernel.refresh_every=5", "model.loss.kernel.refresh_every"),
        ("model.loss.negatives=kernal", "model.loss.negatives"),
    ],
)
def test_bad_kernel_settings_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, ["model.loss.negatives=kernel", override])


def test_kernel_draws_with_replacement_only():
    with pytest.raises(ConfigError, match="unique=true is not supported with negatives='kernel'"):
        load_config(None, ["model.loss.negatives=kernel", "model.loss.unique=true"])


def test_kernel_sampler_needs_queries_and_catalogue():
    sampler = KernelSampler(5, 2)
    with pytest.raises(ValueError, match="needs the batch's queries and embed_catalogue"):
        sampler.sample(tf.constant([1], tf.int64))


def test_a_restored_step_off_the_schedule_still_builds_the_tree():
    # A checkpoint restores the step variable but not the numpy tree: the next call must build it.
    rng = np.random.default_rng(4)
    catalogue = _catalogue(rng, 12, 3)
    sampler = KernelSampler(12, 3, leaf_size=4, refresh_steps=10)
    sampler.step.assign(7)
    negatives = sampler.sample(
        tf.constant([1, 2], tf.int64), queries=tf.constant(rng.normal(size=(2, 3)), tf.float32),
        embed_catalogue=lambda: tf.constant(catalogue, tf.float32),
    )
    assert sampler.refreshes == 1 and negatives.ids.shape == (2, 3)
    items = catalogue[1:].astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(sampler.tree.sums[0], items.T @ items, rtol=1e-6)


def test_refresh_updates_only_the_changed_rows_and_equals_a_rebuild():
    rng = np.random.default_rng(9)
    num_items, dim = 70, 4
    catalogue = _catalogue(rng, num_items, dim).astype(np.float32)
    sampler = KernelSampler(num_items, 5, leaf_size=4)
    sampler.refresh(catalogue)
    assert (sampler.refreshes, sampler.rebuilds, sampler.rows_updated) == (1, 1, 0)
    rows = np.array([1, 2, 33, 70])  # tower indices
    catalogue[rows] = rng.normal(size=(len(rows), dim))
    sampler.refresh(catalogue)
    assert (sampler.refreshes, sampler.rebuilds, sampler.rows_updated) == (2, 1, len(rows))
    fresh = KernelSampler(num_items, 5, leaf_size=4)
    fresh.refresh(catalogue)
    np.testing.assert_allclose(sampler.tree.sums, fresh.tree.sums, rtol=1e-12, atol=1e-12)
    # update_rows: the same result from the ids alone; a repeated id and the OOV row 0.
    ids = np.array([5, 0, 5, 41])
    catalogue[ids] = rng.normal(size=(len(ids), dim))
    catalogue[5] = catalogue[ids[0]]
    sampler.update_rows(ids, catalogue[ids])
    fresh.refresh(catalogue)
    np.testing.assert_allclose(sampler.tree.sums, fresh.tree.sums, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(sampler._oov, catalogue[0])
    sampler.refresh(catalogue)  # nothing changed since update_rows
    assert sampler.rows_updated == len(rows) + 2
    with pytest.raises(ValueError, match="tower indices"):
        sampler.update_rows(np.array([num_items + 1]), np.zeros((1, dim)))
    with pytest.raises(RuntimeError, match="call refresh"):
        KernelSampler(num_items, 5).update_rows(np.array([1]), np.zeros((1, dim)))
