"""Models over time: a frozen model, a warm-start update per period and a full retrain per period.

A timestamped click log is cut into periods (MovieLens 100K by week from its first rating; the
synthetic generator's own periods, with item churn and popularity and taste drift) and replayed.
For the last ``--periods`` update periods t (each followed by a period t + 1 to score on):

- **frozen**: one run of the job on every period before the first update period, never updated;
- **warm**: the job with ``train.warm_start`` from the previous period's warm run (the frozen run for
  the first), trained on period t's clicks; ``--warm "NAME KEY=VALUE ..."`` runs warm variants side
  by side, each its own chain (``--warm "warm-replay train.replay_fraction=0.5"`` replays older clicks,
  ``--warm "warm-reset train.warm_start_optimizer=reset"`` starts a fresh optimizer);
- **retrain**: the job from scratch on every period up to t.

Each run is the product's job (``retrieval.train``: data, training, indexing, evaluation, export), on
``--config`` with the periods' clicks as files (``split.kind: none``, period t + 1 the test file) and
``--set`` overrides for every run. Its wall time is the update's cost. The three are then scored on
the same evaluation of period t + 1, built by the project's protocol (``build_eval_set``): test clicks
are period t + 1's, by users with clicks up to t, on items with clicks up to t (an item first clicked
in t + 1 is unknowable to all three), a user's items up to t never counted nor recommended. Each run's
bundle answers the users as a service would (``Bundle.recommend_batch``: a user it does not know gets
its popular items), excluding those items; recall@20 is ``ranking_metrics``'.

"New items" (``fresh_items``): the items first clicked in period t. The updates trained on their
clicks; the frozen model never saw them. ``recall@20 new`` scores each user on their period t + 1
clicks on those items only (users with none are left out).

    python -m benchmarks.bench_freshness                        # make bench-freshness: ML-100K, 8 weeks
    python -m benchmarks.bench_freshness --dataset synthetic    # 1.1M clicks, 12 periods, the last 3
    python -m benchmarks.bench_freshness --periods 2 --warm warm --set train.epochs=2 --out /tmp/f

Results: ``benchmarks/results/bench_freshness_<dataset>.{json,md}`` (``--out`` without extension).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from benchmarks._harness import RESULTS, ROOT, machine, markdown_table, write_report
from benchmarks._harness import command as command_line

K = 20
ARMS = ("frozen", "warm", "retrain")  # --arms: "warm" stands for every warm variant
WEEK_SECONDS = 7 * 86_400
# The synthetic log: 25k users x 20k items, ~1.1M clicks over 12 weekly periods; each week 3% of the
# catalogue launches and 3% of the live items retire, popularity drifts and 10% of users' tastes move.
SYNTHETIC = {
    "n_users": 25_000, "n_items": 20_000, "n_clusters": 50, "mean_clicks_per_user": 44.0, "days": 84,
    "periods": 12, "new_items_per_period": 0.03, "retired_items_per_period": 0.03,
    "popularity_drift": 0.3, "taste_drift": 0.1, "seed": 0,
}
CONFIGS = {"ml-100k": "configs/ml100k.yaml", "synthetic": "configs/default.yaml"}
# Update periods evaluated by default: 8 weeks of MovieLens (~15 min on 2 cores), 3 synthetic periods
# (each retrain ~1M clicks, ~1 h on 2 cores).
PERIODS = {"ml-100k": 8, "synthetic": 3}
# The warm variants run by default: the optimizer's state carried (the default), reset, and half of each
# update's training clicks replayed from the parent's.
WARM = ("warm", "warm-reset train.warm_start_optimizer=reset", "warm-replay train.replay_fraction=0.5")
# Every run: no ALS or popularity baseline inside the job (the arms are compared here), no plots.
JOB_SETTINGS = ("evaluation.baselines.rankers=[]", "evaluation.plots=false", "evaluation.unseen_items=drop")


@dataclass(frozen=True)
class PeriodLog:
    """A click log cut into periods.

    Attributes:
      clicks: canonical clicks (``user_id``, ``item_id``, ``timestamp``) with ``period`` (int64).
      starts: [periods + 1] Unix times: period p holds ``starts[p] <= timestamp < starts[p + 1]``.
      name, description: for the report.
    """

    clicks: pd.DataFrame
    starts: np.ndarray
    name: str
    description: str

    @property
    def periods(self) -> int:
        return len(self.starts) - 1


def weekly_starts(timestamps: np.ndarray, seconds: int = WEEK_SECONDS) -> np.ndarray:
    """Period boundaries every ``seconds`` from the first timestamp, the last past the last timestamp:
    [periods + 1] int64 (the last period may be shorter than the others)."""
    first, last = int(np.min(timestamps)), int(np.max(timestamps))
    periods = (last - first) // seconds + 1
    return first + seconds * np.arange(periods + 1, dtype=np.int64)


def assign_periods(timestamps: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The period of each timestamp under ``starts`` ([periods + 1] increasing): [clicks] int64.

    Raises:
      ValueError: a timestamp before the first start or at or after the last.
    """
    timestamps = np.asarray(timestamps, dtype=np.int64)
    period = np.searchsorted(starts, timestamps, side="right") - 1
    outside = (period < 0) | (period >= len(starts) - 1)
    if outside.any():
        raise ValueError(f"{int(outside.sum())} timestamps outside the periods [{starts[0]}, {starts[-1]}), "
                         f"e.g. {int(timestamps[outside][0])}")
    return period.astype(np.int64)


