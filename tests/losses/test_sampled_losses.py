"""Sampled losses against independent references.

- sampled softmax with log-Q correction vs ``tf.nn.sampled_softmax_loss`` given the same draws;
- per-query negatives vs the same reference row by row;
- sampled softmax over the whole corpus with uniform Q vs a numpy full softmax;
- in-batch softmax (with hard negatives) vs ``tfrs.tasks.Retrieval``;
- the logit transforms vs TFRS's layers; SGNS vs a numpy computation;
- hierarchical softmax: probabilities over all items sum to 1, gradients reach only path nodes.
"""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_recommenders as tfrs
from reference_losses import in_batch_softmax_task

import retrieval  # noqa: F401
from retrieval.losses import (
    FullSoftmax,
    HierarchicalSoftmax,
    HuffmanTree,
    LossInputs,
    NegativeSampling,
    OwnItems,
    SampledSoftmax,
    mine_hard_negatives,
    remove_accidental_hits,
)
from retrieval.losses.functions import softmax_cross_entropy
from retrieval.samplers import MASKED_LOG_Q, AllItems, Negatives, uniform_sampler, unigram_sampler

BATCH, DIM, NUM_ITEMS = 6, 5, 30


def _embeddings(seed, num_items=NUM_ITEMS):
    rng = np.random.default_rng(seed)
    queries = rng.normal(size=(BATCH, DIM)).astype(np.float32)
    items = rng.normal(size=(num_items + 1, DIM)).astype(np.float32)
    items[0] = 0.0
    return queries, items


def _inputs(queries, items, positive_ids, negatives, *, in_batch=False, weight=None):
    return LossInputs(
        queries=tf.constant(queries),
        positives=tf.constant(items[positive_ids]),
        positive_ids=tf.constant(positive_ids, tf.int64),
        negatives=(negatives,),
        negative_embeddings=(tf.constant(items[negatives.ids.numpy()]),),
        includes_batch_positives=in_batch,
        sample_weight=None if weight is None else tf.constant(weight),
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("remove_hits", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.2])
def test_sampled_softmax_equals_tf_nn_sampled_softmax_loss(seed, remove_hits, temperature):
    queries, items = _embeddings(seed)
    counts = np.r_[0.0, np.random.default_rng(seed).integers(1, 50, NUM_ITEMS)]
    sampler = unigram_sampler(counts, 12, seed=seed)
    positive_ids = np.random.default_rng(seed + 10).integers(1, NUM_ITEMS + 1, BATCH)
    negatives = sampler.sample(tf.constant(positive_ids, tf.int64))
    # Make sure the draw has accidental hits to remove, each positive at most once:
    # tf.nn's compute_accidental_hits removes only one occurrence of a repeated
    # sampled id (it assumes unique draws); we remove all (tested below).
    ids = negatives.ids.numpy()
    free = np.setdiff1d(np.arange(1, NUM_ITEMS + 1), positive_ids)
    ids = np.where(np.isin(ids, positive_ids), free[: len(ids)], ids)
    ids[:2] = positive_ids[:2]
    negatives = Negatives(
        tf.constant(ids), sampler.log_expected_count(tf.constant(ids), 12), negatives.positive_log_q
    )
    loss = SampledSoftmax(temperature=temperature, remove_accidental_hits=remove_hits)
    ours = loss.per_example(_inputs(queries, items, positive_ids, negatives)).numpy()
    reference = tf.nn.sampled_softmax_loss(
        weights=tf.constant(items),
        biases=tf.zeros([NUM_ITEMS + 1]),
        labels=tf.constant(positive_ids.reshape(-1, 1), tf.int64),
        inputs=tf.constant(queries / temperature),
        num_sampled=12,
        num_classes=NUM_ITEMS + 1,
        sampled_values=(
            tf.constant(ids),
            tf.exp(negatives.positive_log_q)[:, tf.newaxis],
            tf.exp(negatives.log_q),
        ),
        remove_accidental_hits=remove_hits,
    ).numpy()
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-5)
    # The correction matters: without it the loss differs.
    uncorrected = SampledSoftmax(
        temperature=temperature, remove_accidental_hits=remove_hits, log_q_weight=0.0
    )
    assert not np.allclose(
        uncorrected.per_example(_inputs(queries, items, positive_ids, negatives)), reference
    )


