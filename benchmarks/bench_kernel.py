"""Kernel-based sampled softmax (Blanc & Rendle, ICML 2018) against static samplers and full softmax.

    python -m benchmarks.bench_kernel                          # or: make bench-kernel
    python -m benchmarks.bench_kernel --datasets ml100k --m 8 64 --samplers uniform kernel --epochs 1  # quick
    python -m benchmarks.bench_kernel --part report            # rewrite md/png from the JSON
    python -m benchmarks.bench_kernel --part curve             # step time at 10k/100k/1M items alone (~10 min)

For m in ``--m`` negatives per step, sampled softmax with uniform, unigram^0.75,
popularity (unigram^1) and kernel negatives, against the exact full softmax,
on MovieLens 100K (configs/ml100k.yaml: temporal split, ID towers, dim 64,
normalised, temperature 0.2, Adam 0.01, batch 1024) and a synthetic log with
100k items (configs/default.yaml's model and training, generator scaled up).
Every row trains a fixed number of epochs (no early stopping, so rows are
comparable) with static log-Q correction and no in-batch negatives: the
uniform/unigram/popularity rows share m draws per batch
(``tf.random.*_candidate_sampler``-style), the kernel row draws m per query
(with replacement, exact log Q = log(m K(q, d) / sum K), tree rebuilt every
``model.loss.kernel.refresh_steps`` steps).

Columns: recall@20 / NDCG@20 on the test split over the whole catalogue (the
users' training items masked, as ``make train`` evaluates); the full-softmax
training loss after training, computed exactly over every item on a fixed
sample of training rows; training wall time; and the sampling cost of one
step (``sampler.sample`` alone on one training batch of the trained model,
median of repeats; for the kernel also the tree rebuild, amortised over
``refresh_steps``). Results merge into ``--out``/bench_kernel.json row by
row, so a partial run keeps what it measured.
"""

from __future__ import annotations

import os

# The kernel sampler's numpy runs inside TensorFlow's step; multi-threaded OpenBLAS spin-waits
# against TensorFlow's own threads on a small machine (measured 3x slower on 2 cores).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import retrieval  # noqa: E402,F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)
from benchmarks._harness import (  # noqa: E402
    RESULTS,
    command,
    describe_machine,
    load_average,
    machine,
    pyplot,
    save_figure,
    write_report,
)
from benchmarks._quality import Prepared, metrics_of, prepare_config  # noqa: E402
from retrieval.config import load_config  # noqa: E402
from retrieval.data import ITEM, USER, locate_movielens_100k  # noqa: E402
from retrieval.model import build_model  # noqa: E402
from retrieval.samplers import KernelSampler  # noqa: E402
from retrieval.training import fit, seed_everything  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
K = 20
M_VALUES = [8, 16, 32, 64, 128, 256, 512]

