"""SASRec's block layout, the unprojected towers and the full cross-entropy at every position.

The ``sasrec`` encoder is checked against the reference code's forward pass written again in numpy
from its weights; causality and padding by changing what a state must not see; the towers without
a projection against the item table; the loss against a numpy cross-entropy over the catalogue.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

import retrieval  # noqa: F401
from retrieval.config import ConfigError, LossConfig, ModelConfig, TowersConfig, load_config
from retrieval.features import FeatureStatistics, TowerStatistics
from retrieval.features.histories import ClickHistories
from retrieval.model import build_model
from retrieval.towers import build_towers, position_states
from retrieval.towers.layers import CausalSequenceEncoder
from retrieval.training import SequenceClicks

LENGTH, DIM = 5, 8


def _layer_norm(x, layer):
    gamma, beta = (w.numpy() for w in layer.weights)
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + layer.epsilon) * gamma + beta


def _reference_sasrec(encoder: CausalSequenceEncoder, embeddings: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """SASRec+'s forward pass (its PyTorch port of SASRec) in numpy, one sequence at a time: the items
    in time order *right*-padded, position i the i-th item from the oldest, a causal mask and no
    padding mask (a real position never sees the padding after it); inputs and output newest first
    as the layer's."""
    out = np.zeros_like(embeddings)
    for row in range(len(embeddings)):
        keep = mask[row].astype(bool)
        n = int(keep.sum())
        items = embeddings[row, :n][::-1]  # oldest first
        x = np.zeros((LENGTH, DIM), np.float32)
        x[:n] = items * np.sqrt(DIM) + encoder.positions.numpy()[:n]
        real = np.arange(LENGTH) < n
        for attention, (inner, outer), (attention_norm, feed_norm) in zip(
            encoder.attention, encoder.feed_forward, encoder.norms, strict=True
        ):
            wq, bq, wk, bk, wv, bv, wo, bo = (w.numpy() for w in attention.weights)
            q = attention_norm_x = _layer_norm(x, attention_norm)
            heads = wq.shape[1]
            mixed = np.zeros_like(x)
            for h in range(heads):
                queries = q @ wq[:, h] + bq[h]
                keys, values = x @ wk[:, h] + bk[h], x @ wv[:, h] + bv[h]
                scores = queries @ keys.T / np.sqrt(queries.shape[-1])
                scores = np.where(np.tril(np.ones((LENGTH, LENGTH), bool)), scores, -1e30)
                weights = np.exp(scores - scores.max(-1, keepdims=True))
                weights = weights / weights.sum(-1, keepdims=True)
                mixed += (weights @ values) @ wo[h]
            x = attention_norm_x + mixed + bo  # the residual from the normalised query
            h_in = _layer_norm(x, feed_norm)
            w1, b1 = (w.numpy() for w in inner.weights)
            w2, b2 = (w.numpy() for w in outer.weights)
            x = h_in + np.maximum(h_in @ w1 + b1, 0) @ w2 + b2
            x = x * real[:, None]
        states = _layer_norm(x, encoder.final_norm)[:n]
        out[row, :n] = states[::-1]  # newest first, the padding after
    return out


def _encoder_inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    embeddings = rng.normal(size=(3, LENGTH, DIM)).astype(np.float32)
    mask = np.ones((3, LENGTH), bool)
    mask[1, 3:] = False  # newest first: a short history is padded at the end
    mask[2, 1:] = False
    return embeddings, mask


def test_the_sasrec_layout_is_the_reference_forward_pass_and_its_newest_state_the_same():
    tf.keras.utils.set_random_seed(0)
    encoder = CausalSequenceEncoder(LENGTH, blocks=2, heads=2, dropout=0.1, layout="sasrec")
    embeddings, mask = _encoder_inputs()
    out = encoder(tf.constant(embeddings), tf.constant(mask), training=False).numpy()
    np.testing.assert_allclose(out, _reference_sasrec(encoder, embeddings, mask), atol=1e-4)
    newest = encoder(tf.constant(embeddings), tf.constant(mask), training=False, newest_only=True).numpy()
    np.testing.assert_allclose(newest[:, 0], out[:, 0], atol=1e-5)
    # The default block is another function of the same weights (it is not the reference's).
    pre_norm = CausalSequenceEncoder(LENGTH, blocks=2, heads=2, dropout=0.1)
    pre_norm(tf.constant(embeddings), tf.constant(mask))
    pre_norm.set_weights(encoder.get_weights())
    assert not np.allclose(pre_norm(tf.constant(embeddings), tf.constant(mask)).numpy(), out, atol=1e-3)


