"""Streaming frequency estimation (Yi et al., RecSys 2019) on synthetic streams with known rates."""

import numpy as np
import pytest
import tensorflow as tf

import retrieval  # noqa: F401
from retrieval.samplers import InBatchSampler, StaticFrequency, StreamingFrequency

_FEEDERS = {}


def _run(estimator, batches):
    """Feed each row of ``batches`` (a list of int arrays) as one step, in one compiled loop."""
    if id(estimator) not in _FEEDERS:

        @tf.function(input_signature=[tf.RaggedTensorSpec([None, None], tf.int64)])
        def feed(ragged):
            for i in tf.range(ragged.nrows()):
                estimator.update(ragged[i])

        _FEEDERS[id(estimator)] = (estimator, feed)
    lengths = np.array([len(b) for b in batches])
    flat = np.concatenate(batches).astype(np.int64)
    _FEEDERS[id(estimator)][1](tf.RaggedTensor.from_row_lengths(flat, lengths))


def _averaged(estimator, batches, ids, every=100, tail=2000):
    """Feed ``batches``; return the mean per-step estimate of ``ids`` over snapshots taken
    every ``every`` steps in the last ``tail`` steps. One EMA snapshot has a relative
    noise of about sqrt(learning_rate / 2); averaging snapshots further apart than the
    EMA's memory shrinks it, so the tolerances below test bias, not luck."""
    start = len(batches) - tail
    _run(estimator, batches[:start])
    snapshots = []
    for begin in range(start, len(batches), every):
        _run(estimator, batches[begin : begin + every])
        snapshots.append(estimator.expected_count_per_step(tf.constant(ids, tf.int64)).numpy())
    return np.mean(snapshots, axis=0)


def _bernoulli_stream(rates, steps, rng):
    """Each step, item i appears once with probability rates[i]."""
    present = rng.random((steps, len(rates))) < rates
    return [np.flatnonzero(row) for row in present]


def _poisson_stream(rates, steps, rng):
    """Each step, item i appears Poisson(rates[i]) times (so several times per batch)."""
    counts = rng.poisson(rates, size=(steps, len(rates)))
    return [np.repeat(np.arange(len(rates)), row) for row in counts]


def _per_occurrence_reference(batches, rate):
    """The paper's rule applied occurrence by occurrence, in plain Python: {item: gap B}, and
    the running mean of the batch size. The c occurrences of an item in one step share the gap
    since its last step evenly. First sight: B = steps so far / occurrences that step."""
    gap, last, draws = {}, {}, 0.0
    for step, batch in enumerate(batches, start=1):
        draws = len(batch) if step == 1 else (1 - rate) * draws + rate * len(batch)
        for item in sorted(set(batch.tolist())):
            occurrences = int(np.sum(batch == item))
            if item not in last:
                gap[item] = step / occurrences
            else:
                for _ in range(occurrences):
                    gap[item] = (1 - rate) * gap[item] + rate * (step - last[item]) / occurrences
            last[item] = step
    return gap, draws


