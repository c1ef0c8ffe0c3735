"""Out-of-core scale benchmark: N synthetic clicks over M items, streamed from Parquet shards.

1. Generates the log as Parquet shards, one chunk of users at a time (the
   whole log is never in memory), with the generative story of
   ``retrieval/data/synthetic.py`` (Zipf popularity, taste clusters, repeats
   redrawn per user, users arriving over the period).
2. Runs the main job out of core (``configs/scale.yaml``): streaming
   statistics, training through tf.data, an IVF index over every item,
   evaluation of a sample of test users, the bundle.
3. Reports generation time, streaming-statistics time, training clicks/s and
   seconds per epoch, index build time, evaluation, peak RSS
   (``ru_maxrss`` and an RSS sampled every second from /proc/self/status, with
   the phase it was in) and the bundle size, to
   ``benchmarks/results/bench_scale.{json,md}``.
4. Saves the trained model's embeddings for ``benchmarks/bench_serving_real.py
   --embeddings`` (ANN measured on real embeddings): every catalogue item's
   (the bundle's doc SavedModel over ``item_ids.parquet``, in index-row order)
   and those of ``--query-users`` training users drawn at random (the query
   SavedModel; users it does not know are skipped), with a manifest, to
   ``$RETRIEVAL_SCALE_DIR/embeddings`` (``--embeddings-dir``).

    python -m benchmarks.bench_scale                                  # 20M clicks / 1M items, 1 epoch
    python -m benchmarks.bench_scale --clicks 1000000 --items 100000  # a couple of minutes
    python -m benchmarks.bench_scale --features --out benchmarks/results/bench_scale_features  # feature tower
    python -m benchmarks.bench_scale --from-bundle /tmp/retrieval-scale/runs/<run>   # step 4 only, no training

The data goes to ``$RETRIEVAL_SCALE_DIR`` (default /tmp/retrieval-scale), never
into the repository; an existing log with the same parameters is reused.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import resource
import shutil
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks._harness import Stopwatch, load_average, machine, markdown_table, timed, write_report
from benchmarks._harness import command as command_line
from benchmarks.scale_resume import markdown_row

ROOT = Path(__file__).resolve().parents[1]

from retrieval.config import SyntheticConfig, load_config  # noqa: E402
from retrieval.data import synthetic  # noqa: E402
from retrieval.data.schema import ITEM, TIME, USER  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
log = logging.getLogger("bench_scale")


# --- Chunked generation. ---


def generate_shards(
    out: Path, clicks: int, items: int, *, clicks_per_user: float, clusters: int, seed: int, shard_clicks: int
) -> dict:
    """Write about ``clicks`` synthetic clicks as Parquet shards by time, as logs are written.

    The latent truth (item clusters and popularity, users' clusters) is drawn
    once by ``synthetic.synthetic_truth``: O(users + items) memory. Clicks are
    drawn per chunk of about ``shard_clicks`` clicks' worth of users with
    ``synthetic._draw_items`` (repeats are redrawn per user, so chunks of users
    are independent), from one seeded generator. The period is cut into
    ``clicks / shard_clicks`` equal time windows, one shard each; every chunk
    appends its clicks of a window to that window's shard as a row group, so a
    shard holds every user active then and only one chunk is in memory.
    """
    users = max(1, int(round(clicks / clicks_per_user)))
    cfg = SyntheticConfig(
        n_users=users, n_items=items, n_clusters=clusters, mean_clicks_per_user=clicks_per_user, seed=seed
    )
    truth = synthetic.synthetic_truth(cfg)
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(3)[1])
    user_ids, item_ids = synthetic._ids("u", users), synthetic._ids("i", items)
    # Per-user activity as in generate_clicks (lognormal rate, Poisson, at least 3).
    sigma = synthetic._CLICKS_SIGMA
    rate = clicks_per_user * rng.lognormal(-(sigma**2) / 2, sigma, users)
    counts = np.maximum(3, rng.poisson(rate))
    span = cfg.days * synthetic._DAY
    arrival = rng.integers(0, max(1, int(synthetic._ARRIVAL_WINDOW * span)), users)
    out.mkdir(parents=True, exist_ok=True)
    n_shards = max(1, int(round(counts.sum() / shard_clicks)))
    schema = pa.schema([(USER, pa.string()), (ITEM, pa.string()), (TIME, pa.int64())])
    writers = [pq.ParquetWriter(out / f"part-{i:05d}.parquet", schema) for i in range(n_shards)]
    ends = np.cumsum(counts)
    bounds = np.unique(np.searchsorted(ends, np.arange(shard_clicks, ends[-1], shard_clicks), side="right"))
    written, start = 0, 0
    for stop in [*bounds[(bounds > 0) & (bounds < users)].tolist(), users]:
        user = np.repeat(np.arange(start, stop), counts[start:stop])
        item = synthetic._draw_items(truth, user, cfg.taste_strength, rng)
        when = arrival[user] + (rng.random(len(user)) * (span - arrival[user])).astype(np.int64)
        order = np.argsort(when, kind="stable")
        user, item, when = user[order], item[order], when[order]
        window = np.minimum(when * n_shards // span, n_shards - 1)
        cuts = np.searchsorted(window, np.arange(n_shards + 1))
        for shard, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:])):
            if hi > lo:
                writers[shard].write_table(
                    pa.table(
                        {USER: user_ids[user[lo:hi]], ITEM: item_ids[item[lo:hi]], TIME: synthetic.START + when[lo:hi]},
                        schema=schema,
                    )
                )
        written += len(user)
        start = stop
        log.info("generated users up to %d: %d clicks so far", stop, written)
    for writer in writers:
        writer.close()
    return {"clicks": int(written), "users": users, "items": items, "shards": n_shards}


def log_name(args: argparse.Namespace) -> str:
    """The log's folder name under ``<--dir>/logs``: every generation parameter but the shard size."""
    return f"clicks{args.clicks}-items{args.items}-cpu{args.clicks_per_user:g}-k{args.clusters}-seed{args.seed}"


def ensure_shards(data_dir: Path, args: argparse.Namespace, before_generating=lambda: None) -> dict:
    """The log's generation record: ``data_dir/_DONE.json``'s when the shards exist (``reused``),
    else that of the shards ``generate_shards`` writes now (``before_generating()`` called first)."""
    done = data_dir / "_DONE.json"
    if done.exists():
        log.info("reusing %s", data_dir)
        return {**json.loads(done.read_text()), "reused": True}
    before_generating()
    with timed() as clock:
        shutil.rmtree(data_dir, ignore_errors=True)
        generation = generate_shards(data_dir, args.clicks, args.items, clicks_per_user=args.clicks_per_user,
                                     clusters=args.clusters, seed=args.seed, shard_clicks=args.shard_clicks)
    generation["seconds"] = round(clock.seconds, 1)
    done.write_text(json.dumps(generation))
    return {**generation, "reused": False}


def write_feature_tables(out: Path, clicks: int, items: int, *, clicks_per_user: float, clusters: int,
                         seed: int) -> dict:
    """The log's item table (``category``, ``price``, ``title``) and user table (``age``, ``country``) as Parquet.

    Drawn by ``synthetic``'s own feature functions from the latent truth the
    shards were drawn from (``synthetic_truth`` of the same config), so
    categories and title words follow the items' taste clusters as in
    ``generate_clicks``; every catalogue item and user has a row.
    """
    users = max(1, int(round(clicks / clicks_per_user)))
    cfg = SyntheticConfig(
        n_users=users, n_items=items, n_clusters=clusters, mean_clicks_per_user=clicks_per_user, seed=seed
    )
    truth = synthetic.synthetic_truth(cfg)
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(3)[2])
    out.mkdir(parents=True, exist_ok=True)
    item_table = synthetic._item_features(truth, synthetic._ids("i", items), rng)
    pq.write_table(pa.Table.from_pandas(item_table, preserve_index=False), out / "items.parquet")
    # signup_day needs the shards' arrival times; the tower does not read it.
    user_table = synthetic._user_features(truth, synthetic._ids("u", users), np.zeros(users, np.int64), rng)
    user_table = user_table.drop(columns=["signup_day"])
    pq.write_table(pa.Table.from_pandas(user_table, preserve_index=False), out / "users.parquet")
    return {"items": len(item_table), "users": len(user_table), "bytes": directory_bytes(out)}