def fresh_items(clicks: pd.DataFrame, period: int) -> np.ndarray:
    """The items first clicked in ``period`` (no click in any earlier period), sorted: what an update on
    ``period`` learns and a model trained before it never saw."""
    first = clicks.groupby("item_id", sort=True)["period"].min()
    return first.index[first.to_numpy() == period].to_numpy(dtype=object)


def update_periods(periods: int, evaluated: int) -> list[int]:
    """The last ``evaluated`` periods t that an update trains on, each followed by t + 1 to score on;
    at least one period comes before the first, for the frozen model to train on.

    Raises:
      ValueError: ``evaluated`` < 1, or the log has too few periods for it (naming ``--periods``).
    """
    if evaluated < 1:
        raise ValueError(f"--periods {evaluated}: evaluate at least 1 period")
    if evaluated > periods - 2:
        raise ValueError(f"--periods {evaluated}: the log has {periods} periods, so at most {max(periods - 2, 0)} "
                         "updates have a period before them (the frozen model's) and one after (to score on)")
    return list(range(periods - 1 - evaluated, periods - 1))


def load_log(dataset: str, synthetic: dict[str, Any]) -> PeriodLog:
    """MovieLens 100K by week (every rating a click) or the synthetic log with churn and drift."""
    from retrieval.data import ITEM, TIME, USER

    if dataset == "ml-100k":
        from retrieval.config import ColumnsConfig, TableConfig
        from retrieval.data.loaders import read_clicks
        from retrieval.data.movielens import locate_movielens_100k

        folder = locate_movielens_100k()
        clicks = read_clicks(TableConfig(path=str(folder / "u.data"), format="movielens-100k"), ColumnsConfig())
        clicks = clicks[[USER, ITEM, TIME]]
        starts = weekly_starts(clicks[TIME].to_numpy())
        description = (f"MovieLens 100K ({folder}), every rating a click, cut into weeks from its first "
                       "rating (the last week partial)")
    elif dataset == "synthetic":
        from retrieval.config import SyntheticConfig
        from retrieval.data.synthetic import generate_clicks, period_starts

        config = SyntheticConfig(**synthetic)
        clicks = generate_clicks(config)[0][[USER, ITEM, TIME]]
        starts = period_starts(config)
        description = "the synthetic generator, " + ", ".join(f"{key}={value}" for key, value in synthetic.items())
    else:
        raise ValueError(f"--dataset {dataset!r}: one of ml-100k, synthetic")
    clicks = clicks.assign(period=assign_periods(clicks[TIME].to_numpy(), starts))
    return PeriodLog(clicks.reset_index(drop=True), starts, dataset, description)


