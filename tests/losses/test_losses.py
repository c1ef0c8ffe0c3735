"""The project's in-batch softmax and logit transforms against a numpy computation and TFRS.

The references (numpy in-batch loss, a ``tfrs.tasks.Retrieval`` set up for a mean
reduction) live in ``tests/reference_losses.py``; ``retrieval.losses`` is what is tested.
"""

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
import tensorflow_recommenders as tfrs
from reference_losses import in_batch_softmax_task, numpy_in_batch_loss, relative_sampling_probability

import retrieval  # noqa: F401
from retrieval.config import LossConfig, ModelConfig
from retrieval.features import FeatureStatistics
from retrieval.losses import (
    LossInputs,
    SampledSoftmax,
    correct_log_q,
    remove_accidental_hits,
    weighted_mean,
)
from retrieval.model import build_model
from retrieval.samplers import MASKED_LOG_Q, Negatives

BATCH, DIM = 8, 4
IDS = np.array([0, 1, 2, 1, 3, 4, 0, 5])  # rows 1/3 and 0/6 share a positive: accidental hits


def _in_batch_inputs(q, d, log_q, ids, weights=None):
    """In-batch negatives only: the other rows' positives, with their log Q."""
    return LossInputs(
        tf.constant(q),
        tf.constant(d),
        tf.constant(ids, tf.int64),
        (Negatives(tf.zeros([0], tf.int64), tf.zeros([0]), tf.constant(log_q, tf.float32)),),
        (tf.zeros([0, q.shape[1]]),),
        True,
        None if weights is None else tf.constant(weights),
    )


