"""benchmarks.bench_batch_recommend runs end to end at toy size: a Flat and an IVF bundle each answer
every user into a file, the IVF one's recall is measured against Flat's, and the JSON and Markdown
are written. No timing is asserted (speed belongs to the benchmark itself)."""

import json

import pytest

from benchmarks import bench_batch_recommend


@pytest.mark.slow  # writes two bundles and loads TensorFlow (~15 s)
def test_bench_batch_recommend_runs_at_toy_size(tmp_path):
    stem = tmp_path / "results" / "bench"
    argv = ["--items", "3000", "--users", "300", "--k", "20", "--block-size", "128", "--tune-queries", "100",
            "--factories", "Flat", "IVF16,Flat", "--workdir", str(tmp_path / "work"), "--out", str(stem)]
    assert bench_batch_recommend.main(argv) == 0
    report = json.loads(stem.with_suffix(".json").read_text())
    flat, ivf = report["results"]
    assert (flat["factory"], ivf["factory"]) == ("Flat", "IVF16,Flat")
    for row in (flat, ivf):
        assert row["users"] == 300 and row["rows"] == 300 * 20 and row["row_groups"] == 3
        assert row["users_per_s"] > 0
    assert ivf["search_params"].startswith("nprobe=") and 0.5 <= ivf["recall_at_20_vs_flat"] <= 1
    assert "recall_at_20_vs_flat" not in flat
    text = stem.with_suffix(".md").read_text()
    assert "**The bundles are synthetic**" in text and "| IVF16,Flat | nprobe=" in text
    assert report["command"].startswith("python -m benchmarks.bench_batch_recommend --items 3000")

    # --bundle: the same path over an existing bundle and a sample of its own training users.
    bundle = next(p for p in (tmp_path / "work").iterdir() if (p / "manifest.json").exists() and "Flat" in p.name)
    trained = tmp_path / "results" / "trained"
    assert bench_batch_recommend.main(["--bundle", str(bundle), "--users", "100", "--k", "20", "--block-size", "64",
                                       "--out", str(trained)]) == 0
    (row,) = json.loads(trained.with_suffix(".json").read_text())["results"]
    assert row["users"] == 100 and row["rows"] == 100 * 20 and row["row_groups"] == 2 and row["build_seconds"] is None
    assert f"**The bundle is trained: {bundle.name}" in trained.with_suffix(".md").read_text()