# --- Memory sampling. ---


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class RssSampler(threading.Thread):
    """Samples the process RSS every ``interval`` seconds; keeps the peak per phase."""

    def __init__(self, interval: float = 1.0):
        super().__init__(daemon=True)
        self.interval, self.phase = interval, "start"
        self.peaks: dict[str, int] = {}
        self.samples: list[tuple[float, str, int]] = []
        self._done = threading.Event()
        self._t0 = time.perf_counter()

    partial_path: Path | None = None
    lines: list | None = None

    def run(self):
        while not self._done.is_set():
            rss = rss_bytes()
            elapsed = round(time.perf_counter() - self._t0, 1)
            self.samples.append((elapsed, self.phase, rss))
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)
            if self.partial_path is not None and len(self.samples) % 30 == 0:
                # If the run is cut short, what it measured so far is on disk.
                self.partial_path.write_text(json.dumps({
                    "elapsed_seconds": elapsed, "phase": self.phase,
                    "peak_rss_bytes_ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                    "peak_rss_bytes_by_phase": self.peaks, "log": self.lines or [],
                }, indent=2))
            self._done.wait(self.interval)

    def stop(self):
        self._done.set()
        self.join()


class PhaseFromLog(logging.Handler):
    """Names the sampler's phase from the job's log lines (data, training, indexing, evaluating, export)."""

    MARKERS = (("training:", "training"), ("indexing", "indexing"), ("evaluating", "evaluation"))

    def __init__(self, sampler: RssSampler, lines: list):
        super().__init__()
        self.sampler, self.lines = sampler, lines

    def emit(self, record):
        message = record.getMessage()
        self.lines.append(f"{time.strftime('%H:%M:%S')} {message}")
        for marker, phase in self.MARKERS:
            if message.startswith(marker):
                self.sampler.phase = phase


