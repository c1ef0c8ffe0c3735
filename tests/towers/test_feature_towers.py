"""Feature-tower preprocessing against numpy / pure-Python references."""

import re

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf
from feature_fixtures import ALL_KINDS, small_tables

import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow)
from retrieval.config import ModelConfig
from retrieval.features import TowerStatistics, TowerTables, age_days, feature_arrays, numeric_values
from retrieval.towers import (
    AttentionPooling,
    HashedText,
    IdDropout,
    MaskedMean,
    NormalizedNumber,
    TimestampAge,
    build_towers,
    text_tokens,
)

TEXTS = ["Toy Story (1995)", "GoldenEye", "Café au lait", "", "  a  b_c ", "Twelve Monkeys: 12", "l'amour", "ÉTÉ"]


def _reference_tokens(text: str, trigrams: bool, words: bool) -> list[str]:
    """DSSM word hashing by hand: lower-case, split on non-alphanumerics, '#word#', letter trigrams."""
    marked = [f"#{w}#" for w in re.sub(r"[\W_]+", " ", text.lower()).split()]
    grams = [m[i : i + 3] for m in marked for i in range(len(m) - 2)] if trigrams else []
    return grams + (marked if words else [])


@pytest.mark.parametrize("trigrams, words", [(True, True), (True, False), (False, True)])
def test_text_tokens_match_a_python_reference(trigrams, words):
    tokens = text_tokens(tf.constant(TEXTS), trigrams=trigrams, words=words).to_list()
    expected = [_reference_tokens(text, trigrams, words) for text in TEXTS]
    assert [[t.decode() for t in row] for row in tokens] == expected
    assert expected[0][:3] == (["#to", "toy", "oy#"] if trigrams else ["#toy#", "#story#", "#1995#"])


def test_hashing_is_deterministic_and_the_same_everywhere():
    # FarmHash64 fingerprints: fixed values, so exported models and tables never drift.
    values = tf.constant(["#ca", "cat", "US", ""])
    buckets = tf.strings.to_hash_bucket_fast(values, 1000).numpy().tolist()
    assert buckets == tf.strings.to_hash_bucket_fast(values, 1000).numpy().tolist()
    assert tf.keras.layers.Hashing(1000)(values).numpy().tolist() == buckets
    assert buckets == [222, 96, 835, 263]


def test_hashed_text_is_the_mean_of_its_token_rows_and_zero_without_tokens():
    layer = HashedText(97, 4, trigrams=True, words=True)
    out = layer(tf.constant(TEXTS)).numpy()
    table = layer.embeddings.numpy()
    for text, row in zip(TEXTS, out):
        tokens = _reference_tokens(text, True, True)
        if not tokens:
            np.testing.assert_array_equal(row, 0.0)
            continue
        ids = tf.strings.to_hash_bucket_fast(tf.constant(tokens), 97).numpy()
        np.testing.assert_allclose(row, table[ids].mean(axis=0), rtol=1e-5, atol=1e-7)


