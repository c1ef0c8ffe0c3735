"""The HTTP questions of the serving benchmarks: ``retrieval serve`` end to end on a loopback load.

A test bundle with fixed towers (``towers_for``, ``write_test_bundle``) is served by a
``Server`` subprocess and swapped in with ``POST /admin/reload``; ``Server.measure`` times
sequential and concurrent single-query requests, ``mixed_load`` single queries beside bulk
clients.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks._harness import ROOT, Stopwatch, load_average, markdown_table, timed
from benchmarks._serving_index import log, percentiles, served_recall

SERVE_ARGS: list[str] = []  # --serve-args: extra `retrieval serve` flags for every server started
TARGET_MIXED_RATIO = 3.0  # single-query p99 under the mixed load <= this x its idle p99
# uvicorn's HTTP parser / event loop: the default (C parser, libuv) and the pure-Python one.
DEFAULT_STACK = "httptools/uvloop"
HTTP_STACKS = [DEFAULT_STACK, "h11/asyncio"]


def towers_for(user_ids, queries, item_ids, items):
    """Fixed towers: user u{q} embeds to evaluation query q (a StringLookup ID tower, as a trained
    model has); item i{r} to item row r, the row read from the id itself, because a 1M-string
    lookup table makes saving the SavedModel take minutes. Unknown users get the zero row."""
    import tensorflow as tf

    tables = []

    def table(vectors):
        rows = np.vstack([np.zeros((1, vectors.shape[1]), np.float32), vectors])
        # Weights are set after building, not through a Constant initializer: Keras would write
        # the initializer's value (every row) into the SavedModel's JSON metadata.
        tables.append((tf.keras.layers.Embedding(len(rows), vectors.shape[1]), rows))
        return tables[-1][0]

    user = tf.keras.Input(shape=(), dtype=tf.string, name="user_id")
    lookup = tf.keras.layers.StringLookup(vocabulary=list(user_ids), mask_token=None, num_oov_indices=1)
    query_tower = tf.keras.Model({"user_id": user}, table(queries)(lookup(user)))

    item = tf.keras.Input(shape=(), dtype=tf.string, name="item_id")
    row = tf.strings.to_number(tf.strings.substr(item, 1, 7), out_type=tf.int64) + 1  # "i0000123" -> 124
    doc_tower = tf.keras.Model({"item_id": item}, table(items)(row))
    for layer, rows in tables:
        layer.set_weights([rows])
    assert item_ids[-1] == f"i{len(items) - 1:07d}"
    return query_tower, doc_tower


def write_test_bundle(workdir: Path, factory: str, index, towers, seen_items=None) -> Path:
    """A bundle per index; the towers (and ``seen_items``, given to the first) are saved once and
    hard-linked into the others."""
    from retrieval.bundle.manifest import MANIFEST_FILE, read_manifest
    from retrieval.bundle.writer import rewrite_bundle, write_bundle

    name = "bench-" + "".join(c if c.isalnum() else "-" for c in factory)
    directory = workdir / name
    first = next((p for p in workdir.iterdir() if (p / MANIFEST_FILE).is_file()), None)
    clock = Stopwatch()
    if first is None:
        directory.mkdir()
        write_bundle(directory, query_tower=towers[0], doc_tower=towers[1], index=index,
                     manifest={"run": name, "popular_item_ids": []}, seen_items=seen_items)
    else:
        shutil.copytree(first, directory, copy_function=os.link,
                        ignore=shutil.ignore_patterns("index.faiss", "index.json", "item_ids.parquet", MANIFEST_FILE))
        source = read_manifest(first)
        # This bundle's own index files, fingerprinted; the first bundle's probe (no probe: it has none).
        rewrite_bundle(directory, source, index=index, probe=source.probe, changes={"run": name})
    log(f"bundle {name} written in {clock.seconds:.1f} s")
    return directory


class Server:
    """``retrieval serve`` in a subprocess on a free 127.0.0.1 port."""

    def __init__(self, bundle: Path, http: str = "auto", loop: str = "auto"):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "retrieval.cli", "serve", "--bundle", str(bundle), "--port", str(self.port),
             "--log-level", "warning", "--http", http, "--loop", loop, *SERVE_ARGS],
            cwd=ROOT,
        )
        import httpx

        deadline = time.monotonic() + 300
        while True:
            if self.process.poll() is not None:
                raise RuntimeError("retrieval serve exited")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("retrieval serve did not come up")
            time.sleep(0.5)

    def measure(self, bundle: Path, user_ids, exact_rows, args, recall_at_k) -> dict:
        import httpx

        with httpx.Client(base_url=self.url, timeout=120) as client:
            with timed() as clock:
                reply = client.post("/admin/reload", json={"bundle": str(bundle)})
            reload_seconds = clock.seconds
            reply.raise_for_status()
            for user in user_ids[:20]:  # warm-up
                client.post("/recommend", json={"query": {"user_id": user}, "k": args.k}).raise_for_status()
            latencies, served, errors = [], {}, 0
            deadline = time.perf_counter() + args.http_seconds
            for i in range(args.http_requests):
                user = user_ids[i % len(user_ids)]
                with timed() as clock:
                    response = client.post("/recommend", json={"query": {"user_id": user}, "k": args.k})
                latencies.append(clock.seconds)
                if response.status_code != 200:
                    errors += 1
                else:
                    served[i % len(user_ids)] = response.json()["item_ids"]
                if time.perf_counter() > deadline:
                    break
        rows = sorted(served)
        recall = served_recall(rows, served, exact_rows, recall_at_k)
        concurrent = self._concurrent(user_ids, args)
        return {"reload_seconds": reload_seconds, "errors": errors + concurrent.pop("errors"),
                "served_recall": recall, **percentiles(latencies, "sequential"),
                "sequential_qps": len(latencies) / sum(latencies), **concurrent}

    def _concurrent(self, user_ids, args) -> dict:
        import httpx

        per_worker = args.http_requests // args.http_concurrency
        deadline = time.perf_counter() + args.http_seconds

        def worker(w):
            latencies, errors = [], 0
            with httpx.Client(base_url=self.url, timeout=120) as client:
                for i in range(per_worker):
                    user = user_ids[(w * per_worker + i) % len(user_ids)]
                    with timed() as clock:
                        response = client.post("/recommend", json={"query": {"user_id": user}, "k": args.k})
                    latencies.append(clock.seconds)
                    errors += response.status_code != 200
                    if time.perf_counter() > deadline:
                        break
            return latencies, errors

        with timed() as clock:
            with ThreadPoolExecutor(args.http_concurrency) as pool:
                outcomes = list(pool.map(worker, range(args.http_concurrency)))
        wall = clock.seconds
        latencies = [x for lat, _ in outcomes for x in lat]
        return {"errors": sum(e for _, e in outcomes), "concurrency": args.http_concurrency,
                "concurrent_qps": len(latencies) / wall, **percentiles(latencies, "concurrent")}

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def mixed_load(server: Server, factory: str, user_ids, args) -> dict:
    """Single-query latency with the server otherwise idle and beside --mixed-bulk-clients clients sending
    big batches, in --mixed-rounds alternating windows of --mixed-seconds each (idle, mixed, idle, ...):
    both phases then see the same background load of a shared machine."""
    import httpx

    context = multiprocessing.get_context("spawn")
    stop, active = context.Event(), context.Event()
    in_flight = context.Value("i", 0)
    results = context.Queue()
    batch_users = [user_ids[i % len(user_ids)] for i in range(args.mixed_batch)]
    clients = [context.Process(target=_bulk_client,
                               args=(server.url, batch_users, args.k, stop, active, in_flight, results))
               for _ in range(args.mixed_bulk_clients)]
    for process in clients:
        process.start()
    phases: dict[str, list] = {"idle": [], "mixed": []}
    errors = {"idle": 0, "mixed": 0}
    loads, windows = [], []
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            _single_loop(client, user_ids, args.k, 2.0)  # warm-up
            for _ in range(args.mixed_rounds):
                for phase in ("idle", "mixed"):
                    if phase == "idle":
                        active.clear()
                        _wait_for(lambda: in_flight.value == 0)  # the last batches finish first
                    else:
                        active.set()
                        _wait_for(lambda: in_flight.value == args.mixed_bulk_clients)  # every client sending
                        time.sleep(0.2)
                    latencies, failed = _single_loop(client, user_ids, args.k, args.mixed_seconds)
                    phases[phase] += latencies
                    errors[phase] += failed
                    loads.append(load_average()[0])
                    windows.append({"phase": phase, "p99_ms": float(np.percentile(latencies, 99) * 1e3),
                                    "count": len(latencies), "load_average_1min": loads[-1]})
                    log(f"mixed load, {phase} window: p99 {np.percentile(latencies, 99) * 1e3:.2f} ms "
                        f"over {len(latencies)} requests, load average {loads[-1]:.1f}")
    finally:
        stop.set()
        active.set()
        bulk = [results.get(timeout=600) for _ in clients]
        for process in clients:
            process.join(timeout=60)
    bulk_latencies = [x for latencies, _ in bulk for x in latencies]
    idle, mixed = ({"count": len(phases[p]), "errors": errors[p], **_stats(phases[p])} for p in ("idle", "mixed"))
    row = {
        "factory": factory,
        "seconds_per_window": args.mixed_seconds,
        "rounds": args.mixed_rounds,
        "bulk_clients": args.mixed_bulk_clients,
        "bulk_batch": args.mixed_batch,
        "k": args.k,
        "idle": idle,
        "mixed": mixed,
        "bulk": {"requests": len(bulk_latencies), "errors": sum(e for _, e in bulk),
                 **(_stats(bulk_latencies) if bulk_latencies else {})},
        "load_average_1min": {"min": min(loads), "max": max(loads)},
        "windows": windows,
        "p99_ratio": mixed["p99_ms"] / idle["p99_ms"],
        "target_ratio": TARGET_MIXED_RATIO,
    }
    row["errors"] = idle["errors"] + mixed["errors"] + row["bulk"]["errors"]
    row["met"] = row["p99_ratio"] <= TARGET_MIXED_RATIO and row["errors"] == 0
    log(f"mixed load: {json.dumps(row, default=float)}")
    return row


def _wait_for(condition, cap: float = 600.0) -> None:
    deadline = time.monotonic() + cap
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError("the bulk clients did not get there in time")
        time.sleep(0.01)


def _single_loop(client, user_ids, k: int, seconds: float) -> dict:
    latencies, errors = [], 0
    deadline = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < deadline:
        with timed() as clock:
            response = client.post("/recommend", json={"query": {"user_id": user_ids[i % len(user_ids)]}, "k": k})
        latencies.append(clock.seconds)
        errors += response.status_code != 200 or len(response.json().get("item_ids", [])) != k
        i += 1
    return latencies, int(errors)


def _stats(seconds: list[float]) -> dict:
    ms = 1e3 * np.asarray(seconds)
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "max_ms": float(ms.max())}


def _bulk_client(url: str, users: list[str], k: int, stop, active, in_flight, results) -> None:
    """One load client (its own process): big batches back to back while ``active``, until ``stop``;
    reports its latencies and errors."""
    import httpx

    os.nice(10)  # a load generator: on a shared machine it must not outrank the server it loads
    body = json.dumps({"queries": [{"user_id": u} for u in users], "k": k}).encode()
    latencies, errors = [], 0
    try:
        with httpx.Client(base_url=url, timeout=600, headers={"content-type": "application/json"}) as client:
            while not stop.is_set():
                if not active.wait(timeout=0.5):
                    continue
                with in_flight.get_lock():
                    in_flight.value += 1
                started = time.perf_counter()
                try:
                    ok = client.post("/recommend", content=body).status_code == 200
                except httpx.HTTPError:
                    ok = False
                finally:
                    with in_flight.get_lock():
                        in_flight.value -= 1
                latencies.append(time.perf_counter() - started)
                errors += not ok
    finally:
        results.put((latencies, errors))


def mixed_markdown(m: dict) -> str:
    """The mixed-load section of the Markdown report."""
    bulk = m["bulk"]
    lines = [
        f"## Mixed load ({m['factory']}, k={m['k']}): single queries beside {m['bulk_clients']} clients sending "
        f"{m['bulk_batch']}-query batches",
        "",
        f"Command: `nice -n 10 {m['command']}` (niced as `make bench-serving` runs it)"
        + (f" ({m['setup']['items']:,} items x {m['setup']['dim']} dims, {m['setup']['total_seconds'] / 60:.1f} min)"
           if "setup" in m else ""),
        "",
        f"One client sends single queries back to back in {m['rounds']} x 2 alternating windows of "
        f"{m['seconds_per_window']:g} s: idle (the server has nothing else to do) and mixed (the bulk clients, "
        "separate processes at nice +10, send batches without pause). Alternating windows give both phases the "
        "same background load; load average (1 min) during the run "
        f"{m['load_average_1min']['min']:.1f}-{m['load_average_1min']['max']:.1f} on {os.cpu_count()} cores "
        "(the machine is shared with other jobs).",
        "",
        *markdown_table(
            ["phase", "single-query requests", "p50 ms", "p99 ms", "max ms", "errors"],
            [[phase, r["count"], f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['max_ms']:.2f}", r["errors"]]
             for phase in ("idle", "mixed") for r in [m[phase]]],
            align="lrrrrr",
        ),
        "",
        "p99 ms per window, in order (idle / mixed): "
        + ", ".join(f"{a['p99_ms']:.1f} / {b['p99_ms']:.1f}" for a, b in zip(m["windows"][::2], m["windows"][1::2]))
        + " (a window that coincides with a burst of other jobs' work shows in either phase).",
        "",
        f"Bulk batches answered: {bulk['requests']} ({bulk['errors']} errors)"
        + (f", p50 {bulk['p50_ms']:.0f} ms, p99 {bulk['p99_ms']:.0f} ms each." if "p50_ms" in bulk else "."),
        f"Mixed p99 / idle p99 = {m['p99_ratio']:.2f} (target <= {m['target_ratio']:g}, zero errors): "
        f"{'met' if m['met'] else 'MISSED'}.",
    ]
    return "\n".join(lines)
