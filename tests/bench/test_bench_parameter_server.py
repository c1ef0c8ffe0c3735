"""benchmarks/bench_parameter_server.py without its runs: the tables' bytes and the report of its results file."""

import json
from pathlib import Path

from benchmarks.bench_parameter_server import markdown, tables

ROOT = Path(__file__).resolve().parents[2]


def test_tables_count_both_id_tables_with_lazy_adams_two_slots():
    t = tables({"train_users": 9, "train_items": 4}, dim=3)
    assert (t["user_rows"], t["item_rows"]) == (10, 5)  # row 0 of each table is the OOV row
    assert t["table_bytes"] == (10 + 5) * 3 * 4 * 3


def test_the_committed_results_render_every_run():
    report = json.loads((ROOT / "benchmarks" / "results" / "bench_parameter_server.json").read_text())
    text = markdown(report)
    for name in [*report["quality"], *report["memory"]]:
        assert f"| {name} |" in text
    for run in report["memory"].values():  # the recorded tables are those of the run's data at its dim
        assert run["tables"] == tables(run["data"], run["tables"]["dim"])
