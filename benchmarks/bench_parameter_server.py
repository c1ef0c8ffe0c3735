"""Parameter-server training on a localhost cluster against one process, and what each task holds.

Every run is a subprocess on the project's synthetic generator (``configs/default.yaml`` with
``--set data.synthetic.*``): ``python -m pipelines.train`` for one process,
``python -m pipelines.local_cluster --workers 2 --ps 2 --rss-report FILE`` (1 chief, 2 workers,
2 ps tasks, the ID tables sharded in two, ``train.parameter_server.max_shards=2`` and a
``min_shard_bytes`` of 1 KiB) for the cluster. The runs go one after another on the same machine
and load, so their ratios compare even when the machine is shared; their seconds compare only
with each other.

1. **Quality and throughput**: one process and the cluster on the same log and flags, the cluster
   twice: the chief feeding the batches, and the workers reading them themselves
   (``train.parameter_server.input=workers``): recall@20
   and NDCG@20 (and popularity's) from each run's ``metrics.json``, its training clicks/s (the
   mean of ``timing.clicks_per_second`` over the epochs after the first, which holds the
   tracing), the whole wall time, and the peak RSS of each process (a process's rusage; the
   cluster's chief from its rusage, each worker's and ps task's ``VmHWM`` read before the
   launcher stops them).
2. **Memory**: the cluster on a log of many users (``--memory-*``: tables of many rows, a small
   catalogue so that embedding and searching it stays cheap at a large dim) with tables of
   ``--dim`` and of ``--large-dim`` (one epoch, no validation, ``--memory-batch``): the ps
   tasks' RSS grows with the tables (``table_bytes``: lazy_adam, two slots), the workers' stays
   flat; the large run caps each worker's data segment (``--worker-memory-limit``,
   ``RLIMIT_DATA``) below the tables' bytes and still completes.

    python -m benchmarks.bench_parameter_server                  # ~11 min on 2 cores
    python -m benchmarks.bench_parameter_server --clicks 2000000 --items 1000000 --users 100000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks._harness import RESULTS, ROOT, machine, markdown_table, timed, write_report
from benchmarks._harness import command as command_line
from retrieval.training.parameter_server import table_bytes

LAZY_ADAM_SLOTS = 2
TASKS = ("chief", "worker-0", "worker-1", "ps-0", "ps-1")


def log_settings(clicks: int, users: int, items: int, seed: int) -> list[str]:
    """The generator's settings: ``users`` users clicking ``clicks`` times over ``items`` items."""
    return [f"data.synthetic.n_users={users}", f"data.synthetic.n_items={items}",
            f"data.synthetic.mean_clicks_per_user={clicks / users}", f"data.synthetic.seed={seed}"]


def run_job(name: str, cluster: bool, settings: list[str], base: Path, worker_memory_limit: int | None = None,
            workers: int = 2) -> dict:
    """One run (a ``pipelines.train`` process, or the cluster's launcher with ``workers`` workers): metrics,
    wall time, peak RSS."""
    overrides = [*settings, "train.verbose=2", f"run.output_dir={base / 'runs'}", f"run.name={name}",
                 "run.overwrite=true", "train.resume=false"]
    train = ["--config", str(ROOT / "configs" / "default.yaml"), *(p for kv in overrides for p in ("--set", kv))]
    rss_file = base / "rss" / f"{name}.json"
    rss_file.unlink(missing_ok=True)
    if cluster:
        launcher = ["--workers", str(workers), "--ps", "2", "--rss-report", str(rss_file),
                    "--task-logs", str(base / "tasks" / name)]
        if worker_memory_limit is not None:
            launcher += ["--worker-memory-limit", str(worker_memory_limit)]
        command = [sys.executable, "-m", "pipelines.local_cluster", *launcher, "--", *train]
    else:
        command = [sys.executable, "-m", "pipelines.train", *train]
    print(f"[{name}] {' '.join(command[1:])}", file=sys.stderr, flush=True)
    with timed() as clock:
        process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "TF_CONFIG": ""})
        _, status, usage = os.wait4(process.pid, 0)
    seconds = clock.seconds
    result = {"command": " ".join(["python", *command[1:]]), "seconds": round(seconds, 1),
              "exit_status": os.waitstatus_to_exitcode(status)}
    if result["exit_status"] != 0:
        print(f"[{name}] failed with status {result['exit_status']}", file=sys.stderr)
        return result
    metrics = json.loads((base / "runs" / name / "metrics.json").read_text())
    rss = json.loads(rss_file.read_text()) if cluster else {"process": usage.ru_maxrss * 1024}
    speeds = metrics["timing"]["clicks_per_second"] or []
    return {**result, "peak_rss_bytes": rss, "metrics": {part: metrics[part] for part in ("model", "popularity")},
            "data": metrics["data"], "timing": metrics["timing"],
            "clicks_per_second": sum(speeds[1:]) / len(speeds[1:]) if len(speeds) > 1 else (speeds or [None])[0]}


