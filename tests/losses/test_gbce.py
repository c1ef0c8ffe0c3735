"""gBCE (``model.loss.kind: gbce``), gSASRec's generalised binary cross-entropy, against numpy.

The reference (``reference_losses.numpy_gbce``) is written from the paper's equation with
``sigmoid`` and ``log`` (Petrov & Macdonald, RecSys 2023; the authors' README states the same):

    loss = -(1 / (k + 1)) * (log(sigmoid(s+) ** beta) + sum_j log(1 - sigmoid(s_j)))
    beta = alpha * (t * (1 - 1/alpha) + 1/alpha),  alpha = k / (|I| - 1)

- the loss equals it on shared and per-row uniform draws, with and without accidental hits (removed
  or kept), padding and sample weights; the query gradient equals the one derived by hand;
- beta's formula, its ends (t = 0: plain binary cross-entropy, t = 1: beta = alpha) and the loss at
  t = 0 against word2vec's logistic loss (``NegativeSampling``) over the same columns;
- the config: wired from its keys, errors naming the bad key;
- ``train.examples: sequences``: the loss of a batch of sequences is gBCE over its non-padded
  positions (query state, next item, that position's own draws); clicks train with it too.
"""

import numpy as np
import pytest
import tensorflow as tf
from reference_losses import numpy_gbce, row_candidates

import retrieval  # noqa: F401
from retrieval.config import ConfigError, LossConfig, ModelConfig, load_config
from retrieval.losses import GeneralizedBinaryCrossEntropy, LossInputs, NegativeSampling, gbce_beta
from retrieval.model.parts import build_objective
from retrieval.samplers import MASKED_LOG_Q, Negatives

BATCH, DIM, NUM_ITEMS, K = 6, 5, 30, 8


def _case(seed, *, layout, hits):
    """Queries, items, positives and one block of ``K`` uniform draws (shared ``[K]`` or per row
    ``[BATCH, K]``), the last column padding; ``hits`` puts rows' own positives among the draws."""
    rng = np.random.default_rng(seed)
    queries = rng.normal(size=(BATCH, DIM)).astype(np.float32)
    items = rng.normal(size=(NUM_ITEMS + 1, DIM)).astype(np.float32)
    positive_ids = rng.choice(np.arange(1, NUM_ITEMS + 1), BATCH, replace=False)
    shape = (BATCH, K) if layout == "per_row" else (K,)
    ids = rng.choice(np.setdiff1d(np.arange(1, NUM_ITEMS + 1), positive_ids), shape)
    if hits:
        if layout == "per_row":
            ids[:, 0] = positive_ids
            ids[2, 3] = positive_ids[2]  # twice in one row
        else:
            ids[:2] = positive_ids[:2]
    log_q = np.full(shape, np.log(K / NUM_ITEMS), np.float32)
    log_q[..., -1] = MASKED_LOG_Q
    negatives = Negatives(tf.constant(ids, tf.int64), tf.constant(log_q),
                          tf.fill([BATCH], np.float32(np.log(K / NUM_ITEMS))))
    return queries, items, positive_ids, negatives, items[ids]


def _inputs(case, weight=None, queries=None):
    q, items, positive_ids, negatives, negative_embeddings = case
    return LossInputs(
        queries=tf.constant(q) if queries is None else queries,
        positives=tf.constant(items[positive_ids]),
        positive_ids=tf.constant(positive_ids, tf.int64),
        negatives=(negatives,),
        negative_embeddings=(tf.constant(negative_embeddings),),
        includes_batch_positives=False,
        sample_weight=None if weight is None else tf.constant(weight, tf.float32),
    )


def _rows(case, remove_hits=True):
    q, items, positive_ids, negatives, negative_embeddings = case
    return row_candidates(q, items[positive_ids], positive_ids, negatives.positive_log_q.numpy(),
                          [(negative_embeddings, negatives.ids.numpy(), negatives.log_q.numpy())],
                          in_batch=False, remove_hits=remove_hits)