def test_a_sasrec_state_ignores_later_items_and_whatever_sits_in_the_padding():
    tf.keras.utils.set_random_seed(0)
    encoder = CausalSequenceEncoder(LENGTH, blocks=2, heads=1, dropout=0.1, layout="sasrec")
    embeddings, mask = _encoder_inputs(1)
    out = encoder(tf.constant(embeddings), tf.constant(mask), training=False).numpy()
    for p in range(LENGTH - 1):  # newest first: position p is later than p + 1, p + 2, ...
        changed = embeddings.copy()
        changed[:, p] += 1.0
        again = encoder(tf.constant(changed), tf.constant(mask), training=False).numpy()
        np.testing.assert_allclose(again[0, p + 1:], out[0, p + 1:], atol=1e-5)
        assert not np.allclose(again[0, : p + 1], out[0, : p + 1], atol=1e-3)
    padded = embeddings.copy()
    padded[~mask] = 7.0  # the padding's values are never read
    np.testing.assert_allclose(encoder(tf.constant(padded), tf.constant(mask), training=False).numpy(), out,
                               atol=1e-6)
    assert np.all(out[~mask] == 0)


def test_an_unknown_layout_is_refused_by_name():
    with pytest.raises(ValueError, match="layout must be one of pre_norm, sasrec, got 'post_norm'"):
        CausalSequenceEncoder(LENGTH, blocks=1, heads=1, dropout=0.0, layout="post_norm")
    with pytest.raises(ConfigError, match="layout"):
        load_config(None, ["towers.query.history.pooling=transformer", "towers.query.history.transformer.layout=x"])


SASREC_TOWERS = TowersConfig.model_validate({
    "query": {"features": [], "mlp": {"projection": False},
              "history": {"length": LENGTH, "pooling": "transformer",
                          "transformer": {"blocks": 2, "heads": 1, "dropout": 0.1, "layout": "sasrec"}}},
    "doc": {"features": [{"name": "item_id", "kind": "id"}], "mlp": {"projection": False}},
})


def _clicks(seed: int = 3, users: int = 12, items: int = 15) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = [(f"u{u}", f"i{rng.integers(items)}", t) for u in range(users) for t in range(rng.integers(1, 10))]
    frame = pd.DataFrame(rows, columns=["user_id", "item_id", "timestamp"])
    frame["weight"] = np.float32(1.0)
    return frame


def _sasrec_model(clicks: pd.DataFrame):
    stats = FeatureStatistics.from_training_clicks(clicks)
    tf.keras.utils.set_random_seed(0)
    config = ModelConfig(embedding_dim=DIM, normalize=False, temperature=1.0,
                         loss=LossConfig(kind="full_softmax", log_q_source="static"))
    statistics = TowerStatistics.fit(SASREC_TOWERS, clicks.assign(history=""), None)
    return build_model(config, stats, towers=build_towers(SASREC_TOWERS, config, statistics)), stats


def test_without_projections_an_item_is_its_row_of_the_table_the_history_reads():
    model, stats = _sasrec_model(_clicks())
    items = list(stats.items.ids)
    table = model.doc_tower.get_layer("item_id_embedding").get_weights()[0]
    np.testing.assert_array_equal(model.doc_tower({"item_id": tf.constant(items)}).numpy(),
                                  table[model.item_index(tf.constant(items)).numpy()])
    assert not [layer for layer in model.query_tower.layers + model.doc_tower.layers
                if isinstance(layer, tf.keras.layers.Dense) and layer.name == "projection"]
    # The query is the encoder's final state of the shared table's rows, unprojected and unnormalised.
    encoder = next(layer for layer in model.query_tower.layers if isinstance(layer, CausalSequenceEncoder))
    history = np.array([[items[2], items[0], items[5], "", ""]], dtype=object)
    rows = model.item_index(tf.constant(history.ravel())).numpy().reshape(history.shape)
    state = encoder(tf.constant(table[rows]), tf.constant(history != ""), training=False).numpy()[:, 0]
    np.testing.assert_allclose(model.query_tower({"history": tf.constant(history)}).numpy(), state, atol=1e-5)


