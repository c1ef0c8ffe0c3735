"""benchmarks.bench_public on a tiny LightGCN-format dataset: rows land in the JSON with recall@20
(popularity checked against an independent numpy computation), the Markdown table and the PNG are
written, and a rerun skips the rows already there."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
N_ITEMS = 30


def _write_dataset(folder: Path) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
    """Item j has 30 - j training clicks (users 0 .. 29 - j), so popularity has no ties; each user's
    valid items are two items they did not click in training."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    train, valid = {}, {}
    with open(folder / "train.txt", "w") as train_file, open(folder / "valid.txt", "w") as valid_file:
        for user in range(N_ITEMS):
            train[user] = set(range(N_ITEMS - user))
            train_file.write(" ".join(map(str, [user, *sorted(train[user])])) + "\n")
            unseen = sorted(set(range(N_ITEMS)) - train[user])
            if unseen:
                valid[user] = set(rng.choice(unseen, min(2, len(unseen)), replace=False).tolist())
                valid_file.write(" ".join(map(str, [user, *sorted(valid[user])])) + "\n")
    return train, valid


def _popularity_recall(train, valid, k=20):
    """Independent reference: the k most clicked items each user has not clicked, recall over |valid|."""
    counts = np.zeros(N_ITEMS)
    for items in train.values():
        counts[list(items)] += 1
    order = np.argsort(-counts, kind="stable")
    recalls = []
    for user, relevant in valid.items():
        top = [item for item in order if item not in train[user]][:k]
        recalls.append(len(relevant & set(top)) / len(relevant))
    return float(np.mean(recalls))


@pytest.fixture
def bench(monkeypatch):
    """The script as a module (in-process runs skip a TensorFlow import per call)."""
    from benchmarks import bench_public

    return bench_public


def _run(data_dir, out, *args):
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_public", "--data-dir", str(data_dir), "--out", str(out), *args],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )


@pytest.mark.slow
def test_rows_land_in_json_and_markdown_and_a_rerun_skips_them(tmp_path, bench, capsys):
    train, valid = _write_dataset(tmp_path / "data" / "tiny")
    out = tmp_path / "results"
    args = ["--variants", "default,popularity", "--max-epochs", "1", "--set", "train.batch_size=64"]
    first = _run(tmp_path / "data", out, *args)
    assert first.returncode == 0, first.stderr[-3000:]

    report = json.loads((out / "bench_public.json").read_text())
    rows = {row["row"]: row for row in report["rows"]}
    assert set(rows) == {"default", "popularity"} and len(report["rows"]) == 2
    assert all(row["dataset"] == "tiny" for row in report["rows"])
    assert rows["popularity"]["recall@20"] == pytest.approx(_popularity_recall(train, valid))
    assert rows["popularity"]["users"] == len(valid)
    model = rows["default"]
    assert 0 <= model["recall@20"] <= 1 and 0 <= model["ndcg@20"] <= 1 and model["seconds"] > 0
    assert model["users"] == len(valid)  # every user of valid.txt has training clicks
    assert model["epochs"] == 1  # --max-epochs capped the default's 30
    assert model["extra"] == ["train.batch_size=64", "train.epochs<=1"]
    assert all(row["cpu"] == bench.cpu_model() != "" for row in report["rows"])  # seconds compare on one CPU only

    markdown = (out / "bench_public.md").read_text()
    assert "| row | tiny |" in markdown
    assert f"| popularity | {rows['popularity']['recall@20']:.4f} |" in markdown
    assert f"| default [train.batch_size=64 train.epochs<=1] | {model['recall@20']:.4f} |" in markdown
    assert f"| {model['seconds']:.0f} | {model['cpu']} | 1 |" in markdown
    assert (out / "bench_public.png").stat().st_size > 0

    common = ["--data-dir", str(tmp_path / "data"), "--out", str(out)]
    assert bench.main([*common, *args]) == 0
    assert capsys.readouterr().out.count("skipped") == 2
    assert json.loads((out / "bench_public.json").read_text()) == report  # nothing re-run or rewritten

    # --force runs a row again and replaces it.
    assert bench.main([*common, "--variants", "popularity", "--force"]) == 0
    rows_now = json.loads((out / "bench_public.json").read_text())["rows"]
    assert len(rows_now) == 2 and rows_now[-1]["row"] == "popularity"
    assert rows_now[-1]["finished"] >= rows["popularity"]["finished"]