def score(bundle, history: pd.DataFrame, test: pd.DataFrame, fresh: np.ndarray, k: int = K,
          batch: int = 2048) -> dict[str, Any]:
    """recall@k of a bundle on ``test`` (period t + 1), overall and on ``fresh`` items.

    The evaluation set is the project's (``build_eval_set``) over the items of ``history`` (every click
    up to t): test users and items with clicks in it, a user's history items neither relevant nor
    recommended. The bundle answers each user as serving does (``recommend_batch``, its popular items
    for a user it does not know), the user's history items excluded; an item the bundle lacks (the
    frozen model's catalogue predates it) is never recommended.
    """
    from retrieval.config import EvaluationConfig
    from retrieval.data import ITEM, USER
    from retrieval.evaluation.metrics import ranking_metrics
    from retrieval.evaluation.protocol import build_eval_set

    catalogue = np.sort(history[ITEM].unique()).astype(object)
    protocol = EvaluationConfig(ks=(k,), unseen_users="drop", unseen_items="drop")
    eval_set = build_eval_set(history, test, list(catalogue), protocol)
    served = set(bundle.index.item_ids)
    ranked = np.full((len(eval_set.user_ids), k), -1, dtype=np.int64)
    row_of = pd.Index(catalogue, dtype=object)
    for start in range(0, len(eval_set.user_ids), batch):
        users = eval_set.user_ids[start : start + batch]
        queries = [{USER: user} for user in users]
        exclude = [[item for item in catalogue[rows] if item in served]
                   for rows in eval_set.exclude[start : start + batch]]
        answers = bundle.recommend_batch(queries, k, exclude, exclude_seen=False)
        for offset, answer in enumerate(answers):
            rows = row_of.get_indexer(pd.Index(answer.item_ids, dtype=object))
            ranked[start + offset, : len(rows)] = rows
    overall = ranking_metrics(ranked, eval_set.relevant, [k])
    fresh_rows = row_of.get_indexer(pd.Index(fresh, dtype=object))
    fresh_rows = fresh_rows[fresh_rows >= 0]
    relevant_fresh = [rows[np.isin(rows, fresh_rows)] for rows in eval_set.relevant]
    new = ranking_metrics(ranked, relevant_fresh, [k])
    return {
        f"recall@{k}": overall[f"recall@{k}"], f"ndcg@{k}": overall[f"ndcg@{k}"], "users": overall["users"],
        f"recall@{k}_new": new[f"recall@{k}"], "users_new": new["users"],
        "test_clicks_scored": int(sum(len(rows) for rows in eval_set.relevant)),
        "test_clicks_on_new_items": int(sum(len(rows) for rows in relevant_fresh)),
    }


