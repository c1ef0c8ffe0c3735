"""Items similar to an item, from a bundle: ``Bundle.similar_items`` against brute force over the item
embeddings, on Flat, HNSW, IVF and IVF-PQ indexes; never-clicked items; ``POST /similar``; the CLI."""

import json

import faiss
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_feature_export import bundle  # noqa: F401  (the module fixture: a feature-tower bundle)
from test_service import NUM_ITEMS, _fixed_id_tower, _unit, call, world  # noqa: F401  (the module fixture)

import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow)
from retrieval import serving
from retrieval.bundle.writer import write_bundle
from retrieval.config import IndexConfig
from retrieval.index import ItemIndex, build_index
from retrieval.serving.bundle import Bundle, RequestError
from retrieval.serving.http import MAX_K, create_app
from retrieval.serving.integrity import same_top_k as _same_top_k

EXAMPLES = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def brute_force(embeddings, item_ids, item, k, exclude=()):
    """(ids, scores) of the k rows of ``embeddings`` [n, dim] nearest ``item``'s row by inner product,
    the item itself and ``exclude`` left out: a full numpy sort."""
    row = list(item_ids).index(item)
    scores = embeddings @ embeddings[row]
    keep = [r for r in np.argsort(-scores, kind="stable") if r != row and item_ids[r] not in set(exclude)][:k]
    return [item_ids[r] for r in keep], scores[keep]


def assert_brute_force(served, embeddings, item_ids, item, k, exclude=(), rtol=1e-5):
    """``served`` is the brute-force top-k: scores position by position, ids up to the order of scores
    equal within float32 rounding (FAISS and numpy sum the products in another order)."""
    ids, scores = brute_force(embeddings, item_ids, item, k, exclude)
    np.testing.assert_allclose(served.scores, scores, rtol=rtol, atol=rtol / 10)
    assert _same_top_k(ids, scores, served.item_ids, served.scores), (served.item_ids, ids)


@pytest.fixture(scope="module")
def flat(world):  # noqa: F811
    return Bundle.load(world["bundle-a"])


@pytest.fixture(scope="module")
def hnsw(world):  # noqa: F811
    return Bundle.load(world["bundle-b"])


@pytest.fixture(scope="module")
def ivf(world, tmp_path_factory):  # noqa: F811
    """Bundles over the world's towers under IVF4,Flat and IVF4,PQ16x4, each probing every list, so that
    their search is exhaustive over what they hold; and IVF4,Flat tuned as the job tunes it."""
    root = tmp_path_factory.mktemp("ivf")
    query_tower = _fixed_id_tower("user_id", world["user_ids"], world["users"])
    doc_tower = _fixed_id_tower("item_id", world["item_ids"], world["items"])
    configs = {
        "ivf-flat": IndexConfig(factory="IVF4,Flat", search_params="nprobe=4"),
        "ivf-pq": IndexConfig(factory="IVF4,PQ16x4", search_params="nprobe=4"),
        "ivf-tuned": IndexConfig(factory="IVF4,Flat", tune_k=10),
    }
    bundles = {}
    for name, config in configs.items():
        index = build_index(world["item_ids"], world["items"], config, world["users"], "test users")
        (root / name).mkdir()
        write_bundle(root / name, query_tower=query_tower, doc_tower=doc_tower, index=index,
                     manifest={"run": name, "popular_item_ids": world["popular"]})
        bundles[name] = Bundle.load(root / name)
    return bundles


def test_similar_items_equal_brute_force_over_the_item_embeddings(world, flat):  # noqa: F811
    items, ids = world["items"], world["item_ids"]
    for item in ["item000", "item123", "item299"]:
        served = flat.similar_items(item, k=10)
        assert_brute_force(served, items, ids, item, 10)
        assert served.fallback is None
    # The vector searched is the doc tower's embedding of the item, read back from the index.
    np.testing.assert_array_equal(flat.index.vectors([123, 0]), items[[123, 0]])


