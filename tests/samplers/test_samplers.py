"""Samplers: their draws follow the stated distribution and their log Q is the expected count they claim.

References: TensorFlow's ``tf.random.*_candidate_sampler`` expected counts on the
same ids, chi-square tests of the draw frequencies, and the empirical mean count
of each item over many batches.
"""

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

import retrieval  # noqa: F401
from retrieval.samplers import (
    AllItems,
    InBatchSampler,
    MixedSampler,
    StaticFrequency,
    frequency_ranks,
    log_uniform_probability,
    log_uniform_sampler,
    uniform_sampler,
    unigram_sampler,
)

NUM_ITEMS = 40


def _counts(seed):
    rng = np.random.default_rng(seed)
    counts = np.zeros(NUM_ITEMS + 1)
    counts[1:] = np.floor(200.0 / np.arange(1, NUM_ITEMS + 1) ** 1.1)[rng.permutation(NUM_ITEMS)] + 1
    return counts


def _sampler(kind, counts, m, unique=False, seed=0):
    if kind == "uniform":
        return uniform_sampler(NUM_ITEMS, m, unique=unique, seed=seed)
    if kind == "unigram_1":
        return unigram_sampler(counts, m, alpha=1.0, unique=unique, seed=seed)
    if kind == "unigram_0.75":
        return unigram_sampler(counts, m, alpha=0.75, unique=unique, seed=seed)
    return log_uniform_sampler(counts, m, unique=unique, seed=seed)


def _tf_candidates(kind, counts, true_ids, m, unique, seed):
    """TensorFlow's sampler over classes 0..V-1, mapped back to tower indices."""
    ranks = frequency_ranks(counts)  # rank -> tower index
    if kind == "log_uniform":
        to_class = np.zeros(NUM_ITEMS + 1, np.int64)
        to_class[ranks] = np.arange(NUM_ITEMS)
        true_classes, to_index = to_class[true_ids], ranks
    else:
        true_classes, to_index = true_ids - 1, np.arange(1, NUM_ITEMS + 1)
    true_classes = tf.constant(true_classes.reshape(-1, 1), tf.int64)
    common = {
        "true_classes": true_classes,
        "num_true": 1,
        "num_sampled": m,
        "unique": unique,
        "range_max": NUM_ITEMS,
        "seed": seed,
    }
    if kind == "uniform":
        out = tf.random.uniform_candidate_sampler(**common)
    elif kind == "log_uniform":
        out = tf.random.log_uniform_candidate_sampler(**common)
    else:
        alpha = 1.0 if kind == "unigram_1" else 0.75
        out = tf.random.fixed_unigram_candidate_sampler(
            **common, unigrams=counts[1:].tolist(), distortion=alpha
        )
    sampled, true_expected, sampled_expected = (t.numpy() for t in out)
    return to_index[sampled], true_expected[:, 0], sampled_expected


KINDS = ["uniform", "unigram_1", "unigram_0.75", "log_uniform"]