class Replay:
    """Runs the arms over one log: period files, jobs and their scores, in ``work``."""

    def __init__(self, log: PeriodLog, config: str, overrides: Sequence[str], warm: dict[str, list[str]],
                 work: Path, retrain: bool = True):
        """``warm``: each warm variant's name and its overrides (on top of ``overrides``); {} runs none."""
        self.log, self.config, self.work, self.warm, self.retrain = log, config, work, warm, retrain
        self.overrides = [*JOB_SETTINGS, *overrides]
        (work / "data").mkdir(parents=True, exist_ok=True)

    def clicks_file(self, name: str, mask: np.ndarray) -> Path:
        from retrieval.data import ITEM, TIME, USER

        path = self.work / "data" / f"{name}.parquet"
        self.log.clicks.loc[mask, [USER, ITEM, TIME]].to_parquet(path, index=False)
        return path

    def job(self, name: str, train: Path, test: Path, extra: Sequence[str] = ()) -> dict[str, Any]:
        """One run of the product's job: its directory, wall time and what it trained."""
        import retrieval

        overrides = [
            "data.source=files", f"data.clicks.path={train}", f"data.test_clicks.path={test}", "split.kind=none",
            f"run.output_dir={self.work / 'runs'}", "run.overwrite=true", *self.overrides, *extra,
        ]
        print(f"[bench_freshness] {name}: training on {train.name}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        run = retrieval.train(str(ROOT / self.config), overrides=overrides, name=name)
        seconds = time.perf_counter() - started
        timing = run.metrics.get("timing", {}).get("seconds", {})
        return {
            "directory": run.directory, "seconds": round(seconds, 1),
            "training_seconds": timing.get("training"),
            "train_clicks": run.metrics.get("data", {}).get("train_clicks"),
            "epochs": run.metrics.get("training", {}).get("epochs"),
            "job_recall@20": run.metrics.get("model", {}).get("recall@20"),
        }

    def run(self, updates: list[int], on_row: Callable[[list[dict[str, Any]]], None] | None = None
            ) -> list[dict[str, Any]]:
        """Every arm over ``updates``; ``on_row(rows)`` after each period (a long run's results so far)."""
        from retrieval.serving import Bundle

        period = self.log.clicks["period"].to_numpy()
        first = updates[0]
        rows: list[dict[str, Any]] = []
        base = self.job("frozen", self.clicks_file(f"upto-{first - 1}", period < first),
                        self.clicks_file(f"period-{first}", period == first))
        frozen_bundle = Bundle.load(base["directory"])
        parents = {name: base["directory"] for name in self.warm}
        for t in updates:
            history, test = self.log.clicks[period <= t], self.log.clicks[period == t + 1]
            fresh = fresh_items(self.log.clicks, t)
            test_file = self.clicks_file(f"period-{t + 1}", period == t + 1)
            row: dict[str, Any] = {
                "period": t, "clicks_in_period": int((period == t).sum()), "clicks_up_to_period": len(history),
                "test_clicks": len(test), "new_items": len(fresh),
                "frozen": {**score(frozen_bundle, history, test, fresh), "seconds": base["seconds"],
                           "training_seconds": base["training_seconds"], "train_clicks": base["train_clicks"],
                           "trained_up_to_period": first - 1},
            }
            train_file = self.clicks_file(f"period-{t}", period == t)
            for name, overrides in self.warm.items():
                parent = parents[name]
                warm = self.job(f"{name}-{t}", train_file, test_file, [f"train.warm_start={parent}", *overrides])
                row[name] = {**score(Bundle.load(warm["directory"]), history, test, fresh),
                             **_timing(warm), "parent": Path(parent).name}
                if parent != base["directory"]:
                    shutil.rmtree(parent, ignore_errors=True)
                parents[name] = warm["directory"]
            if self.retrain:
                retrain = self.job(f"retrain-{t}", self.clicks_file(f"upto-{t}", period <= t), test_file)
                row["retrain"] = {**score(Bundle.load(retrain["directory"]), history, test, fresh),
                                  **_timing(retrain)}
                shutil.rmtree(retrain["directory"], ignore_errors=True)
            row.update(_ratios(row))
            rows.append(row)
            if on_row is not None:
                on_row(rows)
            print(f"[bench_freshness] period {t}: " + ", ".join(
                f"{arm} {row[arm]['recall@20']:.4f}" for arm in arms_of(row)), file=sys.stderr, flush=True)
        return rows


def _timing(job: dict[str, Any]) -> dict[str, Any]:
    return {key: job[key] for key in ("seconds", "training_seconds", "train_clicks", "epochs", "job_recall@20")}


def arms_of(row: dict[str, Any]) -> list[str]:
    """The arms a row scored, in run order: frozen, the warm variants, retrain."""
    return [key for key, value in row.items() if isinstance(value, dict) and f"recall@{K}" in value]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 4)


def _ratios(row: dict[str, Any]) -> dict[str, Any]:
    """Each warm variant against the retrain: wall time and recall@20 (overall and new), where both ran."""
    if "retrain" not in row:
        return {}
    retrain = row["retrain"]
    variants = [arm for arm in arms_of(row) if arm not in ("frozen", "retrain")]
    return {"over_retrain": {
        arm: {key: _ratio(row[arm][key], retrain[key])
              for key in ("seconds", "training_seconds", f"recall@{K}", f"recall@{K}_new")}
        for arm in variants
    }} if variants else {}


