"""Step time of the training loop (``retrieval.training.loop``) against its bound, vs ID-table size, and
checkpoint overhead.

    python -m benchmarks.bench_steps                      # or: make bench-steps (~30 min on 2 busy cores)
    python -m benchmarks.bench_steps --part bound --bound-rounds 1 --bound-dims 64   # quick
    (one --part alone writes bench_steps_<part>.{json,md}, all of them bench_steps.{json,md})
    python -m benchmarks.bench_steps --part tables --sizes 10000 100000 --rounds 1   # quick

- ``bound``: the project's step beside the bare cost of the same shapes, in the same process. For
  each negatives kind (``in_batch``: the default model's in-batch softmax; ``shared``:
  ``model.loss.negatives: uniform`` with ``--shared-negatives`` uniform draws shared by the batch),
  each dimension of ``--bound-dims`` and batch of ``--bound-batches``, on Gowalla-sized ID tables
  (``--users`` x ``--items``): the project's step, ``retrieval.training.fit`` on the default model
  at that dimension and loss for two epochs of ``--bound-clicks`` clicks, once per
  ``train.steps_per_execution`` of ``--steps-per-execution``, timed as the second epoch's seconds
  over its steps (``fit``'s ``timing``: input, step, reading its values, Python around it; the first
  epoch holds the tracing); and the bare step (``bare_step``): the same gathers, L2 normalisation,
  logits matmul forward and backward and softmax cross-entropy written directly in TensorFlow on
  pre-built integer ids, its update a scatter of the touched rows (SGD), traced as a graph and
  compiled by XLA (``jit_compile=True``), timed over as many steps after warm-up, each
  step's loss read as the loop reads it. The bound is the faster of the two bare steps; the table
  gives step / bound and bound / step (the target: bound / step >= 0.5).

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
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import tensorflow as tf

import retrieval  # noqa: F401  (sets TF_USE_LEGACY_KERAS before tf.keras is first used)
from benchmarks._harness import (
    RESULTS,
    Stopwatch,
    command,
    data_dir,
    load_average,
    machine,
    markdown_table,
    timed,
    versions_of,
    write_report,
)
from retrieval.config import ColumnsConfig, LossConfig, ModelConfig, TableConfig, TrainConfig
from retrieval.data import ITEM, USER, read_clicks
from retrieval.features import FeatureStatistics
from retrieval.model import build_model
from retrieval.training import TrainingCheckpoint, fit, loop, seed_everything
from retrieval.training.sources import steps_per_epoch

BATCH = 1024
TARGET_BOUND_FRACTION = 0.5  # the loop's target: its step >= 0.5 x the bound (bound / step >= 0.5)
GOWALLA_USERS, GOWALLA_ITEMS = 29_858, 40_981
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
    with timed() as clock:
        model = build_model(ModelConfig(), stats)
    build = clock.seconds
    load_before = load_average()[0]
    start = time.perf_counter()
    saves: list[float] = []
    save = TrainingCheckpoint.save

    def timed_save(self, state):
        with timed() as clock:
            save(self, state)
        saves.append(clock.seconds)

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


def uptime() -> str:
    """``uptime``'s line (load averages), recorded beside the timings."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "uptime: unavailable; 1-min load average " + f"{load_average()[0]:.2f}"


def _bare_tables(users: int, items: int, dim: int) -> tuple[tf.Variable, tf.Variable]:
    """User and item tables ``[users + 1, dim]``, ``[items + 1, dim]`` (row 0: unknown), seeded."""
    return (tf.Variable(tf.random.uniform([users + 1, dim], -0.05, 0.05, seed=1)),
            tf.Variable(tf.random.uniform([items + 1, dim], -0.05, 0.05, seed=2)))


def _bare_candidates(item_rows: tf.Tensor, seed: tf.Tensor, shared: int, items: int) -> tf.Tensor:
    """The batch's item rows, then ``shared`` uniform rows drawn statelessly from ``seed`` (0: none)."""
    if not shared:
        return item_rows
    negatives = tf.random.stateless_uniform([shared], seed, minval=1, maxval=items + 1, dtype=tf.int32)
    return tf.concat([item_rows, negatives], axis=0)