def tables(data: dict, dim: int) -> dict:
    """The ID tables' rows and bytes (with lazy_adam's slots) for a run's data summary."""
    users, items = data["train_users"] + 1, data["train_items"] + 1
    return {"user_rows": users, "item_rows": items, "dim": dim,
            "table_bytes": table_bytes(users, dim, LAZY_ADAM_SLOTS) + table_bytes(items, dim, LAZY_ADAM_SLOTS)}


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def markdown(report: dict) -> str:
    quality, memory = report["quality"], report["memory"]
    lines = [
        "# Parameter-server training on a localhost cluster", "",
        f"`{report['command']}` on {report['machine']['cpu']}, {report['machine']['cpus']} CPUs (load average "
        f"{report['machine']['load_average']} at the start: the machine was shared with another long job, so "
        "compare the rows with each other, not with other files).", "",
    ]
    if quality:  # not --skip quality
        lines += _quality_section(report)
    if memory:  # not --skip memory
        lines += _memory_section(report)
    return "\n".join(lines)


def _quality_section(report: dict) -> list[str]:
    quality = report["quality"]
    lines = [
        f"## One process against the cluster ({report['log']})", "",
        f"Flags: `{' '.join(report['quality_settings'])}`; the cluster adds {report.get('workers', 2)} worker(s), "
        "2 ps tasks and "
        "`train.parameter_server.max_shards=2`, `min_shard_bytes=1024`.", "",
    ]
    header = ["run", "recall@20", "NDCG@20", "popularity recall@20", "train clicks/s", "wall s",
              *[f"{task} GiB" for task in ("process", *TASKS)]]
    rows = []
    for name, run in quality.items():
        if run["exit_status"] != 0:
            rows.append([name, f"failed ({run['exit_status']})", *["-"] * (len(header) - 2)])
            continue
        model, popular, rss = run["metrics"]["model"], run["metrics"]["popularity"], run["peak_rss_bytes"]
        rows.append([name, f"{model['recall@20']:.4f}", f"{model['ndcg@20']:.4f}", f"{popular['recall@20']:.4f}",
                     f"{run['clicks_per_second']:,.0f}", f"{run['seconds']:.0f}",
                     *[_gib(rss.get(task)) for task in ("process", *TASKS)]])
    lines += markdown_table(header, rows, "l" + "r" * (len(header) - 1))
    for key, what in (("cluster_vs_process", "Cluster"), ("workers_read_vs_process", "Cluster, workers read")):
        ratio = report.get(key)
        if ratio:
            lines += ["", f"{what} / one process: training clicks/s x{ratio['clicks_per_second']:.3f}, wall time "
                      f"x{ratio['seconds']:.3f}, recall@20 x{ratio['recall@20']:.3f}."]
    if "cluster, workers read" in quality:
        lines += ["", "`cluster, workers read`: `train.parameter_server.input=workers`: the chief stages the training "
                  "batches once as TFRecord files and each worker reads them through the tf.data service; in the "
                  "`cluster` row the chief reads every batch and sends it with its step."]
    return lines


def _memory_section(report: dict) -> list[str]:
    memory = report["memory"]
    drawn = next((run["data"]["clicks"] for run in memory.values() if "data" in run), None)
    lines = ["", f"## What each task holds ({report['memory_log']}"
              + (f"; the generator drew {drawn:,}" if drawn else "") + ")", "",
              f"Flags: `{' '.join(report['memory_settings'])}` and the dim of the row; peak RSS in GiB.", ""]
    header = ["run", "dim", "table rows", "tables GiB (lazy_adam)", "worker limit GiB", "status", "wall s",
              "train clicks/s", *[f"{task}" for task in TASKS]]
    rows = []
    for name, run in memory.items():
        t, rss = run["tables"] or {"dim": "-", "user_rows": 0, "item_rows": 0, "table_bytes": None}, \
            run.get("peak_rss_bytes", {})
        limit = run.get("worker_memory_limit")
        rows.append([name, t["dim"], f"{t['user_rows'] + t['item_rows']:,}", _gib(t["table_bytes"]),
                     _gib(limit) if limit else "none", "completed" if run["exit_status"] == 0 else
                     f"failed ({run['exit_status']})", f"{run['seconds']:.0f}",
                     f"{run['clicks_per_second']:,.0f}" if run.get("clicks_per_second") else "-",
                     *[_gib(rss.get(task)) for task in TASKS]])
    lines += markdown_table(header, rows, "llrrrlrr" + "r" * len(TASKS))
    lines += ["", "The worker limit is `RLIMIT_DATA` (`pipelines.local_cluster --worker-memory-limit`, thread "
              "stacks cut to 2 MiB): a worker's data segment is about 2.3 GB of TensorFlow's own before its first "
              "step, "
              "so the capped run's limit is the uncapped run's worker peak RSS + 1.5 GiB (a cap of 2.2 GB crashed "
              "the workers)."]
    return lines