def test_normalized_number_matches_pandas():
    values = pd.Series([1.0, np.nan, 5.0, -2.0, 250.0], dtype="float32")
    for log in (False, True):
        transformed = pd.Series(numeric_values(values.to_numpy(), log))
        mean, std = transformed.mean(), transformed.std(ddof=0)
        out = NormalizedNumber(mean, std, log)(tf.constant(values.to_numpy())).numpy()
        np.testing.assert_allclose(out[:, 0], ((transformed - mean) / std).fillna(0.0), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(out[:, 1], values.isna().astype(float))


@pytest.mark.parametrize("unit, values", [("seconds", [1.6e9, np.nan, 1.69e9]), ("days", [18_000.0, 19_000.5]),
                                          ("years", [1995.0, 2001.0, np.nan])])
def test_timestamp_age_matches_numpy(unit, values):
    reference = 1.7e9
    age = age_days(values, unit, reference)
    stats = (np.nanmean(age), np.nanstd(age) or 1.0)
    log_age = np.log1p(np.maximum(age, 0))
    log_stats = (np.nanmean(log_age), np.nanstd(log_age) or 1.0)
    out = TimestampAge(unit, reference, stats, log_stats)(tf.constant(values, tf.float64)).numpy()
    missing = np.isnan(values)
    np.testing.assert_allclose(out[:, 0], np.where(missing, 0, (age - stats[0]) / stats[1]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        out[:, 1], np.where(missing, 0, (log_age - log_stats[0]) / log_stats[1]), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_array_equal(out[:, 2], missing.astype(float))


def test_pooling_ignores_padding_and_attention_starts_as_the_mean():
    rng = np.random.default_rng(0)
    values = rng.normal(size=(3, 4, 5)).astype(np.float32)
    mask = np.array([[True, True, False, False], [False] * 4, [True] * 4])
    mean = MaskedMean()(tf.constant(values), tf.constant(mask)).numpy()
    np.testing.assert_allclose(mean[0], values[0, :2].mean(axis=0), rtol=1e-6)
    np.testing.assert_array_equal(mean[1], 0.0)
    attention = AttentionPooling()
    np.testing.assert_allclose(attention(tf.constant(values), tf.constant(mask)).numpy(), mean, rtol=1e-5, atol=1e-6)
    attention.position_bias.assign([5.0, 0.0, 0.0, 0.0])  # a recency bias moves weight to the first slot
    shifted = attention(tf.constant(values), tf.constant(mask)).numpy()
    assert np.linalg.norm(shifted[2] - values[2, 0]) < np.linalg.norm(mean[2] - values[2, 0])
    np.testing.assert_array_equal(shifted[1], 0.0)


@pytest.fixture(scope="module")
def towers():
    clicks, users, items = small_tables(0)
    tables = TowerTables(ALL_KINDS, clicks, users, items)
    stats = TowerStatistics.fit(ALL_KINDS, tables.examples(), tables.reference_time)
    tf.keras.utils.set_random_seed(0)
    query, doc = build_towers(ALL_KINDS, ModelConfig(embedding_dim=8), stats)
    return tables, stats, query, doc


def test_towers_declare_exactly_the_configured_raw_inputs(towers):
    _, _, query, doc = towers
    assert sorted(query.input_names) == sorted(ALL_KINDS.query.input_names)
    assert sorted(doc.input_names) == sorted(ALL_KINDS.doc.input_names)
    dtypes = {name: tensor.dtype for name, tensor in zip(query.input_names, query.inputs)}
    assert dtypes == {"user_id": tf.string, "age": tf.float32, "zip": tf.string, "country": tf.string,
                      "signup": tf.float64, "history": tf.string}


def test_split_and_prefix_layers_transform_the_raw_strings(towers):
    _, _, query, doc = towers
    # tags: separator "|", max_values 3: the first three kept, "" padded.
    split = doc.get_layer("tags_split")(tf.constant(["c|a|b|d", "", "a"])).numpy().astype(str)
    assert split.tolist() == [["c", "a", "b"], ["", "", ""], ["a", "", ""]]
    prefix = query.get_layer("zip_prefix")(tf.constant(["10001", "9", "", "941ü5"])).numpy()
    assert [p.decode() for p in prefix] == ["100", "9", "", "941"]


def _tower_inputs(tower, frame):
    return {name: tf.constant(values) for name, values in feature_arrays(frame, tower.input_names).items()}


def test_every_raw_input_changes_the_embedding(towers):
    # A feature the tower declares but drops on the way (a wiring slip) leaves the output unchanged.
    tables, _, query, doc = towers
    users = [f"u{i}" for i in range(6)]
    for tower, frame in ((doc, tables.catalogue()), (query, tables.queries(users))):
        inputs = _tower_inputs(tower, frame)
        base = tower(inputs, training=False).numpy()
        for name in tower.input_names:
            shuffled = dict(inputs, **{name: tf.reverse(inputs[name], axis=[0])})
            moved = np.abs(tower(shuffled, training=False).numpy() - base).max()
            assert moved > 1e-3, f"{name} does not reach the {tower.name} output"


def test_lookups_follow_the_training_vocabulary_with_oov(towers):
    _, stats, query, doc = towers
    zips = tf.constant(["10001", "94199", "99999", ""])  # prefixes 100, 941 known; 999 and "" are OOV
    ids = query.get_layer("zip_lookup")(query.get_layer("zip_prefix")(zips)).numpy()
    vocabulary = list(stats["zip"].ids)
    assert ids.tolist() == [vocabulary.index("100") + 1, vocabulary.index("941") + 1, 0, 0]
    genres = doc.get_layer("genres_lookup")(tf.constant([["Drama", "Nope"]])).numpy()
    assert genres.tolist() == [[list(stats["genres"].ids).index("Drama") + 1, 0]]


def test_history_shares_the_doc_item_embedding(towers):
    _, _, query, doc = towers
    assert query.get_layer("item_id_embedding") is doc.get_layer("item_id_embedding")
    shared = {id(v) for v in query.trainable_variables} & {id(v) for v in doc.trainable_variables}
    assert len(shared) == 1


def test_multi_values_are_the_mean_of_their_rows(towers):
    tables, stats, _, doc = towers
    catalogue = tables.catalogue()
    arrays = feature_arrays(catalogue, ["genres"])
    pooled = tf.keras.Model(doc.input, doc.get_layer("genres_mean").output)
    out = pooled({name: feature_arrays(catalogue, [name])[name] for name in doc.input_names}).numpy()
    table = doc.get_layer("genres_embedding").embeddings.numpy()
    vocabulary = list(stats["genres"].ids)
    for row, values in zip(out, arrays["genres"]):
        ids = [vocabulary.index(v) + 1 if v in vocabulary else 0 for v in values if v != ""]
        np.testing.assert_allclose(row, table[ids].mean(axis=0) if ids else 0.0, rtol=1e-5, atol=1e-7)


def test_id_dropout_sends_ids_to_the_oov_row_only_in_training():
    ids = tf.constant(np.arange(1, 2001, dtype=np.int64))
    layer = IdDropout(0.3)
    np.testing.assert_array_equal(layer(ids, training=False).numpy(), ids.numpy())
    dropped = layer(ids, training=True).numpy()
    assert set(np.unique(dropped[dropped != ids.numpy()])) == {0}
    assert 0.25 < np.mean(dropped == 0) < 0.35
