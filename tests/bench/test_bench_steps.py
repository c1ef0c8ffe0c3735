"""benchmarks.bench_steps runs end to end at toy size: every (size, optimizer) gets a step time,
the checkpoint part counts the saves it asked for, the bound part sets the project's step beside
the bare one, and the JSON and Markdown are written.

No timing is asserted (speed belongs to the benchmark itself); this keeps the harness working
when the training loop it wraps changes (it once died on a new argument of ``step_function``).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_steps_runs_at_toy_size(tmp_path):
    toy_log = tmp_path / "train.txt"  # user-items lines, as Gowalla's train.txt
    toy_log.write_text("".join(f"{user} " + " ".join(str((user * 7 + j) % 90) for j in range(12)) + "\n"
                               for user in range(40)))
    command = [
        sys.executable, "-m", "benchmarks.bench_steps", "--sizes", "300", "600",
        "--optimizers", "lazy_adam", "rowwise_adagrad", "--steps", "8", "--rounds", "1", "--warmup", "2",
        "--checkpoint-size", "300", "--every", "0", "4", "--checkpoint-steps", "12", "--checkpoint-rounds", "1",
        "--bound-dims", "8", "--bound-batches", "32", "--bound-clicks", "160", "--users", "50", "--items", "60",
        "--bound-rounds", "1", "--steps-per-execution", "4", "--shared-negatives", "7",
        "--score-dtypes", "float32", "bfloat16",
        "--epoch-log", str(toy_log), "--epoch-dims", "8", "--epoch-steps-per-execution", "1", "0",
        "--epoch-rounds", "1",
        "--out", str(tmp_path),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "bench_steps.json").read_text())
    rows = {(row["n"], row["optimizer"]): row for row in report["tables"]["summary"]}
    assert set(rows) == {(n, opt) for n in (300, 600) for opt in ("lazy_adam", "rowwise_adagrad")}
    assert all(row["median_ms"] > 0 for row in rows.values())
    assert rows[(300, "lazy_adam")]["ratio_to_300"] == 1.0
    saves = {row["every"]: row["saves_per_run"] for row in report["checkpoints"]["summary"]}
    assert saves["0"] == 0 and saves["4"] >= 2  # 12 steps, a save every 4 (the last may fall at the end)
    assert "| 600 | rowwise_adagrad |" in (tmp_path / "bench_steps.md").read_text()
    bound = {row["negatives"]: row for row in report["bound"]["summary"]}
    assert set(bound) == {"in_batch", "shared"}
    for row in bound.values():
        assert set(row["project_ms"]) == {"K=4", "K=4 bf16"}
        assert row["bound_ms"] == min(row["bare_graph_ms"], row["bare_xla_ms"])
        assert row["step_over_bound"]["K=4 bf16"] == row["project_ms"]["K=4 bf16"] / row["bound_ms"]
    assert report["bound"]["uptime"] and "| shared (7) | 8 | 32 |" in (tmp_path / "bench_steps.md").read_text()
    for row in bound.values():  # the products alone: the bare step's matmuls, gathers and scatter
        assert row["products_ms"] > 0
        assert row["products_over_step"]["K=4"] == row["products_ms"] / row["project_ms"]["K=4"]
    epochs = report["epoch"]
    assert (epochs["clicks"], epochs["steps"]) == (480, 1)  # 40 users x 12 items, one batch of 1,024
    assert [(row["dim"], row["steps_per_call"], row["default"]) for row in epochs["summary"]] == [
        (8, 1, False), (8, 16, True)]
    assert all(row["epoch_s"] > 0 for row in epochs["summary"])
    assert "## An epoch of " in (tmp_path / "bench_steps.md").read_text()