def pooled(rows: list[dict[str, Any]], arm: str, key: str = f"recall@{K}", users: str = "users") -> float:
    """An arm's recall over every scored user of every period: the periods' recalls weighted by their
    users (``users_new`` for the new-item recall). A period of 30 users moves it as 30 users do."""
    weights = np.array([row[arm][users] for row in rows], dtype=np.float64)
    if weights.sum() == 0:
        return float("nan")
    return float(np.average([row[arm][key] for row in rows], weights=weights))


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm its recall@20 over every scored user of the periods (``pooled``, overall and new) and its
    total seconds; per warm variant the targets (an update at <= 10 % of a retrain's wall time: total
    seconds over total; >= 0.97 x its recall@20: pooled over pooled) and how many periods meet each
    alone; the frozen model's decay (its recall@20 in the last period less its first)."""
    summary: dict[str, Any] = {"periods": len(rows)}
    arms = arms_of(rows[0]) if rows else []
    for arm in arms:
        runs = rows[:1] if arm == "frozen" else rows  # the frozen model trained once
        summary[arm] = {f"recall@{K}": round(pooled(rows, arm), 4),
                        f"recall@{K}_new": round(pooled(rows, arm, f"recall@{K}_new", "users_new"), 4),
                        "seconds": round(float(sum(row[arm]["seconds"] for row in runs)), 1),
                        "training_seconds": round(float(sum(row[arm]["training_seconds"] or 0 for row in runs)), 1)}
    if "frozen" in arms:
        first, last = rows[0]["frozen"][f"recall@{K}"], rows[-1]["frozen"][f"recall@{K}"]
        summary["frozen_decay_recall@20"] = round(last - first, 4)
    retrains = [row["retrain"] for row in rows if row.get("retrain", {}).get("job_recall@20") is not None]
    if retrains:
        # The retrain's own job scored the same period t + 1 over the same users: the same number.
        summary["retrain_score_less_job_recall@20_max_abs"] = max(
            abs(r[f"recall@{K}"] - r["job_recall@20"]) for r in retrains)
    over: dict[str, Any] = {}
    for arm in (rows[0].get("over_retrain", {}) if rows else {}):
        retrain = summary["retrain"]
        seconds = summary[arm]["seconds"] / retrain["seconds"]
        recall = summary[arm][f"recall@{K}"] / retrain[f"recall@{K}"]
        per_period = [row["over_retrain"][arm] for row in rows]
        over[arm] = {
            "seconds": round(seconds, 4),
            "training_seconds": round(summary[arm]["training_seconds"] / retrain["training_seconds"], 4),
            f"recall@{K}": round(recall, 4),
            "targets": {"seconds <= 0.10 x retrain": seconds <= 0.10, "recall@20 >= 0.97 x retrain": recall >= 0.97},
            "periods_meeting": {"seconds": sum(r["seconds"] <= 0.10 for r in per_period),
                                "recall@20": sum(r[f"recall@{K}"] >= 0.97 for r in per_period)},
        }
    if over:
        summary["over_retrain"] = over
    return summary