def test_no_projection_needs_no_hidden_layers_and_an_encoding_of_the_output_width():
    with pytest.raises(ConfigError, match=r"mlp.projection=false outputs the encoding itself.*mlp.widths=\[16\]"):
        load_config(None, ["towers.query.mlp.widths=[16]", "towers.query.mlp.projection=false"])
    towers = TowersConfig.model_validate({
        "query": {"features": [{"name": "user_id", "kind": "id", "embedding_dim": 4}], "mlp": {"projection": False}},
        "doc": {"features": [{"name": "item_id", "kind": "id"}]},
    })
    clicks = _clicks()
    config = ModelConfig(embedding_dim=DIM)
    with pytest.raises(ValueError, match="query_tower: mlp.projection=false .* 4 wide, but model.embedding_dim is 8"):
        build_towers(towers, config, TowerStatistics.fit(towers, clicks, None))


def test_the_full_softmax_at_every_position_is_the_cross_entropy_over_the_catalogue():
    clicks = _clicks()
    model, stats = _sasrec_model(clicks)
    users, items = pd.Index(stats.users.ids), pd.Index(stats.items.ids)
    histories = ClickHistories(users.get_indexer(clicks["user_id"]), items.get_indexer(clicks["item_id"]),
                               clicks["timestamp"].to_numpy(), stats.users.ids, stats.items.ids)
    batch = next(iter(SequenceClicks(histories, "history", LENGTH, batch_size=8, seed=0).epoch(0)))
    loss = float(model.compute_loss(batch, training=False))
    per_position = position_states(model.query_tower).model({"history": batch["history"]}, training=False).numpy()
    targets = batch["item_id"].numpy().astype(str)
    trained = targets != ""
    catalogue = model.doc_tower({"item_id": tf.constant(list(stats.items.ids))}).numpy()
    logits = per_position[trained] @ catalogue.T  # raw dot products, temperature 1
    positive = items.get_indexer(targets[trained])
    log_softmax = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - logits.max(1, keepdims=True)
    expected = -log_softmax[np.arange(len(positive)), positive].mean()
    assert trained.sum() > 8 and (~trained).any()  # more positions than sequences, and padded ones skipped
    assert loss == pytest.approx(expected, rel=1e-5)


def _same_weights_longer(encoder: CausalSequenceEncoder, length: int, embeddings, mask) -> CausalSequenceEncoder:
    """An encoder of ``length`` positions with ``encoder``'s weights, its first positions ``encoder``'s."""
    longer = CausalSequenceEncoder(length, blocks=encoder.blocks, heads=encoder.heads, dropout=encoder.dropout,
                                   layout=encoder.layout)
    pad = np.zeros((len(embeddings), length - encoder.length, DIM), np.float32)
    longer(tf.constant(np.concatenate([embeddings, pad], 1)),
           tf.constant(np.concatenate([mask, np.zeros(pad.shape[:2], bool)], 1)))
    weights = encoder.get_weights()
    positions = np.random.default_rng(5).normal(size=(length, DIM)).astype(np.float32)
    positions[: encoder.length] = weights[0]
    longer.set_weights([positions, *weights[1:]])
    return longer


def test_a_sasrec_history_is_numbered_from_its_oldest_item_so_the_padding_moves_nothing():
    """SASRec+'s port right-pads: a user's oldest item is position 0 and the newest position n - 1,
    however long the window. The same history in a window of 5 or of 9 positions (the first 5 alike)
    has the same states; the pre_norm layout numbers from the window's start (the newest item at
    the last position), so there the padding moves every item."""
    tf.keras.utils.set_random_seed(0)
    embeddings, mask = _encoder_inputs(2)
    pad = np.zeros((len(embeddings), 4, DIM), np.float32)
    wide_embeddings = np.concatenate([embeddings, pad + 3.0], 1)  # whatever sits in the padding
    wide_mask = np.concatenate([mask, np.zeros(pad.shape[:2], bool)], 1)
    for layout, invariant in (("sasrec", True), ("pre_norm", False)):
        encoder = CausalSequenceEncoder(LENGTH, blocks=2, heads=1, dropout=0.1, layout=layout)
        out = encoder(tf.constant(embeddings), tf.constant(mask), training=False).numpy()
        longer = _same_weights_longer(encoder, LENGTH + 4, embeddings, mask)
        wide = longer(tf.constant(wide_embeddings), tf.constant(wide_mask), training=False).numpy()
        assert np.allclose(wide[:, :LENGTH], out, atol=1e-5) == invariant, layout
    # The one-item history (row 2) is its item at position 0: the layer's first rows in numpy.
    encoder = CausalSequenceEncoder(LENGTH, blocks=1, heads=1, dropout=0.0, layout="sasrec")
    out = encoder(tf.constant(embeddings), tf.constant(mask), training=False).numpy()
    np.testing.assert_allclose(out[2], _reference_sasrec(encoder, embeddings, mask)[2], atol=1e-4)
    alone = embeddings[2:3].copy()
    positions = encoder.positions.numpy()
    encoder.positions.assign(np.roll(positions, 1, axis=0))  # another position 0: another state
    assert not np.allclose(encoder(tf.constant(alone), tf.constant(mask[2:3]), training=False).numpy()[0, 0],
                           out[2, 0], atol=1e-3)