# (config file, overrides) per dataset. The synthetic log keeps configs/default.yaml's generator
# shape (20 taste clusters, Zipf popularity) at 100k items; users and clicks are sized so a
# training run of the slowest row (full softmax) fits the budget on 2 cores.
DATASETS: dict[str, tuple[Path, list[str]]] = {
    "ml100k": (ROOT / "configs/ml100k.yaml", []),
    "synthetic100k": (
        ROOT / "configs/default.yaml",
        [
            "data.synthetic.n_items=100000",
            "data.synthetic.n_users=4000",
            "data.synthetic.mean_clicks_per_user=12",
            # Kernel draws cost per query, full softmax per (query, item): a smaller batch gives
            # 4x the updates for the same sampling cost per epoch.
            "train.batch_size=256",
        ],
    ),
}
DEFAULT_EPOCHS = {"ml100k": 3, "synthetic100k": 2}
# Kernel rows of the default run; the others use every m. At 100k items a kernel draw walks
# ~13 tree levels at O(D^2) each (see bench_kernel.md for the measured cost), so the default run
# leaves the synthetic kernel rows at m = 8, 32, 128; the rest:
#   python -m benchmarks.bench_kernel --datasets synthetic100k --samplers kernel --kernel-m 16 64 256 512
DEFAULT_KERNEL_M = {"ml100k": M_VALUES, "synthetic100k": [8, 32, 128]}
NOTES = [
    "- Budget (2 shared CPU cores, ~40 min for `make bench-kernel`): ML-100K 3 epochs of batch 1024 "
    "(Adam 0.01, as configs/ml100k.yaml); synthetic 100k items x 4,000 users x ~12 clicks, 2 epochs of "
    "batch 256; one seed per row; 2,000 evaluated users at most; full-softmax loss on 5,000 training rows.",
    "- Kernel: alpha = 100 on the raw (L2-normalised) tower dot product, leaf size 32, tree rebuilt every "
    "100 steps (the library defaults, not tuned). Its sampling runs in numpy (tf.numpy_function) on one "
    "BLAS thread; the static samplers are TensorFlow ops.",
    "- Default kernel m on the synthetic corpus: 8, 32, 128 (see DEFAULT_KERNEL_M in the script for the "
    "command of the rest).",
    "- The synthetic catalogue has 100,000 items, but with ~48k clicks and Zipf popularity only ~14.7k "
    "have training clicks: the towers' vocabulary, hence every softmax and sampler, spans those; evaluation "
    "ranks the whole 100k catalogue (unclicked items score 0, as in the FAISS index). A 100k-item "
    "vocabulary needs ~10x the clicks, beyond this budget.",
    "- One seed per row (the seed-to-seed spread was not measured); ML-100K's temporal split leaves 109 "
    "evaluated users, so do not over-read recall@20 differences of a hundredth or two there. The full-softmax "
    "loss (5,000 training rows) moves smoothly with m.",
    "- Training seconds are wall time on the shared machine: the synthetic kernel rows m = 16, 64, 256, 512 "
    "ran after the others, with less contention.",
    "- Sampling ms per step of the static samplers (~1 ms) is mostly the call overhead of one tf.function. "
    "The kernel's is numpy, measured on a machine shared with other jobs (load ~6 on 2 cores): absolute "
    "times are inflated. At these sizes it costs more than the full softmax step itself: a kernel draw "
    "walks log2(n / leaf) tree levels at D(D+1)/2 = 2,080 multiply-adds each (D = 64), while a full-softmax "
    "row costs n * D = 103k (ML-100K) or 943k (14.7k items) multiply-adds, plus a tree rebuild every "
    "refresh_steps.",
]

# Only the candidates change between rows; static log-Q, no in-batch negatives, no hard negatives.
COMMON = [
    "train.verbose=0",
    "train.validation_fraction=0",
    "model.loss.hard_negatives=none",
    "model.log_q_correction=true",
    "model.loss.log_q_source=static",
]
SAMPLERS: dict[str, list[str]] = {
    "uniform": ["model.loss.kind=softmax", "model.loss.negatives=uniform"],
    "unigram^0.75": [
        "model.loss.kind=softmax",
        "model.loss.negatives=unigram",
        "model.loss.unigram_alpha=0.75",
    ],
    "popularity": ["model.loss.kind=softmax", "model.loss.negatives=unigram", "model.loss.unigram_alpha=1.0"],
    "kernel": ["model.loss.kind=softmax", "model.loss.negatives=kernel"],
}
FULL = "full softmax"


def prepare(name: str, eval_users: int) -> Prepared:
    """Split the dataset and build its evaluation set (at most ``eval_users`` test users, seeded)."""
    path, overrides = DATASETS[name]
    return prepare_config(name, load_config(path, [*COMMON, *overrides]), eval_users)


