"""Human-readable results: Markdown tables, ``report.md`` and PNG plots.

Takes the dict ``evaluate_against_baselines`` returns. matplotlib is imported
inside the plotting functions (Agg canvas, no pyplot state), so importing this
module stays light and works without a display.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPORT_FILE = "report.md"
PLOT_FILES = {
    "recall": "recall_at_k.png",
    "ndcg": "ndcg_at_k.png",
    "popularity_bias": "popularity_bias.png",
}
TRAINING_PLOT = "training.png"  # loss and validation recall per epoch, when the results say how training went
SUMMARY_METRICS = (
    "recall",
    "ndcg",
    "hit_rate",
    "precision",
    "mrr",
    "tail_recall",
    "coverage",
    "popularity_bias",
)


def ranker_names(results: dict[str, Any]) -> list[str]:
    """The rankers in ``results``, model first: the entries that are metric maps."""
    return [name for name, value in results.items() if isinstance(value, dict) and "users" in value]


def cutoffs(results: dict[str, Any]) -> list[int]:
    """The ks present in the results, ascending."""
    first = results[ranker_names(results)[0]]
    return sorted({int(key.split("@")[1]) for key in first if key.startswith("recall@")})


def headline_k(ks: Sequence[int], preferred: int = 20) -> int:
    """The k shown in the one-line tables: ``preferred`` when evaluated, else the closest."""
    return min(ks, key=lambda k: (abs(k - preferred), k))


def format_table(
    results: dict[str, Any],
    metrics: Sequence[str] = ("recall", "ndcg", "hit_rate", "mrr", "tail_recall", "coverage", "popularity_bias"),
) -> str:
    """A Markdown table: one row per metric@k, one column per ranker."""
    rankers = ranker_names(results)
    keys = [key for key in results[rankers[0]] if key.split("@")[0] in metrics]
    keys.sort(key=lambda key: (metrics.index(key.split("@")[0]), int(key.split("@")[1])))
    lines = ["| metric | " + " | ".join(rankers) + " |", "|---" * (len(rankers) + 1) + "|"]
    for key in keys:
        lines.append(f"| {key} | " + " | ".join(_cell(results[name].get(key)) for name in rankers) + " |")
    return "\n".join(lines)


def summary_table(results: dict[str, Any], k: int, metrics: Sequence[str] = SUMMARY_METRICS) -> str:
    """A Markdown table at one k: one row per ranker, one column per metric."""
    present = [m for m in metrics if f"{m}@{k}" in results[ranker_names(results)[0]]]
    lines = ["| ranker | " + " | ".join(f"{m}@{k}" for m in present) + " |", "|---" * (len(present) + 1) + "|"]
    for name in ranker_names(results):
        lines.append(f"| {name} | " + " | ".join(_cell(results[name].get(f"{m}@{k}")) for m in present) + " |")
    return "\n".join(lines)


def segment_table(results: dict[str, Any], k: int, metrics: Sequence[str] = ("recall", "ndcg")) -> str:
    """A Markdown table of per-segment metrics at one k: one row per segment."""
    segments = results.get("segments") or {}
    rankers = [name for name in ranker_names(results) if name in segments]
    if not rankers:
        return ""
    labels = list(segments[rankers[0]])
    header = ["segment (training clicks)", "users"] + [f"{m}@{k} {name}" for m in metrics for name in rankers]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for label in labels:
        cells = [label, str(segments[rankers[0]][label]["users"])]
        cells += [_cell(segments[name].get(label, {}).get(f"{m}@{k}")) for m in metrics for name in rankers]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_report(results: dict[str, Any], title: str = "Offline evaluation", plots: bool = True) -> str:
    """The text of ``report.md``."""
    ks = cutoffs(results)
    k = headline_k(ks)
    reference = results.get("reference", {})
    parts = [f"# {title}", ""]
    data = results.get("data")
    if data:
        parts += [
            f"Data: `{data.get('source')}`: {data.get('train_clicks')} training and {data.get('test_clicks')} "
            f"test clicks, {data.get('catalogue_items')} catalogue items.",
            "",
        ]
    parts += [
        "Every ranker ranks the full catalogue for the same users with the same masks. Metric "
        "definitions and formulas: `retrieval/evaluation/metrics.py`; recall@k divides by the number of "
        "relevant items (LightGCN protocol), not by min(|relevant|, k).",
        "",
        f"## Model vs baselines at k = {k}",
        "",
        summary_table(results, k),
        "",
    ]
    if reference:
        parts += [
            f"Tail = the {reference.get('tail_items')} of {reference.get('catalogue_items')} catalogue items "
            f"outside the top {reference.get('head_fraction', 0.2):.0%} by training clicks; "
            f"{reference.get('relevant_pairs_on_tail_items')} relevant test pairs are on tail items. "
            "popularity_bias = mean ln(1 + training clicks) of recommended items; the test items "
            f"themselves average {reference.get('test_items_log_popularity', 0.0):.3f}.",
            "",
        ]
    parts += ["## Every cut-off", "", format_table(results), ""]
    table = segment_table(results, k)
    if table:
        parts += ["## By user activity", "", table, ""]
    if results.get("seconds"):
        parts += [
            "## Seconds to rank (ALS: fit included)",
            "",
            "| ranker | seconds |",
            "|---|---|",
            *[f"| {name} | {value:.2f} |" for name, value in results["seconds"].items()],
            "",
        ]
    if results.get("counts"):
        parts += ["## Counts", "", "| count | value |", "|---|---|"]
        parts += [f"| {name} | {value} |" for name, value in results["counts"].items()] + [""]
    training = results.get("training")
    if training:
        parts += ["## Training", "", training_text(training), ""]
        if plots:
            parts += [f"![training]({TRAINING_PLOT})", ""]
    if plots:
        parts += ["## Plots", ""] + [f"![{name}]({file})" for name, file in PLOT_FILES.items()] + [""]
    return "\n".join(parts)


def training_text(training: dict[str, Any]) -> str:
    """What the run trained (``training.training_summary``), in a sentence or two."""
    text = f"The served weights trained {training['epochs']} epochs (at most {training['max_epochs']})"
    text += f", final loss {training['loss'][-1]:.4f}." if training["loss"] else "."
    stopping = training.get("early_stopping")
    if stopping:
        text += f" {stopping['message'][0].upper()}{stopping['message'][1:]}."
    return text


@dataclass(frozen=True)
class TrainingPanel:
    """One panel of the training plot: a run's curves per epoch; ``recall`` on a second axis."""

    title: str
    loss_label: str
    loss: list[float]
    recall_label: str | None = None
    recall: list[float] | None = None
    best_epoch: int | None = None


