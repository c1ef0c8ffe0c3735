"""benchmarks.bench_both_ways runs end to end at toy size: it writes the whole-log file beside
the shards, trains the same job in memory and streamed, and the two runs agree.

No timing is asserted; the agreement is the contract ``tests/jobs/test_out_of_core.py`` proves on its
own log, here on the benchmark's generator and ``configs/scale.yaml``.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_both_ways_runs_at_toy_size_and_the_sources_agree(tmp_path):
    out = tmp_path / "both"
    command = [
        sys.executable, "-m", "benchmarks.bench_both_ways", "--clicks", "20000", "--items", "2000",
        "--shard-clicks", "5000", "--dir", str(tmp_path / "scale"), "--out", str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert set(report["runs"]) == {"in memory", "streamed"}
    assert report["same_evaluation_set"]
    assert report["max_relative_difference"]["popularity"] < 1e-9
    assert report["max_relative_difference"]["model"] < 1e-4
    assert report["max_relative_difference"]["final_train_loss"] < 1e-5
    assert len(list((tmp_path / "scale" / "logs").glob("*/*.parquet"))) >= 2  # streamed from several shards
    assert "| streamed |" in out.with_suffix(".md").read_text()
