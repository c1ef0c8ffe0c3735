"""The corrected log-Q (``model.loss.log_q_variant: corrected``) against a numpy reference.

The reference is written from the refined correction of Khrylchenko et al. ("Correcting the LogQ
Correction", RecSys 2025, arXiv 2507.09331) as the authors' code computes it (NonameUntitled/logq,
``train_in_batch_logq_new.py``), in *per-draw probabilities* (not the samplers' expected counts):
for a row with positive ``i``, score ``s+`` and kept negatives ``N`` (draws other than ``i``),

    Q'(j) = q(j) / (1 - q(i))                           (a draw, given it is not the positive)
    Z     = (1 / |N|) sum_{j in N} exp(s_j) / Q'(j)     (the catalogue's other items, estimated)
    P+    = exp(s+) / (exp(s+) + Z)
    loss  = -(1 - P+) * (s+ - log sum_{j in N} exp(s_j) / Q'(j)),   (1 - P+) without gradient

with ``q`` the distribution each candidate was drawn from: the training popularity for in-batch
negatives, uniform for uniform draws, and for mixed negatives the mixture of both in proportion to
their draws. The loss's own code works from log expected counts instead.
"""

import numpy as np
import pytest
import tensorflow as tf

import retrieval  # noqa: F401
from retrieval.config import Config, ConfigError
from retrieval.losses import LossInputs, SampledSoftmax
from retrieval.model.parts import build_objective
from retrieval.samplers import InBatchSampler, MixedSampler, Negatives, StaticFrequency, uniform_sampler

DIM, NUM_ITEMS, TEMPERATURE = 4, 12, 0.5


def _reference_row(query, positive, negative_ids, items, q):
    """The corrected loss of one row, its weight 1 - P+ and its gradient in ``query`` (weight held)."""
    kept = np.array([j for j in negative_ids if j != positive])
    if kept.size == 0:
        return 0.0, 0.0, np.zeros_like(query)
    s_pos = query @ items[positive] / TEMPERATURE
    s_neg = items[kept] @ query / TEMPERATURE
    q_given_not_positive = q[kept] / (1.0 - q[positive])
    terms = np.exp(s_neg) / q_given_not_positive
    z = terms.mean()
    p_pos = np.exp(s_pos) / (np.exp(s_pos) + z)
    weight = 1.0 - p_pos
    loss = -weight * (s_pos - np.log(terms.sum()))
    softmax = terms / terms.sum()
    gradient = weight * (softmax @ items[kept] - items[positive]) / TEMPERATURE
    return loss, weight, gradient


def _embeddings(seed, batch):
    rng = np.random.default_rng(seed)
    queries = rng.normal(size=(batch, DIM))
    items = rng.normal(size=(NUM_ITEMS + 1, DIM))
    items[0] = 0.0
    return queries, items


def _ours(queries, items, positive_ids, negatives, in_batch, strength=1.0):
    query = tf.Variable(queries.astype(np.float32))
    inputs_ids = negatives.ids.numpy()
    with tf.GradientTape() as tape:
        inputs = LossInputs(
            queries=query,
            positives=tf.constant(items[positive_ids].astype(np.float32)),
            positive_ids=tf.constant(positive_ids, tf.int64),
            negatives=(negatives,),
            negative_embeddings=(tf.constant(items[inputs_ids].astype(np.float32)),),
            includes_batch_positives=in_batch,
        )
        loss = SampledSoftmax(temperature=TEMPERATURE, log_q_weight=strength, log_q_variant="corrected")
        per_example = loss.per_example(inputs)
        total = tf.reduce_sum(per_example)
    return per_example.numpy(), tape.gradient(total, query).numpy()