def _random_batch(seed):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(BATCH, DIM)).astype(np.float32)
    d = rng.normal(size=(BATCH, DIM)).astype(np.float32)
    prob = rng.uniform(0.01, 1.0, size=BATCH).astype(np.float32)
    weights = rng.uniform(0.5, 2.0, size=BATCH).astype(np.float32)
    return q, d, prob, weights


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("remove_hits", [True, False])
def test_in_batch_softmax_equals_numpy_and_tfrs(seed, remove_hits):
    q, d, prob, weights = _random_batch(seed)
    temperature = 0.2
    loss = SampledSoftmax(temperature=temperature, remove_accidental_hits=remove_hits)
    ours = float(loss.compute(_in_batch_inputs(q, d, np.log(prob), IDS, weights)))
    expected = numpy_in_batch_loss(q, d, np.log(prob), IDS, temperature, weights, remove_hits=remove_hits)
    assert ours == pytest.approx(expected, rel=1e-5)
    task = in_batch_softmax_task(temperature=temperature, remove_accidental_hits=remove_hits)
    tfrs_loss = task(
        tf.constant(q),
        tf.constant(d),
        sample_weight=tf.constant(weights),
        candidate_sampling_probability=tf.constant(relative_sampling_probability(prob)),
        candidate_ids=tf.constant(IDS),
        compute_metrics=False,
    )
    assert ours == pytest.approx(float(tfrs_loss), rel=1e-5)
    # Neither reference is blind to what is tested: the correction and the hit removal change the value.
    assert expected != pytest.approx(
        numpy_in_batch_loss(q, d, np.zeros(BATCH), IDS, temperature, weights, remove_hits=remove_hits), rel=1e-3
    )
    assert expected != pytest.approx(
        numpy_in_batch_loss(q, d, np.log(prob), IDS, temperature, weights, remove_hits=not remove_hits), rel=1e-3
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_sum_reduction_equals_tfrs_default_retrieval_task(seed):
    """reduction="sum" is tfrs.tasks.Retrieval as its tutorials use it (Keras SUM), not the mean times a constant."""
    q, d, _, weights = _random_batch(seed)
    ids = np.arange(BATCH)  # no accidental hits: TFRS's default task does not remove them
    inputs = _in_batch_inputs(q, d, np.zeros(BATCH, np.float32), ids, weights)
    summed = float(SampledSoftmax(temperature=1.0, reduction="sum").compute(inputs))
    task = tfrs.tasks.Retrieval()  # default loss: CategoricalCrossentropy(from_logits=True, reduction=SUM)
    expected = float(task(tf.constant(q), tf.constant(d), sample_weight=tf.constant(weights), compute_metrics=False))
    assert summed == pytest.approx(expected, rel=1e-5)
    mean = float(SampledSoftmax(temperature=1.0).compute(inputs))
    assert summed == pytest.approx(BATCH * mean, rel=1e-5) and summed != pytest.approx(mean, rel=1e-2)
    with pytest.raises(ValueError, match="reduction"):
        SampledSoftmax(reduction="avg")


@pytest.mark.parametrize("seed", [0, 1])
def test_log_q_weight_scales_the_correction(seed):
    q, d, prob, _ = _random_batch(seed)
    inputs = _in_batch_inputs(q, d, np.log(prob), IDS)
    for weight in (0.0, 0.5):
        ours = float(SampledSoftmax(temperature=0.5, log_q_weight=weight).compute(inputs))
        assert ours == pytest.approx(numpy_in_batch_loss(q, d, weight * np.log(prob), IDS, 0.5), rel=1e-5)


def test_masked_negatives_stay_masked_whatever_the_log_q_weight():
    # A sampler masks a column with log Q = MASKED_LOG_Q (hard.py: a slot with no hard negative);
    # with log_q_weight = 0 the correction is off, but the mask must not be.
    rng = np.random.default_rng(3)
    q = rng.normal(size=(BATCH, DIM)).astype(np.float32)
    items = rng.normal(size=(20, DIM)).astype(np.float32)
    positive_ids = np.arange(1, BATCH + 1)
    ids = np.array([[11, 12, 13]] * BATCH)
    log_q = np.zeros(ids.shape, np.float32)
    log_q[:, 1] = MASKED_LOG_Q

    def per_example(loss, columns):
        negatives = Negatives(tf.constant(ids[:, columns], tf.int64), tf.constant(log_q[:, columns]), tf.zeros([BATCH]))
        inputs = LossInputs(
            tf.constant(q),
            tf.constant(items[positive_ids]),
            tf.constant(positive_ids, tf.int64),
            (negatives,),
            (tf.constant(items[ids[:, columns]]),),
            False,
        )
        return loss.per_example(inputs).numpy()

    for weight in (0.0, 1.0):
        loss = SampledSoftmax(temperature=1.0, log_q_weight=weight)
        np.testing.assert_allclose(per_example(loss, [0, 1, 2]), per_example(loss, [0, 2]), rtol=1e-6)


def test_correct_log_q_subtracts():
    logits = tf.constant([[1.0, 2.0, 3.0]])
    log_q = tf.constant([0.5, -1.0, 0.0])
    np.testing.assert_allclose(correct_log_q(logits, log_q), [[0.5, 3.0, 3.0]])


def test_remove_accidental_hits_masks_only_the_rows_own_positive_elsewhere():
    logits = tf.zeros([3, 4])
    labels = tf.constant(np.eye(3, 4, dtype=np.float32))
    ids = tf.constant([7, 8, 7, 9])  # row 0's positive 7 again at column 2; row 2's label column is 7 too
    out = remove_accidental_hits(logits, labels, ids).numpy()
    masked = out < -1e30
    assert masked.tolist() == [
        [False, False, True, False],
        [False, False, False, False],
        [True, False, False, False],
    ]


def test_weighted_mean_divides_by_the_global_batch():
    per_example = tf.constant([1.0, 2.0, 3.0])
    weights = tf.constant([1.0, 0.0, 2.0])
    assert float(weighted_mean(per_example, weights)) == pytest.approx((1 + 6) / 3)
    assert float(weighted_mean(per_example, weights, global_batch_size=6)) == pytest.approx((1 + 6) / 6)


@pytest.mark.parametrize(
    "correction, strength, remove_hits", [(True, 1.0, True), (True, 0.5, True), (False, 1.0, True), (True, 1.0, False)]
)
def test_model_loss_uses_training_popularity_as_q(correction, strength, remove_hits):
    # The model's switches reach its loss: log-Q on/off and its strength, accidental-hit removal.
    train = pd.DataFrame(
        {
            "user_id": ["u1", "u2", "u3", "u1", "u2", "u4"],
            "item_id": ["a", "a", "a", "b", "c", "b"],
            "weight": np.ones(6, np.float32),
        }
    )
    stats = FeatureStatistics.from_training_clicks(train)
    config = ModelConfig(
        embedding_dim=6,
        temperature=0.1,
        log_q_correction=correction,
        log_q_strength=strength,
        remove_accidental_hits=remove_hits,
        loss=LossConfig(log_q_source="static"),  # Q = the training popularity this test computes
    )
    tf.keras.utils.set_random_seed(0)
    model = build_model(config, stats)
    batch = {"user_id": tf.constant(["u1", "u2", "u3", "u4"]), "item_id": tf.constant(["a", "c", "b", "b"])}
    loss = float(model.compute_loss(batch))

    q = model.query_tower({"user_id": batch["user_id"]}).numpy()
    d = model.doc_tower({"item_id": batch["item_id"]}).numpy()
    counts = {"a": 3, "b": 2, "c": 1}  # training clicks per item
    log_q = np.log([counts[i] / 6 for i in ["a", "c", "b", "b"]])
    ids = np.array([0, 1, 2, 2])  # "b" twice: an accidental hit
    weight = strength if correction else 0.0
    expected = numpy_in_batch_loss(q, d, weight * log_q, ids, 0.1, remove_hits=remove_hits)
    assert loss == pytest.approx(expected, rel=1e-5)


def test_unknown_ids_embed_to_zero():
    train = pd.DataFrame({"user_id": ["u1", "u2"], "item_id": ["a", "b"], "weight": [1.0, 1.0]})
    model = build_model(ModelConfig(embedding_dim=4), FeatureStatistics.from_training_clicks(train))
    out = model.query_tower({"user_id": tf.constant(["never-seen", "u1"])}).numpy()
    np.testing.assert_array_equal(out[0], np.zeros(4))
    assert np.linalg.norm(out[1]) == pytest.approx(1.0, rel=1e-5)


def _round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bfloat16 (ties to even), as float32: the top 16 bits of the float32 pattern."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def test_bfloat16_rounding_reference_keeps_eight_significant_bits():
    assert _round_to_bfloat16(np.float32([1.0, 1 + 2**-8, 1 + 2**-7, 1 + 3 * 2**-8])).tolist() == [
        1.0, 1.0, 1 + 2**-7, 1 + 2**-6]  # ties go to the even significand


@pytest.mark.parametrize("seed", [0, 1])
def test_bfloat16_scores_are_the_product_of_rounded_sides_rounded(seed):
    from retrieval.losses.functions import candidate_scores

    rng = np.random.default_rng(seed)
    q = rng.normal(size=(16, 32)).astype(np.float32)
    c = rng.normal(size=(24, 32)).astype(np.float32)
    per_query = rng.normal(size=(16, 5, 32)).astype(np.float32)
    scores = candidate_scores(tf.constant(q), tf.constant(c), "bfloat16")
    assert scores.dtype == tf.float32
    expected = _round_to_bfloat16(_round_to_bfloat16(q).astype(np.float64) @ _round_to_bfloat16(c).T.astype(np.float64))
    # float32 accumulation may end a sum a hair from float64's, then round to the neighbouring bfloat16.
    np.testing.assert_allclose(scores.numpy(), expected, rtol=2**-7, atol=1e-6)
    assert np.mean(scores.numpy() == expected) > 0.9
    assert np.abs(scores.numpy() - q @ c.T).max() > 1e-4  # the precision did change
    rows = candidate_scores(tf.constant(q), tf.constant(per_query), "bfloat16").numpy()
    expected_rows = _round_to_bfloat16(np.einsum("bd,bcd->bc", _round_to_bfloat16(q).astype(np.float64),
                                                 _round_to_bfloat16(per_query).astype(np.float64)))
    np.testing.assert_allclose(rows, expected_rows, rtol=2**-7, atol=1e-6)
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, got 'float16'"):
        candidate_scores(tf.constant(q), tf.constant(c), "float16")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_in_batch_softmax_in_bfloat16_equals_numpy_on_rounded_scores(seed):
    q, d, prob, weights = _random_batch(seed)
    temperature = 0.2
    loss = SampledSoftmax(temperature=temperature, score_dtype="bfloat16")
    inputs = _in_batch_inputs(q, d, np.log(prob), IDS, weights)
    with tf.GradientTape() as tape:
        tape.watch(inputs.queries)
        ours = loss.compute(inputs)
    gradient = tape.gradient(ours, inputs.queries)
    assert gradient.dtype == tf.float32 and np.all(np.isfinite(gradient.numpy()))
    scores = _round_to_bfloat16(_round_to_bfloat16(q).astype(np.float64) @ _round_to_bfloat16(d).T.astype(np.float64))
    logits = scores / temperature - np.log(prob)[None, :]
    logits = np.where((IDS[:, None] == IDS[None, :]) & ~np.eye(BATCH, dtype=bool), -np.inf, logits)
    per_row = -np.diag(logits - np.logaddexp.reduce(logits, axis=1, keepdims=True))
    assert float(ours) == pytest.approx(float(np.sum(per_row * weights) / BATCH), rel=1e-3)
    exact = numpy_in_batch_loss(q, d, np.log(prob), IDS, temperature, weights)
    assert float(ours) == pytest.approx(exact, rel=2e-2)


def _in_batch_reference_on_rounded_scores(q, d, log_q, ids, temperature):
    """numpy_in_batch_loss's value with q . d computed as model.loss.score_dtype=bfloat16 does."""
    scores = _round_to_bfloat16(_round_to_bfloat16(q).astype(np.float64) @ _round_to_bfloat16(d).T.astype(np.float64))
    logits = scores / temperature - log_q[None, :]
    logits = np.where((ids[:, None] == ids[None, :]) & ~np.eye(len(ids), dtype=bool), -np.inf, logits)
    return float(np.mean(-np.diag(logits - np.logaddexp.reduce(logits, axis=1, keepdims=True))))


def test_score_dtype_reaches_the_models_loss_and_is_refused_where_there_are_no_candidate_logits():
    train = pd.DataFrame({"user_id": ["u1", "u2", "u3", "u1", "u2", "u4"], "item_id": ["a", "a", "a", "b", "c", "b"],
                          "weight": np.ones(6, np.float32)})
    config = ModelConfig(embedding_dim=6, temperature=0.1,
                         loss=LossConfig(log_q_source="static", score_dtype="bfloat16"))
    tf.keras.utils.set_random_seed(0)
    model = build_model(config, FeatureStatistics.from_training_clicks(train))
    batch = {"user_id": tf.constant(["u1", "u2", "u3", "u4"]), "item_id": tf.constant(["a", "c", "b", "b"])}
    loss = float(model.compute_loss(batch))
    q = model.query_tower({"user_id": batch["user_id"]}).numpy()
    d = model.doc_tower({"item_id": batch["item_id"]}).numpy()
    log_q = np.log(np.array([3, 1, 2, 2]) / 6)
    ids = np.array([0, 1, 2, 2])
    assert loss == pytest.approx(_in_batch_reference_on_rounded_scores(q, d, log_q, ids, 0.1), rel=1e-3)
    with pytest.raises(ValueError, match="model.loss.score_dtype='bfloat16' .* hierarchical_softmax has none"):
        LossConfig(kind="hierarchical_softmax", score_dtype="bfloat16")
    with pytest.raises(ValueError, match="score_dtype must be one of float32, bfloat16"):
        SampledSoftmax(score_dtype="half")