def test_every_repeat_of_an_accidental_hit_is_removed():
    queries, items = _embeddings(5)
    positive_ids = np.array([4, 4, 9, 2, 7, 7])
    ids = np.array([4, 11, 4, 7, 13, 7, 4])
    log_q = np.log(np.linspace(0.2, 1.5, 7)).astype(np.float32)
    negatives = Negatives(tf.constant(ids, tf.int64), tf.constant(log_q), tf.zeros([BATCH]))
    ours = (
        SampledSoftmax(temperature=1.0).per_example(_inputs(queries, items, positive_ids, negatives)).numpy()
    )
    for row, positive in enumerate(positive_ids):
        logits = np.r_[queries[row] @ items[positive], queries[row] @ items[ids].T - log_q]
        logits = logits[np.r_[True, ids != positive]]
        assert ours[row] == pytest.approx(np.logaddexp.reduce(logits) - logits[0], rel=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_per_query_negatives_equal_the_reference_row_by_row(seed):
    """Negatives drawn per query ([batch, m], as a kernel sampler would) give each row the
    loss tf.nn.sampled_softmax_loss gives that row with its own draws."""
    queries, items = _embeddings(seed)
    rng = np.random.default_rng(seed)
    positive_ids = rng.integers(1, NUM_ITEMS + 1, BATCH)
    ids = rng.integers(1, NUM_ITEMS + 1, (BATCH, 7))
    ids[0, 3] = positive_ids[0]  # an accidental hit
    log_q = np.log(rng.uniform(0.05, 2.0, (BATCH, 7))).astype(np.float32)
    positive_log_q = np.log(rng.uniform(0.05, 2.0, BATCH)).astype(np.float32)
    negatives = Negatives(tf.constant(ids, tf.int64), tf.constant(log_q), tf.constant(positive_log_q))
    inputs = LossInputs(
        tf.constant(queries),
        tf.constant(items[positive_ids]),
        tf.constant(positive_ids, tf.int64),
        (negatives,),
        (tf.constant(items[ids]),),
        False,
    )
    ours = SampledSoftmax(temperature=0.5).per_example(inputs).numpy()
    for row in range(BATCH):
        expected = tf.nn.sampled_softmax_loss(
            weights=tf.constant(items),
            biases=tf.zeros([NUM_ITEMS + 1]),
            labels=tf.constant([[positive_ids[row]]], tf.int64),
            inputs=tf.constant(queries[row : row + 1] / 0.5),
            num_sampled=7,
            num_classes=NUM_ITEMS + 1,
            sampled_values=(
                tf.constant(ids[row], tf.int64),
                tf.constant(np.exp(positive_log_q[row : row + 1, None])),
                tf.constant(np.exp(log_q[row])),
            ),
            remove_accidental_hits=True,
        ).numpy()[0]
        assert ours[row] == pytest.approx(expected, rel=1e-5, abs=1e-5)


def _numpy_full_softmax(queries, items, positive_ids, temperature):
    logits = queries @ items[1:].T / temperature
    log_softmax = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    return -log_softmax[np.arange(len(positive_ids)), positive_ids - 1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_softmax_over_the_whole_corpus_with_uniform_q_is_full_softmax(seed):
    queries, items = _embeddings(seed)
    positive_ids = np.random.default_rng(seed).integers(1, NUM_ITEMS + 1, BATCH)
    expected = _numpy_full_softmax(queries, items, positive_ids, 0.3)
    loss = SampledSoftmax(temperature=0.3, remove_accidental_hits=True)
    exact = AllItems(NUM_ITEMS).sample(tf.constant(positive_ids, tf.int64))
    np.testing.assert_allclose(
        loss.per_example(_inputs(queries, items, positive_ids, exact)), expected, rtol=1e-5, atol=1e-5
    )
    # Any uniform Q (here: each item's expected count m / V for m draws) is the same softmax.
    constant = Negatives(
        exact.ids, tf.fill([NUM_ITEMS], np.log(7 / NUM_ITEMS)), tf.fill([BATCH], np.log(7 / NUM_ITEMS))
    )
    np.testing.assert_allclose(
        loss.per_example(_inputs(queries, items, positive_ids, constant)), expected, rtol=1e-5, atol=1e-5
    )
    # A non-uniform Q over the whole corpus is not.
    skewed = Negatives(exact.ids, tf.range(NUM_ITEMS, dtype=tf.float32) / 10, tf.zeros([BATCH]))
    assert not np.allclose(
        loss.per_example(_inputs(queries, items, positive_ids, skewed)), expected, rtol=1e-3
    )


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_the_full_softmax_from_one_block_of_logits_is_the_numpy_one_and_the_generic_paths(seed, temperature):
    queries, items = _embeddings(seed)
    positive_ids = np.random.default_rng(seed).integers(1, NUM_ITEMS + 1, BATCH)
    exact = AllItems(NUM_ITEMS).sample(tf.constant(positive_ids, tf.int64))
    inputs = _inputs(queries, items, positive_ids, exact)
    fast = FullSoftmax(temperature=temperature, log_q_weight=0.0).per_example(inputs).numpy()
    np.testing.assert_allclose(fast, _numpy_full_softmax(queries, items, positive_ids, temperature),
                               rtol=1e-5, atol=1e-5)
    generic = SampledSoftmax(temperature=temperature, log_q_weight=0.0)
    np.testing.assert_allclose(fast, generic.per_example(inputs).numpy(), rtol=1e-5, atol=1e-5)
    # A row's own items (its sequence's other items) left out of its softmax, its positive kept.
    rng = np.random.default_rng(seed + 5)
    own_ids = np.sort(rng.choice(np.arange(1, NUM_ITEMS + 1), size=(2, 4), replace=False), axis=1)
    own_ids[1, 3] = -1  # padding
    own = OwnItems(tf.constant(own_ids, tf.int64), tf.constant(np.arange(BATCH) % 2))
    owned = inputs._replace(own_items=own)
    logits = queries @ items[1:].T / temperature
    left_out = np.zeros_like(logits, bool)
    for row in range(BATCH):
        left_out[row, [i - 1 for i in own_ids[row % 2] if i > 0 and i != positive_ids[row]]] = True
    logits = np.where(left_out, -np.inf, logits)
    expected = np.logaddexp.reduce(logits, axis=1) - logits[np.arange(BATCH), positive_ids - 1]
    fast_owned = FullSoftmax(temperature=temperature, log_q_weight=0.0).per_example(owned).numpy()
    np.testing.assert_allclose(fast_owned, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fast_owned, generic.per_example(owned).numpy(), rtol=1e-5, atol=1e-5)
    assert left_out.any() and not np.allclose(fast_owned, fast, atol=1e-4)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("hard", [None, 2])
def test_in_batch_softmax_equals_tfrs_retrieval(seed, hard):
    queries, items = _embeddings(seed)
    rng = np.random.default_rng(seed)
    positive_ids = np.array([3, 5, 3, 9, 1, 5])  # repeated positives: accidental hits
    positive_log_q = np.log(rng.uniform(0.01, 1.0, BATCH)).astype(np.float32)
    weights = rng.uniform(0.5, 2.0, BATCH).astype(np.float32)
    negatives = Negatives(tf.zeros([0], tf.int64), tf.zeros([0]), tf.constant(positive_log_q))
    inputs = LossInputs(
        tf.constant(queries),
        tf.constant(items[positive_ids]),
        tf.constant(positive_ids, tf.int64),
        (negatives,),
        (tf.zeros([0, DIM]),),
        True,
        tf.constant(weights),
    )
    ours = float(SampledSoftmax(temperature=0.2, num_hard_negatives=hard).compute(inputs))
    task = in_batch_softmax_task(temperature=0.2, remove_accidental_hits=True, num_hard_negatives=hard)
    reference = float(
        task(
            tf.constant(queries),
            tf.constant(items[positive_ids]),
            sample_weight=tf.constant(weights),
            candidate_sampling_probability=tf.exp(tf.constant(positive_log_q)),
            candidate_ids=tf.constant(positive_ids),
            compute_metrics=False,
        )
    )
    assert ours == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_transforms_equal_tfrs_layers(seed):
    rng = np.random.default_rng(seed)
    logits = tf.constant(rng.normal(size=(5, 8)).astype(np.float32))
    labels = tf.constant(np.eye(5, 8, dtype=np.float32))
    ids = tf.constant([1, 2, 1, 4, 2, 6, 7, 1])
    np.testing.assert_allclose(
        remove_accidental_hits(logits, labels, ids),
        tfrs.layers.loss.RemoveAccidentalHits()(labels, logits, ids),
    )
    ours = mine_hard_negatives(logits, labels, 3)
    theirs = tfrs.layers.loss.HardNegativeMining(3)(logits, labels)
    # Same columns kept (top_k unsorted: compare sorted rows).
    np.testing.assert_allclose(np.sort(ours[0], axis=1), np.sort(theirs[0], axis=1))
    np.testing.assert_allclose(ours[1].numpy().sum(axis=1), np.ones(5))
    with pytest.raises(ValueError, match="k must be positive"):
        mine_hard_negatives(logits, labels, 0)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("log_q_weight", [0.0, 1.0])
def test_negative_sampling_equals_numpy(seed, log_q_weight):
    queries, items = _embeddings(seed)
    rng = np.random.default_rng(seed)
    positive_ids = rng.integers(1, NUM_ITEMS + 1, BATCH)
    sampler = uniform_sampler(NUM_ITEMS, 5, seed=seed)
    negatives = sampler.sample(tf.constant(positive_ids, tf.int64))
    ids = negatives.ids.numpy()
    ids[0] = positive_ids[1]  # row 1 has an accidental hit
    negatives = Negatives(tf.constant(ids), negatives.log_q, negatives.positive_log_q)
    ours = NegativeSampling(temperature=0.5, log_q_weight=log_q_weight).per_example(
        _inputs(queries, items, positive_ids, negatives)
    )
    log_q = np.log(5 / NUM_ITEMS) * log_q_weight

    def log_sigmoid(x):
        return -np.logaddexp(0, -x)

    positive = np.sum(queries * items[positive_ids], axis=1) / 0.5 - log_q
    negative = queries @ items[ids].T / 0.5 - log_q
    hit = ids[None, :] == positive_ids[:, None]
    expected = -log_sigmoid(positive) - np.sum(np.where(hit, 0.0, log_sigmoid(-negative)), axis=1)
    np.testing.assert_allclose(ours, expected, rtol=1e-5)


def _skewed_counts(seed, num_items):
    rng = np.random.default_rng(seed)
    return np.r_[0.0, rng.zipf(1.5, num_items).astype(float)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_huffman_probabilities_sum_to_one_for_any_query(seed):
    num_items = 57
    tree = HuffmanTree.from_counts(_skewed_counts(seed, num_items))
    rng = np.random.default_rng(seed)
    loss = HierarchicalSoftmax(tree, DIM, temperature=0.7)
    loss.node_embeddings.assign(rng.normal(size=(num_items - 1, DIM)).astype(np.float32) * 2)
    queries = tf.constant(rng.normal(size=(9, DIM)).astype(np.float32))
    log_p = loss.item_scores(queries).numpy()
    assert np.all(np.isneginf(log_p[:, 0]))  # OOV
    np.testing.assert_allclose(np.exp(log_p[:, 1:]).sum(axis=1), np.ones(9), rtol=1e-5)
    # The exact per-item scores are the training loss's log-probabilities.
    ids = rng.integers(1, num_items + 1, 9)
    np.testing.assert_allclose(
        loss.log_probability(queries, tf.constant(ids, tf.int32)), log_p[np.arange(9), ids], rtol=1e-5
    )


def test_huffman_tree_is_a_huffman_code():
    counts = _skewed_counts(4, 40)
    tree = HuffmanTree.from_counts(counts)
    lengths = tree.path_length()[1:]
    p = counts[1:] / counts[1:].sum()
    entropy = -np.sum(p * np.log2(p))
    # Huffman's bound: H <= expected code length < H + 1; frequent items are never deeper.
    assert entropy <= np.sum(p * lengths) < entropy + 1
    more_frequent = counts[1:, None] > counts[None, 1:]
    assert np.all(lengths[:, None] <= lengths[None, :], where=more_frequent)
    # Every internal node is used; prefix-free codes (each path distinct).
    assert set(np.unique(tree.nodes[1:][tree.signs[1:] != 0])) == set(range(tree.num_internal))
    codes = {tuple(zip(n[s != 0], s[s != 0])) for n, s in zip(tree.nodes[1:], tree.signs[1:])}
    assert len(codes) == 40
    with pytest.raises(ValueError, match="at least 2 items"):
        HuffmanTree.from_counts([0.0, 3.0])


@pytest.mark.parametrize("seed", [0, 1])
def test_hierarchical_gradient_flows_only_through_path_nodes(seed):
    num_items = 33
    tree = HuffmanTree.from_counts(_skewed_counts(seed, num_items))
    loss = HierarchicalSoftmax(tree, DIM)
    rng = np.random.default_rng(seed)
    loss.node_embeddings.assign(rng.normal(size=(num_items - 1, DIM)).astype(np.float32))
    positive_ids = rng.integers(1, num_items + 1, 2)
    queries = tf.constant(rng.normal(size=(2, DIM)).astype(np.float32))
    inputs = LossInputs(
        queries,
        tf.zeros([2, DIM]),
        tf.constant(positive_ids, tf.int64),
        (Negatives(tf.zeros([0], tf.int64), tf.zeros([0]), tf.zeros([2])),),
        (tf.zeros([0, DIM]),),
        True,
    )
    with tf.GradientTape() as tape:
        value = loss.compute(inputs)
    gradient = tf.convert_to_tensor(tape.gradient(value, loss.node_embeddings)).numpy()
    touched = set(np.flatnonzero(np.abs(gradient).sum(axis=1) > 0))
    on_path = set()
    for item in positive_ids:
        on_path |= set(tree.nodes[item][tree.signs[item] != 0].tolist())
    assert touched == on_path
    assert len(on_path) < num_items - 1  # a real restriction, not every node


def _block_cases(seed):
    """LossInputs with duplicate positives, accidental hits, padded columns, own items, per-row draws."""
    rng = np.random.default_rng(seed)
    queries, items = _embeddings(seed)
    positive_ids = rng.integers(1, NUM_ITEMS + 1, BATCH)
    positive_ids[1] = positive_ids[0]  # a repeated positive: an accidental hit among the in-batch columns
    positive_log_q = tf.constant(rng.normal(size=BATCH), tf.float32)
    shared_ids = np.r_[positive_ids[:2], rng.integers(1, NUM_ITEMS + 1, 6)]
    shared_log_q = rng.normal(size=len(shared_ids)).astype(np.float32)
    shared_log_q[-1] = MASKED_LOG_Q  # a padded column
    shared = Negatives(tf.constant(shared_ids, tf.int64), tf.constant(shared_log_q), positive_log_q)
    per_row_ids = rng.integers(1, NUM_ITEMS + 1, (BATCH, 4))
    per_row_ids[:, 0] = positive_ids
    per_row = Negatives(tf.constant(per_row_ids, tf.int64), tf.constant(rng.normal(size=(BATCH, 4)), tf.float32),
                        positive_log_q)
    own = OwnItems(tf.constant(np.c_[positive_ids, rng.integers(1, NUM_ITEMS + 1, BATCH), -np.ones(BATCH)], tf.int64),
                   tf.range(BATCH))
    in_batch = Negatives(tf.zeros([0], tf.int64), tf.zeros([0], tf.float32), positive_log_q)

    def inputs(negatives, includes_batch_positives, own_items=None):
        return LossInputs(
            queries=tf.constant(queries), positives=tf.constant(items[positive_ids]),
            positive_ids=tf.constant(positive_ids, tf.int64), negatives=(negatives,),
            negative_embeddings=(tf.constant(items[negatives.ids.numpy()]),),
            includes_batch_positives=includes_batch_positives, own_items=own_items,
        )

    return {
        "in-batch": inputs(in_batch, True), "in-batch own items": inputs(in_batch, True, own),
        "mixed": inputs(shared, True), "shared": inputs(shared, False), "shared own items": inputs(shared, False, own),
        "per-row": inputs(per_row, False),
    }


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("remove_hits", [True, False])
@pytest.mark.parametrize("case", ["in-batch", "in-batch own items", "mixed", "shared", "shared own items", "per-row"])
def test_the_blockwise_softmax_equals_the_generic_columns_and_their_gradients(seed, remove_hits, case):
    inputs = _block_cases(seed)[case]
    if inputs.own_items is not None and not remove_hits:
        pytest.skip("own items are masked only with remove_accidental_hits")
    loss = SampledSoftmax(temperature=0.3, log_q_weight=0.7, remove_accidental_hits=remove_hits)

    def per_example_and_gradients(per_example):
        with tf.GradientTape() as tape:
            tape.watch([inputs.queries, inputs.positives, inputs.negative_embeddings[0]])
            values = per_example()
        return values, tape.gradient(tf.reduce_sum(values * np.arange(1, BATCH + 1)),
                                     [inputs.queries, inputs.positives, inputs.negative_embeddings[0]])

    blockwise, blockwise_gradients = per_example_and_gradients(lambda: loss.per_example(inputs))
    generic, generic_gradients = per_example_and_gradients(
        lambda: softmax_cross_entropy(*loss.logits_and_labels(inputs)))
    np.testing.assert_allclose(blockwise, generic, rtol=1e-5, atol=1e-5)
    for ours, reference in zip(blockwise_gradients, generic_gradients, strict=True):
        if reference is None:  # the in-batch sampler's empty block
            assert ours is None or tf.size(ours) == 0
            continue
        np.testing.assert_allclose(tf.convert_to_tensor(ours), tf.convert_to_tensor(reference), rtol=1e-4, atol=1e-5)