def rewrite_markdown(stem: Path) -> None:
    """``<stem>.md`` again from ``<stem>.json`` (after a change to ``markdown``, without rerunning)."""
    report = json.loads(stem.with_name(stem.name + ".json").read_text())
    stem.with_name(stem.name + ".md").write_text(markdown(report) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clicks", type=int, default=200_000, help="clicks of the generated log")
    parser.add_argument("--users", type=int, default=5_000)
    parser.add_argument("--items", type=int, default=100_000, help="catalogue of the quality runs")
    parser.add_argument("--memory-clicks", type=int, default=50_000, help="clicks of the memory runs' log")
    parser.add_argument("--memory-users", type=int, default=25_000, help="users of the memory runs' log")
    parser.add_argument("--memory-items", type=int, default=10_000, help="catalogue of the memory runs' log")
    parser.add_argument("--dim", type=int, default=64, help="model.embedding_dim of the quality runs and small tables")
    parser.add_argument("--large-dim", type=int, default=8192, help="model.embedding_dim of the large tables")
    parser.add_argument("--epochs", type=int, default=5, help="train.epochs of the quality runs (early stopping on)")
    parser.add_argument("--memory-batch", type=int, default=256, help="train.batch_size of the memory runs")
    parser.add_argument("--worker-memory-limit", type=int, default=None,
                        help="RLIMIT_DATA of each worker in the capped large-table run, bytes (0: no capped run; "
                        "default: the uncapped run's largest worker peak RSS + 1.5 GiB, the data segment a "
                        "TensorFlow task reserves beyond what it touches)")
    parser.add_argument("--workers", type=int, default=2, help="worker tasks of the quality runs' cluster")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", action="append", default=[], choices=["quality", "memory"])
    parser.add_argument("--set", action="append", default=[], help="extra config overrides for every run")
    parser.add_argument("--dir", default="/tmp/retrieval-psbench", help="run directories and task logs")
    parser.add_argument("--out", default=str(RESULTS / "bench_parameter_server"), help="results path without extension")
    args = parser.parse_args()
    base = Path(args.dir)
    shard = ["train.parameter_server.max_shards=2", "train.parameter_server.min_shard_bytes=1024"]
    quality_settings = [*log_settings(args.clicks, args.users, args.items, args.seed),
                        f"model.embedding_dim={args.dim}", f"train.epochs={args.epochs}", *args.set]
    memory_settings = [*log_settings(args.memory_clicks, args.memory_users, args.memory_items, args.seed),
                       "train.epochs=1", "train.validation_fraction=0", f"train.batch_size={args.memory_batch}",
                       *shard, *args.set]
    report: dict = {
        "command": command_line("bench_parameter_server"),
        "machine": machine("numpy", "tensorflow", "faiss"),
        "log": f"{args.clicks:,} clicks by {args.users:,} users over {args.items:,} items",
        "memory_log": f"{args.memory_clicks:,} clicks by {args.memory_users:,} users over {args.memory_items:,} items",
        "quality_settings": quality_settings, "memory_settings": memory_settings, "workers": args.workers,
        "quality": {}, "memory": {},
    }
    if "memory" not in args.skip:
        sizes = [("small tables", args.dim, None), ("large tables", args.large_dim, None)]
        if args.worker_memory_limit != 0:
            sizes.append(("large tables, capped workers", args.large_dim, args.worker_memory_limit or -1))
        for name, dim, cap in sizes:
            if cap == -1:  # from the uncapped run's workers
                peaks = report["memory"]["large tables"].get("peak_rss_bytes", {})
                workers = [v for k, v in peaks.items() if k.startswith("worker") and v]
                cap = max(workers) + (3 << 29) if workers else None
                if cap is None:
                    continue
            label = f"memory-{dim}" + ("-capped" if cap else "")
            run = run_job(label, True, [*memory_settings, f"model.embedding_dim={dim}"], base, cap)
            run["worker_memory_limit"] = cap
            if "data" in run:
                run["tables"] = tables(run["data"], dim)
            else:  # a failed run: the tables of the same log at this dim (when the small run read it)
                data = next((r["data"] for r in report["memory"].values() if "data" in r), None)
                run["tables"] = tables(data, dim) if data else None
            report["memory"][name] = run
    if "quality" not in args.skip:
        report["quality"]["one process"] = run_job("process", False, quality_settings, base)
        report["quality"]["cluster"] = run_job("cluster", True, [*quality_settings, *shard], base,
                                               workers=args.workers)
        report["quality"]["cluster, workers read"] = run_job(
            "cluster-workers", True, [*quality_settings, *shard, "train.parameter_server.input=workers"], base,
            workers=args.workers)
        one = report["quality"]["one process"]
        for name, key in (("cluster", "cluster_vs_process"), ("cluster, workers read", "workers_read_vs_process")):
            many = report["quality"][name]
            if one["exit_status"] == 0 and many["exit_status"] == 0:
                report[key] = {
                    "clicks_per_second": many["clicks_per_second"] / one["clicks_per_second"],
                    "seconds": many["seconds"] / one["seconds"],
                    "recall@20": many["metrics"]["model"]["recall@20"] / one["metrics"]["model"]["recall@20"],
                }
    write_report(args.out, report, markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