@pytest.mark.parametrize("seed", [0, 1])
def test_each_update_follows_the_per_occurrence_rule(seed):
    rng = np.random.default_rng(seed)
    ids = np.array([3, 17, 40, 91, 250])
    estimator = StreamingFrequency(num_buckets=1 << 16, num_hashes=1, learning_rate=0.1)
    assert len(set(estimator.buckets(tf.constant(ids)).numpy()[0])) == len(ids)  # no collision
    batches = [np.repeat(ids, counts) for counts in rng.poisson([0.2, 0.7, 1.5, 3.0, 0.05], size=(60, 5))]
    batches[0] = np.repeat(ids, [1, 1, 2, 3, 0])  # first sight with several occurrences in one step
    _run(estimator, batches)
    gap, draws = _per_occurrence_reference(batches, 0.1)
    seen = np.array(sorted(gap))
    np.testing.assert_allclose(
        estimator.expected_count_per_step(tf.constant(seen)).numpy(), [1 / gap[i] for i in seen], rtol=1e-5
    )
    assert float(estimator.draws_per_step) == pytest.approx(draws, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_estimate_converges_to_known_rates(seed):
    """Rates 0.05..1 per step, EMA rate 0.02: averaged over the last 4000 of 6000 steps the
    estimate is within 15% of the truth for every item, 5% at the median, and unbiased
    across items within 4% (mean log ratio). A single snapshot is noisier (about 10%)."""
    rng = np.random.default_rng(seed)
    rates = np.geomspace(0.05, 1.0, 30)
    estimator = StreamingFrequency(num_buckets=4096, num_hashes=2, learning_rate=0.02)
    estimate = _averaged(estimator, _bernoulli_stream(rates, 6000, rng), np.arange(30), tail=4000)
    error = np.abs(estimate / rates - 1)
    assert np.median(error) < 0.05, error
    assert error.max() < 0.15, error
    assert abs(np.mean(np.log(estimate / rates))) < 0.04


@pytest.mark.parametrize("seed", [0, 1])
def test_several_occurrences_per_batch_are_counted(seed):
    """Items appearing several times per step (Poisson rates up to 4): 1 / gap still
    estimates the expected count per step, which a one-update-per-batch rule would cap at 1."""
    rng = np.random.default_rng(seed)
    rates = np.array([0.1, 0.3, 1.0, 2.0, 4.0])
    estimator = StreamingFrequency(num_buckets=1024, learning_rate=0.02)
    estimate = _averaged(estimator, _poisson_stream(rates, 4000, rng), np.arange(5))
    np.testing.assert_allclose(estimate, rates, rtol=0.12)
    # Per-draw probability = count per step / draws per step (noisier: one snapshot).
    probability = np.exp(estimator.log_probability(tf.range(5, dtype=tf.int64)).numpy())
    np.testing.assert_allclose(probability, rates / rates.sum(), rtol=0.4)


@pytest.mark.parametrize("seed", [0, 1])
def test_items_many_times_per_batch_are_not_overcounted(seed):
    """Head items of a small catalogue fill a large batch: 10 to 100 occurrences a step at the
    default EMA rate 0.05. The estimate stays within 10% of the Poisson rate (a numpy replay of
    both rules over seeds 0-5: within 5%); with the batch's gap given to its first occurrence and
    0 to the rest, 1 / gap ends every step on c - 1 zero gaps and reads about 1.3 times the rate
    at 10, 2.8 at 36 and 33 at 100."""
    rng = np.random.default_rng(seed)
    rates = np.array([10.0, 36.0, 100.0])
    estimator = StreamingFrequency(num_buckets=1024, learning_rate=0.05)
    estimate = _averaged(estimator, _poisson_stream(rates, 1500, rng), np.arange(3), every=20, tail=1000)
    np.testing.assert_allclose(estimate, rates, rtol=0.1)


@pytest.mark.parametrize("seed", [0, 1])
def test_estimate_tracks_a_rate_change(seed):
    """Rates are reversed at step 2000; 1000 steps later the estimates follow the new rates."""
    rng = np.random.default_rng(seed)
    before = np.geomspace(0.1, 1.0, 10)
    after = before[::-1]
    estimator = StreamingFrequency(num_buckets=1024, learning_rate=0.05)
    ids = np.arange(10)
    estimate = _averaged(estimator, _bernoulli_stream(before, 2000, rng), ids, tail=1000)
    np.testing.assert_allclose(estimate, before, rtol=0.2)
    # 600 steps after the change the old rates are forgotten (0.95^60 < 5% left for the
    # slowest item); average the next 1400.
    estimate = _averaged(estimator, _bernoulli_stream(after, 2000, rng), ids, tail=1400)
    np.testing.assert_allclose(estimate, after, rtol=0.2)
    # ... and not the old ones: the two head/tail items swapped by a factor of 10.
    assert estimate[0] > 5 * estimate[-1]


def test_unseen_items_and_new_items_of_a_growing_corpus():
    """A key never seen reports the initial gap; a key that appears later starts from the
    steps since the start and then converges like the others."""
    rng = np.random.default_rng(3)
    estimator = StreamingFrequency(num_buckets=1024, learning_rate=0.05, initial_gap=1e4)
    _run(estimator, _bernoulli_stream(np.array([0.5, 0.5]), 500, rng))
    assert estimator.expected_count_per_step(tf.constant([7], tf.int64)).numpy()[0] == pytest.approx(1e-4)
    stream = _bernoulli_stream(np.array([0.5, 0.5, 0.5]), 1500, rng)  # item 2 is new
    _run(estimator, stream)
    estimate = estimator.expected_count_per_step(tf.constant([2], tf.int64)).numpy()[0]
    assert estimate == pytest.approx(0.5, rel=0.3)


def test_state_is_checkpointed(tmp_path):
    rng = np.random.default_rng(4)
    estimator = StreamingFrequency(num_buckets=256)
    _run(estimator, _bernoulli_stream(np.linspace(0.1, 0.9, 8), 200, rng))
    path = tf.train.Checkpoint(estimator=estimator).save(str(tmp_path / "freq"))
    restored = StreamingFrequency(num_buckets=256)
    tf.train.Checkpoint(estimator=restored).restore(path)
    ids = tf.range(8, dtype=tf.int64)
    np.testing.assert_array_equal(restored.log_probability(ids), estimator.log_probability(ids))
    assert int(restored.step) == 200


def test_in_batch_sampler_with_streaming_q_approaches_static_q():
    """On a stationary log the streaming log Q of in-batch negatives approaches the static
    one from click counts (same unit: log of B * p)."""
    rng = np.random.default_rng(5)
    counts = np.r_[0.0, np.floor(1000 / np.arange(1, 21))]
    p = counts / counts.sum()
    batches = [rng.choice(21, size=64, p=p) for _ in range(1500)]
    streaming = InBatchSampler(StreamingFrequency(num_buckets=4096, learning_rate=0.01))
    _run(streaming.frequency, batches)
    positives = tf.range(1, 21, dtype=tf.int64)
    static = InBatchSampler(StaticFrequency(counts)).sample(positives).positive_log_q.numpy()
    online = streaming.sample(positives).positive_log_q.numpy()
    # Same unit up to noise (a difference in log space is a relative error; one
    # snapshot at EMA rate 0.01 has about 7% noise).
    np.testing.assert_allclose(online, static, atol=0.25)
    assert abs(np.mean(online - static)) < 0.08


def test_bad_arguments():
    with pytest.raises(ValueError, match="learning_rate"):
        StreamingFrequency(learning_rate=0.0)
    with pytest.raises(ValueError, match="num_hashes"):
        StreamingFrequency(num_hashes=9)


@pytest.mark.slow
def test_the_training_loop_advances_the_estimator_once_per_batch():
    """The step counter counts training steps only: not the read that finds the end of an epoch."""
    import pandas as pd

    from retrieval.config import LossConfig, ModelConfig
    from retrieval.features import FeatureStatistics
    from retrieval.model import build_model
    from retrieval.training import FrameClicks, train_epochs
    from retrieval.training.loop import step_function

    rng = np.random.default_rng(0)
    clicks = pd.DataFrame({
        "user_id": [f"u{i}" for i in rng.integers(0, 50, 300)],
        "item_id": [f"i{i}" for i in rng.integers(0, 40, 300)],
    })
    model = build_model(
        ModelConfig(embedding_dim=8, loss=LossConfig(log_q_source="streaming")),
        FeatureStatistics.from_training_clicks(clicks),
    )
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1))
    source = FrameClicks(clicks, 160, seed=0)  # 2 batches an epoch
    estimator = model.sampler.frequency
    train_epochs(model, source, 2, verbose=0)
    assert int(estimator.step.numpy()) == 4
    step = step_function(model)
    for batch in source.epoch(2).take(1):
        step(batch)
    assert int(estimator.step.numpy()) == 5
    with pytest.raises(ValueError, match="num_shards"):
        StreamingFrequency(num_buckets=8, num_shards=9)


def test_a_sharded_estimator_keeps_the_state_of_a_whole_one():
    """num_shards splits each hash array into row-range variables (bucket b: shard b % S, row b // S):
    the same updates give the same arrays and estimates as one variable a hash."""
    rng = np.random.default_rng(6)
    batches = [rng.integers(0, 5000, size=int(rng.integers(1, 200))) for _ in range(60)]
    whole = StreamingFrequency(num_buckets=1000, num_hashes=3, learning_rate=0.1)
    sharded = StreamingFrequency(num_buckets=1000, num_hashes=3, learning_rate=0.1, num_shards=3)
    assert len(sharded.gaps[0]) == 3 and sharded.gaps[0][0].shape == (334,)
    _run(whole, batches)
    _run(sharded, batches)
    np.testing.assert_array_equal(sharded.gap.numpy(), whole.gap.numpy())
    np.testing.assert_array_equal(sharded.last_step.numpy(), whole.last_step.numpy())
    ids = tf.constant([[3, 17], [4999, 123456]], tf.int64)
    np.testing.assert_array_equal(sharded.log_probability(ids), whole.log_probability(ids))
