"""bench_catalogue's summary of a series of live edits, by its stated rules, and its stored results."""

import json
from pathlib import Path

import pytest

from benchmarks.bench_catalogue import TARGET_SECONDS, markdown, summarise_adds

ROOT = Path(__file__).resolve().parents[2]


def _edit(change, served):
    return {"change": change, "served_after_seconds": served}


def test_adds_count_within_the_target_inclusive_and_never_served_ones_apart():
    summary = summarise_adds([_edit("add", 0.2), _edit("add", TARGET_SECONDS), _edit("remove", 5.0),
                              _edit("add", 1.4), _edit("add", None), _edit("update", None)])
    assert summary == {"adds": 4, "adds_served_within_target": 2, "served_after_seconds_median": 1.0,
                       "served_after_seconds_max": 1.4, "never_served": 1}
    assert summarise_adds([_edit("remove", 0.1)])["served_after_seconds_median"] is None


@pytest.mark.parametrize("name", ["bench_catalogue", "bench_catalogue_100k", "bench_catalogue_1m"])
def test_the_stored_results_agree_with_their_edits(name):
    report = json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())
    summary = report["summary"]
    assert {key: summary[key] for key in summarise_adds([])} == summarise_adds(report["edits"])
    assert summary["failed_requests"] == report["load"]["failed"] == 0
    assert summary["restart_serves"] and summary["restart_bundle"] == report["edits"][-1]["bundle"]
    text = markdown(report)
    assert f"**{summary['adds_served_within_target']} of {summary['adds']}**" in text
    assert (ROOT / "benchmarks" / "results" / f"{name}.md").read_text() == text
