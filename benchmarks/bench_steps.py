"""Step time of the training loop (``retrieval.training.loop``) vs ID-table size, and checkpoint overhead.

    python -m benchmarks.bench_steps                      # or: make bench-steps (~15 min on 2 busy cores)
    python -m benchmarks.bench_steps --part tables --sizes 10000 100000 --rounds 1   # quick

Both parts call the project's own training code, ``retrieval.training.fit`` on a
model from ``retrieval.model.build_model(ModelConfig())`` (the default model: ID
towers, dim 64, normalised, in-batch softmax with log-Q correction) with a
``TrainConfig`` of batch 1024, one epoch of ``--steps`` steps, no early stopping.

- ``tables``: n users x n items for n in ``--sizes``, for each optimizer in
  ``--optimizers`` (``adam``, the default, updates every row of both tables at
  every step; ``lazy_adam`` only the rows a batch touches). No checkpoints.
- ``checkpoints``: n = ``--checkpoint-size``, the default optimizer, with each
  checkpoint policy of ``--every`` (``0`` = none, ``200`` = every 200 steps,
  ``30s`` = ``train.checkpoint_every_seconds: 30``) into a fresh temporary
  directory per run (a run finding an old checkpoint would resume). Each save
  (``TrainingCheckpoint.save``) is timed too: the overhead of the default
  policy (every ``checkpoint_every_seconds``) on a long run is the save time
  over that interval.

The vocabularies (``FeatureStatistics``) come from a frame holding every id once,
so the tables have exactly n rows whatever the number of steps; the training
clicks are ``steps * 1024`` rows of uniformly drawn (user, item) pairs, the same
for every run of a size. The loop's step function is wrapped to stamp the end
of each step (a step returns once its ops ran: eager CPU execution is
synchronous), and the end of ``fit`` is stamped too: a step's time is the
interval between consecutive step ends, so a checkpoint save lands in the step
after the one that made it due; the first ``--warmup`` steps (tracing, caches)
are dropped. Per run: the median step and the span from the end of the
warm-up to the end of training (periodic and end-of-epoch saves included);
also the wall time of the whole ``fit`` call. Configurations are interleaved
(round-robin, order rotated each round) so background load hits them alike;
the summary is the median over rounds. The load average is recorded around
every run.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import tensorflow as tf

import retrieval  # noqa: F401  (sets TF_USE_LEGACY_KERAS before tf.keras is first used)
from benchmarks._harness import RESULTS, command, load_average, machine, versions_of, write_report
from retrieval.config import ModelConfig, TrainConfig
from retrieval.data import ITEM, USER
from retrieval.features import FeatureStatistics
from retrieval.model import build_model
from retrieval.training import TrainingCheckpoint, fit, loop, seed_everything

BATCH = 1024
TARGET_RATIO = 1.5  # the scale target: step(1M) <= 1.5 x step(10k)
TARGET_CHECKPOINT_FRACTION = 0.05  # the scale target: checkpoints <= 5 % of training time


class StepTimer:
    """Stamps ``time.perf_counter()`` at the end of every training step of ``retrieval.training.loop``."""

    def __init__(self) -> None:
        self.batch_ends: list[float] = []

    def __enter__(self) -> StepTimer:
        self._original = loop.step_function

        def timed_step_function(model, *args, **kwargs):
            step = self._original(model, *args, **kwargs)

            def stamped(batch):
                values = step(batch)
                self.batch_ends.append(time.perf_counter())
                return values

            return stamped

        loop.step_function = timed_step_function
        return self

    def __exit__(self, *exc) -> None:
        loop.step_function = self._original


def vocabulary_frame(n: int) -> pd.DataFrame:
    """One click per user and per item: ``n`` users, ``n`` items (so the tables have ``n`` rows)."""
    order = np.random.default_rng(n).permutation(n)
    return pd.DataFrame({USER: [f"u{i}" for i in range(n)], ITEM: [f"i{i}" for i in order]})


def training_frame(n: int, rows: int, seed: int) -> pd.DataFrame:
    """``rows`` clicks with users and items drawn uniformly from the ``n`` of each."""
    rng = np.random.default_rng(seed)
    users, items = rng.integers(0, n, size=rows), rng.integers(0, n, size=rows)
    return pd.DataFrame({USER: np.char.add("u", users.astype(str)), ITEM: np.char.add("i", items.astype(str))})


def timed_run(
    stats: FeatureStatistics, train: pd.DataFrame, config: TrainConfig, warmup: int, checkpoint_dir: Path | None
) -> dict[str, Any]:
    """One ``fit`` of a fresh default model; step times from ``StepTimer``."""
    tf.keras.backend.clear_session()
    gc.collect()
    seed_everything(config.seed)
    began = time.perf_counter()
    model = build_model(ModelConfig(), stats)
    build = time.perf_counter() - began
    load_before = load_average()[0]
    start = time.perf_counter()
    saves: list[float] = []
    save = TrainingCheckpoint.save

    def timed_save(self, state):
        began = time.perf_counter()
        save(self, state)
        saves.append(time.perf_counter() - began)

    TrainingCheckpoint.save = timed_save  # type: ignore[method-assign]
    try:
        with StepTimer() as timer:
            history = fit(model, train, config, checkpoint_dir=checkpoint_dir)
    finally:
        TrainingCheckpoint.save = save  # type: ignore[method-assign]
    train_end = time.perf_counter()
    wall = train_end - start
    ends = np.asarray(timer.batch_ends)
    steps = np.diff(ends)[warmup:]  # steps[i] = step warmup+2 .. : the first step (tracing) has no start stamp
    if len(steps) == 0:
        raise ValueError(f"--steps must exceed --warmup + 1, got {len(ends)} steps and warmup {warmup}")
    span = train_end - ends[warmup]  # from the end of the warm-up to the end of training
    result = {
        "median_ms": 1000 * float(np.median(steps)),
        "p90_ms": 1000 * float(np.percentile(steps, 90)),
        "timed_steps": len(steps),
        "span_s": float(span),
        "fit_wall_s": float(wall),
        "build_model_s": float(build),
        "to_first_step_end_s": float(ends[0] - start),  # dataset, compile, tracing, optimizer slots
        "loss": float(history["loss"][-1]),
        "save_seconds": saves,  # every call, the final one (often of an already saved step: ~0 s) included
        "load_1min": [load_before, load_average()[0]],
    }
    del model
    return result


def rotated(configs: list, round_: int) -> list:
    shift = round_ % len(configs)
    return configs[shift:] + configs[:shift]


def run_tables(args, log) -> dict[str, Any]:
    rows = args.steps * BATCH
    data = {}
    for n in args.sizes:
        began = time.perf_counter()
        data[n] = (FeatureStatistics.from_training_clicks(vocabulary_frame(n)), training_frame(n, rows, seed=1))
        log(f"tables: data for n={n} in {time.perf_counter() - began:.1f}s")
    configs = [(n, opt) for n in args.sizes for opt in args.optimizers]
    runs: dict[str, list[dict]] = {f"{n}/{opt}": [] for n, opt in configs}
    for round_ in range(args.rounds):
        for n, opt in rotated(configs, round_):
            config = TrainConfig(epochs=1, batch_size=BATCH, optimizer=opt, verbose=0, checkpoint_every_steps=0)
            result = timed_run(*data[n], config, args.warmup, None)
            runs[f"{n}/{opt}"].append(result)
            log(f"tables round {round_} n={n} {opt}: {result['median_ms']:.1f} ms/step "
                f"(build {result['build_model_s']:.1f}s, first step ends {result['to_first_step_end_s']:.1f}s "
                f"into fit, fit {result['fit_wall_s']:.1f}s, load {result['load_1min'][1]:.2f})")
    summary = []
    for n, opt in configs:
        medians = [r["median_ms"] for r in runs[f"{n}/{opt}"]]
        summary.append({
            "n": n,
            "optimizer": opt,
            "median_ms": statistics.median(medians),
            "runs_ms": medians,
            "setup_s": statistics.median(r["build_model_s"] + r["to_first_step_end_s"] for r in runs[f"{n}/{opt}"]),
        })
    smallest = min(args.sizes)
    for row in summary:
        base = next(r["median_ms"] for r in summary if r["n"] == smallest and r["optimizer"] == row["optimizer"])
        row[f"ratio_to_{smallest}"] = row["median_ms"] / base
    return {"steps_per_run": args.steps, "summary": summary, "runs": runs}


def run_checkpoints(args, log) -> dict[str, Any]:
    n = args.checkpoint_size
    rows = args.checkpoint_steps * BATCH
    stats, train = FeatureStatistics.from_training_clicks(vocabulary_frame(n)), training_frame(n, rows, seed=2)
    runs: dict[str, list[dict]] = {str(every): [] for every in args.every}
    for round_ in range(args.checkpoint_rounds):
        for every in rotated(list(args.every), round_):
            seconds = float(every[:-1]) if every.endswith("s") else 0.0
            steps = 0 if every.endswith("s") else int(every)
            config = TrainConfig(epochs=1, batch_size=BATCH, verbose=0, checkpoint_every_seconds=seconds,
                                 checkpoint_every_steps=steps)
            with tempfile.TemporaryDirectory(prefix="bench_steps_") as directory:
                where = Path(directory) / "checkpoints" if config.checkpoints else None
                result = timed_run(stats, train, config, args.warmup, where)
                # Files left at the end (tf.train.CheckpointManager keeps 2), not the number of saves.
                result["checkpoints_kept"] = len(list(Path(directory).glob("checkpoints/state-*.json")))
            runs[str(every)].append(result)
            log(f"checkpoints round {round_} every={every}: span {result['span_s']:.2f}s, "
                f"{result['median_ms']:.1f} ms/step (fit {result['fit_wall_s']:.1f}s, "
                f"load {result['load_1min'][1]:.2f})")
    base_span = statistics.median(r["span_s"] for r in runs["0"])
    base_wall = statistics.median(r["fit_wall_s"] for r in runs["0"])
    summary = []
    for every in args.every:
        spans = [r["span_s"] for r in runs[str(every)]]
        walls = [r["fit_wall_s"] for r in runs[str(every)]]
        summary.append({
            "every": every,
            "span_s": statistics.median(spans),
            "fit_wall_s": statistics.median(walls),
            "median_ms": statistics.median(r["median_ms"] for r in runs[str(every)]),
            "overhead_span": statistics.median(spans) / base_span - 1,
            "overhead_fit_wall": statistics.median(walls) / base_wall - 1,
            "runs_span_s": spans,
            "saves_per_run": statistics.median(sum(1 for t in r["save_seconds"] if t > 1e-3)
                                               for r in runs[str(every)]),
            "seconds_per_save": statistics.median(
                [t for r in runs[str(every)] for t in r["save_seconds"] if t > 1e-3] or [0.0]
            ),
        })
    return {"n": n, "optimizer": TrainConfig().optimizer, "steps_per_run": args.checkpoint_steps,
            "summary": summary, "runs": runs}


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Step time of the training loop (retrieval.training.loop) vs ID-table size, and checkpoint overhead",
        "",
        f"`{result['command']}` on {result['machine']['cpus']} CPUs ({result['machine']['platform']}, "
        f"TensorFlow {versions_of(result['machine'])['tensorflow']}), {result['date']}. 1-min load average during the "
        f"runs: {result['load_1min']['min']:.2f}-{result['load_1min']['max']:.2f} "
        f"(mean {result['load_1min']['mean']:.2f}).",
        "",
        "Default model (ID towers, dim 64, in-batch softmax), batch 1024, `retrieval.training.fit`; "
        f"median step after {result['args']['warmup']} warm-up steps, median over {result['args']['rounds']} "
        f"(tables) and {result['args']['checkpoint_rounds']} (checkpoints) interleaved rounds. See the module "
        "docstring of benchmarks/bench_steps.py for the method.",
    ]
    if "tables" in result:
        tables = result["tables"]
        smallest = min(r["n"] for r in tables["summary"])
        lines += [
            "",
            f"## Step time vs table size (n users x n items, {tables['steps_per_run']} steps per run)",
            "",
            f"| n | optimizer | ms/step | x step(n={smallest:,}) | runs (ms/step) | setup (s) |",
            "|---:|---|---:|---:|---|---:|",
        ]
        for row in tables["summary"]:
            runs = ", ".join(f"{v:.1f}" for v in row["runs_ms"])
            lines.append(f"| {row['n']:,} | {row['optimizer']} | {row['median_ms']:.1f} | "
                         f"{row[f'ratio_to_{smallest}']:.2f} | {runs} | {row['setup_s']:.1f} |")
        lines += [
            "",
            f"Target: step(1M) <= {TARGET_RATIO} x step(10k). Setup: `build_model` plus `fit` up to the "
            "end of its first step (dataset, compile, tracing, optimizer slots), once per run, not in ms/step.",
        ]
    if "checkpoints" in result:
        ckpt = result["checkpoints"]
        lines += [
            "",
            f"## Checkpoint overhead (n = {ckpt['n']:,}, {ckpt['optimizer']}, {ckpt['steps_per_run']} steps per run)",
            "",
            "| checkpoints every | timed span (s) | overhead | fit wall (s) | overhead (fit wall) "
            "| ms/step | saves a run | s per save | runs span (s) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for row in ckpt["summary"]:
            runs = ", ".join(f"{v:.2f}" for v in row["runs_span_s"])
            lines.append(
                f"| {row['every']} | {row['span_s']:.2f} | {100 * row['overhead_span']:+.1f} % | "
                f"{row['fit_wall_s']:.2f} | {100 * row['overhead_fit_wall']:+.1f} % | {row['median_ms']:.1f} | "
                f"{row['saves_per_run']:g} | {row['seconds_per_save']:.2f} | {runs} |"
            )
        per_save = max(row["seconds_per_save"] for row in ckpt["summary"])
        default = TrainConfig().checkpoint_every_seconds or float("nan")
        lines += [
            "",
            f"At the default `train.checkpoint_every_seconds: {default:g}` a long run spends at most "
            f"{per_save:.2f} s / {default:g} s = {100 * per_save / default:.2f} % of its time saving at this "
            "table size (the slowest save above over the interval); a save costs a pass over the tables "
            "and optimizer slots, so it grows with n while a lazy step does not.",
        ]
        lines += [
            "",
            "Timed span: from the end of the warm-up steps to the end of training (saves included); "
            "fit wall: the whole `fit` call (dataset, tracing, final save). Overhead against every=0 (no "
            f"checkpoints). Target: <= {100 * TARGET_CHECKPOINT_FRACTION:.0f} %.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["all", "tables", "checkpoints"], default="all")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--optimizers", nargs="+", default=["adam", "lazy_adam"],
                        choices=["adam", "adagrad", "sgd", "lazy_adam", "rowwise_adagrad"])
    parser.add_argument("--steps", type=int, default=100, help="steps per run of the tables part")
    parser.add_argument("--checkpoint-size", type=int, default=100_000)
    parser.add_argument("--every", nargs="+", default=["0", "200", "50", "2s"],
                        help="checkpoint policies: 0 = none, N = every N steps, Ns = every N seconds")
    parser.add_argument("--checkpoint-steps", type=int, default=400, help="steps per run of the checkpoints part")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the tables part")
    parser.add_argument("--checkpoint-rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.part in ("all", "checkpoints") and "0" not in args.every:
        parser.error("--every must include 0 (the baseline without checkpoints)")

    began = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - began:7.1f}s] {message}", flush=True)

    result: dict[str, Any] = {
        "command": command("bench_steps"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine("tensorflow"),
        "args": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
    }
    if args.part in ("all", "tables"):
        result["tables"] = run_tables(args, log)
    if args.part in ("all", "checkpoints"):
        result["checkpoints"] = run_checkpoints(args, log)
    loads = [load for part in ("tables", "checkpoints") if part in result
             for runs in result[part]["runs"].values() for run in runs for load in run["load_1min"]]
    result["load_1min"] = {"min": min(loads), "max": max(loads), "mean": float(np.mean(loads))}
    result["total_s"] = time.perf_counter() - began
    write_report(args.out / "bench_steps", result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