def _draw_batches(sampler, batches):
    """``batches`` calls of ``sampler.draw()`` in one graph: ids [batches, m], tries [batches]."""

    @tf.function
    def run():
        ids = tf.TensorArray(tf.int64, size=batches)
        tries = tf.TensorArray(tf.int64, size=batches)
        for i in tf.range(batches):
            drawn, num_tries = sampler.draw()
            ids = ids.write(i, drawn)
            tries = tries.write(i, num_tries)
        return ids.stack(), tries.stack()

    ids, tries = run()
    return ids.numpy(), tries.numpy()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_expected_counts_with_replacement_equal_tensorflow(kind, seed):
    counts = _counts(seed)
    true_ids = np.random.default_rng(seed).integers(1, NUM_ITEMS + 1, size=7)
    sampled, true_expected, sampled_expected = _tf_candidates(kind, counts, true_ids, 16, False, seed)
    sampler = _sampler(kind, counts, 16)
    ours = sampler.log_expected_count(tf.constant(sampled), 16).numpy()
    np.testing.assert_allclose(np.exp(ours), sampled_expected, rtol=1e-5)
    np.testing.assert_allclose(
        np.exp(sampler.log_expected_count(tf.constant(true_ids), 16)), true_expected, rtol=1e-5
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_expected_counts_without_replacement_follow_tensorflows_formula(kind, seed):
    """TF's unique expected count is 1 - (1 - p)^T with T its number of tries; T is
    recovered from one sampled id, then every other id must agree with our formula."""
    counts = _counts(seed)
    true_ids = np.random.default_rng(seed).integers(1, NUM_ITEMS + 1, size=7)
    m = 12
    sampled, true_expected, sampled_expected = _tf_candidates(kind, counts, true_ids, m, True, seed)
    sampler = _sampler(kind, counts, m, unique=True)
    p = sampler.probability[sampled[0]]
    if sampled_expected[0] == pytest.approx(m * p, rel=1e-6):
        tries = m  # no repeat was drawn: TensorFlow then reports m * p
    else:
        tries = np.log1p(-sampled_expected[0]) / np.log1p(-p)
        assert tries == pytest.approx(round(tries), abs=1e-2) and round(tries) > m
        tries = round(tries)
    np.testing.assert_allclose(
        np.exp(sampler.log_expected_count(tf.constant(sampled), tries)), sampled_expected, rtol=1e-4
    )
    np.testing.assert_allclose(
        np.exp(sampler.log_expected_count(tf.constant(true_ids), tries)), true_expected, rtol=1e-4
    )


def test_log_uniform_is_tensorflows_zipf_over_frequency_ranks():
    counts = _counts(3)
    sampler = log_uniform_sampler(counts, 5)
    ranks = frequency_ranks(counts)
    assert counts[ranks[0]] == counts[1:].max() and np.all(np.diff(counts[ranks]) <= 0)
    r = np.arange(NUM_ITEMS)
    np.testing.assert_allclose(sampler.probability[ranks], np.log((r + 2) / (r + 1)) / np.log(NUM_ITEMS + 1))
    np.testing.assert_allclose(log_uniform_probability(NUM_ITEMS).sum(), 1.0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_draw_frequencies_match_the_stated_distribution(kind, seed):
    counts = _counts(seed)
    sampler = _sampler(kind, counts, 500, seed=seed)
    draws = _draw_batches(sampler, 40)[0].ravel()
    assert draws.min() >= 1  # never the OOV row
    observed = np.bincount(draws, minlength=NUM_ITEMS + 1)[1:]
    expected = sampler.probability[1:] * draws.size
    if kind.startswith("unigram"):
        alpha = 1.0 if kind == "unigram_1" else 0.75
        np.testing.assert_allclose(sampler.probability[1:], counts[1:] ** alpha / np.sum(counts[1:] ** alpha))
    assert stats.chisquare(observed, expected).pvalue > 1e-3


@pytest.mark.parametrize("kind", ["uniform", "unigram_1", "log_uniform"])
def test_log_q_is_the_mean_count_per_batch(kind):
    """With replacement, exp(log_q) is exactly the mean count of the item in one batch's draws."""
    counts = _counts(5)
    m, batches = 20, 3000
    sampler = _sampler(kind, counts, m, seed=5)
    total = np.bincount(_draw_batches(sampler, batches)[0].ravel(), minlength=NUM_ITEMS + 1)
    claimed = np.exp(sampler.log_expected_count(tf.range(1, NUM_ITEMS + 1), m).numpy())
    mean = total[1:] / batches
    stderr = np.sqrt(claimed / batches)  # Poisson-like count per batch
    assert np.all(np.abs(mean - claimed) < 5 * stderr + 1e-3), np.max(np.abs(mean - claimed) / stderr)


@pytest.mark.parametrize("kind", ["uniform", "unigram_1", "log_uniform"])
def test_unique_draws_are_distinct_and_inclusion_matches_claimed_count(kind):
    """Without replacement exp(log_q) is TensorFlow's *approximation* of the inclusion
    probability, 1 - (1 - p)^T (or m p when no repeat was drawn, which overstates head
    items). Averaged over batches it matches the observed inclusion rate within 0.05 for
    items with a claimed rate below 0.5 and within 0.1 for the few head items above."""
    counts = _counts(7)
    m, batches = 10, 2000
    sampler = _sampler(kind, counts, m, unique=True, seed=7)
    ids, tries = _draw_batches(sampler, batches)
    assert all(len(set(row)) == m for row in ids.tolist())
    included = np.bincount(ids.ravel(), minlength=NUM_ITEMS + 1) / batches
    unique_tries, times = np.unique(tries, return_counts=True)
    all_ids = tf.range(NUM_ITEMS + 1, dtype=tf.int64)
    claimed = (
        sum(n * np.exp(sampler.log_expected_count(all_ids, t).numpy()) for t, n in zip(unique_tries, times))
        / batches
    )
    light = claimed[1:] < 0.5
    np.testing.assert_allclose(included[1:][light], claimed[1:][light], atol=0.05)
    np.testing.assert_allclose(included[1:], claimed[1:], atol=0.1)
    # The claimed inclusion probabilities add up to m up to the approximation.
    assert claimed[1:].sum() == pytest.approx(m, rel=0.05)


def test_unique_needs_enough_items():
    with pytest.raises(ValueError, match="num_samples=50 distinct items"):
        uniform_sampler(NUM_ITEMS, 50, unique=True)


def test_bad_distributions_are_rejected():
    with pytest.raises(ValueError, match=r"probability\[0\]"):
        from retrieval.samplers import CorpusSampler

        CorpusSampler(np.array([1.0, 1.0, 1.0]), 2)
    with pytest.raises(ValueError, match="alpha"):
        unigram_sampler(_counts(0), 3, alpha=-1.0)


def test_in_batch_log_q_is_batch_size_times_popularity():
    counts = _counts(1)
    sampler = InBatchSampler(StaticFrequency(counts))
    positives = tf.constant([3, 3, 7, 1, 40], tf.int64)
    negatives = sampler.sample(positives)
    assert sampler.includes_batch_positives and negatives.ids.shape == (0,)
    np.testing.assert_allclose(
        np.exp(negatives.positive_log_q), 5 * counts[positives.numpy()] / counts.sum(), rtol=1e-5
    )


@pytest.mark.parametrize("corpus_kind", ["uniform", "unigram_0.75"])
def test_mixed_log_q_is_the_combined_expected_count(corpus_kind):
    """Simulate batches (B positives from the training distribution + m corpus draws):
    the mean count of each item in the union is exp(log_q) of the mixed sampler."""
    counts = _counts(2)
    p_train = counts / counts.sum()
    batch, m, batches = 16, 8, 3000
    sampler = MixedSampler(StaticFrequency(counts), _sampler(corpus_kind, counts, m, seed=2))
    positives = np.random.default_rng(2).choice(NUM_ITEMS + 1, size=(batches, batch), p=p_train)
    corpus_ids, _ = _draw_batches(sampler.corpus, batches)  # what sample() draws for its corpus part
    total = np.bincount(np.concatenate([positives.ravel(), corpus_ids.ravel()]), minlength=NUM_ITEMS + 1)
    everything = tf.range(1, NUM_ITEMS + 1, dtype=tf.int64)
    claimed = np.exp(sampler.sample(everything[:batch]).positive_log_q.numpy())  # for B = 16 positives
    claimed_all = np.exp(sampler._log_count(everything, batch, m).numpy())
    np.testing.assert_allclose(claimed, claimed_all[:batch], rtol=1e-5)
    mean = total[1:] / batches
    stderr = np.sqrt(claimed_all / batches)
    assert np.all(np.abs(mean - claimed_all) < 5 * stderr + 1e-3), np.max(np.abs(mean - claimed_all) / stderr)
    # Neither part alone would do: the in-batch part alone misses the corpus draws.
    assert np.max(np.abs(mean - batch * p_train[1:]) / stderr) > 5


def test_all_items_is_every_item_once():
    negatives = AllItems(6).sample(tf.constant([2, 5], tf.int64))
    np.testing.assert_array_equal(negatives.ids, np.arange(1, 7))
    np.testing.assert_array_equal(negatives.log_q, np.zeros(6))
    np.testing.assert_array_equal(negatives.positive_log_q, np.zeros(2))


def test_sampler_state_is_seeded_and_checkpointed(tmp_path):
    counts = _counts(0)
    a, b = _sampler("unigram_1", counts, 30, seed=11), _sampler("unigram_1", counts, 30, seed=11)
    np.testing.assert_array_equal(a.draw()[0], b.draw()[0])
    checkpoint = tf.train.Checkpoint(sampler=a)
    path = checkpoint.save(str(tmp_path / "ckpt"))
    expected = a.draw()[0].numpy()
    tf.train.Checkpoint(sampler=b).restore(path)
    np.testing.assert_array_equal(b.draw()[0], expected)