@EXAMPLES
@given(
    item=st.integers(0, NUM_ITEMS - 1),
    k=st.integers(1, NUM_ITEMS + 5),
    excluded=st.lists(st.integers(0, NUM_ITEMS - 1), max_size=40),
    self_excluded=st.booleans(),
    unknown_excluded=st.booleans(),
)
def test_never_the_item_itself_nor_an_excluded_one_and_k_while_the_catalogue_has_them(
    world, flat, hnsw, item, k, excluded, self_excluded, unknown_excluded  # noqa: F811
):
    ids = world["item_ids"]
    exclude = [ids[r] for r in excluded] + [ids[item]] * self_excluded + ["not-in-catalogue"] * unknown_excluded
    left = NUM_ITEMS - len({*excluded, item})
    for served_by in (flat, hnsw):
        served = served_by.similar_items(ids[item], k, exclude_item_ids=exclude)
        assert ids[item] not in served.item_ids and not set(exclude) & set(served.item_ids)
        assert len(served.item_ids) == len(set(served.item_ids)) == min(k, left)
    assert_brute_force(flat.similar_items(ids[item], k, exclude_item_ids=exclude), world["items"], ids, ids[item],
                       k, exclude)


def test_batch_equals_one_item_at_a_time(world, flat):  # noqa: F811
    asked = ["item010", "item200", "item010"]
    excluded = [["item011"], [], ["item012", "item013"]]
    batch = flat.similar_items_batch(asked, 7, excluded)
    assert batch == [flat.similar_items(item, 7, exclude_item_ids=ex) for item, ex in zip(asked, excluded)]
    assert flat.similar_items_batch([], 7) == []


def test_ivf_indexes_read_their_vectors_back_through_a_direct_map(world, ivf):  # noqa: F811
    items, ids = world["items"], world["item_ids"]
    exact = ivf["ivf-flat"]
    inner = faiss.extract_index_ivf(exact.index.index)
    assert inner.direct_map.no()  # as loaded: FAISS cannot reconstruct yet
    for item in ["item005", "item250"]:
        assert_brute_force(exact.similar_items(item, k=10), items, ids, item, 10)
    assert not inner.direct_map.no()
    np.testing.assert_array_equal(exact.index.vectors(np.arange(NUM_ITEMS)), items)

    # Tuned nprobe (not every list): approximate, but never the item, always k items, mostly the exact ones.
    tuned = ivf["ivf-tuned"]
    assert tuned.index.search_params.startswith("nprobe=")
    found = 0
    for item in ids[::30]:
        served = tuned.similar_items(item, k=10, exclude_item_ids=[ids[0]])
        assert item not in served.item_ids and ids[0] not in served.item_ids and len(served.item_ids) == 10
        found += len(set(served.item_ids) & set(brute_force(items, ids, item, 10, [ids[0]])[0]))
    assert found >= 0.8 * 10 * len(ids[::30])


def test_a_lossy_code_searches_its_decoded_vectors(world, ivf):  # noqa: F811
    items, ids = world["items"], world["item_ids"]
    pq = ivf["ivf-pq"]
    decoded = pq.index.vectors(np.arange(NUM_ITEMS))
    assert 1e-3 < np.abs(decoded - items).max() < 0.5  # approximate: PQ codes, not the embeddings
    for item in ["item005", "item250"]:
        served = pq.similar_items(item, k=10)
        assert_brute_force(served, decoded, ids, item, 10, rtol=1e-4)
        assert len(set(served.item_ids) & set(brute_force(items, ids, item, 10)[0])) >= 6