def rank_model(model, data: Prepared, k: int = K, chunk: int = 512) -> np.ndarray:
    """Top-k catalogue rows per evaluated user, by the model's dot product, in user chunks.

    Equal to ``bench_losses.rank_scores(model_scores(...))`` but never holds the
    [users, catalogue] score matrix (100k items): items without training clicks
    score 0, the OOV embedding, as in the FAISS index.
    """
    catalogue = model.embed_catalogue().numpy()[data.catalogue_index]  # [num_catalogue, dim]
    catalogue[data.catalogue_index == 0] = 0.0
    users = np.asarray(data.eval_set.user_ids, dtype=object)
    ranked = []
    for start in range(0, len(users), chunk):
        queries = model.query_tower({USER: tf.constant(users[start : start + chunk])}).numpy()
        scores = (queries @ catalogue.T).astype(np.float64)
        for row, excluded in enumerate(data.eval_set.exclude[start : start + chunk]):
            scores[row, excluded] = -np.inf
        top = np.argpartition(-scores, k, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1, kind="stable")
        ranked.append(np.take_along_axis(top, order, axis=1))
    return np.concatenate(ranked)


def full_softmax_loss(model, clicks, chunk: int = 512) -> float:
    """Mean exact ``-log softmax(q . d_pos / T)`` over every vocabulary item, on ``clicks`` rows."""
    items = model.embed_catalogue().numpy()[1:].astype(np.float64)
    temperature = model.objective.temperature
    total = 0.0
    for start in range(0, len(clicks), chunk):
        part = clicks.iloc[start : start + chunk]
        users = tf.constant(part[USER].astype(str).to_numpy(dtype=object))
        queries = model.query_tower({USER: users}).numpy()
        logits = queries.astype(np.float64) @ items.T / temperature
        rows = model.item_index(tf.constant(part[ITEM].astype(str).to_numpy(dtype=object))).numpy() - 1
        top = logits.max(axis=1)
        log_partition = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
        total += float(np.sum(log_partition - logits[np.arange(len(rows)), rows]))
    return total / len(clicks)


def sampling_cost(model, data: Prepared, batch_size: int, repeats: int = 5) -> dict:
    """Milliseconds of ``sampler.sample`` for one training batch (median), and the kernel's rebuild."""
    clicks = data.train.sample(n=min(batch_size, len(data.train)), random_state=0)  # one training batch
    batch = {column: tf.constant(clicks[column].astype(str).to_numpy()) for column in (USER, ITEM)}
    positive_ids = model.item_index(batch[ITEM])
    queries = model.query_tower({USER: batch[USER]})
    sampler = model.sampler
    sample = tf.function(lambda p, q: sampler.sample(p, queries=q, embed_catalogue=model.embed_catalogue))
    result = {}
    if isinstance(sampler, KernelSampler):
        started = time.perf_counter()
        sampler.refresh(model.embed_catalogue().numpy())
        result["refresh_ms"] = (time.perf_counter() - started) * 1000
        result["refresh_ms_per_step"] = result["refresh_ms"] / sampler.refresh_steps
        sampler.step.assign(1)  # off the refresh schedule: time the draws alone
    tf.nest.map_structure(lambda t: t.numpy(), sample(positive_ids, queries))  # trace
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        tf.nest.map_structure(lambda t: t.numpy(), sample(positive_ids, queries))
        times.append(time.perf_counter() - started)
    result["sample_ms"] = statistics.median(times) * 1000
    result["sampling_ms_per_step"] = result["sample_ms"] + result.get("refresh_ms_per_step", 0.0)
    return result