def test_the_sasrec_layout_starts_from_the_reference_initialisation():
    """SASRec+'s reference initialises every nn.Linear / Conv1d kernel and every embedding normal(0, 0.02)
    and every bias at zero; nn.MultiheadAttention's fused [3 dim, dim] input projection keeps PyTorch's
    Xavier-uniform, bound sqrt(6 / (dim + 3 dim)). The moments of each weight at d = 64 against those."""
    dim, length = 64, 50
    tf.keras.utils.set_random_seed(0)
    encoder = CausalSequenceEncoder(length, blocks=2, heads=1, dropout=0.1, layout="sasrec")
    encoder(tf.zeros([1, length, dim]), tf.ones([1, length], bool))
    bound = np.sqrt(6.0 / (dim + 3 * dim))
    positions = encoder.positions.numpy()
    assert positions.std() == pytest.approx(0.02, rel=0.05) and np.abs(positions).max() > 2.5 * 0.02  # untruncated
    kernels = {}
    for weight in encoder.weights:
        name, values = weight.name.split("/", 1)[1].split(":")[0], weight.numpy()
        if name.endswith("bias") or name.endswith("beta"):
            assert not values.any(), name
        elif name.endswith(("query/kernel", "key/kernel", "value/kernel")):
            assert np.abs(values).max() <= bound and np.abs(values).max() > 0.98 * bound, name
            assert values.std() == pytest.approx(bound / np.sqrt(3), rel=0.05), name
            kernels[name] = values
        elif name.endswith("kernel"):  # the attention output and the feed-forward layers
            assert values.std() == pytest.approx(0.02, rel=0.05) and abs(values.mean()) < 0.002, name
            kernels[name] = values
    assert len(kernels) == 2 * 6
    flat = [k.ravel()[:100] for k in kernels.values()]
    assert len({tuple(np.round(f, 6)) for f in flat}) == len(flat)  # no two layers drawn alike
    # The default layout keeps Keras' Glorot-uniform, which reads a [64, 1, 64] query kernel's fans
    # as (64, 4096): a bound of sqrt(6 / 4160).
    default = CausalSequenceEncoder(length, blocks=1, heads=1, dropout=0.1)
    default(tf.zeros([1, length, dim]), tf.ones([1, length], bool))
    query = default.attention[0].weights[0].numpy()
    assert np.abs(query).max() == pytest.approx(np.sqrt(6.0 / (dim + dim * dim)), rel=0.02)


def test_normal_embedding_init_draws_the_tables_normal_with_the_out_of_vocabulary_row_at_zero():
    clicks = _clicks(items=4000, users=400)
    stats = FeatureStatistics.from_training_clicks(clicks)
    tables = {}
    for init in ("uniform", "normal"):
        config = ModelConfig(embedding_dim=DIM, normalize=False, temperature=1.0, embedding_init=init,
                             loss=LossConfig(kind="full_softmax", log_q_source="static"))
        statistics = TowerStatistics.fit(SASREC_TOWERS, clicks.assign(history=""), None)
        model = build_model(config, stats, towers=build_towers(SASREC_TOWERS, config, statistics))
        tables[init] = model.doc_tower.get_layer("item_id_embedding").get_weights()[0]
        assert not tables[init][0].any()
    rows = tables["normal"][1:]
    assert rows.std() == pytest.approx(0.02, rel=0.05) and np.abs(rows).max() > 0.05
    assert np.abs(tables["uniform"][1:]).max() <= 0.05
    assert tables["uniform"][1:].std() == pytest.approx(0.1 / np.sqrt(12), rel=0.05)
    with pytest.raises(ConfigError, match="embedding_init"):
        load_config(None, ["model.embedding_init=xavier"])