@pytest.mark.parametrize("layout", ["shared", "per_row"])
@pytest.mark.parametrize("hits", [False, True])
@pytest.mark.parametrize("remove_hits", [True, False])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("calibration, temperature", [(0.75, 1.0), (0.0, 0.5), (1.0, 2.0)])
def test_gbce_equals_numpy(layout, hits, remove_hits, weighted, calibration, temperature):
    case = _case(1, layout=layout, hits=hits)
    weight = np.linspace(0.5, 2.0, BATCH) if weighted else None
    loss = GeneralizedBinaryCrossEntropy(num_negatives=K, num_items=NUM_ITEMS, calibration=calibration,
                                         temperature=temperature, remove_accidental_hits=remove_hits)
    beta = 1.0 - calibration * (1.0 - K / (NUM_ITEMS - 1))
    ours = float(loss.compute(_inputs(case, weight)))
    assert ours == pytest.approx(numpy_gbce(_rows(case, remove_hits), beta, temperature, weight), rel=1e-5)


def test_accidental_hits_are_left_out_of_the_sum_and_the_count():
    case = _case(2, layout="per_row", hits=True)
    rows = _rows(case, remove_hits=True)
    assert [len(r[2]) for r in rows] == [K - 2, K - 2, K - 3, K - 2, K - 2, K - 2]  # the padding and the hits
    removed = GeneralizedBinaryCrossEntropy(num_negatives=K, num_items=NUM_ITEMS).per_example(_inputs(case)).numpy()
    kept = GeneralizedBinaryCrossEntropy(num_negatives=K, num_items=NUM_ITEMS, remove_accidental_hits=False) \
        .per_example(_inputs(case)).numpy()
    assert np.all(np.abs(removed - kept) > 1e-4)


def test_the_query_gradient_is_the_derived_one():
    """dL/dq_i = (-beta (1 - sigmoid(s+)) d+ + sum_j sigmoid(s_j) d_j) / ((|N| + 1) tau batch): the
    positive pulls the query towards its item, each negative pushes it away."""
    case = _case(3, layout="per_row", hits=True)
    temperature, calibration = 0.5, 0.75
    beta = gbce_beta(K, NUM_ITEMS, calibration)
    queries = tf.Variable(case[0])
    loss = GeneralizedBinaryCrossEntropy(num_negatives=K, num_items=NUM_ITEMS, calibration=calibration,
                                         temperature=temperature)
    with tf.GradientTape() as tape:
        value = loss.compute(_inputs(case, queries=queries))
    ours = tape.gradient(value, queries).numpy()
    q, items, positive_ids, negatives, negative_embeddings = case
    ids, log_q = negatives.ids.numpy(), negatives.log_q.numpy()

    def sigmoid(x):
        return 1.0 / (1.0 + np.exp(-x))

    expected = np.zeros_like(q, dtype=np.float64)
    for i in range(BATCH):
        positive = items[positive_ids[i]]
        kept = [c for c in range(K) if log_q[i, c] < 1e29 and ids[i, c] != positive_ids[i]]
        s_plus = q[i] @ positive / temperature
        pull = -beta * (1.0 - sigmoid(s_plus)) * positive
        push = sum(sigmoid(q[i] @ negative_embeddings[i, c] / temperature) * negative_embeddings[i, c] for c in kept)
        expected[i] = (pull + push) / ((len(kept) + 1) * temperature * BATCH)
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-7)
    # Along the positive's direction alone the gradient lowers the loss by raising s+.
    positive_only = GeneralizedBinaryCrossEntropy(num_negatives=K, num_items=NUM_ITEMS, temperature=temperature)
    no_negatives = _inputs(case, queries=queries)._replace(negatives=(negatives._replace(
        log_q=tf.fill(tf.shape(negatives.log_q), MASKED_LOG_Q)),))
    with tf.GradientTape() as tape:
        value = positive_only.compute(no_negatives)
    gradient = tape.gradient(value, queries).numpy()
    assert np.all(np.sum(gradient * items[positive_ids], axis=1) < 0)