def _check(queries, items, positive_ids, candidates_of_row, q, ours, gradient):
    for row, positive in enumerate(positive_ids):
        loss, _, grad = _reference_row(queries[row], positive, candidates_of_row(row), items, q)
        assert ours[row] == pytest.approx(loss, rel=2e-4, abs=2e-5), row
        np.testing.assert_allclose(gradient[row], grad, rtol=2e-3, atol=2e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_in_batch_equals_the_reference(seed):
    """In-batch: a row's negatives are the other rows' positives; a repeat of its own positive
    (rows 0 and 1, rows 4 and 5) is an accidental hit, out of the sum and of |N|."""
    rng = np.random.default_rng(seed)
    counts = np.r_[0.0, rng.integers(1, 40, NUM_ITEMS)].astype(np.float64)
    q = counts / counts.sum()
    positive_ids = np.array([3, 3, 7, 1, 9, 9, 2, 12])
    queries, items = _embeddings(seed, len(positive_ids))
    negatives = InBatchSampler(StaticFrequency(counts)).sample(tf.constant(positive_ids, tf.int64))
    ours, gradient = _ours(queries, items, positive_ids, negatives, in_batch=True)
    _check(
        queries, items, positive_ids, lambda row: np.delete(positive_ids, row), q, ours, gradient
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_uniform_shared_draws_equal_the_reference(seed):
    """Shared uniform draws with accidental hits (a drawn id equal to a row's positive, twice for row 0)."""
    rng = np.random.default_rng(seed)
    positive_ids = np.array([2, 5, 5, 11, 8, 1])
    queries, items = _embeddings(seed, len(positive_ids))
    sampler = uniform_sampler(NUM_ITEMS, 9, seed=seed)
    ids = rng.integers(1, NUM_ITEMS + 1, 9)
    ids[[0, 4]] = 2
    ids[6] = 5
    _check_uniform_draws(sampler, ids, queries, items, positive_ids, lambda row: ids)


def test_per_row_draws_equal_the_reference():
    rng = np.random.default_rng(4)
    positive_ids = np.array([2, 5, 7, 11])
    queries, items = _embeddings(4, len(positive_ids))
    sampler = uniform_sampler(NUM_ITEMS, 6, seed=4, per_row=True)
    ids = rng.integers(1, NUM_ITEMS + 1, (4, 6))
    ids[1, 2] = 5
    _check_uniform_draws(sampler, ids, queries, items, positive_ids, lambda row: ids[row])


def _check_uniform_draws(sampler, ids, queries, items, positive_ids, row_draws):
    """Uniform draws ``ids`` with the sampler's expected counts, checked against the reference."""
    negatives = Negatives(
        tf.constant(ids, tf.int64),
        sampler.log_expected_count(tf.constant(ids, tf.int64), None),
        sampler.log_expected_count(tf.constant(positive_ids, tf.int64), None),
    )
    q = np.r_[0.0, np.full(NUM_ITEMS, 1.0 / NUM_ITEMS)]
    ours, gradient = _ours(queries, items, positive_ids, negatives, in_batch=False)
    _check(queries, items, positive_ids, row_draws, q, ours, gradient)


@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_equals_the_reference(seed):
    """Mixed: the batch's B positives (popularity) and m uniform draws, one draw of the mixture
    ``(B p + m u) / (B + m)`` each; hits in both parts."""
    rng = np.random.default_rng(seed)
    counts = np.r_[0.0, rng.integers(1, 40, NUM_ITEMS)].astype(np.float64)
    positive_ids = np.array([4, 4, 6, 10, 1])
    queries, items = _embeddings(seed, len(positive_ids))
    corpus = uniform_sampler(NUM_ITEMS, 7, seed=seed)
    sampler = MixedSampler(StaticFrequency(counts), corpus)
    drawn = sampler.sample(tf.constant(positive_ids, tf.int64))
    ids = rng.integers(1, NUM_ITEMS + 1, 7)
    ids[[1, 5]] = [6, 4]
    negatives = Negatives(
        tf.constant(ids, tf.int64),
        sampler._log_count(tf.constant(ids, tf.int64), len(positive_ids), tf.constant(7, tf.int64)),
        drawn.positive_log_q,
    )
    batch, draws = len(positive_ids), 7
    q = (batch * counts / counts.sum() + draws * np.r_[0.0, np.full(NUM_ITEMS, 1.0 / NUM_ITEMS)]) / (
        batch + draws
    )
    ours, gradient = _ours(queries, items, positive_ids, negatives, in_batch=True)
    _check(
        queries,
        items,
        positive_ids,
        lambda row: np.r_[np.delete(positive_ids, row), ids],
        q,
        ours,
        gradient,
    )


def test_the_weight_is_the_probability_of_misclassifying():
    """A row the model already ranks far above its negatives weighs almost nothing; a row it gets
    wrong weighs almost 1; a row whose only negatives are its own positive has loss 0."""
    items = np.zeros((NUM_ITEMS + 1, DIM))
    items[1:5] = np.eye(DIM)
    positive_ids = np.array([1, 2, 3])
    queries = np.array([[20.0, 0, 0, 0], [0, -20.0, 20.0, 0], [0, 0, 1.0, 0]])
    ids = np.array([2, 3, 4, 4])
    sampler = uniform_sampler(NUM_ITEMS, 4)
    negatives = Negatives(
        tf.constant(ids, tf.int64),
        sampler.log_expected_count(tf.constant(ids, tf.int64), None),
        sampler.log_expected_count(tf.constant(positive_ids, tf.int64), None),
    )
    q = np.r_[0.0, np.full(NUM_ITEMS, 1.0 / NUM_ITEMS)]
    weights = [_reference_row(queries[r], p, ids, items, q)[1] for r, p in enumerate(positive_ids)]
    assert weights[0] < 1e-12 and weights[1] > 1 - 1e-12
    ours, _ = _ours(queries, items, positive_ids, negatives, in_batch=False)
    assert ours[0] == pytest.approx(0.0, abs=1e-6)
    only_hits = Negatives(
        tf.constant([3, 3], tf.int64), tf.constant(np.log([2 / 12, 2 / 12]), tf.float32), tf.zeros([3])
    )
    ours, _ = _ours(queries, items, positive_ids, only_hits, in_batch=False)
    assert ours[2] == 0.0 and np.isfinite(ours).all()


def test_standard_is_the_default_and_differs():
    positive_ids = np.array([3, 3, 7, 1])
    queries, items = _embeddings(0, 4)
    negatives = InBatchSampler(StaticFrequency(np.r_[0.0, np.arange(1.0, NUM_ITEMS + 1)])).sample(
        tf.constant(positive_ids, tf.int64)
    )
    inputs = LossInputs(
        queries=tf.constant(queries, tf.float32),
        positives=tf.constant(items[positive_ids], tf.float32),
        positive_ids=tf.constant(positive_ids, tf.int64),
        negatives=(negatives,),
        negative_embeddings=(tf.zeros([0, DIM]),),
        includes_batch_positives=True,
    )
    default = SampledSoftmax(temperature=TEMPERATURE).per_example(inputs).numpy()
    standard = SampledSoftmax(temperature=TEMPERATURE, log_q_variant="standard").per_example(inputs).numpy()
    corrected = SampledSoftmax(temperature=TEMPERATURE, log_q_variant="corrected").per_example(inputs).numpy()
    np.testing.assert_array_equal(default, standard)
    assert not np.allclose(standard, corrected)


def _config(**loss):
    model = {k: loss.pop(k) for k in ("log_q_correction", "remove_accidental_hits") if k in loss}
    return Config.model_validate({"model": {**model, "loss": {"log_q_variant": "corrected", **loss}}})


@pytest.mark.parametrize(
    "loss, key",
    [
        ({"kind": "sgns"}, "model.loss.kind"),
        ({"kind": "bsl"}, "model.loss.kind"),
        ({"kind": "full_softmax"}, "model.loss.kind"),
        ({"negatives": "kernel"}, "model.loss.negatives"),
        ({"hard_negatives": "in_batch_top_k"}, "model.loss.hard_negatives"),
        ({"hard_negatives": "mined"}, "model.loss.hard_negatives"),
        ({"negatives": "uniform", "unique": True}, "model.loss.unique"),
        ({"log_q_correction": False}, "model.log_q_correction"),
        ({"remove_accidental_hits": False}, "model.remove_accidental_hits"),
    ],
)
def test_undefined_combinations_are_refused_naming_the_key(loss, key):
    with pytest.raises((ConfigError, ValueError), match=key.replace(".", r"\.")):
        _config(**loss)


@pytest.mark.parametrize("negatives", ["in_batch", "uniform", "unigram", "mixed"])
def test_the_config_builds_the_corrected_loss(negatives):
    config = _config(negatives=negatives).model.model_copy(update={"temperature": 0.2})
    loss = build_objective(config, np.r_[0.0, np.ones(NUM_ITEMS)], DIM)
    assert isinstance(loss, SampledSoftmax) and loss.log_q_variant == "corrected"
    default = Config.model_validate({}).model.model_copy(update={"temperature": 0.2})
    assert build_objective(default, np.r_[0.0, np.ones(NUM_ITEMS)], DIM).log_q_variant == "standard"