def training_panels(training: dict[str, Any]) -> list[TrainingPanel]:
    """The training plot's panels: one per run, never one run's loss beside another's recall.

    With early stopping: the selection run (its loss and validation recall, the best epoch marked)
    and, when a refit followed, the refit (the served run's loss) in a panel of its own. Without it:
    the one run's loss.
    """
    stopping = training.get("early_stopping")
    if not stopping:
        return [TrainingPanel("Training", "training loss", list(training["loss"]))]
    watched = f"val_{stopping.get('metric', 'recall')}@"  # the metric that chose the best epoch
    key = next(name for name in stopping if name.startswith(watched))
    selection = TrainingPanel(
        "Selection run (early stopping)", "selection loss", list(stopping["selection_loss"]),
        f"{key} (validation)", list(stopping[key]), int(stopping["best_epoch"]),
    )
    if stopping.get("refit", "none") == "none":
        return [selection]  # the served weights are the selection's best epoch
    return [selection, TrainingPanel(f"Refit (from {stopping['refit']}, served)", "refit loss", list(training["loss"]))]


def plot_training(training: dict[str, Any], path: str | Path) -> Path:
    """``training_panels`` side by side, saved as a PNG."""
    panels = training_panels(training)
    figure = _figure()
    figure.set_size_inches(6 * len(panels), 4)
    figure.set_layout_engine("constrained")  # the recall axis's label clear of the next panel
    for axes, panel in zip(np.atleast_1d(figure.subplots(1, len(panels))), panels):
        axes.plot(range(1, len(panel.loss) + 1), panel.loss, marker="o", color="tab:blue", label=panel.loss_label)
        axes.set_xlabel("epoch")
        axes.set_ylabel("loss")
        axes.xaxis.get_major_locator().set_params(integer=True)
        if panel.recall is not None:
            recall = axes.twinx()
            recall.plot(range(1, len(panel.recall) + 1), panel.recall, marker="s", color="tab:orange",
                        label=panel.recall_label)
            if panel.best_epoch is not None:
                recall.axvline(panel.best_epoch, color="tab:orange", linestyle="--", alpha=0.5, label="best epoch")
            recall.set_ylabel(str(panel.recall_label))
            recall.legend(loc="lower right")
        axes.legend(loc="upper right")
        axes.set_title(panel.title)
        axes.grid(True, alpha=0.3)
    figure.savefig(path, dpi=100, bbox_inches="tight")
    return Path(path)