def test_beta_is_the_papers_formula():
    for k, items, t in [(256, 54542, 0.75), (1, 3707, 0.5), (128, 1682, 0.9), (8, 30, 1.0), (8, 30, 0.0)]:
        alpha = k / (items - 1)
        assert gbce_beta(k, items, t) == pytest.approx(alpha * (t * (1 - 1 / alpha) + 1 / alpha), rel=1e-12)
        assert gbce_beta(k, items, t) == pytest.approx(1 - t * (1 - alpha), rel=1e-12)
    assert gbce_beta(256, 54542, 0.0) == pytest.approx(1.0)  # plain BCE
    assert gbce_beta(256, 54542, 1.0) == pytest.approx(256 / 54541)  # calibrated: beta = alpha
    for bad, match in [((0, 30, 0.5), "num_negatives"), ((8, 1, 0.5), "catalogue"), ((8, 30, 1.5), "calibration"),
                       ((8, 30, -0.1), "calibration")]:
        with pytest.raises(ValueError, match=match):
            gbce_beta(*bad)


@pytest.mark.parametrize("remove_hits", [True, False])
def test_at_t_zero_it_is_binary_cross_entropy_averaged_over_its_terms(remove_hits):
    """t = 0: beta = 1, so each row is word2vec's logistic loss (``NegativeSampling``, summed over
    the same columns, no log-Q) divided by its number of terms."""
    case = _case(4, layout="shared", hits=True)
    inputs = _inputs(case)
    gbce = GeneralizedBinaryCrossEntropy(num_negatives=K, num_items=NUM_ITEMS, calibration=0.0,
                                         remove_accidental_hits=remove_hits).per_example(inputs).numpy()
    bce = NegativeSampling(log_q_weight=0.0, remove_accidental_hits=remove_hits).per_example(inputs).numpy()
    terms = np.array([len(r[2]) + 1 for r in _rows(case, remove_hits)])
    np.testing.assert_allclose(gbce * terms, bce, rtol=1e-5)


def test_the_loss_refuses_log_q_and_hard_negatives():
    with pytest.raises(ValueError, match="log_q_weight"):
        GeneralizedBinaryCrossEntropy(num_negatives=K, num_items=NUM_ITEMS, log_q_weight=1.0)
    with pytest.raises(ValueError, match="num_hard_negatives"):
        GeneralizedBinaryCrossEntropy(num_negatives=K, num_items=NUM_ITEMS, num_hard_negatives=3)


def test_config_builds_gbce_from_its_keys_without_log_q():
    counts = np.r_[0.0, np.ones(NUM_ITEMS)]
    config = ModelConfig(temperature=0.5, log_q_correction=True,
                         loss=LossConfig(kind="gbce", negatives="uniform", num_negatives=K, calibration=0.6))
    loss = build_objective(config, counts, 8)
    assert isinstance(loss, GeneralizedBinaryCrossEntropy)
    assert (loss.num_items, loss.num_negatives, loss.calibration, loss.temperature, loss.log_q_weight) == \
        (NUM_ITEMS, K, 0.6, 0.5, 0.0)
    assert loss.beta == pytest.approx(1 - 0.6 * (1 - K / (NUM_ITEMS - 1)))
    assert LossConfig().calibration == 0.75 and loss.score_dtype == "float32"
    bfloat16 = config.model_copy(update={"loss": config.loss.model_copy(update={"score_dtype": "bfloat16"})})
    assert build_objective(bfloat16, counts, 8).score_dtype == "bfloat16"


