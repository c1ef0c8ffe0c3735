"""What every benchmark shares: the machine it ran on, its command line and its result files.

Benchmarks are modules of the ``benchmarks`` package, run from the repository root as
``python -m benchmarks.bench_x`` (so ``retrieval`` and ``benchmarks`` import without
touching ``sys.path``). Their seconds compare only on one machine under one load, so
every results file records ``machine()``; ``write_report`` writes the JSON and the
Markdown beside it, whole or not at all.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the repository
RESULTS = ROOT / "benchmarks" / "results"  # where results files are kept (each script's --out default)


def data_dir() -> Path:
    """Where the public datasets are (each script's --data-dir default): $RETRIEVAL_DATA_DIR, or
    ../shared/datasets beside the repository when that is unset or empty."""
    return Path(os.environ.get("RETRIEVAL_DATA_DIR") or ROOT.parent / "shared" / "datasets")


# Every ``machine()`` dict has these keys (and the versions asked for under "versions").
MACHINE_KEYS = ("cpu", "cpus", "platform", "processor", "python", "memory_bytes", "load_average", "versions")


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded to 0.01 (others share these machines' cores)."""
    return [round(x, 2) for x in os.getloadavg()]


def cpu_model() -> str:
    """The CPU's model name, with its widest vector extension: seconds compare only on one model.

    The VMs these benchmarks run on change (an AMD EPYC with AVX2, an Intel Xeon with
    AVX-512 and AMX), and ``platform.processor()`` is empty on Linux.
    """
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    pairs = (line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields: dict[str, str] = {}
    for key, value in pairs:  # the first CPU's fields: every core of a VM reports the same
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    vector = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2")) if flag in flags), "")
    matrix = "AMX" if "amx_tile" in flags else ""
    return ", ".join(part for part in (fields.get("model name", platform.machine()), vector, matrix) if part)


def memory_bytes() -> int | None:
    """Physical memory of the machine (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _version(name: str) -> str | None:
    module = sys.modules.get(name)
    if module is not None and isinstance(getattr(module, "__version__", None), str):
        return module.__version__
    distribution = {"tfrs": "tensorflow-recommenders", "faiss": "faiss-cpu"}.get(name, name)
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def machine(*libraries: str, **extra: Any) -> dict[str, Any]:
    """The machine and its load now, as every results file records it.

    Args:
      libraries: import names whose versions matter to the numbers (e.g. "numpy", "faiss",
        "tensorflow", "tfrs"); a library neither imported nor installed records None.
      extra: script-specific entries (e.g. the BLAS in use), added as they are.

    Returns:
      {"cpu", "cpus", "platform", "processor", "python", "memory_bytes",
      "load_average": [1, 5, 15 min], "versions": {library: version}, **extra}.
    """
    return {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "memory_bytes": memory_bytes(),
        "load_average": load_average(),
        "versions": {name: _version(name) for name in libraries},
        **extra,
    }


def versions_of(record: dict[str, Any]) -> dict[str, Any]:
    """Library versions of a machine record (older results files hold them at its top level)."""
    return record.get("versions", record)


def describe_machine(m: dict[str, Any] | str) -> str:
    """One line for a Markdown report: CPU, core count, platform (a string, as older reports hold, as is)."""
    if isinstance(m, str):
        return m
    versions = ", ".join(f"{name} {v}" for name, v in m.get("versions", {}).items() if v)
    return f"{m.get('cpu', m.get('processor', '?'))}, {m['cpus']} CPUs, {m['platform']}" + (
        f" ({versions})" if versions else ""
    )


def command(module: str, argv: Sequence[str] | None = None) -> str:
    """The command line that reruns this benchmark: ``python -m benchmarks.<module> <argv>``."""
    return shlex.join(["python", "-m", f"benchmarks.{module}", *(sys.argv[1:] if argv is None else argv)])


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.tmp")
    partial.write_text(text)
    partial.replace(path)


def write_json(path: Path | str, report: Any) -> None:
    """``report`` as indented JSON (numpy scalars as floats), replacing ``path`` whole or not at all."""
    _write_atomically(Path(path), json.dumps(report, indent=2, default=float) + "\n")


def write_report(stem: Path | str, report: Any, markdown: str | None = None) -> None:
    """``<stem>.json`` and, given ``markdown``, ``<stem>.md`` (each replaced whole or not at all)."""
    stem = Path(stem)
    write_json(stem.with_name(stem.name + ".json"), report)
    if markdown is not None:
        _write_atomically(stem.with_name(stem.name + ".md"), markdown if markdown.endswith("\n") else markdown + "\n")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> list[str]:
    """A GitHub Markdown table, one line each: the header, the rule, then ``rows`` (cells as ``str``).

    ``align``: one letter a column, "l" or "r" (right-aligned numbers); "" leaves every column left.
    """
    if align and (len(align) != len(header) or set(align) - {"l", "r"}):
        raise ValueError(f"markdown_table: align {align!r} needs one of l/r for each of {len(header)} columns")
    rule = [("---:" if a == "r" else "---") for a in (align or "l" * len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"markdown_table: a row has {len(row)} cells for {len(header)} columns: {row}")
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return lines


class Stopwatch:
    """Wall seconds (``time.perf_counter``) since it started; ``stop`` freezes them (``timed`` does)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.stopped: float | None = None

    def stop(self) -> float:
        """Freeze the reading at now (a second call keeps the first); return the seconds."""
        if self.stopped is None:
            self.stopped = time.perf_counter()
        return self.seconds

    @property
    def seconds(self) -> float:
        """The seconds from start to stop; before ``stop``, to now."""
        return (time.perf_counter() if self.stopped is None else self.stopped) - self.started

    @property
    def ms(self) -> float:
        """``seconds`` in milliseconds."""
        return self.seconds * 1000


@contextmanager
def timed() -> Iterator[Stopwatch]:
    """Time a block: ``with timed() as clock: work()`` then ``clock.seconds`` (or ``clock.ms``) is the block's
    wall time, stopped when the block ends (by an error too)."""
    clock = Stopwatch()
    try:
        yield clock
    finally:
        clock.stop()


def pyplot():
    """matplotlib.pyplot on the Agg backend (benchmarks write PNGs; no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path | str, dpi: int = 120) -> None:
    """Write ``fig`` as a PNG at ``path`` and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