# --- Embeddings of the trained model, for bench_serving_real --embeddings. ---

EMBEDDINGS_MANIFEST = "manifest.json"


def _batched(signature, name: str, values: np.ndarray, batch: int = 8192) -> tuple[np.ndarray, np.ndarray]:
    """Run a tower's serving signature over string ``values`` in batches: (embeddings, known_ids)."""
    import tensorflow as tf

    embeddings, known = [], []
    for start in range(0, len(values), batch):
        outputs = signature(**{name: tf.constant(values[start : start + batch].astype(str))})
        embeddings.append(outputs["embedding"].numpy().astype(np.float32))
        if "known_ids" in outputs:
            known.append(outputs["known_ids"].numpy())
        else:
            known.append(np.any(embeddings[-1] != 0, axis=1))
    return np.concatenate(embeddings), np.concatenate(known)


def save_embeddings(bundle_dir: Path, out: Path, *, query_users: int, seed: int) -> dict:
    """Write the bundle's item embeddings and a sample of training users' query embeddings to ``out``.

    ``items.npy`` [num_items, dim] float32 in index-row order, ``item_ids.txt``
    (one id a line, same order), ``queries.npy`` [query_users, dim] float32 and
    ``query_user_ids.txt``, and ``manifest.json`` (run, config, date, shapes,
    model metrics). The users are drawn (seeded) from the user ids of the log
    the run's config names and kept when the query tower knows them (they have
    training clicks); the item embeddings are checked against the vectors the
    bundle's index holds when the index can give them back.
    """
    import faiss
    import pyarrow.compute as pc
    import pyarrow.dataset as ds
    import tensorflow as tf

    from retrieval.bundle.manifest import read_manifest
    from retrieval.config import Config

    clock = Stopwatch()
    manifest = read_manifest(bundle_dir)
    if manifest.doc_features != [ITEM] or manifest.query_features != [USER]:
        raise SystemExit(
            f"{bundle_dir}: embeddings are extracted from ID towers only (doc {manifest.doc_features}, "
            f"query {manifest.query_features})"
        )
    config = Config.from_dict(manifest.config or {}, source=f"{bundle_dir}/manifest.json config")
    item_ids = pq.read_table(bundle_dir / "item_ids.parquet").to_pandas().sort_values("row")["item_id"].to_numpy()
    doc = tf.saved_model.load(str(bundle_dir / manifest.files["doc_model"])).signatures["serving_default"]
    items, _ = _batched(doc, ITEM, item_ids)
    log.info("embedded %d items in %.1f s", len(items), clock.seconds)
    check: dict = {}
    index = faiss.read_index(str(bundle_dir / "index.faiss"))
    try:
        ivf = faiss.extract_index_ivf(index)
        ivf.make_direct_map()
    except RuntimeError:
        ivf = None
    source = ivf if ivf is not None else index
    try:
        rows = np.random.default_rng(seed).choice(len(items), min(1000, len(items)), replace=False)
        stored = np.stack([source.reconstruct(int(r)) for r in rows])
        check = {"rows_compared": len(rows), "max_abs_difference": float(np.abs(stored - items[rows]).max())}
    except RuntimeError as error:
        check = {"skipped": str(error).splitlines()[0][:200]}
    del index, ivf, source
    log.info("index vectors vs doc model: %s", check)

    if config.data.clicks is None:
        raise SystemExit(f"{bundle_dir}: the run's config names no click files to draw users from")
    path = config.data.clicks.path
    clicks = ds.dataset(sorted(glob.glob(path)) if glob.has_magic(path) else path, format="parquet")
    users = pc.unique(clicks.to_table(columns=[config.data.columns.user]).column(0).combine_chunks())
    users = np.sort(np.asarray(users.to_pylist(), dtype=object))
    rng = np.random.default_rng(seed)
    query = tf.saved_model.load(str(bundle_dir / manifest.files["query_model"])).signatures["serving_default"]
    drawn = users[rng.choice(len(users), min(len(users), 2 * query_users), replace=False)]
    embeddings, known = _batched(query, USER, drawn)
    keep = np.flatnonzero(known & np.any(embeddings != 0, axis=1))[:query_users]
    queries, query_ids = embeddings[keep], drawn[keep]

    scratch = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    np.save(scratch / "items.npy", items)
    np.save(scratch / "queries.npy", queries)
    (scratch / "item_ids.txt").write_text("\n".join(map(str, item_ids)) + "\n")
    (scratch / "query_user_ids.txt").write_text("\n".join(map(str, query_ids)) + "\n")
    norms = np.linalg.norm(items, axis=1)
    info = {
        "run": manifest.run,
        "bundle": str(bundle_dir),
        "bundle_created_at": manifest.created_at,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": manifest.config,
        "model_metrics": (manifest.metrics or {}).get("model"),
        "index": (manifest.index or {}).get("factory"),
        "items": {"file": "items.npy", "ids": "item_ids.txt", "shape": list(items.shape),
                  "norm_min": float(norms.min()), "norm_max": float(norms.max())},
        "queries": {"file": "queries.npy", "ids": "query_user_ids.txt", "shape": list(queries.shape),
                    "source": f"training users (known to the query tower) drawn from {len(users):,} log users, "
                              f"seed {seed}", "drawn": int(len(drawn)), "known": int(known.sum())},
        "index_check": check,
        "seconds": round(clock.seconds, 1),
    }
    (scratch / EMBEDDINGS_MANIFEST).write_text(json.dumps(info, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    scratch.rename(out)
    log.info("embeddings: %s items, %s queries -> %s (%.1f s)", items.shape, queries.shape, out, info["seconds"])
    return {"dir": str(out), "items": list(items.shape), "queries": list(queries.shape), "seconds": info["seconds"]}


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clicks", type=int, default=20_000_000)
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--epochs", type=int, default=None, help="train.epochs (default: the config's)")
    parser.add_argument("--clicks-per-user", type=float, default=20.0)
    parser.add_argument("--clusters", type=int, default=200)
    parser.add_argument("--shard-clicks", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", default=None,
                        help="default configs/scale.yaml, or configs/scale_features.yaml with --features")
    parser.add_argument("--set", action="append", default=[], help="extra config overrides")
    parser.add_argument("--dir", default=os.environ.get("RETRIEVAL_SCALE_DIR", "/tmp/retrieval-scale"))
    parser.add_argument("--keep-run", action="store_true", help="keep the run directory (bundle)")
    parser.add_argument("--generate-only", action="store_true", help="write the shards and stop")
    parser.add_argument("--features", action="store_true",
                        help="also write item and user feature tables beside the log and train with "
                        "configs/scale_features.yaml (a feature tower; early stopping and checkpoints on)")
    parser.add_argument("--out", default=str(RESULTS / "bench_scale"), help="results path without extension")
    parser.add_argument("--embeddings-dir", default=None,
                        help="where the trained model's embeddings go (default <--dir>/embeddings)")
    parser.add_argument("--query-users", type=int, default=20_000, help="training users whose embeddings are saved")
    parser.add_argument("--no-embeddings", action="store_true", help="do not save the embeddings")
    parser.add_argument("--from-bundle", default=None,
                        help="only save the embeddings of this existing run directory (no generation, no training)")
    parser.add_argument("--resume-check", type=int, default=0, metavar="BATCHES",
                        help="after the job, run it twice more as subprocesses with training capped at BATCHES "
                        "an epoch: uninterrupted, and SIGKILLed at its first checkpoint then restarted; "
                        "record whether they end equal (benchmarks/scale_resume.py)")
    parser.add_argument("--resume-check-seconds", type=int, default=30,
                        help="train.checkpoint_every_seconds of the resume check's runs")
    parser.add_argument("--only-resume-check", action="store_true",
                        help="skip the measured job: run --resume-check alone and add it to the --out results")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    logging.getLogger("faiss").setLevel(logging.WARNING)
    embeddings_dir = Path(args.embeddings_dir or Path(args.dir) / "embeddings")
    if args.from_bundle:
        print(json.dumps(save_embeddings(Path(args.from_bundle), embeddings_dir, query_users=args.query_users,
                                         seed=args.seed)))
        return

    load_average_start = load_average()
    sampler = RssSampler()
    sampler.start()
    base = Path(args.dir)
    name = log_name(args)
    data_dir = base / "logs" / name

    def generating():
        sampler.phase = "generation"

    generation = ensure_shards(data_dir, args, before_generating=generating)
    generation["bytes"] = directory_bytes(data_dir)
    log.info("log: %s", json.dumps(generation))
    table_dir = base / "logs" / f"{name}-tables"
    table_overrides: list[str] = []
    if args.features:
        tables_done = table_dir / "_DONE.json"
        if not tables_done.exists():
            with timed() as clock:
                written = write_feature_tables(table_dir, args.clicks, args.items, clicks_per_user=args.clicks_per_user,
                                               clusters=args.clusters, seed=args.seed)
            written["seconds"] = round(clock.seconds, 1)
            tables_done.write_text(json.dumps(written))
        generation["tables"] = json.loads(tables_done.read_text())
        log.info("feature tables: %s", json.dumps(generation["tables"]))
        table_overrides = [f"data.item_features.path={table_dir}/items.parquet",
                           f"data.user_features.path={table_dir}/users.parquet"]
    if args.generate_only:
        sampler.stop()
        return

    from retrieval.jobs import train_evaluate_export  # TensorFlow is imported here, after generation

    sampler.phase = "streaming_stats"
    lines: list[str] = []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # every result file below goes next to it
    sampler.lines, sampler.partial_path = lines, Path(f"{args.out}.partial.json")
    logging.getLogger("retrieval").setLevel(logging.INFO)
    logging.getLogger("retrieval").addHandler(PhaseFromLog(sampler, lines))
    args.config = args.config or str(ROOT / "configs" / ("scale_features.yaml" if args.features else "scale.yaml"))
    overrides = [
        f"data.clicks.path={data_dir}/*.parquet",
        *table_overrides,
        *([f"train.epochs={args.epochs}"] if args.epochs else []),
        f"run.output_dir={base / 'runs'}",
        f"run.name={name}{'-features' if args.features else ''}-e{args.epochs or 'config'}",
        "run.overwrite=true",
        *args.set,
    ]
    config = load_config(args.config, overrides)
    if args.only_resume_check:
        sampler.stop()
        results = Path(f"{args.out}.json")
        report = json.loads(results.read_text()) if results.exists() else None
        check = _resume_check(args, overrides, base, name)
        if report is None:  # a results file of its own
            results.write_text(json.dumps({"resume_check": check}, indent=2))
            Path(f"{args.out}.md").write_text(f"# SIGKILL mid-epoch at scale\n\n`{check['command']}`\n\n"
                                             "| check | result |\n|---|---|\n" + markdown_row(check) + "\n")
            return
        report["resume_check"] = check
        _write(report, args.out)
        return
    rss_before_job = rss_bytes()
    with timed() as clock:
        result = train_evaluate_export(config, config_name="scale")
    job_seconds = clock.seconds
    sampler.stop()

    metrics = result.metrics
    ooc = metrics["timing"]
    bundle = {
        "bytes": directory_bytes(result.directory),
        "files": {
            p.name: directory_bytes(p) if p.is_dir() else p.stat().st_size
            for p in sorted(result.directory.iterdir())
        },
    }
    report = {
        "command": command_line("bench_scale"),
        "machine": machine("numpy", "tensorflow", "faiss", "pyarrow", load_average_start=load_average_start,
                           load_average_end=load_average()),
        "generation": generation,
        "config": args.config,
        "overrides": overrides,
        "data": metrics["data"],
        "seconds": {**ooc["seconds"], "job_total": round(job_seconds, 1)},
        "epoch_seconds": ooc["epoch_seconds"],
        "training_clicks_per_second": ooc["clicks_per_second"],
        "final_train_loss": metrics["final_train_loss"],
        "train_batches": (
            f"capped at {config.data.stream.max_train_batches} batches of {config.train.batch_size} per epoch"
            if config.data.stream.max_train_batches
            else f"every training click, batches of {config.train.batch_size}"
        ),
        "evaluation": {
            ranker: {k: v for k, v in metrics[ranker].items() if k.split("@")[0] in ("recall", "ndcg", "coverage")}
            for ranker in ("model", "popularity")
            if ranker in metrics
        },
        "evaluation_counts": metrics["counts"],
        "memory": {
            "peak_rss_bytes_ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "rss_before_job_bytes": rss_before_job,
            "peak_rss_bytes_by_phase": sampler.peaks,
        },
        "bundle": bundle,
        "log": lines,
    }
    manifest = json.loads((result.directory / "manifest.json").read_text())
    report["index"] = manifest.get("index")
    # After the memory figures: loading the SavedModels again is not the job's. The ANN benchmark reads
    # the ID model's embeddings; a feature query tower needs more than user ids.
    if not args.no_embeddings and not args.features:
        report["embeddings"] = save_embeddings(result.directory, embeddings_dir, query_users=args.query_users,
                                               seed=args.seed)
    if not args.keep_run:
        shutil.rmtree(result.directory)
    _write(report, args.out)  # before the resume check: its two runs must not put these figures at risk
    if args.resume_check:
        report["resume_check"] = _resume_check(args, overrides, base, name)
        _write(report, args.out)
    Path(f"{args.out}.partial.json").unlink(missing_ok=True)
    print(markdown(report))


def _resume_check(args, overrides: list[str], base: Path, name: str) -> dict:
    from benchmarks.scale_resume import resume_check

    batches = args.resume_check or 1500
    check = resume_check(args.config, overrides, base / "resume-check", name, batches=batches,
                         checkpoint_seconds=args.resume_check_seconds, log=log.info)
    check["command"] = command_line("bench_scale")
    shutil.rmtree(base / "resume-check", ignore_errors=True)
    return check


def _write(report: dict, out: str) -> None:
    write_report(out, report, markdown(report))


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def markdown(r: dict) -> str:
    g, s, m = r["generation"], r["seconds"], r["memory"]
    rows = [
        "# Out-of-core scale benchmark",
        "",
        f"`{r['command']}` on {r['machine']['cpus']} CPUs ({r['machine']['platform']})"
        + (f", load average {r['machine']['load_average_start'][0]:.1f} at start and "
           f"{r['machine']['load_average_end'][0]:.1f} at end (a shared machine)"
           if "load_average_start" in r["machine"] else "")
        + ".",
        "",
        "| step | figure |",
        "|---|---|",
        f"| log | {g['clicks']:,} clicks, {g['users']:,} users, {g['items']:,} items, {g['shards']} Parquet shards, "
        f"{g['bytes'] / 2**20:.0f} MiB |",
        f"| generation | {'reused' if g.get('reused') else str(g.get('seconds')) + ' s'} |",
        f"| streaming statistics (pass 1: time cut; pass 2: counts and vocabularies) | {s['streaming_stats']:.1f} s |",
        f"| training ({r['train_batches']}) | {s['training']:.1f} s; per epoch "
        + ", ".join(f"{e:.0f} s" for e in r["epoch_seconds"] or [])
        + "; "
        + ", ".join(f"{c:,.0f} clicks/s" for c in r["training_clicks_per_second"] or [])
        + " |",
        f"| index ({(r.get('index') or {}).get('factory', '?')}) build + tuning | {s['indexing']:.1f} s |",
        f"| evaluation ({r['evaluation_counts'].get('evaluated_users', 0):,} sampled users, incl. pass 3) | "
        f"{s['evaluation']:.1f} s |",
        f"| whole job | {s['job_total']:.1f} s |",
        f"| peak RSS (ru_maxrss) | {_gib(m['peak_rss_bytes_ru_maxrss'])} |",
        "| peak RSS by phase (sampled 1/s) | "
        + ", ".join(f"{k} {_gib(v)}" for k, v in m["peak_rss_bytes_by_phase"].items())
        + " |",
        f"| bundle | {r['bundle']['bytes'] / 2**20:.0f} MiB |",
        *(
            [f"| embeddings saved for bench_serving.py --embeddings (after the job) | items {e['items']}, queries "
             f"{e['queries']} in {e['seconds']:.1f} s |"]
            if (e := r.get("embeddings"))
            else []
        ),
        *([markdown_row(r["resume_check"])] if "resume_check" in r else []),
        "",
        *markdown_table(["ranker", *next(iter(r["evaluation"].values()))],
                        [[ranker, *(f"{v:.4f}" for v in values.values())]
                         for ranker, values in r["evaluation"].items()]),
    ]
    return "\n".join(rows)


if __name__ == "__main__":
    main()
