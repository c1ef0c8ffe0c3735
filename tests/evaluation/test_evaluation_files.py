"""Given test files: the "uid iid iid ..." (user-items) format, end to end through build_eval_set."""

import zlib

import numpy as np
import pandas as pd
import pytest

from retrieval.config import BaselinesConfig, ColumnsConfig, EvaluationConfig, SyntheticConfig, TableConfig, load_config
from retrieval.data import (
    ITEM,
    TIME,
    USER,
    WEIGHT,
    DataError,
    generate_clicks,
    load_dataset,
    read_clicks,
    read_feature_table,
)
from retrieval.evaluation import build_eval_set, evaluate_against_baselines
from retrieval.index import ItemIndex


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    return str(path)


def _user_items(path, **options):
    return TableConfig(path=path, format="user-items", **options)


def test_user_items_lines_become_canonical_clicks(tmp_path):
    path = _write(tmp_path, "train.txt", "0 10 11 12\n\n1\t11\r\n2\n  3   12 10 \n")
    clicks = read_clicks(_user_items(path), ColumnsConfig())
    assert list(clicks.columns) == [USER, ITEM, WEIGHT]  # no timestamp in this format
    assert clicks[USER].tolist() == ["0", "0", "0", "1", "3", "3"]  # user 2 has no items: no clicks
    assert clicks[ITEM].tolist() == ["10", "11", "12", "11", "12", "10"]
    assert (clicks[WEIGHT] == 1.0).all() and clicks[WEIGHT].dtype == np.float32
    assert pd.api.types.is_string_dtype(clicks[USER]) and pd.api.types.is_string_dtype(clicks[ITEM])
    same_with_separator = read_clicks(
        _user_items(_write(tmp_path, "t.txt", "0;10;11;12\n1;11\n"), separator=";"), ColumnsConfig()
    )
    assert same_with_separator[ITEM].tolist() == ["10", "11", "12", "11"]


@pytest.mark.parametrize(
    "text, options, message",
    [
        ("0 1 2\n1 3\n0 4\n", {}, r"u\.txt, line 3: user '0' already has a line \(line 1\)"),
        ("0 1 2\n1,3,4\n", {}, r"u\.txt, line 2: found ',' in '1,3,4'.*format: csv"),
        ("0;1;;2\n", {"separator": ";"}, r"u\.txt, line 1: field 3 is empty"),
        ("0\n1\n\n", {}, "no clicks: the file holds user ids but no item ids"),
        ("\n\n", {}, "no clicks: the file holds no lines"),
    ],
)
def test_bad_user_items_lines_are_located(tmp_path, text, options, message):
    path = _write(tmp_path, "u.txt", text)
    with pytest.raises(DataError, match=message):
        read_clicks(_user_items(path, **options), ColumnsConfig())


def test_user_items_is_not_a_feature_table_and_missing_files_are_named(tmp_path):
    path = _write(tmp_path, "u.txt", "0 1\n")
    with pytest.raises(DataError, match="click-log format"):
        read_feature_table(_user_items(path), "user_id")
    with pytest.raises(DataError, match="file not found"):
        read_clicks(_user_items(str(tmp_path / "nope.txt")), ColumnsConfig())


def _benchmark_files(tmp_path):
    """A LightGCN-style train.txt / test.txt pair and the same split as CSV files."""
    clicks, _, _ = generate_clicks(SyntheticConfig(n_users=200, n_items=120, mean_clicks_per_user=15, seed=5))
    clicks = clicks.drop_duplicates([USER, ITEM])
    test_mask = np.random.default_rng(0).random(len(clicks)) < 0.2
    paths = {}
    for part, frame in (("train", clicks[~test_mask]), ("test", clicks[test_mask])):
        lines = [f"{user} " + " ".join(group[ITEM]) for user, group in frame.groupby(USER, sort=False)]
        paths[part] = _write(tmp_path, f"{part}.txt", "\n".join(lines) + "\n")
        paths[f"{part}_csv"] = str(tmp_path / f"{part}.csv")
        frame[[USER, ITEM]].to_csv(paths[f"{part}_csv"], index=False)
    return paths


def _vector(key):
    """An embedding keyed by id (not by row), so catalogues in different orders score alike."""
    return np.random.default_rng(zlib.crc32(key.encode())).normal(size=8).astype(np.float32)


def _evaluate(dataset, config):
    catalogue = dataset.items[ITEM].astype(str).tolist()
    eval_set = build_eval_set(dataset.train, dataset.test, catalogue, config.evaluation)
    index = ItemIndex.build(catalogue, np.stack([_vector("i" + i) for i in catalogue]))
    queries = np.stack([_vector("u" + u) for u in eval_set.user_ids])
    return eval_set, evaluate_against_baselines(index, queries, eval_set, dataset.train, config.evaluation)