@pytest.mark.parametrize("overrides, key", [
    (["model.loss.kind=gbce"], "model.loss.negatives"),  # in_batch by default
    (["model.loss.kind=gbce", "model.loss.negatives=mixed"], "model.loss.negatives"),
    (["model.loss.kind=gbce", "model.loss.negatives=unigram"], "model.loss.negatives"),
    (["model.loss.kind=gbce", "model.loss.negatives=uniform", "model.loss.hard_negatives=mined"],
     "model.loss.hard_negatives"),
    (["model.loss.kind=gbce", "model.loss.negatives=uniform", "model.loss.calibration=1.5"], "calibration"),
    (["model.loss.kind=gbce", "model.loss.negatives=uniform", "model.loss.calibration=-0.25"], "calibration"),
    (["model.loss.kind=gbce", "model.loss.negatives=uniform", "model.loss.log_q_variant=corrected"],
     "model.loss.kind"),
])
def test_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


def test_a_gbce_config_loads():
    config = load_config(None, ["model.loss.kind=gbce", "model.loss.negatives=uniform", "model.loss.num_negatives=256",
                                "model.loss.negatives_per_row=true", "model.loss.calibration=0.75"])
    assert config.model.loss.kind == "gbce" and config.model.loss.calibration == 0.75


def test_sequence_batches_train_gbce_on_every_non_padded_position():
    """A batch of sequences: one row a non-padded position (its state, its next item, its own K
    uniform draws); the loss is numpy's gBCE over those rows."""
    from test_sequences import LENGTH, _clicks, _histories, _model

    from retrieval.towers import position_states
    from retrieval.training import SequenceClicks

    clicks = _clicks(seed=3)
    model, stats = _model(clicks, temperature=1.0, normalize=False, log_q_correction=True,
                          loss=LossConfig(kind="gbce", negatives="uniform", num_negatives=K,
                                          negatives_per_row=True, calibration=0.75))
    captured = {}
    compute = model.objective.compute
    model.objective.compute = lambda inputs: captured.setdefault("inputs", inputs) and compute(inputs)
    batch = next(iter(SequenceClicks(_histories(clicks, stats), "history", LENGTH, batch_size=8, seed=0).epoch(0)))
    loss = float(model.compute_loss(batch, training=False))  # no dropout: the states below are the same
    per_position = position_states(model.query_tower).model({"history": batch["history"]}, training=False).numpy()
    targets = batch["item_id"].numpy().astype(str)
    trained = targets != ""
    q = per_position[trained]
    positive_ids = model.item_index(tf.constant(targets[trained])).numpy()
    ids = captured["inputs"].negatives[0].ids.numpy()
    assert ids.shape == (trained.sum(), K) and trained.sum() > 8  # more rows than sequences, K draws each
    table = model.embed_catalogue().numpy()  # [items + 1, dim], row = tower index
    rows = row_candidates(q, table[positive_ids], positive_ids, np.zeros(len(q)),
                          [(table[ids], ids, np.zeros(ids.shape))], in_batch=False)
    assert loss == pytest.approx(numpy_gbce(rows, gbce_beta(K, len(stats.items), 0.75)), rel=1e-5)


def test_clicks_train_with_gbce():
    from test_loss_wiring import _batch, _train

    from retrieval.features import FeatureStatistics
    from retrieval.model import build_model

    train = _train()
    stats = FeatureStatistics.from_training_clicks(train)
    tf.keras.utils.set_random_seed(0)
    config = ModelConfig(embedding_dim=8, temperature=0.2,
                         loss=LossConfig(kind="gbce", negatives="uniform", num_negatives=6, negatives_per_row=True))
    model = build_model(config, stats, train_clicks=train)
    assert model.objective.name == "gbce"
    with tf.GradientTape() as tape:
        value = model.compute_loss(_batch(train), training=True)
    assert np.isfinite(float(value))
    gradients = [g for g in tape.gradient(value, model.query_tower.trainable_variables) if g is not None]
    assert sum(float(tf.reduce_sum(tf.abs(tf.convert_to_tensor(g)))) for g in gradients) > 0