def plot_metric_curves(results: dict[str, Any], metric: str, path: str | Path) -> Path:
    """metric@k against k, one line per ranker, saved as a PNG."""
    figure = _figure()
    axes = figure.subplots()
    ks = cutoffs(results)
    for name in ranker_names(results):
        axes.plot(ks, [results[name][f"{metric}@{k}"] for k in ks], marker="o", label=name)
    axes.set_xscale("log")
    axes.set_xticks(ks, [str(k) for k in ks])
    axes.set_xlabel("k")
    axes.set_ylabel(f"{metric}@k")
    axes.set_title(f"{metric}@k over the full catalogue")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.savefig(path, dpi=100, bbox_inches="tight")
    return Path(path)


def plot_popularity_bias(results: dict[str, Any], k: int, path: str | Path) -> Path:
    """Mean log-popularity of the top k per ranker (bars) and of the test items (line)."""
    figure = _figure()
    axes = figure.subplots()
    names = ranker_names(results)
    axes.bar(names, [results[name][f"popularity_bias@{k}"] for name in names], color="tab:blue")
    reference = results.get("reference", {}).get("test_items_log_popularity")
    if reference is not None:
        axes.axhline(reference, color="tab:red", linestyle="--", label="test items")
        axes.legend()
    axes.set_ylabel(f"mean ln(1 + training clicks) of top {k}")
    axes.set_title(f"Popularity bias at k = {k}")
    figure.savefig(path, dpi=100, bbox_inches="tight")
    return Path(path)


def write_report(
    directory: str | Path, results: dict[str, Any], *, title: str = "Offline evaluation", plots: bool = True
) -> list[Path]:
    """Write ``report.md`` and (when ``plots``) the PNGs of ``PLOT_FILES`` into ``directory``.

    Returns:
      The paths written.
    """
    directory = Path(directory)
    written = []
    if plots:
        k = headline_k(cutoffs(results))
        written.append(plot_metric_curves(results, "recall", directory / PLOT_FILES["recall"]))
        written.append(plot_metric_curves(results, "ndcg", directory / PLOT_FILES["ndcg"]))
        written.append(plot_popularity_bias(results, k, directory / PLOT_FILES["popularity_bias"]))
        if results.get("training"):
            written.append(plot_training(results["training"], directory / TRAINING_PLOT))
    report = directory / REPORT_FILE
    report.write_text(render_report(results, title, plots) + "\n", encoding="utf-8")
    return [report, *written]


def _figure():
    from matplotlib.figure import Figure  # a bare Figure renders with Agg, no pyplot or display needed

    return Figure(figsize=(6, 4))


def _cell(value) -> str:
    return "—" if value is None else f"{value:.4f}"