def bare_step(users: int, items: int, dim: int, batch: int, shared: int, jit: bool, temperature: float = 0.1,
              learning_rate: float = 0.01
              ) -> tuple[Callable[[tf.Tensor, tf.Tensor, tf.Tensor], tf.Tensor], tuple[tf.Variable, tf.Variable]]:
    """A training step of the same shapes as the project's, with nothing around it.

    Tables ``[users + 1, dim]`` and ``[items + 1, dim]``; ``step(user_rows, item_rows, seed)``
    (int32 ``[batch]`` rows, an int32 ``[2]`` seed) gathers the batch's rows (and ``shared``
    uniform negative rows drawn statelessly from ``seed``; 0 = in-batch negatives), L2-normalises
    them, takes the logits (``[batch, batch]`` in-batch, or the positive's score beside
    ``[batch, shared]``) over ``temperature``, the mean softmax cross-entropy and its gradients
    with respect to the gathered rows, and subtracts ``learning_rate`` x those from the touched
    rows (a scatter), and returns the loss. Returns ``(step, (user_table, item_table))``.
    """
    user_table, item_table = _bare_tables(users, items, dim)

    @tf.function(jit_compile=jit)
    def step(user_rows, item_rows, seed):
        candidates = _bare_candidates(item_rows, seed, shared, items)
        with tf.GradientTape() as tape:
            query_vectors, candidate_vectors = tf.gather(user_table, user_rows), tf.gather(item_table, candidates)
            tape.watch([query_vectors, candidate_vectors])
            queries = tf.math.l2_normalize(query_vectors, axis=-1)
            docs = tf.math.l2_normalize(candidate_vectors, axis=-1)
            if shared:
                positive = tf.reduce_sum(queries * docs[:batch], axis=-1, keepdims=True)
                logits = tf.concat([positive, tf.matmul(queries, docs[batch:], transpose_b=True)], axis=1)
                labels = tf.zeros([batch], tf.int32)
            else:
                logits = tf.matmul(queries, docs, transpose_b=True)
                labels = tf.range(batch)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits / temperature))
        query_gradient, candidate_gradient = tape.gradient(loss, [query_vectors, candidate_vectors])
        user_table.scatter_sub(tf.IndexedSlices(learning_rate * query_gradient, user_rows))
        item_table.scatter_sub(tf.IndexedSlices(learning_rate * candidate_gradient, candidates))
        return loss

    return step, (user_table, item_table)


def bare_products(users: int, items: int, dim: int, batch: int, shared: int, learning_rate: float = 0.01
                  ) -> tuple[Callable[[tf.Tensor, tf.Tensor, tf.Tensor], tf.Tensor], tuple[tf.Variable, tf.Variable]]:
    """The products a step cannot do without, and nothing else: ``bare_step``'s gathers, its logits
    matmul forward and the two matmuls of its backward pass, and its scatter of the touched rows.

    The backward matmuls take the logits themselves as their incoming gradient (``dq = G d``,
    ``dd = G^T q`` with ``G = logits``): the shapes and the work of the real backward pass with no
    normalisation, softmax or loss around them. ``step(user_rows, item_rows, seed)`` returns a
    scalar read from the result, as the loop reads a step's loss.
    """
    user_table, item_table = _bare_tables(users, items, dim)

    @tf.function
    def step(user_rows, item_rows, seed):
        candidates = _bare_candidates(item_rows, seed, shared, items)
        queries, docs = tf.gather(user_table, user_rows), tf.gather(item_table, candidates)
        scored = docs[batch:] if shared else docs  # shared: the positives' dot products are O(batch x dim)
        logits = tf.matmul(queries, scored, transpose_b=True)
        query_gradient = tf.matmul(logits, scored)
        doc_gradient = tf.matmul(logits, queries, transpose_a=True)
        if shared:
            doc_gradient = tf.concat([queries, doc_gradient], axis=0)
        user_table.scatter_sub(tf.IndexedSlices(learning_rate * query_gradient, user_rows))
        item_table.scatter_sub(tf.IndexedSlices(learning_rate * doc_gradient, candidates))
        return logits[0, 0]

    return step, (user_table, item_table)