def test_unknown_rows_bad_overrides_and_missing_data_are_refused(tmp_path, bench, capsys):
    _write_dataset(tmp_path / "data" / "tiny")
    common = ["--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match="unknown row bogus; valid: popularity, als, ease, default"):
        bench.main([*common, "--variants", "default,bogus"])
    with pytest.raises(SystemExit, match="(?s)row default: .*model.temprature: unknown key"):  # before any training
        bench.main([*common, "--variants", "default", "--set", "model.temprature=0.1"])
    assert not (tmp_path / "out" / "bench_public.json").exists()
    assert bench.main(["--data-dir", str(tmp_path / "nothing"), "--out", str(tmp_path / "out")]) == 2
    assert "no dataset folder with train.txt and valid.txt" in capsys.readouterr().err


def test_ease_ranks_each_user_by_the_closed_form_scores(tmp_path, bench):
    """EASE's ranking against an independent numpy closed form: B = I - P / diag(P), P = (X'X + l2 I)^-1,
    scores x_u B, the user's training items masked. Scores, not ids, are compared (the triangular
    log has tied scores, which may come in any order)."""
    train, _ = _write_dataset(tmp_path / "tiny")
    baselines = bench.Baselines(tmp_path / "tiny")
    l2, depth = 10.0, 5
    rows = bench.ease_ranking(baselines.train, baselines.catalogue_ids, baselines.eval_set, depth, l2=l2)
    clicks = np.zeros((N_ITEMS, N_ITEMS))
    for user, items in train.items():
        clicks[user, list(items)] = 1.0
    precision = np.linalg.inv(clicks.T @ clicks + l2 * np.eye(N_ITEMS))
    weights = np.eye(N_ITEMS) - precision / np.diag(precision)
    items = np.array([int(i) for i in baselines.catalogue_ids])
    for user, ranked in zip(baselines.eval_set.user_ids, rows):
        scores = clicks[int(user)] @ weights
        scores[list(train[int(user)])] = -np.inf
        expected = np.sort(scores)[::-1][:depth]
        expected = expected[np.isfinite(expected)]
        got = scores[items[ranked[ranked >= 0]]]
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_als_grid_points_are_every_combination_of_valid_als_config_fields(bench):
    from retrieval.config import ALSConfig

    points = bench.als_grid()
    assert len(points) == np.prod([len(values) for values in bench.ALS_GRID.values()])
    assert len({tuple(p.items()) for p in points}) == len(points)
    for point in points:
        config = ALSConfig(**point)  # a key that is not an ALSConfig field fails here
        assert all(getattr(config, key) == value for key, value in point.items())


@pytest.mark.slow
def test_a_record_row_keeps_its_valid_curve_and_epoch_times_and_draws_them(tmp_path, bench):
    """A record row selects on valid.txt itself: its run keeps the validation recall of every epoch with each
    epoch's training and validation seconds, and the report tabulates and draws the curve."""
    _write_dataset(tmp_path / "data" / "tiny")
    out = tmp_path / "results"
    assert bench.main(["--data-dir", str(tmp_path / "data"), "--out", str(out), "--variants", "mf-bsl-record",
                       "--max-epochs", "3", "--set", "model.loss.num_negatives=10",
                       "--set", "train.early_stopping_patience=5", "--set", "train.learning_rate=0.05"]) == 0
    (run,) = json.loads((out / "bench_public.json").read_text())["rows"]
    recalls = run["selection"][f"val_recall@{bench.K}"]
    assert len(recalls) == len(run["epoch_seconds"]) == len(run["hook_seconds"]) == run["epochs"] == 3
    assert run["selection"]["refit"] == "none" and all(seconds >= 0 for seconds in run["hook_seconds"])
    (curve,) = bench.curves(json.loads((out / "bench_public.json").read_text()))
    assert curve["recall"] == recalls and curve["best_epoch"] == 1 + int(np.argmax(recalls))
    assert curve["wall"] == pytest.approx(np.cumsum(np.add(run["epoch_seconds"], run["hook_seconds"])))
    markdown = (out / "bench_public.md").read_text()
    assert "## Records at their own length: the curves" in markdown
    assert f"| {curve['label']} | 3 | {curve['best_epoch']} | {max(recalls):.4f} |" in markdown
    assert (out / "bench_public_curves.png").stat().st_size > 0