def train_row(data: Prepared, overrides: list[str], epochs: int, seed: int, loss_rows) -> dict:
    path, dataset_overrides = DATASETS[data.name]
    config = load_config(
        path,
        [*COMMON, *dataset_overrides, f"train.epochs={epochs}", f"train.seed={42 + seed}",
         f"model.loss.seed={seed}", *overrides],
    )
    seed_everything(config.train.seed)
    model = build_model(config.model, data.stats, train_clicks=data.train)
    started = time.perf_counter()
    history = fit(model, data.train, config.train, split=config.split)
    seconds = time.perf_counter() - started
    result = metrics_of(rank_model(model, data), data)
    steps = epochs * -(-len(data.train) // config.train.batch_size)
    result.update(
        full_softmax_loss=full_softmax_loss(model, loss_rows),
        sampled_loss=history["loss"][-1],
        train_seconds=seconds,
        train_ms_per_step=seconds / steps * 1000,
        epochs=epochs,
        steps=steps,
    )
    if config.model.loss.kind != "full_softmax":
        result.update(sampling_cost(model, data, config.train.batch_size))
    return result


def summarise(runs: list[dict]) -> dict:
    summary = {"runs": len(runs), "users": runs[0]["users"]}
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and key not in ("users", "tail_users"):
            values = [run[key] for run in runs]
            summary[key] = statistics.fmean(values)
            summary[f"{key}_std"] = statistics.pstdev(values) if len(values) > 1 else 0.0
    return summary


# -- reports ---------------------------------------------------------------------------


def _cell(summary: dict | None, key: str, digits: int = 4) -> str:
    if summary is None or key not in summary:
        return ""
    text = f"{summary[key]:.{digits}f}"
    return text + (f" ± {summary[key + '_std']:.{digits}f}" if summary["runs"] > 1 else "")


def markdown(report: dict) -> str:
    lines = [
        "# Kernel-based sampled softmax (Blanc & Rendle 2018) vs static samplers\n",
        "Sampled softmax with m negatives per step from uniform, unigram^0.75, popularity (unigram^1) "
        "or the quadratic kernel of the current model, against the exact full softmax. Static log-Q, "
        "no in-batch negatives, fixed epochs (no early stopping). Static samplers share their m draws "
        "across the batch; the kernel draws m per query. recall@20 on the test split over the whole "
        "catalogue; full-softmax loss = exact mean -log softmax over every item on a fixed sample of "
        "training rows after training (lower is better); sampling = `sampler.sample` on one batch "
        "(kernel: + tree rebuild / refresh_steps).\n",
    ]
    for name, part in report.get("datasets", {}).items():
        lines += [
            f"## {name}: {part['description']}\n",
            *(f"`{command}`  " for command in part.get("commands", [])),
            "",
        ]
        rows = part["rows"]
        full = rows.get(FULL)
        if full:
            lines.append(
                f"Full softmax: recall@{K} {_cell(full, f'recall@{K}')}, full-softmax loss "
                f"{_cell(full, 'full_softmax_loss', 3)}, {full['train_ms_per_step']:.0f} ms/step, "
                f"{full['train_seconds']:.0f} s.\n"
            )
        for metric, title, digits in (
            (f"recall@{K}", f"recall@{K}", 4),
            ("full_softmax_loss", "full-softmax training loss", 3),
            ("sampling_ms_per_step", "sampling ms per step", 1),
            ("train_seconds", "training seconds", 0),
        ):
            samplers = [s for s in SAMPLERS if s in rows]
            ms = sorted({int(m) for s in samplers for m in rows[s]})
            if not samplers:
                continue
            lines += [
                f"### {title}\n",
                "| sampler | " + " | ".join(f"m={m}" for m in ms) + " |",
                "|---" * (len(ms) + 1) + "|",
            ]
            for sampler in samplers:
                cells = [_cell(rows[sampler].get(str(m)), metric, digits) for m in ms]
                lines.append(f"| {sampler} | " + " | ".join(cells) + " |")
            if full and metric in (f"recall@{K}", "full_softmax_loss"):
                lines.append(f"| {FULL} | " + " | ".join(_cell(full, metric, digits) for _ in ms) + " |")
            lines.append("")
    if "curve" in report:
        lines += curve_markdown(report["curve"])
    if "notes" in report:
        lines += ["## Budget and notes\n", *report["notes"], ""]
    if "machine" in report:
        lines.append(f"Machine: {describe_machine(report['machine'])}\n")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()

    datasets = list(report.get("datasets", {}))
    if not datasets:
        return
    fig, axes = plt.subplots(2, len(datasets), figsize=(6 * len(datasets), 8), squeeze=False)
    for column, name in enumerate(datasets):
        rows = report["datasets"][name]["rows"]
        for line, (metric, label) in enumerate(
            ((f"recall@{K}", f"recall@{K} (test)"), ("full_softmax_loss", "full-softmax training loss"))
        ):
            ax = axes[line][column]
            for sampler in SAMPLERS:
                if sampler not in rows:
                    continue
                ms = sorted(int(m) for m in rows[sampler])
                values = [rows[sampler][str(m)][metric] for m in ms]
                errors = [rows[sampler][str(m)].get(f"{metric}_std", 0.0) for m in ms]
                ax.errorbar(ms, values, yerr=errors, marker="o", capsize=3, label=sampler)
            if FULL in rows:
                ax.axhline(rows[FULL][metric], color="black", linestyle="--", label=FULL)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("negatives per step m")
            ax.set_ylabel(label)
            ax.set_title(f"{name}: {label}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


def write(report: dict, out: Path) -> None:
    write_report(out / "bench_kernel", report, markdown(report))
    plot(report, out / "bench_kernel.png")


# -- wall-clock curve: one training step at n items --------------------------------------

CURVE_SIZES = [10_000, 100_000, 1_000_000]
CURVE_NOTES = [
    "- Step = forward, backward and SGD update of one batch on an ID-tower model (item table "
    "[n + 1, D], user table [10,000, D], both trained), random L2-normalised embeddings, temperature 0.2, "
    "uniformly random users and positives. Full softmax: logits against every item (in query chunks of at "
    "most 2^28 logits, gradients accumulated: the same arithmetic, bounded memory), dense item update. "
    "Sampled rows: m draws per query with log-Q correction and accidental-hit removal, sparse updates of "
    "the rows they touch. Uniform: per-query uniform draws (TensorFlow op). Kernel: KernelSampler "
    "(alpha 100, leaf 32) inside the step (tf.numpy_function, one BLAS thread).",
    "- Random unit vectors make the kernel nearly flat (alpha (q.d)^2 ~ 1.6 on average): nearly every draw "
    "reaches a leaf of its own, the most distinct (query, node) pairs, hence the slowest case for the walk; "
    "trained embeddings concentrate the draws.",
    "- Rows are measured side by side, interleaved (full, uniform, kernel, full, ...): median of the timed "
    "steps after one warm-up step each. The kernel's draw step runs off the refresh schedule; the tree "
    "refresh is timed apart, after one kernel step whose sparse update changed the rows it touched: "
    "'diff' = KernelSampler.refresh (reads the whole table, compares, recomputes the changed rows' "
    "ancestors), 'ids' = KernelSampler.update_rows with the step's ids (no scan), 'rebuild' = a full "
    "QuadraticKernelTree.refresh. kernel step @ k = draw step + diff / k; "
    "k = 100 is the library default (model.loss.kernel.refresh_steps). With m = 64 draws per query a step "
    "touches up to batch x 65 rows, half of a 100k catalogue, so a refresh there costs about a rebuild.",
    "- The dataset tables above (recall, loss, sampling ms, training seconds) were measured before the "
    "sampler was vectorised (per-level walk, incremental refresh); their kernel sampling ms are the old "
    "implementation's.",
]


def _normalised(rng: np.random.Generator, rows: int, dim: int) -> np.ndarray:
    values = rng.normal(size=(rows, dim)).astype(np.float32)
    return values / np.linalg.norm(values, axis=1, keepdims=True)


def curve_point(num_items: int, *, dim: int, batch: int, m: int, repeats: int, seed: int = 0) -> dict:
    """Median step milliseconds of full softmax, uniform and kernel sampled softmax at ``num_items``."""
    rng = np.random.default_rng(seed)
    temperature, lr, num_users = 0.2, 0.05, 10_000
    catalogue = _normalised(rng, num_items + 1, dim)
    catalogue[0] = 0.0  # the ID tower's OOV row
    items = tf.Variable(catalogue)
    users = tf.Variable(_normalised(rng, num_users, dim))
    # Query chunks of the full softmax: at most 2^28 logits (1 GiB) alive at once.
    chunk = max(1, min(batch, (1 << 28) // (num_items + 1)))

    @tf.function
    def full_step(user_ids, positive_ids):
        item_grad = tf.zeros_like(items)
        total = tf.constant(0.0)
        for start in range(0, batch, chunk):  # unrolled; each chunk waits for the previous one
            with tf.control_dependencies([item_grad]):
                part_users, part_pos = user_ids[start : start + chunk], positive_ids[start : start + chunk]
                with tf.GradientTape() as tape:
                    queries = tf.gather(users, part_users)
                    logits = tf.matmul(queries, items, transpose_b=True) / temperature
                    loss = tf.reduce_sum(
                        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=part_pos, logits=logits)
                    ) / batch
                grad_users, grad_items = tape.gradient(loss, [users, items])
                users.scatter_sub(tf.IndexedSlices(lr * grad_users.values, grad_users.indices))
                item_grad = item_grad + grad_items
                total += loss
        items.assign_sub(lr * item_grad)
        return total

    def sampled_loss(user_ids, positive_ids, negative_ids, log_q, positive_log_q):
        with tf.GradientTape() as tape:
            queries = tf.gather(users, user_ids)
            positive = tf.reduce_sum(queries * tf.gather(items, positive_ids), axis=1) / temperature
            negative = tf.einsum("bd,bmd->bm", queries, tf.gather(items, negative_ids)) / temperature
            negative = tf.where(negative_ids == positive_ids[:, None], -1e9, negative - log_q)
            logits = tf.concat([(positive - positive_log_q)[:, None], negative], axis=1)
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.zeros_like(user_ids), logits=logits)
            )
        for variable, grad in zip((users, items), tape.gradient(loss, [users, items]), strict=True):
            variable.scatter_sub(tf.IndexedSlices(lr * grad.values, grad.indices))
        return loss

    @tf.function
    def uniform_step(user_ids, positive_ids):
        negative_ids = tf.random.uniform([batch, m], 1, num_items + 1, dtype=tf.int64)
        log_q = tf.math.log(tf.constant(m / num_items, tf.float32))
        return sampled_loss(user_ids, positive_ids, negative_ids, log_q, tf.fill([batch], log_q))

    sampler = KernelSampler(num_items, m, alpha=100.0, leaf_size=32, refresh_steps=10**9, seed=seed)

    @tf.function
    def kernel_step(user_ids, positive_ids):
        queries = tf.gather(users, user_ids)
        negatives = sampler.sample(positive_ids, queries=queries, embed_catalogue=items.read_value)
        loss = sampled_loss(user_ids, positive_ids, negatives.ids, negatives.log_q, negatives.positive_log_q)
        return loss, negatives.ids

    def batch_ids():
        return (
            tf.constant(rng.integers(0, num_users, batch), tf.int64),
            tf.constant(rng.integers(1, num_items + 1, batch), tf.int64),
        )

    steps = {
        FULL: lambda: full_step(*batch_ids()).numpy(),
        "uniform": lambda: uniform_step(*batch_ids()).numpy(),
        "kernel": lambda: kernel_step(*batch_ids())[0].numpy(),
    }
    started = time.perf_counter()
    steps["kernel"]()  # traces, and builds the tree (first call)
    result: dict = {"num_items": num_items, "kernel_build_ms": (time.perf_counter() - started) * 1000}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()  # warm-up (traces)
    for _ in range(repeats):
        for name, step in steps.items():
            started = time.perf_counter()
            step()
            times[name].append((time.perf_counter() - started) * 1000)
    for name, values in times.items():
        result[f"{name}_ms"] = statistics.median(values)
        result[f"{name}_ms_all"] = values
    # Tree refresh after one kernel step, whose sparse SGD update changed exactly the rows it touched
    # (the full-softmax steps above moved every row: bring the tree up to date first).
    sampler.refresh(items.numpy())
    user_ids, positive_ids = batch_ids()
    _, negative_ids = kernel_step(user_ids, positive_ids)
    touched = np.unique(np.concatenate([positive_ids.numpy(), negative_ids.numpy().ravel()]))
    before = (sampler.refreshes, sampler.rebuilds, sampler.rows_updated)
    started = time.perf_counter()
    sampler.refresh(items.numpy())
    result["refresh_diff_ms"] = (time.perf_counter() - started) * 1000
    result["refresh_rows"] = sampler.rows_updated - before[2]
    result["refresh_rebuilt"] = sampler.rebuilds > before[1]
    result["touched_rows"] = len(touched)
    started = time.perf_counter()
    sampler.update_rows(touched, tf.gather(items, touched).numpy())
    result["refresh_ids_ms"] = (time.perf_counter() - started) * 1000
    assert sampler.tree is not None
    started = time.perf_counter()
    sampler.tree.refresh(items.numpy()[1:])
    result["rebuild_ms"] = (time.perf_counter() - started) * 1000
    # Draws alone, on the same machine state (numpy, outside TensorFlow).
    queries = tf.gather(users, user_ids).numpy()
    draws = []
    for _ in range(repeats):
        started = time.perf_counter()
        sampler.draw(queries, positive_ids.numpy())
        draws.append((time.perf_counter() - started) * 1000)
    result["kernel_draw_ms"] = statistics.median(draws)
    return result


def run_curve(args: argparse.Namespace, command: str) -> None:
    path = args.out / "bench_kernel.json"
    for num_items in args.sizes:
        load = load_average()[0]
        point = curve_point(num_items, dim=args.dim, batch=args.batch, m=args.kernel_m_curve, repeats=args.repeats)
        point["load_average_1min"] = [load, load_average()[0]]
        print(json.dumps(point), flush=True)
        report = json.loads(path.read_text()) if path.exists() else {}
        curve = report.setdefault("curve", {})
        curve.update(
            settings={"dim": args.dim, "batch": args.batch, "m": args.kernel_m_curve, "repeats": args.repeats},
            command=command,
            notes=CURVE_NOTES,
        )
        curve.setdefault("points", {})[str(num_items)] = point
        report["machine"] = machine("tensorflow", "numpy")
        write(report, args.out)


def curve_markdown(curve: dict) -> list[str]:
    settings = curve["settings"]
    lines = [
        f"## Step time against catalogue size (dim {settings['dim']}, batch {settings['batch']}, "
        f"kernel and uniform m = {settings['m']} per query)\n",
        f"`{curve['command']}`\n",
        "| items | full softmax ms | uniform ms | kernel ms (draw step) | kernel draws ms | tree refresh ms: "
        "diff / ids / rebuild (rows) | kernel @ refresh every step | kernel @ every 100 | full / kernel @ 100 "
        "| full / kernel @ 1 | load avg |",
        "|---" * 11 + "|",
    ]
    for key in sorted(curve["points"], key=int):
        p = curve["points"][key]
        every_step = p["kernel_ms"] + p["refresh_diff_ms"]
        every_100 = p["kernel_ms"] + p["refresh_diff_ms"] / 100
        rebuilt = ", rebuilt" if p["refresh_rebuilt"] else ""
        lines.append(
            f"| {int(key):,} | {p[FULL + '_ms']:.0f} | {p['uniform_ms']:.0f} | {p['kernel_ms']:.0f} | "
            f"{p['kernel_draw_ms']:.0f} | {p['refresh_diff_ms']:.0f} / {p['refresh_ids_ms']:.0f} / "
            f"{p['rebuild_ms']:.0f} ({p['refresh_rows']:,}{rebuilt}) | {every_step:.0f} | {every_100:.0f} | "
            f"{p[FULL + '_ms'] / every_100:.1f}x | {p[FULL + '_ms'] / every_step:.1f}x | "
            f"{p['load_average_1min'][0]:.1f}-{p['load_average_1min'][1]:.1f} |"
        )
    return [*lines, "", *curve["notes"], ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part",
        choices=["all", "run", "curve", "report"],
        default="all",
        help="run: the dataset rows; curve: step time against catalogue size; all: both; report: rewrite md/png",
    )
    parser.add_argument("--datasets", nargs="+", choices=list(DATASETS), default=list(DATASETS))
    # Cheapest-to-lose rows last: a run cut short keeps the full-softmax line and the kernel rows.
    parser.add_argument(
        "--samplers",
        nargs="+",
        choices=[*SAMPLERS, "full"],
        default=["full", "kernel", "uniform", "popularity", "unigram^0.75"],
    )
    parser.add_argument("--m", type=int, nargs="+", default=M_VALUES, help="negatives per step")
    parser.add_argument(
        "--kernel-m",
        type=int,
        nargs="+",
        default=None,
        help="m values for the kernel rows (default: DEFAULT_KERNEL_M within --m)",
    )
    parser.add_argument("--epochs", type=int, default=None, help="default: ml100k 5, synthetic100k 2")
    parser.add_argument("--seeds", type=int, default=1, help="training seeds per row")
    parser.add_argument("--eval-users", type=int, default=2000, help="test users evaluated (seeded sample)")
    parser.add_argument("--loss-rows", type=int, default=5000, help="training rows of the full-softmax loss")
    parser.add_argument("--sizes", type=int, nargs="+", default=CURVE_SIZES, help="curve: catalogue sizes")
    parser.add_argument("--dim", type=int, default=64, help="curve: embedding dimension")
    parser.add_argument("--batch", type=int, default=1024, help="curve: batch size")
    parser.add_argument("--curve-m", dest="kernel_m_curve", type=int, default=64, help="curve: draws per query")
    parser.add_argument("--repeats", type=int, default=5, help="curve: timed steps per row and size")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    command_line = command("bench_kernel", argv)
    path = args.out / "bench_kernel.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    if args.part == "report":
        report["notes"] = NOTES
        write(report, args.out)
        print(markdown(report))
        return 0
    if args.part == "curve":
        run_curve(args, command_line)
        print(markdown(json.loads(path.read_text())))
        return 0

    for name in args.datasets:
        if name == "ml100k":
            try:
                locate_movielens_100k()
            except FileNotFoundError as error:
                print(f"skipping ml100k: {error}", flush=True)
                continue
        epochs = args.epochs or DEFAULT_EPOCHS[name]
        data = prepare(name, args.eval_users)
        loss_rows = data.train.sample(min(args.loss_rows, len(data.train)), random_state=0)
        part = report.setdefault("datasets", {}).setdefault(name, {"rows": {}, "commands": []})
        part["description"] = (
            f"{len(data.stats.items)} training items, {len(data.train)} training clicks, "
            f"{len(data.eval_set.user_ids)} evaluated users, {epochs} epochs of batch {data.config.train.batch_size} "
            f"({DATASETS[name][0].relative_to(ROOT)} {' '.join(DATASETS[name][1])})"
        )
        part["commands"] = [*[c for c in part["commands"] if c != command_line], command_line]
        plan = []
        for sampler in args.samplers:
            if sampler == "full":
                plan.append((FULL, None, ["model.loss.kind=full_softmax"]))
                continue
            ms = args.m
            if sampler == "kernel":
                ms = args.kernel_m or [m for m in DEFAULT_KERNEL_M[name] if m in args.m]
            plan += [(sampler, m, [*SAMPLERS[sampler], f"model.loss.num_negatives={m}"]) for m in ms]
        for sampler, m, overrides in plan:
            runs = []
            for seed in range(args.seeds):
                runs.append(train_row(data, overrides, epochs, seed, loss_rows))
                print(f"{name} | {sampler} | m={m} | seed {seed}: {json.dumps(runs[-1])}", flush=True)
            summary = summarise(runs)
            if m is None:
                part["rows"][sampler] = summary
            else:
                part["rows"].setdefault(sampler, {})[str(m)] = summary
            merge(part, name, args.out)  # after every row: a partial run keeps what it measured
    if args.part == "all":
        run_curve(args, command_line)
    report = json.loads(path.read_text()) if path.exists() else report
    print(markdown(report))
    return 0


def merge(part: dict, name: str, out: Path) -> None:
    """Write this dataset's part into the report on disk (re-read now: runs of other datasets may
    be going side by side) and rewrite the md/png."""
    path = out / "bench_kernel.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    report.setdefault("datasets", {})[name] = part
    report["notes"] = NOTES
    report["machine"] = machine("tensorflow", "numpy")
    write(report, out)


if __name__ == "__main__":
    sys.exit(main())