def time_bare(users: int, items: int, dim: int, batch: int, shared: int, jit: bool, steps: int,
              products: bool = False) -> dict[str, float]:
    """Mean wall and process CPU ms of ``steps`` bare steps (``products``: ``bare_products``) after 3
    warm-up steps (tracing, compiling), each loss read."""
    tf.keras.backend.clear_session()
    gc.collect()
    step, _ = (bare_products(users, items, dim, batch, shared) if products
               else bare_step(users, items, dim, batch, shared, jit))
    rng = np.random.default_rng(dim + batch)
    user_rows = tf.constant(rng.integers(1, users + 1, size=(steps + 3, batch)), tf.int32)
    item_rows = tf.constant(rng.integers(1, items + 1, size=(steps + 3, batch)), tf.int32)
    for warm in range(3):
        float(step(user_rows[warm], item_rows[warm], tf.constant([warm, 0])))
    seeds = [tf.constant([s, 0]) for s in range(3, steps + 3)]
    rows = [(user_rows[s], item_rows[s]) for s in range(3, steps + 3)]
    began, cpu = time.perf_counter(), time.process_time()
    for (users_of, items_of), seed in zip(rows, seeds, strict=True):
        float(step(users_of, items_of, seed))
    return {"ms": 1000 * (time.perf_counter() - began) / steps, "cpu_ms": 1000 * (time.process_time() - cpu) / steps}


def time_project(stats: FeatureStatistics, train: pd.DataFrame, dim: int, batch: int, negatives: str, shared: int,
                 per_call: int, score_dtype: str = "float32") -> dict[str, float]:
    """ms of the project's step: ``fit`` for 2 epochs, the second epoch's seconds over its steps."""
    tf.keras.backend.clear_session()
    gc.collect()
    config = TrainConfig(epochs=2, batch_size=batch, verbose=0, checkpoint_every_seconds=0, validation_fraction=0,
                         steps_per_execution=per_call)
    seed_everything(config.seed)
    loss = (LossConfig(score_dtype=score_dtype) if negatives == "in_batch"
            else LossConfig(negatives="uniform", num_negatives=shared, score_dtype=score_dtype))
    model = build_model(ModelConfig(embedding_dim=dim, loss=loss), stats)
    timed = second_epoch(model, train, config)
    steps = steps_per_epoch(len(train), batch)
    del model
    return {"ms": 1000 * timed["epoch_s"] / steps, "cpu_ms": 1000 * timed["cpu_s"] / steps,
            "first_epoch_s": timed["first_epoch_s"]}


def second_epoch(model, train: pd.DataFrame, config: TrainConfig) -> dict[str, float]:
    """``fit`` of ``model`` for ``config.epochs`` (2): the second epoch's wall and process CPU seconds
    (its timing, input and Python around the steps included), and the first's wall seconds (tracing)."""
    timing: dict[str, list[float]] = {}
    cpu = [time.process_time()]  # process CPU seconds at each epoch's end (after its timing)
    fit(model, train, config, timing=timing, epoch_hooks=[lambda epoch, logs: cpu.append(time.process_time())])
    return {"epoch_s": timing["epoch_seconds"][1], "cpu_s": cpu[2] - cpu[1],
            "first_epoch_s": timing["epoch_seconds"][0]}