@pytest.fixture(scope="module")
def id_tower_cold(tmp_path_factory):
    """A bundle as the job exports an ID-only model: the doc tower's vocabulary is the clicked items, and the
    catalogue's never-clicked items ("cold0", "cold1") sit at its all-zero out-of-vocabulary row."""
    rng = np.random.default_rng(3)
    centres = rng.normal(size=(4, 8))
    clicked = [f"item{i:02d}" for i in range(40)]
    catalogue = clicked + ["cold0", "cold1"]
    vectors = _unit(rng, len(clicked), centres)
    doc_tower = _fixed_id_tower("item_id", clicked, vectors)
    embeddings = doc_tower.predict({"item_id": np.array(catalogue)}, verbose=0)
    assert not embeddings[-2:].any()
    directory = tmp_path_factory.mktemp("cold") / "bundle"
    directory.mkdir()
    popular = ["item07", "cold1", "item03", "item09", "item01"]
    write_bundle(directory, query_tower=_fixed_id_tower("user_id", ["u0"], vectors[:1]), doc_tower=doc_tower,
                 index=ItemIndex.build(catalogue, embeddings), manifest={"run": "cold", "popular_item_ids": popular})
    return Bundle.load(directory)


def test_an_item_at_the_zero_row_gets_the_popular_items(id_tower_cold):
    served = id_tower_cold.similar_items("cold1", k=3, exclude_item_ids=["item03"])
    # Not itself, not the excluded one: the most popular of the others, said to be a fallback.
    assert served.item_ids == ["item07", "item09", "item01"]
    assert served.scores == [None] * 3 and served.fallback == "popular"
    assert id_tower_cold.similar_items("item05", k=3).fallback is None


@pytest.mark.slow  # the feature-tower bundle of test_feature_export (~10-30 s)
def test_a_never_clicked_item_of_a_feature_tower_gets_its_neighbours(bundle):  # noqa: F811
    directory, tables, _, _, catalogue, embeddings = bundle
    ids = catalogue["item_id"].tolist()
    assert sorted(set(ids) - set(tables.train["item_id"])) == ["i7"]  # embedded from its features only
    served = Bundle.load(directory).similar_items("i7", k=3)
    assert_brute_force(served, embeddings, ids, "i7", 3)
    assert served.fallback is None


@pytest.mark.parametrize(
    "item, k, message",
    [
        ("nope", 10, "item id 'nope' is not in the catalogue of bundle 'bundle-a' (300 items)"),
        ("", 10, "item id '' is not in the catalogue"),
        (7, 10, "item id '7' is not in the catalogue"),  # an int id is its decimal string, as for users
        (7.0, 10, "item_id must be an id (a string or an integer), got 7.0"),
        ("item001", 0, "k must be at least 1, got 0"),
        ("item001", -3, "got -3"),
        ("item001", "10", "k must be an integer (the number of items to return), got '10'"),
        ("item001", True, "got True"),
        ("item001", 2.5, "got 2.5"),
    ],
)
def test_unknown_items_and_bad_k_are_one_line_errors(flat, item, k, message):
    with pytest.raises(RequestError) as info:
        flat.similar_items(item, k)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_http_answers_as_the_python_call(world, flat):  # noqa: F811
    app = create_app(flat)
    response = call(app, "POST", "/similar", json={"item_id": "item042", "k": 5, "exclude_item_ids": ["item001"]})
    assert response.status_code == 200, response.text
    direct = flat.similar_items("item042", 5, exclude_item_ids=["item001"])
    assert response.json() == {"bundle": "bundle-a", "item_id": "item042", "item_ids": direct.item_ids,
                               "scores": pytest.approx(direct.scores), "fallback": None}
    # k defaults to 10, as for /recommend.
    assert call(app, "POST", "/similar", json={"item_id": "item042"}).json()["item_ids"] == (
        flat.similar_items("item042", 10).item_ids
    )