def _cell(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def markdown(report: dict[str, Any]) -> str:
    rows, summary = report["rows"], report["summary"]
    arms = arms_of(rows[0]) if rows else []
    variants = [arm for arm in arms if arm not in ("frozen", "retrain")]
    lines = [
        f"# Models over time: {report['dataset']}", "",
        f"`{report['command']}` on {report['machine']['cpus']} CPUs ({report['machine']['cpu']}); load average "
        f"(1, 5, 15 min) at start {report['machine']['load_average']}, at end {report['load_average_end']}; "
        f"`uptime` at start: `{report['uptime_start']}`.", "",
        *([f"**Partial**: {len(rows)} of the {len(report['updates'])} update periods finished.", ""]
          if report.get("partial") else []),
        f"Log: {report['log']}; {report['clicks']:,} clicks in {report['periods']} periods. Config "
        f"`{report['config']}` with `{' '.join(report['overrides']) or '(none)'}` for every run; each warm "
        "variant adds `train.warm_start=<its previous run>` and: "
        + "; ".join(f"{name} `{' '.join(o) or '(nothing)'}`" for name, o in report["warm"].items()) + ".", "",
        "Each row is an update period t: **frozen** trained once on the periods before the first row, "
        "**warm** the job warm-started from the previous period's warm run on period t's clicks, **retrain** "
        "the job from scratch on every period up to t; all scored on period t + 1 (users and items with "
        "clicks up to t; a user's items up to t neither counted nor recommended). **new**: recall@20 on "
        "period t + 1's clicks on items first clicked in period t (the updates trained on them, the frozen "
        "model never saw them). Users scored: period t + 1's users with clicks up to t (the same for every "
        "arm); users with new: those of them with a click on a new item. Seconds: the whole job's wall time "
        "(data, training, index, evaluation, export).",
        "",
    ]
    header = ["t", "clicks in t", "clicks up to t", "new items", "users scored", "users with new"]
    for arm in arms:
        header += [f"{arm} recall@20", f"{arm} new"]
    header += [f"{arm} s" for arm in arms if arm != "frozen"]
    if "retrain" in arms:
        for arm in variants:
            header += [f"{arm}/retrain s", f"{arm}/retrain recall"]
    table = []
    for row in rows:
        scored = row["frozen"]
        cells = [row["period"], f"{row['clicks_in_period']:,}", f"{row['clicks_up_to_period']:,}", row["new_items"],
                 f"{scored['users']:,}", f"{scored['users_new']:,}"]
        for arm in arms:
            cells += [_cell(row[arm][f"recall@{K}"]), _cell(row[arm][f"recall@{K}_new"])]
        cells += [_cell(row[arm]["seconds"], 1) for arm in arms if arm != "frozen"]
        for arm in row.get("over_retrain", {}):
            cells += [_cell(row["over_retrain"][arm]["seconds"], 3), _cell(row["over_retrain"][arm][f"recall@{K}"], 3)]
        table.append(cells)
    lines += markdown_table(header, table, "r" * len(header))
    frozen = rows[0]["frozen"] if rows else None
    if frozen is not None:
        lines += ["", f"The frozen run: {frozen['train_clicks']:,} training clicks (periods up to "
                      f"{frozen['trained_up_to_period']}), {frozen['seconds']:.1f} s."]
    if "frozen_decay_recall@20" in summary:
        lines += [f"Frozen model's recall@20 from the first row to the last: {summary['frozen_decay_recall@20']:+.4f}."]
    if arms:
        lines += ["", "Over every period (recall@20 over all scored users of all periods, seconds summed):", ""]
        lines += markdown_table(
            ["arm", "recall@20", "recall@20 new", "seconds", "training seconds"],
            [[arm, _cell(summary[arm][f"recall@{K}"]), _cell(summary[arm][f"recall@{K}_new"]),
              _cell(summary[arm]["seconds"], 1) + (" (once)" if arm == "frozen" else ""),
              _cell(summary[arm]["training_seconds"], 1)] for arm in arms],
            "lrrrr",
        )
    for arm, ratio in summary.get("over_retrain", {}).items():
        targets, meeting = ratio["targets"], ratio["periods_meeting"]
        lines += [
            "",
            f"{arm} over retrain: wall time {ratio['seconds']:.3f} (target <= 0.10: "
            f"{'met' if targets['seconds <= 0.10 x retrain'] else 'not met'}; {meeting['seconds']} of "
            f"{len(rows)} periods alone), training time alone {ratio['training_seconds']:.3f}; recall@20 "
            f"{ratio[f'recall@{K}']:.3f} (target >= 0.97: "
            f"{'met' if targets['recall@20 >= 0.97 x retrain'] else 'not met'}; {meeting['recall@20']} of "
            f"{len(rows)} periods alone)."]
    if "retrain_score_less_job_recall@20_max_abs" in summary:
        lines += [f"Cross-check: each retrain's own job, scoring period t + 1 by its evaluation, gives the retrain "
                  f"recall@20 above to within {summary['retrain_score_less_job_recall@20_max_abs']:.1e}."]
    return "\n".join(lines) + "\n"


def _uptime() -> str:
    try:
        import subprocess

        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unavailable"


def parse_warm(variants: Sequence[str]) -> dict[str, list[str]]:
    """``["warm", "warm-replay train.replay_fraction=0.5"]`` -> {name: overrides}; names unique, not an
    arm's, usable in a run name."""
    parsed: dict[str, list[str]] = {}
    for variant in variants:
        name, *overrides = shlex.split(variant)
        if name in parsed or name in ("frozen", "retrain") or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise SystemExit(f"--warm {variant!r}: the name {name!r} must be new, not frozen or retrain, and "
                             "letters, digits, '_', '.', '-'")
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise SystemExit(f"--warm {variant!r}: {bad[0]!r} is not KEY=VALUE")
        parsed[name] = overrides
    return parsed


def _parse_synthetic(settings: Sequence[str]) -> dict[str, Any]:
    values = dict(SYNTHETIC)
    for setting in settings:
        key, sep, raw = setting.partition("=")
        if not sep or key not in values:
            raise SystemExit(f"--synthetic {setting!r}: KEY=VALUE with KEY one of {', '.join(values)}")
        values[key] = type(values[key])(float(raw)) if not isinstance(values[key], str) else raw
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=["ml-100k", "synthetic"], default="ml-100k")
    parser.add_argument("--periods", type=int, default=None,
                        help=f"update periods evaluated, the log's last (default {PERIODS})")
    parser.add_argument("--config", default=None, help="the job's config (default: configs/ml100k.yaml for "
                        "ml-100k, configs/default.yaml for synthetic)")
    parser.add_argument("--set", action="append", default=[], help="config override for every run")
    parser.add_argument("--warm", action="append", default=None, metavar='"NAME KEY=VALUE ..."',
                        help=f"a warm variant: its name and its overrides (default: {list(WARM)})")
    parser.add_argument("--synthetic", action="append", default=[], help=f"generator KEY=VALUE ({SYNTHETIC})")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of frozen,warm,retrain "
                        "(frozen always runs: it is the first warm update's parent)")
    parser.add_argument("--work-dir", default=None,
                        help="runs and period files (default /tmp/bench-freshness/<dataset>)")
    parser.add_argument("--out", default=None, help="results path without extension "
                        "(default benchmarks/results/bench_freshness_<dataset>)")
    parser.add_argument("--render", metavar="JSON", help="rewrite the Markdown of a results file and stop")
    args = parser.parse_args(argv)
    if args.render:
        stored = json.loads(Path(args.render).read_text())
        stored["summary"] = summarise(stored["rows"])
        write_report(Path(args.render).with_suffix(""), stored, markdown(stored))
        return 0
    arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    if set(arms) - set(ARMS):
        raise SystemExit(f"--arms {args.arms!r}: each of {', '.join(ARMS)}")
    warm = parse_warm(args.warm or WARM) if "warm" in arms else {}
    synthetic = _parse_synthetic(args.synthetic)
    log = load_log(args.dataset, synthetic)
    updates = update_periods(log.periods, args.periods or PERIODS[args.dataset])
    work = Path(args.work_dir or f"/tmp/bench-freshness/{args.dataset}")
    config = args.config or CONFIGS[args.dataset]
    report: dict[str, Any] = {
        "dataset": args.dataset, "command": command_line("bench_freshness", argv),
        "machine": machine("numpy", "pandas", "tensorflow", "faiss"), "uptime_start": _uptime(),
        "log": log.description, "clicks": len(log.clicks), "periods": log.periods,
        "period_starts": log.starts.tolist(), "config": config, "overrides": [*JOB_SETTINGS, *args.set],
        "warm": warm,
        "updates": updates, "new_items_definition": "items first clicked in period t (no click before it)",
    }
    out = Path(args.out) if args.out else RESULTS / f"bench_freshness_{args.dataset.replace('-', '')}"

    def write(rows: list[dict[str, Any]], partial: bool = True) -> None:
        # After every period: a run stopped early keeps the periods it finished, marked partial.
        report.update(rows=[_plain(row) for row in rows], summary=summarise(rows), partial=partial,
                      load_average_end=machine()["load_average"], uptime_end=_uptime())
        write_report(out, report, markdown(report))

    rows = Replay(log, config, args.set, warm, work, retrain="retrain" in arms).run(updates, write)
    write(rows, partial=False)
    print(markdown(report))
    return 0


def _plain(value: Any) -> Any:
    """Paths as strings, recursively (the report is JSON)."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items() if key != "directory"}
    return str(value) if isinstance(value, os.PathLike) else value


if __name__ == "__main__":
    raise SystemExit(main())
