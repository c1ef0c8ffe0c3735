"""benchmarks._harness: the machine record every results file holds, the result writers, and that every
benchmark is a module of the benchmarks package (importable and runnable without touching sys.path)."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from benchmarks import _harness as harness

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__")


def test_machine_has_the_keys_every_results_file_records():
    m = harness.machine("numpy", "not_a_library", blas=["x"])
    assert set(harness.MACHINE_KEYS) <= set(m) and m["blas"] == ["x"]
    assert m["cpus"] >= 1 and m["cpu"] and m["python"].count(".") == 2
    assert len(m["load_average"]) == 3 and all(isinstance(x, float) for x in m["load_average"])
    assert m["versions"] == {"numpy": np.__version__, "not_a_library": None}
    assert m["memory_bytes"] is None or m["memory_bytes"] > 2**20
    json.dumps(m)  # it goes into a JSON file as it is
    line = harness.describe_machine(m)
    assert m["cpu"] in line and f"numpy {np.__version__}" in line
    assert harness.describe_machine("an older report's string") == "an older report's string"


def test_cpu_model_names_the_widest_vector_extension(tmp_path, monkeypatch):
    cpuinfo = "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx avx2 avx512f amx_tile\n\n" \
              "processor\t: 1\nmodel name\t: Some CPU\nflags\t\t: fpu avx avx2 avx512f amx_tile\n"
    real_read = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: cpuinfo if str(self) == "/proc/cpuinfo"
                        else real_read(self, *a, **k))
    assert harness.cpu_model() == "Some CPU, AVX-512, AMX"


def test_markdown_table_and_report_writers(tmp_path):
    assert harness.markdown_table(["index", "recall@10"], [["Flat", "1.000"], ["HNSW16", 0.97]]) == [
        "| index | recall@10 |",
        "|---|---|",
        "| Flat | 1.000 |",
        "| HNSW16 | 0.97 |",
    ]
    assert harness.markdown_table(["call", "ms"], [["eager", "1.0"]], align="lr")[1] == "|---|---:|"
    with pytest.raises(ValueError, match="align 'x'"):
        harness.markdown_table(["a"], [], align="x")
    with pytest.raises(ValueError, match="1 cells for 2 columns"):
        harness.markdown_table(["a", "b"], [["only one"]])
    report = {"seconds": np.float32(0.5), "rows": [1, 2]}
    harness.write_report(tmp_path / "sub" / "bench_x", report, "# Title")
    assert json.loads((tmp_path / "sub" / "bench_x.json").read_text()) == {"seconds": 0.5, "rows": [1, 2]}
    assert (tmp_path / "sub" / "bench_x.md").read_text() == "# Title\n"
    assert not list((tmp_path / "sub").glob(".*.tmp"))  # written whole, nothing partial left behind


def test_timed_reads_the_block_in_seconds_and_ms_and_stops_on_an_error(monkeypatch):
    ticks = iter([10.0, 10.25, 12.5, 20.0, 21.5, 30.0])
    monkeypatch.setattr(harness.time, "perf_counter", lambda: next(ticks))
    with harness.timed() as clock:  # starts at 10.0
        assert clock.seconds == 0.25  # inside the block: the seconds so far (10.25)
    assert clock.seconds == 2.5 and clock.ms == 2500.0  # stopped at 12.5: later reads do not move
    assert clock.stop() == 2.5  # a second stop keeps the first
    with pytest.raises(KeyError), harness.timed() as failed:  # 20.0 to 21.5
        raise KeyError("x")
    assert failed.stopped is not None and failed.seconds == 1.5  # stopped when the error left the block
    watch = harness.Stopwatch()  # 30.0
    assert watch.stopped is None and watch.started == 30.0


def test_command_reruns_the_module():
    assert harness.command("bench_eval", ["--mode", "tfrs", "--set", "a b"]) == (
        "python -m benchmarks.bench_eval --mode tfrs --set 'a b'"
    )
    assert harness.command("bench_serving", []) == "python -m benchmarks.bench_serving"


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmarks_are_package_modules_without_sys_path_edits(name):
    source = (ROOT / "benchmarks" / f"{name}.py").read_text()
    assert "sys.path" not in source.replace("``sys.path``", "")
    assert not re.search(r"^(from|import) (bench_|scale_resume)", source, re.MULTILINE)  # sibling by path
    assert "/proc/cpuinfo" not in source or name == "_harness"  # the machine is captured once


def test_quoted_benchmark_commands_name_modules_that_exist():
    # The Makefile's bench targets and the commands README, docs and results files quote stay runnable.
    texts = [ROOT / "Makefile", ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
             *(ROOT / "benchmarks" / "results").glob("*.md")]
    modules = set()
    for path in texts:
        text = path.read_text()
        assert not re.search(r"python3? benchmarks/\w+\.py", text), f"{path}: run benchmarks as python -m"
        modules |= set(re.findall(r"python3? -m benchmarks\.(\w+)", text))
    assert {"bench_serving", "bench_serving_real", "bench_eval"} <= modules
    assert modules <= set(BENCHMARKS), modules - set(BENCHMARKS)


def test_the_data_dir_default_is_the_environment_or_shared_datasets_beside_the_repository(monkeypatch, tmp_path):
    monkeypatch.setenv("RETRIEVAL_DATA_DIR", str(tmp_path))
    assert harness.data_dir() == tmp_path
    for unset in (monkeypatch.delenv, lambda name: monkeypatch.setenv(name, "")):
        unset("RETRIEVAL_DATA_DIR")
        assert harness.data_dir() == ROOT.parent / "shared" / "datasets"
