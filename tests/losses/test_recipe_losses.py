"""The losses of the published ID-only recipes: SimpleX's cosine contrastive loss and BSL.

- each equals a numpy reference written by loops over rows and columns (``reference_losses``),
  on in-batch, shared corpus, per-row and mixed candidates, with and without accidental hits,
  padding and sample weights; their gradients are finite, also for rows with no negative left;
- the config keys are validated (cosine_contrastive needs normalised towers and no log-Q);
- per-row corpus negatives: ``[batch, m]`` draws with log Q = log(m p);
- a small synthetic run of each new kind lowers its loss and beats popularity.
"""

import numpy as np
import pytest
import tensorflow as tf
from reference_losses import numpy_bilateral_softmax, numpy_cosine_contrastive, row_candidates

import retrieval  # noqa: F401
from retrieval.config import ConfigError, LossConfig, ModelConfig, load_config
from retrieval.losses import BilateralSoftmax, CosineContrastive, LossInputs, SampledSoftmax
from retrieval.model.parts import build_objective, build_sampler
from retrieval.samplers import MASKED_LOG_Q, Negatives, uniform_sampler, unigram_sampler

BATCH, DIM, NUM_ITEMS = 7, 6, 20


def _unit(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _case(seed, *, hits, layout):
    """Random unit queries and items, the rows' positives and one negatives block for ``layout``.

    layout: in_batch (no sampled block), shared ([num] ids), per_row ([batch, num] ids), or
    mixed (in-batch and a shared block). ``hits`` repeats positives (in-batch hits) and puts
    rows' own positives among the sampled ids. Sampled blocks carry one padding column.
    """
    rng = np.random.default_rng(seed)
    queries = _unit(rng.normal(size=(BATCH, DIM)))
    items = _unit(rng.normal(size=(NUM_ITEMS + 1, DIM)))
    if hits:
        positive_ids = np.array([3, 5, 3, 9, 5, 3, 11])
    else:
        positive_ids = rng.choice(np.arange(1, NUM_ITEMS + 1), BATCH, replace=False)
    positive_log_q = rng.normal(size=BATCH).astype(np.float32)
    if layout == "in_batch":
        negatives = Negatives(tf.zeros([0], tf.int64), tf.zeros([0], tf.float32), tf.constant(positive_log_q))
        return queries, items, positive_ids, negatives, np.zeros([0, DIM], np.float32), True
    shape = (BATCH, 9) if layout == "per_row" else (9,)
    free = np.setdiff1d(np.arange(1, NUM_ITEMS + 1), positive_ids)
    ids = rng.choice(free, shape)
    log_q = rng.normal(size=shape).astype(np.float32)
    if hits:
        if layout == "per_row":
            ids[:, 0] = positive_ids  # each row meets its own positive
            ids[1, 4] = positive_ids[1]  # twice
        else:
            ids[:2] = positive_ids[:2]
    log_q[..., -1] = MASKED_LOG_Q  # padding, as the miner writes it
    negatives = Negatives(tf.constant(ids, tf.int64), tf.constant(log_q), tf.constant(positive_log_q))
    return queries, items, positive_ids, negatives, items[ids], layout == "mixed"


def _inputs(case, weight=None):
    queries, items, positive_ids, negatives, negative_embeddings, in_batch = case
    return LossInputs(
        queries=tf.constant(queries),
        positives=tf.constant(items[positive_ids]),
        positive_ids=tf.constant(positive_ids, tf.int64),
        negatives=(negatives,),
        negative_embeddings=(tf.constant(negative_embeddings),),
        includes_batch_positives=in_batch,
        sample_weight=None if weight is None else tf.constant(weight, tf.float32),
    )


def _rows(case, remove_hits=True):
    queries, items, positive_ids, negatives, negative_embeddings, in_batch = case
    blocks = []
    if negatives.ids.shape[-1]:
        blocks.append((negative_embeddings, negatives.ids.numpy(), negatives.log_q.numpy()))
    return row_candidates(
        queries, items[positive_ids], positive_ids, negatives.positive_log_q.numpy(), blocks,
        in_batch=in_batch, remove_hits=remove_hits,
    )


LAYOUTS = ["in_batch", "shared", "per_row", "mixed"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("hits", [False, True])
@pytest.mark.parametrize("remove_hits", [True, False])
@pytest.mark.parametrize("weighted", [False, True])
def test_cosine_contrastive_equals_numpy(layout, hits, remove_hits, weighted):
    case = _case(1, hits=hits, layout=layout)
    weight = np.linspace(0.5, 2.0, BATCH) if weighted else None
    loss = CosineContrastive(margin=0.2, negative_weight=150.0, remove_accidental_hits=remove_hits)
    ours = float(loss.compute(_inputs(case, weight)))
    reference = numpy_cosine_contrastive(_rows(case, remove_hits), 0.2, 150.0, weight)
    assert ours == pytest.approx(reference, rel=1e-5)
    assert reference > 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("hits", [False, True])
@pytest.mark.parametrize("remove_hits", [True, False])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("log_q_weight", [0.0, 1.0])
def test_bilateral_softmax_equals_numpy(layout, hits, remove_hits, weighted, log_q_weight):
    case = _case(2, hits=hits, layout=layout)
    weight = np.linspace(0.5, 2.0, BATCH) if weighted else None
    loss = BilateralSoftmax(
        temperature=0.5, negative_temperature=1.22, log_q_weight=log_q_weight, remove_accidental_hits=remove_hits
    )
    ours = float(loss.compute(_inputs(case, weight)))
    reference = numpy_bilateral_softmax(_rows(case, remove_hits), 0.5, 1.22, log_q_weight, weight)
    assert ours == pytest.approx(reference, rel=1e-5, abs=1e-5)


def test_bsl_at_tau2_one_is_the_softmax_over_the_negatives_only():
    """tau2 = 1 (the authors' SL) is cross-entropy with the positive left out of the denominator:
    sampled softmax minus log(1 + exp(l+) / sum exp(l-)) per row."""
    case = _case(3, hits=True, layout="shared")
    inputs = _inputs(case)
    bsl = BilateralSoftmax(temperature=0.3, negative_temperature=1.0).per_example(inputs).numpy()
    softmax = SampledSoftmax(temperature=0.3).per_example(inputs).numpy()
    logits, labels, kept = SampledSoftmax(temperature=0.3).candidate_columns(inputs)
    logits, labels, kept = logits.numpy(), labels.numpy(), kept.numpy()
    positive = (logits * labels).sum(axis=1)
    negatives = np.where(kept & (labels == 0), np.exp(logits.astype(np.float64)), 0.0).sum(axis=1)
    np.testing.assert_allclose(softmax - bsl, np.log1p(np.exp(positive) / negatives), rtol=1e-4)


def test_cosine_contrastive_defaults_are_simplex_gowalla():
    loss = CosineContrastive()
    assert (loss.margin, loss.negative_weight, loss.temperature, loss.log_q_weight) == (0.9, 150.0, 1.0, 0.0)


@pytest.mark.parametrize("loss", [
    CosineContrastive(margin=0.1, negative_weight=50.0),
    BilateralSoftmax(temperature=0.1, negative_temperature=1.3),
])
def test_gradients_are_finite_also_without_negatives(loss):
    """Every row's positive is the same item: in-batch, each row's negatives are all accidental
    hits. CCL keeps its positive term; BSL's row counts 0. Gradients stay finite (no NaN from the
    masked columns) and the positive term still pulls the query (CCL)."""
    rng = np.random.default_rng(4)
    queries = tf.Variable(_unit(rng.normal(size=(4, DIM))))
    positives = tf.Variable(np.repeat(_unit(rng.normal(size=(1, DIM))), 4, axis=0))
    for ids, expected_zero in ([[2, 2, 2, 2]], True), ([[2, 2, 5, 7]], False):
        inputs = LossInputs(
            queries=queries,
            positives=positives,
            positive_ids=tf.constant(ids[0], tf.int64),
            negatives=(Negatives(tf.zeros([0], tf.int64), tf.zeros([0]), tf.zeros([4])),),
            negative_embeddings=(tf.zeros([0, DIM]),),
            includes_batch_positives=True,
        )
        with tf.GradientTape() as tape:
            value = loss.compute(inputs)
        gradients = tape.gradient(value, [queries, positives])
        assert np.isfinite(float(value))
        assert all(np.all(np.isfinite(g.numpy())) for g in gradients)
        if isinstance(loss, BilateralSoftmax) and expected_zero:
            assert float(value) == 0.0
        else:
            assert float(tf.reduce_sum(tf.abs(gradients[0]))) > 0


def test_hard_negatives_keep_the_top_scores_of_the_kept_columns():
    """With in_batch_top_k, CCL averages over each row's k highest-scoring kept negatives."""
    case = _case(5, hits=True, layout="mixed")
    k = 3
    loss = CosineContrastive(margin=-1.0, negative_weight=1.0, num_hard_negatives=k)
    ours = loss.per_example(_inputs(case)).numpy()
    rows = [(p, lq, np.sort(s)[-k:], lq_) for p, lq, s, lq_ in _rows(case)]
    expected = [1 - p + np.mean(s + 1.0) for p, _, s, _ in rows]
    np.testing.assert_allclose(ours, expected, rtol=1e-5)


def _model_config(**loss):
    defaults = {"normalize": True, "log_q_correction": False}
    model = {key: loss.pop(key) for key in list(loss) if key in ModelConfig.model_fields}
    return {**defaults, **model, "loss": loss}


def test_config_builds_the_losses_with_their_keys():
    counts = np.r_[0.0, np.ones(NUM_ITEMS)]
    config = ModelConfig(**_model_config(kind="cosine_contrastive", margin=0.8, negative_weight=200.0,
                                         negatives="uniform", num_negatives=5))
    loss = build_objective(config.model_copy(update={"temperature": 0.1}), counts, 8)
    assert isinstance(loss, CosineContrastive)
    assert (loss.margin, loss.negative_weight, loss.temperature, loss.log_q_weight) == (0.8, 200.0, 1.0, 0.0)
    config = ModelConfig(**_model_config(kind="bsl", bsl_temperature=1.1, temperature=0.08, log_q_correction=True))
    loss = build_objective(config, counts, 8)
    assert isinstance(loss, BilateralSoftmax)
    assert (loss.temperature, loss.negative_temperature, loss.log_q_weight) == (0.08, 1.1, 1.0)
    assert LossConfig().bsl_temperature == 1.22 and LossConfig().margin == 0.9
    assert LossConfig().negative_weight == 150.0


@pytest.mark.parametrize("overrides, key", [
    (["model.loss.kind=cosine_contrastive", "model.normalize=false", "model.log_q_correction=false"],
     "model.normalize"),
    (["model.loss.kind=cosine_contrastive"], "model.log_q_correction"),
    (["model.loss.kind=cosine_contrastive", "model.log_q_correction=false", "model.loss.margin=1.0"],
     "margin"),
    (["model.loss.negative_weight=-1"], "negative_weight"),
    (["model.loss.kind=bsl", "model.loss.bsl_temperature=0"], "bsl_temperature"),
    (["model.loss.negatives_per_row=true"], "model.loss.negatives_per_row"),
    (["model.loss.negatives=uniform", "model.loss.negatives_per_row=true", "model.loss.unique=true"],
     "model.loss.unique"),
])
def test_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


def test_valid_recipe_configs_load():
    ccl = load_config(None, ["model.loss.kind=cosine_contrastive", "model.log_q_correction=false",
                             "model.loss.negatives=uniform", "model.loss.num_negatives=800",
                             "model.loss.negatives_per_row=true"])
    assert ccl.model.loss.negatives_per_row and ccl.model.loss.margin == 0.9
    bsl = load_config(None, ["model.loss.kind=bsl", "model.temperature=0.08"])
    assert bsl.model.loss.bsl_temperature == 1.22


@pytest.mark.parametrize("make", [
    lambda: uniform_sampler(NUM_ITEMS, 50, per_row=True, seed=1),
    lambda: unigram_sampler(np.r_[0.0, np.arange(1.0, NUM_ITEMS + 1)], 50, alpha=1.0, per_row=True, seed=1),
])
def test_per_row_draws_are_batch_by_m_with_log_m_p(make):
    sampler = make()
    positive_ids = tf.constant([1, 4, 4, 20], tf.int64)
    negatives = sampler.sample(positive_ids)
    ids = negatives.ids.numpy()
    assert ids.shape == (4, 50) and negatives.per_query
    assert ids.min() >= 1 and ids.max() <= NUM_ITEMS
    assert len({tuple(row) for row in ids}) == 4  # each row its own draw
    p = sampler.probability
    np.testing.assert_allclose(negatives.log_q.numpy(), np.log(50 * p[ids]), rtol=1e-6)
    np.testing.assert_allclose(negatives.positive_log_q.numpy(), np.log(50 * p[[1, 4, 4, 20]]), rtol=1e-6)


def test_per_row_draws_follow_the_distribution():
    counts = np.r_[0.0, np.arange(1.0, NUM_ITEMS + 1)]
    sampler = unigram_sampler(counts, 2000, alpha=1.0, per_row=True, seed=2)
    ids = sampler.sample(tf.ones([50], tf.int64)).ids.numpy().ravel()
    frequency = np.bincount(ids, minlength=NUM_ITEMS + 1) / ids.size
    np.testing.assert_allclose(frequency, counts / counts.sum(), atol=0.002)


def test_per_row_is_wired_from_the_config_and_refuses_unique():
    loss = LossConfig(negatives="uniform", num_negatives=6, negatives_per_row=True)
    sampler = build_sampler(loss, np.r_[0.0, np.ones(NUM_ITEMS)])
    assert sampler.sample(tf.constant([1, 2, 3], tf.int64)).ids.shape == (3, 6)
    assert build_sampler(LossConfig(negatives="uniform", num_negatives=6), np.r_[0.0, np.ones(NUM_ITEMS)]) \
        .sample(tf.constant([1, 2, 3], tf.int64)).ids.shape == (6,)
    with pytest.raises(ValueError, match="unique"):
        uniform_sampler(NUM_ITEMS, 5, per_row=True, unique=True)


MODEL_LOSSES = [
    {"kind": "cosine_contrastive"},
    {"kind": "cosine_contrastive", "negatives": "uniform", "num_negatives": 6, "negatives_per_row": True},
    {"kind": "cosine_contrastive", "negatives": "mixed", "hard_negatives": "in_batch_top_k", "num_hard_negatives": 3},
    {"kind": "bsl", "log_q_correction": True},
    {"kind": "bsl", "negatives": "unigram", "num_negatives": 6, "negatives_per_row": True},
    {"kind": "bsl", "hard_negatives": "mined", "num_hard_negatives": 3, "mining_refresh_steps": 2},
]


@pytest.mark.parametrize("loss", MODEL_LOSSES, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_the_model_trains_with_each_recipe_loss(loss):
    """Through build_model, on every candidate layout (in-batch, per-row, mixed with top-k,
    mined): a finite loss and a gradient to the query tower."""
    from test_loss_wiring import _batch, _train

    from retrieval.features import FeatureStatistics
    from retrieval.model import build_model

    train = _train()
    stats = FeatureStatistics.from_training_clicks(train)
    tf.keras.utils.set_random_seed(0)
    config = ModelConfig(embedding_dim=8, temperature=0.2, **_model_config(**loss))
    model = build_model(config, stats, train_clicks=train)
    assert model.objective.name == loss["kind"]
    with tf.GradientTape() as tape:
        value = model.compute_loss(_batch(train), training=True)
    assert np.isfinite(float(value))
    gradients = [g for g in tape.gradient(value, model.query_tower.trainable_variables) if g is not None]
    assert sum(float(tf.reduce_sum(tf.abs(tf.convert_to_tensor(g)))) for g in gradients) > 0


SMALL = [
    "data.synthetic.n_users=400",
    "data.synthetic.n_items=200",
    "data.synthetic.mean_clicks_per_user=30",
    "train.epochs=6",
    "train.batch_size=256",
    "train.validation_fraction=0",
    "model.embedding_dim=32",
]

RECIPES = {
    "cosine_contrastive": [
        "model.loss.kind=cosine_contrastive", "model.log_q_correction=false", "model.loss.negatives=uniform",
        "model.loss.num_negatives=50", "model.loss.negatives_per_row=true", "model.loss.negative_weight=50",
    ],
    "bsl": [
        "model.loss.kind=bsl", "model.log_q_correction=false", "model.loss.negatives=uniform",
        "model.loss.num_negatives=200", "model.temperature=0.1",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_trains_and_beats_popularity(train_run, recipe):
    _, result = train_run("default.yaml", [*SMALL, *RECIPES[recipe]], recipe)
    losses = result.metrics["training"]["loss"]
    assert losses[-1] < losses[0], losses
    model, popular = result.metrics["model"], result.metrics["popularity"]
    assert model["recall@20"] > 1.3 * popular["recall@20"], (model["recall@20"], popular["recall@20"])