@pytest.mark.parametrize(
    "kwargs, status, reason",
    [
        ({"json": {"item_id": "nope"}}, 422, "item id 'nope' is not in the catalogue of bundle 'bundle-a'"),
        ({"json": {"item_id": "item001", "k": 0}}, 422, "k: k must be at least 1, got 0"),
        ({"json": {"item_id": "item001", "k": MAX_K + 1}}, 422, f"k: k must be at most {MAX_K} over HTTP"),
        ({"json": {"item_id": "item001", "k": "10"}}, 422, "k: k must be an integer"),
        ({"json": {"item_id": "item001", "k": True}}, 422, "k: k must be an integer"),
        ({"json": {"item_id": 1}}, 422, "item id '1' is not in the catalogue"),  # an int id reads as "1"
        ({"json": {"item_id": 1.5}}, 422, "item_id: item_id must be an id (a string or an integer), got 1.5"),
        ({"json": {"k": 3}}, 422, "item_id: Field required"),
        ({"json": {"item_id": "item001", "top": 3}}, 422, "top: unknown field"),
        ({"json": {"item_id": "item001", "exclude_item_ids": "item002"}}, 422, "exclude_item_ids"),
        ({"json": {"item_id": "item001", "exclude_item_ids": [["item002"]]}}, 422, "exclude_item_ids[0] must be an id"),
        ({"json": {"item_id": "item001", "exclude_item_ids": ["x"] * 10_001}}, 422, "exclude_item_ids"),
        ({"content": b"{not json"}, 400, "not valid JSON"),
        ({"json": ["item001"]}, 400, "must be a JSON object"),
        ({"content": json.dumps({"item_id": "u" * 100_000}).encode()}, 413, "request body over"),
    ],
)
def test_bad_similar_requests_get_4xx_with_a_reason(flat, kwargs, status, reason):
    from retrieval.serving.http import ServiceLimits

    response = call(create_app(flat, limits=ServiceLimits(max_body_bytes=96 * 1024)), "POST", "/similar", **kwargs)
    assert response.status_code == status, response.text
    assert reason in response.json()["error"]


def test_cli_prints_similar_items_as_recommendations_print(world, flat, capsys):  # noqa: F811
    status = serving.main(["--bundle", str(world["bundle-a"]), "--similar", "item003", "--similar", "item004",
                           "-k", "4", "--exclude", "item005"])
    assert status == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["item_id"] for line in lines] == ["item003", "item004"]
    for line in lines:
        direct = flat.similar_items(line["item_id"], 4, exclude_item_ids=["item005"])
        assert line["item_ids"] == direct.item_ids and line["fallback"] is None
        assert line["scores"] == pytest.approx(direct.scores)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--similar", "nope"], "error: item id 'nope' is not in the catalogue of bundle 'bundle-a' (300 items)\n"),
        (["--similar", "item003", "--include-seen"], "error: --include-seen applies to --user-id queries"),
        (["--similar", "item003", "-k", "0"], "error: -k must be at least 1, got 0\n"),
    ],
)
def test_cli_errors_are_one_line(world, capsys, flags, message):  # noqa: F811
    assert serving.main(["--bundle", str(world["bundle-a"]), *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(message) and captured.err.count("\n") == 1


def test_cli_asks_for_a_user_or_an_item_not_both(world, capsys):  # noqa: F811
    for flags in ([], ["--user-id", "user01", "--similar", "item003"]):
        with pytest.raises(SystemExit) as info:
            serving.main(["--bundle", str(world["bundle-a"]), *flags])
        assert info.value.code == 2
    assert "one of the arguments --user-id --similar --users is required" in capsys.readouterr().err


def test_an_index_that_cannot_give_back_its_vectors_says_so():
    flat = faiss.IndexIDMap(faiss.IndexFlatIP(4))  # FAISS's IDMap has no reconstruct
    flat.add_with_ids(np.eye(4, dtype=np.float32), np.arange(4))
    index = ItemIndex(flat, ["a", "b", "c", "d"], "IDMap,Flat")
    with pytest.raises(ValueError, match=r"^index.factory 'IDMap,Flat' cannot give back its vectors "
                                         r"\(reconstruct not implemented for this type of index\); re-index"):
        index.vectors([1])
    with pytest.raises(ValueError, match=r"row 4 is not in the index \(rows 0..3\)"):
        index.vectors([0, 4])