def test_given_test_file_end_to_end_matches_the_same_split_as_csv(tmp_path):
    paths = _benchmark_files(tmp_path)
    common = [
        "data.source=files",
        "split.kind=none",
        "evaluation.ks=[5, 20]",
        "evaluation.baselines.rankers=[popularity]",
    ]
    given = load_config(
        None,
        common
        + [
            f"data.clicks={{path: '{paths['train']}', format: user-items}}",
            f"data.test_clicks={{path: '{paths['test']}', format: user-items}}",
        ],
    )
    as_csv = load_config(
        None,
        common
        + [
            f"data.clicks={{path: '{paths['train_csv']}'}}",
            f"data.test_clicks={{path: '{paths['test_csv']}'}}",
            "data.columns.timestamp=null",
        ],
    )
    dataset = load_dataset(given.data, given.split)
    assert TIME not in dataset.train
    eval_set, results = _evaluate(dataset, given)
    _, reference = _evaluate(load_dataset(as_csv.data, as_csv.split), as_csv)
    assert results["model"]["users"] == len(eval_set.user_ids) > 50
    for key in ("recall@20", "ndcg@5", "coverage@20", "tail_recall@20", "popularity_bias@20"):
        assert results["model"][key] == pytest.approx(reference["model"][key]), key
    # Popularity breaks ties by catalogue order, which differs between the two files: compare loosely.
    assert results["popularity"]["users"] == reference["popularity"]["users"]
    assert results["popularity"]["recall@20"] == pytest.approx(reference["popularity"]["recall@20"], abs=0.02)

    # Masking is configurable: without it, training items compete for the top slots.
    unmasked = given.model_copy(
        update={"evaluation": given.evaluation.model_copy(update={"exclude_train_items": False})}
    )
    unmasked_set = build_eval_set(dataset.train, dataset.test, dataset.items[ITEM].tolist(), unmasked.evaluation)
    assert all(len(e) == 0 for e in unmasked_set.exclude)
    assert sum(len(e) for e in eval_set.exclude) > 0


def test_user_items_log_cannot_be_split_by_time(tmp_path):
    paths = _benchmark_files(tmp_path)
    config = load_config(None, ["data.source=files", f"data.clicks={{path: '{paths['train']}', format: user-items}}"])
    with pytest.raises(DataError, match="needs timestamps"):
        load_dataset(config.data, config.split)
    random_split = load_config(
        None,
        ["data.source=files", f"data.clicks={{path: '{paths['train']}', format: user-items}}", "split.kind=random"],
    )
    dataset = load_dataset(random_split.data, random_split.split)
    assert len(dataset.train) > len(dataset.test) > 0


def test_default_evaluation_config_has_both_baselines():
    assert EvaluationConfig().baselines == BaselinesConfig(rankers=("popularity", "als"))


@pytest.mark.slow  # trains and exports (~30 s)
def test_a_pooled_history_trains_and_serves_on_a_log_without_time(tmp_path):
    """A user-items log has no time: a click's history is its user's other training items. The job
    trains and exports a history tower there, and the bundle answers a history (leaving its items out)."""
    from retrieval.jobs import train_evaluate_export
    from retrieval.serving import Bundle

    paths = _benchmark_files(tmp_path)
    config = load_config(None, [
        "data.source=files", f"data.clicks={{path: '{paths['train']}', format: user-items}}",
        f"data.test_clicks={{path: '{paths['test']}', format: user-items}}", "split.kind=none",
        "towers.query.features=[{name: user_id, kind: id}]", "towers.doc.features=[{name: item_id, kind: id}]",
        "towers.query.history={length: 10, pooling: mean}", "train.epochs=4", "train.validation_fraction=0",
        "model.embedding_dim=16", "evaluation.plots=false", "evaluation.baselines.rankers=[popularity]",
        f"run.output_dir={tmp_path / 'runs'}", "run.name=history"])
    result = train_evaluate_export(config, config_name="history")
    assert result.metrics["model"]["recall@20"] > result.metrics["popularity"]["recall@20"]
    bundle = Bundle.load(result.directory)
    assert bundle.manifest["query_history"]["input"] == "history"
    (user,) = bundle.known_user_ids(1)
    history = bundle.training_items(user)[:3]
    answer = bundle.recommend({"user_id": user, "history": history}, 10)
    assert len(answer.item_ids) == 10 and not set(history) & set(answer.item_ids)
    # A user id alone: the bundle fills the stored history, the one the probe query was exported with.
    probe = bundle.manifest["probe"]
    assert bundle.manifest["user_histories"]["limit"] == config.export.history_clicks
    alone = bundle.recommend({"user_id": probe["query"]["user_id"]}, probe["k"], exclude_seen=False)
    assert alone.item_ids == probe["item_ids"] and alone.fallback is None
    np.testing.assert_allclose(alone.scores, probe["scores"], rtol=1e-5, atol=1e-6)
