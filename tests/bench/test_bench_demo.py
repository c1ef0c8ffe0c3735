"""bench_demo's summary: the model's spread over seeds and its margin over ALS, by their stated rules."""

import json
from pathlib import Path

import pytest

from benchmarks.bench_demo import CONFIG, summarise

ROOT = Path(__file__).resolve().parents[2]


def _row(seed, model, als, popularity=0.16):
    return {"seed": seed, "model": {"recall@20": model}, "als": {"recall@20": als},
            "popularity": {"recall@20": popularity}}


def test_spread_is_max_less_min_and_the_margin_the_lowest_model_less_the_highest_als():
    summary = summarise([_row(0, 0.50, 0.49), _row(1, 0.47, 0.48), _row(2, 0.52, 0.495)])
    assert summary["model_spread_recall@20"] == pytest.approx(0.05)
    assert summary["model_min_less_als_max_recall@20"] == pytest.approx(0.47 - 0.495)
    assert summary["model_mean_recall@20"] == pytest.approx((0.50 + 0.47 + 0.52) / 3)
    assert summary["als_mean_recall@20"] == pytest.approx((0.49 + 0.48 + 0.495) / 3)


def test_the_stored_results_agree_with_their_rows():
    report = json.loads((ROOT / "benchmarks/results/bench_demo.json").read_text())
    assert report["config"] == CONFIG and [row["seed"] for row in report["rows"]] == [0, 1, 2]
    assert report["summary"] == pytest.approx(summarise(report["rows"]))