def run_bound(args, log) -> dict[str, Any]:
    users, items = args.users, args.items
    every = range(max(users, items))  # each user and each item at least once: tables of exactly that many rows
    stats = FeatureStatistics.from_training_clicks(
        pd.DataFrame({USER: [f"u{i % users}" for i in every], ITEM: [f"i{i % items}" for i in every]})
    )
    frames = {}
    for batch in args.bound_batches:
        rng = np.random.default_rng(batch)
        rows = max(args.bound_clicks // batch, 2) * batch
        frames[batch] = pd.DataFrame({
            USER: np.char.add("u", rng.integers(0, users, size=rows).astype(str)),
            ITEM: np.char.add("i", rng.integers(0, items, size=rows).astype(str)),
        })
    shapes = [(kind, dim, batch) for kind in args.bound_negatives for dim in args.bound_dims
              for batch in args.bound_batches]
    # A project variant per (K, score dtype): "K=1", "K=1 bf16", ...
    project_labels = {f"K={k}" + ("" if dtype == "float32" else " bf16"): (k, dtype)
                      for k in args.steps_per_execution for dtype in args.score_dtypes}
    variants = [*(f"project/{label}" for label in project_labels), "bare/graph", "bare/xla", "bare/products"]
    runs: dict[str, dict[str, list[float]]] = {f"{kind}/{dim}/{batch}": {v: [] for v in variants}
                                               for kind, dim, batch in shapes}
    cpu_runs: dict[str, dict[str, list[float]]] = {key: {v: [] for v in variants} for key in runs}
    uptimes = [uptime()]
    for round_ in range(args.bound_rounds):
        for kind, dim, batch in rotated(shapes, round_):
            shared = args.shared_negatives if kind == "shared" else 0
            key = f"{kind}/{dim}/{batch}"
            for variant in rotated(variants, round_):
                if variant.startswith("project/"):
                    per_call, dtype = project_labels[variant.removeprefix("project/")]
                    timed = time_project(stats, frames[batch], dim, batch, kind, shared, per_call, dtype)
                else:
                    timed = time_bare(users, items, dim, batch, shared, variant == "bare/xla",
                                      max(args.bound_clicks // batch, 2), products=variant == "bare/products")
                runs[key][variant].append(timed["ms"])
                cpu_runs[key][variant].append(timed["cpu_ms"])
            medians = {v: statistics.median(runs[key][v]) for v in variants}
            log(f"bound round {round_} {key}: " + ", ".join(f"{v} {ms:.1f} ms" for v, ms in medians.items())
                + f" | {uptime()}")
        uptimes.append(uptime())
    summary = []
    for kind, dim, batch in shapes:
        key = f"{kind}/{dim}/{batch}"
        medians = {v: statistics.median(runs[key][v]) for v in variants}
        bound = min(medians["bare/graph"], medians["bare/xla"])
        project = {label: medians[f"project/{label}"] for label in project_labels}
        cpu = {v: statistics.median(cpu_runs[key][v]) for v in variants}
        cpu_bound = min(cpu["bare/graph"], cpu["bare/xla"])
        summary.append({
            "cpu_ms": cpu,
            "cpu_step_over_bound": {label: cpu[f"project/{label}"] / cpu_bound for label in project_labels},
            "negatives": kind, "dim": dim, "batch": batch,
            "shared_negatives": args.shared_negatives if kind == "shared" else 0,
            "project_ms": dict(project),
            "bare_graph_ms": medians["bare/graph"], "bare_xla_ms": medians["bare/xla"], "bound_ms": bound,
            "step_over_bound": {label: ms / bound for label, ms in project.items()},
            "bound_over_step": {label: bound / ms for label, ms in project.items()},
            "products_ms": medians["bare/products"],
            "products_over_step": {label: medians["bare/products"] / ms for label, ms in project.items()},
            "cpu_products_over_step": {label: cpu["bare/products"] / cpu[f"project/{label}"]
                                       for label in project_labels},
        })
    return {"users": users, "items": items, "clicks_per_epoch": args.bound_clicks, "uptime": uptimes,
            "summary": summary, "runs": runs, "cpu_runs": cpu_runs}


EPOCH_TARGETS_S = {64: 4.0, 256: 10.0}  # a Gowalla epoch on 2 cores, by dimension


def epoch_log(args) -> Path:
    """The epoch part's log: ``--epoch-log``, else Gowalla's ``train.txt`` under ``--data-dir``."""
    return args.epoch_log or args.data_dir / "gowalla" / "train.txt"


def run_epochs(args, log) -> dict[str, Any]:
    """Gowalla's training log (``train.txt``, held in memory as the job holds it; or ``--epoch-log``):
    ``fit`` of the default model at each dimension of ``--epoch-dims`` and each
    ``train.steps_per_execution`` of ``--epoch-steps-per-execution`` (0: the config's default), two
    epochs, the second timed."""
    path = epoch_log(args)
    clicks = read_clicks(TableConfig(path=str(path), format="user-items"), ColumnsConfig())
    stats = FeatureStatistics.from_training_clicks(clicks)
    configs = [(dim, k) for dim in args.epoch_dims for k in args.epoch_steps_per_execution]
    runs: dict[str, list[dict[str, float]]] = {f"{dim}/{k}": [] for dim, k in configs}
    uptimes = [uptime()]
    for round_ in range(args.epoch_rounds):
        for dim, k in rotated(configs, round_):
            tf.keras.backend.clear_session()
            gc.collect()
            config = TrainConfig(epochs=2, batch_size=BATCH, verbose=0, checkpoint_every_seconds=0,
                                 validation_fraction=0, steps_per_execution=k or None)
            seed_everything(config.seed)
            timed = second_epoch(build_model(ModelConfig(embedding_dim=dim), stats), clicks, config)
            runs[f"{dim}/{k}"].append({**timed, "steps_per_call": config.steps_per_call})
            log(f"epoch round {round_} dim {dim} K={config.steps_per_call}: {timed['epoch_s']:.2f} s | {uptime()}")
        uptimes.append(uptime())
    summary = [{
        "dim": dim, "steps_per_call": runs[f"{dim}/{k}"][0]["steps_per_call"], "default": k == 0,
        "epoch_s": statistics.median(r["epoch_s"] for r in runs[f"{dim}/{k}"]),
        "cpu_s": statistics.median(r["cpu_s"] for r in runs[f"{dim}/{k}"]),
        "target_s": EPOCH_TARGETS_S.get(dim),
    } for dim, k in configs]
    return {"log": str(path), "clicks": len(clicks), "users": len(stats.users), "items": len(stats.items),
            "batch": BATCH, "steps": steps_per_epoch(len(clicks), BATCH), "uptime": uptimes, "summary": summary,
            "runs": runs}


def epoch_markdown(epochs: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"## An epoch of {Path(epochs['log']).parent.name}/{Path(epochs['log']).name} ({epochs['clicks']:,} "
        f"training clicks, {epochs['users']:,} users x "
        f"{epochs['items']:,} items, batch {epochs['batch']:,}: {epochs['steps']} steps)",
        "",
        "`fit` of the default model (in-batch softmax, streaming log-Q, lazy Adam) on the log held in memory, "
        "as the job trains it; the second epoch's seconds (the first holds the tracing), medians over "
        "interleaved rounds. K: `train.steps_per_execution` (default: the config's own).",
        "",
    ]
    lines += markdown_table(
        ["dim", "K", "epoch (s)", "CPU s", "ms a step", "target (s)"],
        [[row["dim"], f"{row['steps_per_call']}" + (" (default)" if row["default"] else ""), f"{row['epoch_s']:.2f}",
          f"{row['cpu_s']:.2f}", f"{1000 * row['epoch_s'] / epochs['steps']:.1f}",
          "" if row["target_s"] is None else f"<= {row['target_s']:g}"]
         for row in epochs["summary"]],
        align="rlrrrr",
    )
    lines += ["", "`uptime` before, between rounds and after:", ""]
    lines += [f"    {line}" for line in epochs["uptime"]]
    return lines


def rotated(configs: list, round_: int) -> list:
    shift = round_ % len(configs)
    return configs[shift:] + configs[:shift]


def run_tables(args, log) -> dict[str, Any]:
    rows = args.steps * BATCH
    data = {}
    for n in args.sizes:
        with timed() as clock:
            data[n] = (FeatureStatistics.from_training_clicks(vocabulary_frame(n)), training_frame(n, rows, seed=1))
        log(f"tables: data for n={n} in {clock.seconds:.1f}s")
    configs = [(n, opt) for n in args.sizes for opt in args.optimizers]
    runs: dict[str, list[dict]] = {f"{n}/{opt}": [] for n, opt in configs}
    for round_ in range(args.rounds):
        for n, opt in rotated(configs, round_):
            # One step a call: StepTimer stamps each step's end (a graph loop of several has none).
            config = TrainConfig(epochs=1, batch_size=BATCH, optimizer=opt, verbose=0, checkpoint_every_steps=0,
                                 steps_per_execution=1)
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
                                 steps_per_execution=1,  # StepTimer stamps each step
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


def bound_markdown(bound: dict[str, Any]) -> list[str]:
    per_calls = list(bound["summary"][0]["project_ms"])
    lines = [
        "",
        f"## The project's step against its bound ({bound['users']:,} users x {bound['items']:,} items, "
        f"{bound['clicks_per_epoch']:,} clicks an epoch)",
        "",
        "Project: `fit` of the default model at that dimension (`shared`: `model.loss.negatives: uniform`, "
        "the draws shared by the batch), the second epoch's seconds over its steps, for each "
        "`train.steps_per_execution` (K; bf16: `model.loss.score_dtype: bfloat16`). Bare: the same shapes "
        "written directly (gathers, L2 normalise, "
        "logits matmul forward and backward, softmax cross-entropy, scatter of the touched rows), as a graph "
        "and compiled by XLA; bound = the faster. Medians over interleaved rounds.",
        "",
    ]

    def first_cells(row: dict[str, Any]) -> list[Any]:
        kind = row["negatives"] + (f" ({row['shared_negatives']})" if row["shared_negatives"] else "")
        return [kind, row["dim"], f"{row['batch']:,}"]

    lines += markdown_table(
        ["negatives", "dim", "batch", *(f"project {k} (ms)" for k in per_calls), "bare graph (ms)", "bare XLA (ms)",
         *(f"step / bound {k}" for k in per_calls), *(f"bound / step {k}" for k in per_calls)],
        [[*first_cells(row), *(f"{row['project_ms'][k]:.1f}" for k in per_calls), f"{row['bare_graph_ms']:.1f}",
          f"{row['bare_xla_ms']:.1f}", *(f"{row['step_over_bound'][k]:.2f}" for k in per_calls),
          *(f"{row['bound_over_step'][k]:.2f}" for k in per_calls)]
         for row in bound["summary"]],
        align="l" + "r" * (3 * len(per_calls) + 4),
    )
    lines += [
        "",
        "The same in process CPU time per step (less sensitive to other processes on a shared machine; "
        "two cores give up to 2 CPU ms a wall ms):",
        "",
    ]
    lines += markdown_table(
        ["negatives", "dim", "batch", *(f"project {k} (CPU ms)" for k in per_calls), "bare graph (CPU ms)",
         "bare XLA (CPU ms)", *(f"step / bound {k}" for k in per_calls)],
        [[*first_cells(row), *(f"{row['cpu_ms'][f'project/{k}']:.1f}" for k in per_calls),
          f"{row['cpu_ms']['bare/graph']:.1f}", f"{row['cpu_ms']['bare/xla']:.1f}",
          *(f"{row['cpu_step_over_bound'][k]:.2f}" for k in per_calls)]
         for row in bound["summary"]],
        align="l" + "r" * (2 * len(per_calls) + 4),
    )
    if "products_ms" in bound["summary"][0]:  # rows run before this column have no products
        lines += [
            "",
            "Against the products alone (`bare_products`: the gathers, the logits matmul forward and the two "
            "matmuls of its backward pass, the scatter of the touched rows; no normalisation, softmax or "
            "optimizer), wall and CPU:",
            "",
        ]
        lines += markdown_table(
            ["negatives", "dim", "batch", "products (ms)", "products (CPU ms)",
             *(f"products / step {k}" for k in per_calls), *(f"products / step {k} (CPU)" for k in per_calls)],
            [[*first_cells(row), f"{row['products_ms']:.1f}", f"{row['cpu_ms']['bare/products']:.1f}",
              *(f"{row['products_over_step'][k]:.2f}" for k in per_calls),
              *(f"{row['cpu_products_over_step'][k]:.2f}" for k in per_calls)]
             for row in bound["summary"]],
            align="l" + "r" * (2 * len(per_calls) + 4),
        )
    lines += ["", f"Target: bound / step >= {TARGET_BOUND_FRACTION}. `uptime` before, between rounds and after:", ""]
    lines += [f"    {line}" for line in bound["uptime"]]
    return lines


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Step time of the training loop (retrieval.training.loop): its bound, ID-table size, checkpoint overhead",
        "",
        f"`{result['command']}` on {result['machine']['cpus']} CPUs ({result['machine']['platform']}, "
        f"TensorFlow {versions_of(result['machine'])['tensorflow']}), {result['date']}. 1-min load average during the "
        f"runs: {result['load_1min']['min']:.2f}-{result['load_1min']['max']:.2f} "
        f"(mean {result['load_1min']['mean']:.2f}).",
        "",
        "Tables and checkpoints: default model (ID towers, dim 64, in-batch softmax), batch 1024, "
        f"`retrieval.training.fit`; median step after {result['args']['warmup']} warm-up steps, median over "
        f"{result['args']['rounds']} (tables) and {result['args']['checkpoint_rounds']} (checkpoints) interleaved "
        "rounds. See the module docstring of benchmarks/bench_steps.py for the method.",
    ]
    if "bound" in result:
        lines += bound_markdown(result["bound"])
    if "epoch" in result:
        lines += epoch_markdown(result["epoch"])
    if "tables" in result:
        tables = result["tables"]
        smallest = min(r["n"] for r in tables["summary"])
        lines += [
            "",
            f"## Step time vs table size (n users x n items, {tables['steps_per_run']} steps per run)",
            "",
            *markdown_table(
                ["n", "optimizer", "ms/step", f"x step(n={smallest:,})", "runs (ms/step)", "setup (s)"],
                [[f"{row['n']:,}", row["optimizer"], f"{row['median_ms']:.1f}", f"{row[f'ratio_to_{smallest}']:.2f}",
                  ", ".join(f"{v:.1f}" for v in row["runs_ms"]), f"{row['setup_s']:.1f}"]
                 for row in tables["summary"]],
                align="rlrrlr",
            ),
        ]
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
            *markdown_table(
                ["checkpoints every", "timed span (s)", "overhead", "fit wall (s)", "overhead (fit wall)", "ms/step",
                 "saves a run", "s per save", "runs span (s)"],
                [[row["every"], f"{row['span_s']:.2f}", f"{100 * row['overhead_span']:+.1f} %",
                  f"{row['fit_wall_s']:.2f}", f"{100 * row['overhead_fit_wall']:+.1f} %", f"{row['median_ms']:.1f}",
                  f"{row['saves_per_run']:g}", f"{row['seconds_per_save']:.2f}",
                  ", ".join(f"{v:.2f}" for v in row["runs_span_s"])]
                 for row in ckpt["summary"]],
                align="rrrrrrrrl",
            ),
        ]
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
    parser.add_argument("--part", choices=["all", "bound", "epoch", "tables", "checkpoints"], default="all")
    parser.add_argument("--data-dir", type=Path, default=data_dir(), help="public datasets (epoch part: gowalla/)")
    parser.add_argument("--epoch-log", type=Path, default=None,
                        help="user-items log of the epoch part (default: gowalla/train.txt under --data-dir)")
    parser.add_argument("--epoch-dims", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--epoch-steps-per-execution", type=int, nargs="+", default=[1, 0],
                        help="train.steps_per_execution values of the epoch part; 0 = the config's default")
    parser.add_argument("--epoch-rounds", type=int, default=2, help="interleaved rounds of the epoch part")
    parser.add_argument("--bound-dims", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--bound-batches", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--bound-negatives", nargs="+", default=["in_batch", "shared"], choices=["in_batch", "shared"])
    parser.add_argument("--shared-negatives", type=int, default=800, help="uniform negatives shared by a batch")
    parser.add_argument("--score-dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                        help="model.loss.score_dtype values of the project's step (bound part)")
    parser.add_argument("--steps-per-execution", type=int, nargs="+", default=[1, 8],
                        help="train.steps_per_execution values of the project's step")
    parser.add_argument("--bound-clicks", type=int, default=65_536,
                        help="clicks an epoch of the project's runs, and bare steps timed x batch")
    parser.add_argument("--bound-rounds", type=int, default=3, help="interleaved rounds of the bound part")
    parser.add_argument("--users", type=int, default=GOWALLA_USERS, help="user table rows of the bound part")
    parser.add_argument("--items", type=int, default=GOWALLA_ITEMS, help="item table rows of the bound part")
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

    clock = Stopwatch()

    def log(message: str) -> None:
        print(f"[{clock.seconds:7.1f}s] {message}", flush=True)

    result: dict[str, Any] = {
        "command": command("bench_steps"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine("tensorflow"),
        "args": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
    }
    if args.part in ("all", "bound"):
        result["bound"] = run_bound(args, log)
    if args.part == "epoch" or (args.part == "all" and epoch_log(args).is_file()):
        result["epoch"] = run_epochs(args, log)
    elif args.part == "all":
        log(f"epoch part skipped: no log at {epoch_log(args)} (--epoch-log, --data-dir or $RETRIEVAL_DATA_DIR)")
    if args.part in ("all", "tables"):
        result["tables"] = run_tables(args, log)
    if args.part in ("all", "checkpoints"):
        result["checkpoints"] = run_checkpoints(args, log)
    loads = [load for part in ("tables", "checkpoints") if part in result
             for runs in result[part]["runs"].values() for run in runs for load in run["load_1min"]]
    loads = loads or [load_average()[0]]
    result["load_1min"] = {"min": min(loads), "max": max(loads), "mean": float(np.mean(loads))}
    result["total_s"] = clock.seconds
    # One part alone does not overwrite the report of all of them: bench_steps_<part>.{json,md}.
    name = "bench_steps" if args.part == "all" else f"bench_steps_{args.part}"
    write_report(args.out / name, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
