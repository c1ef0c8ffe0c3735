"""Live catalogue edits on a served feature-tower bundle: how soon a new item is served, and whether
any request fails while the catalogue changes.

    python -m benchmarks.bench_catalogue            # or: make bench-catalogue (~5 min on 2 cores)
    python -m benchmarks.bench_catalogue --bundle artifacts/<feature run> --edits 12 --clients 4
    python -m benchmarks.bench_catalogue --grow 100000 --out benchmarks/results/bench_catalogue_100k

The question: after ``POST /admin/catalogue`` adds an item to a running service, how many seconds
until a request gets it (target: within 1 s), and how many requests of a concurrent load fail
during a series of edits (target: none)?

Setup: the MovieLens-100K feature towers (``configs/ml100k_features.yaml``, trained by the job in a
subprocess unless ``--bundle`` names one) are copied to a scratch directory (``--grow N`` first adds N
copies of its items offline, for a larger index) and served by ``retrieval serve`` in a subprocess.
New items copy the raw doc features of some user's top-1 item (genres, release year moved by up to
6 years) with a new title. For each, a probe request is found by brute force through the bundle's
own doc and query models over the index's vectors: a user (of 300 drawn) and the (at most 100) items
that user ranks above the new one, excluded by the request with the other new items, so that its
top-1 (k = 1) is exactly the new item once it is served. ``--clients`` threads post ``/recommend``
for random known users (k = 10) the whole time. The edits cycle add, add, remove (the item added two
edits before: timed until its probe's top-1 is another item), update (a title, re-embedded). For
each add a prober thread, started just before the admin call, posts the probe request in a loop;
the time to served is from the admin call to the first answer naming the item. Last, the server is
restarted on the same directory: it must serve the newest version and answer the kept items' probes
as the live service last did.

Writes ``bench_catalogue.json`` and ``.md`` in ``--out``; seconds hold for this machine under its
load (``uptime`` is recorded before and after).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks._harness import RESULTS, ROOT, command, machine, markdown_table, write_report

CONFIG = "configs/ml100k_features.yaml"
TARGET_SECONDS = 1.0
# A probe request excludes at most this many catalogue items that its user ranks above the new item.
MAX_ABOVE = 100
PROBE_USERS = 300  # users a probe may be found for
YEAR_SHIFTS = (-6.0, -3.0, 0.0, 3.0, 6.0)  # a new item's release year: its source item's, moved


def train_bundle(output_dir: Path) -> Path:
    """The job on ``CONFIG`` (its own settings) into ``output_dir``; the bundle's directory."""
    name = "catalogue-bench"
    subprocess.run([sys.executable, "-m", "pipelines.train", "--config", CONFIG, "--set",
                    f"run.output_dir={output_dir}", "--set", f"run.name={name}", "--set", "train.verbose=0"],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return output_dir / name


def choose_new_items(root: Path, count: int, seed: int,
                     max_above: int = MAX_ABOVE) -> tuple[list[dict[str, Any]], list[dict], list[str]]:
    """``count`` new items (raw doc features, ``item_id`` new-<n>) and for each a probe: a user and the
    catalogue items that user ranks above it (at most ``max_above``), which the probe request excludes,
    so that its top-1 is the new item once served (brute force through the bundle's own models, the
    next item more than 1e-4 below). Returns (items, probes {"user", "exclude"}, known user ids)."""
    import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS)
    from retrieval.bundle.catalogue import CatalogueModels, input_tensor
    from retrieval.serving import Bundle

    bundle = Bundle.load(root)
    manifest = bundle.manifest_model
    rng = np.random.default_rng(seed)
    users = bundle.known_user_ids(100_000)
    # The probes' users: at most PROBE_USERS of them, so [users, items] scores fit in memory at 100k items.
    probe_users = sorted(rng.choice(users, min(len(users), PROBE_USERS), replace=False).tolist())
    queries = bundle.embed([{bundle.metadata()["user_input"]: user} for user in probe_users])
    catalogue = queries @ bundle.index.vectors(np.arange(len(bundle.index))).T  # [users, items]
    # Near what users like: the features of some probe users' top-1 items, the release year moved.
    favourites = catalogue[rng.permutation(len(probe_users))[: 4 * count]].argmax(axis=1)
    features = bundle.item_features(list(bundle.index.item_ids[favourites]))
    inputs = [name for name in manifest.doc_features if name != "item_id"]
    pool = []
    for row in features:
        for shift in YEAR_SHIFTS:
            item = {"item_id": f"new-{len(pool)}", **{name: (row or {}).get(name) for name in inputs}}
            item["title"] = f"{item.get('title') or 'Untitled'} (restored)"
            year = item.get("release_year")
            if isinstance(year, float) and not np.isnan(year):
                item["release_year"] = year + shift
            pool.append(item)
    models = CatalogueModels.load(root, manifest)
    specs = manifest.doc_inputs or {}
    embedded = models.embed_items(**{name: input_tensor([item.get(name) for item in pool], specs[name], name)
                                     for name in manifest.doc_features})["embedding"].numpy()
    chosen, probes, taken = [], [], set()
    for candidate, item in enumerate(pool):
        scores = queries @ embedded[candidate]  # [users]
        above = (catalogue > scores[:, None]).sum(axis=1)
        above[list(taken)] = len(bundle.index) + 1
        user = int(np.argmin(above))
        if above[user] > max_above:
            continue
        order = np.argsort(-catalogue[user])
        excluded, rest = order[: above[user]], order[above[user]:]
        if scores[user] - catalogue[user, rest[0]] <= 1e-4:  # clear of ties
            continue
        chosen.append(item)
        probes.append({"user": probe_users[user], "exclude": [str(i) for i in bundle.index.item_ids[excluded]]})
        taken.add(user)
        if len(chosen) == count:
            new_ids = [new["item_id"] for new in chosen]
            for new, probe in zip(chosen, probes):  # the other new items never stand in the way
                probe["exclude"] += [other for other in new_ids if other != new["item_id"]]
            return chosen, probes, users
    raise RuntimeError(f"only {len(chosen)} of {count} new items come within {max_above} items of some user's top "
                       "(--max-above)")


def grow_catalogue(source: Path, out: Path, count: int, seed: int) -> None:
    """``out``: ``source`` with ``count`` more items, copies of its items' raw doc features (release year
    moved by up to 10 years, a numbered title), added offline by ``edit_catalogue``."""
    import pandas as pd

    import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS)
    from retrieval.bundle.catalogue import edit_catalogue
    from retrieval.serving import Bundle

    bundle = Bundle.load(source)
    rng = np.random.default_rng(seed + 1)
    picks = rng.integers(0, len(bundle.index), count)
    features = bundle.item_features(list(bundle.index.item_ids[picks]))
    inputs = [name for name in bundle.manifest_model.doc_features if name != "item_id"]
    rows = []
    for n, row in enumerate(features):
        item = {"item_id": f"grow-{n}", **{name: (row or {}).get(name) for name in inputs}}
        item["title"] = f"{item.get('title') or 'Untitled'} #{n}"
        year = item.get("release_year")
        if isinstance(year, float) and not np.isnan(year):
            item["release_year"] = year + float(rng.integers(-10, 11))
        rows.append(item)
    edit_catalogue(source, "add", pd.DataFrame.from_records(rows), out)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(root: Path, port: int) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "retrieval.cli", "serve", "--bundle", str(root), "--port",
                               str(port), "--log-level", "warning"], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"retrieval serve exited: {server.stderr.read() if server.stderr else ''}")
        if time.monotonic() > deadline:
            raise RuntimeError("retrieval serve did not come up in 300 s")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            time.sleep(0.2)


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


class Load:
    """``clients`` threads posting /recommend for random known users until ``stop``: every reply's
    status, latency and bundle, and every failure (a non-200 status or a transport error)."""

    def __init__(self, url: str, users: list[str], clients: int, seed: int):
        self.url, self.users = url, users
        self.stop = threading.Event()
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.versions: dict[str, int] = {}
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(seed + i,), daemon=True) for i in range(clients)]

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self.stop.is_set():
                started = time.perf_counter()
                try:
                    reply = client.post("/recommend", json={"query": {"user_id": rng.choice(self.users)}, "k": 10})
                    ok = reply.status_code == 200
                    problem = None if ok else f"{reply.status_code} {reply.text[:200]}"
                    version = reply.json()["bundle"] if ok else None
                except (httpx.HTTPError, ValueError) as error:
                    problem, version = f"{type(error).__name__}: {error}", None
                seconds = time.perf_counter() - started
                with self._lock:
                    self.latencies.append(seconds)
                    if problem is not None:
                        self.failures.append(problem)
                    elif version is not None:
                        self.versions[version] = self.versions.get(version, 0) + 1

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)


def top1(client: httpx.Client, probe: dict) -> str | None:
    """The top-1 of a probe: its user, the items it excludes, k = 1 (None for a failed request)."""
    reply = client.post("/recommend", json={"query": {"user_id": probe["user"]}, "k": 1, "exclude_seen": False,
                                            "exclude_item_ids": probe["exclude"]})
    return reply.json()["item_ids"][0] if reply.status_code == 200 else None


def timed_edit(url: str, edit: dict[str, Any], user: dict | None, served: Any, limit: float = 60.0) -> dict:
    """Post ``edit``; with a probe (``user``), ask its top-1 until ``served(top1)`` holds: the seconds
    from the admin call to the first such answer (None when it never came within ``limit``)."""
    seen_at: list[float] = []
    go = threading.Event()
    started = 0.0

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            go.wait()
            while time.perf_counter() - started < limit:
                if served(top1(client, user)):
                    seen_at.append(time.perf_counter())
                    return

    prober = threading.Thread(target=probe, daemon=True) if user is not None else None
    if prober is not None:
        prober.start()
    with httpx.Client(base_url=url, timeout=120) as admin:
        started = time.perf_counter()
        go.set()
        reply = admin.post("/admin/catalogue", json=edit)
        answered = time.perf_counter()
    if reply.status_code != 200:
        raise RuntimeError(f"the edit {edit['change']} failed: {reply.status_code} {reply.text}")
    if prober is not None:
        prober.join(timeout=limit + 5)
    body = reply.json()
    return {"change": edit["change"], "bundle": body["bundle"], "admin_seconds": round(answered - started, 3),
            "server_seconds": body["seconds"], "server_served_seconds": body["served_seconds"],
            "server_persisted_seconds": body["persisted_seconds"], "num_items": body["num_items"],
            "served_after_seconds": round(seen_at[0] - started, 3) if seen_at else None}


def run(args: argparse.Namespace) -> dict:
    load_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="bench-catalogue-") as scratch:
        scratch_dir = Path(scratch)
        source = Path(args.bundle) if args.bundle else train_bundle(scratch_dir / "artifacts")
        root = scratch_dir / "shop"
        if args.grow:  # a larger catalogue: the source's items copied with new ids, added offline
            base = scratch_dir / "base"
            shutil.copytree(source, base, symlinks=True)
            grow_catalogue(base, root, args.grow, args.seed)
        else:
            shutil.copytree(source, root, symlinks=True)
        adds = sum(1 for i in range(args.edits) if i % 4 in (0, 1))
        items, probes, users = choose_new_items(root, adds, args.seed, args.max_above)
        manifest = json.loads((root / "manifest.json").read_text())
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_server(root, port)
        rows: list[dict] = []
        added: list[tuple[dict, str]] = []
        try:
            with Load(url, users, args.clients, args.seed) as load:
                time.sleep(2)  # the load running before the first edit
                next_add = 0
                for i in range(args.edits):
                    kind = ("add", "add", "remove", "update")[i % 4]
                    if kind == "add":
                        item, user = items[next_add], probes[next_add]
                        next_add += 1
                        row = timed_edit(url, {"change": "add", "items": [item]}, user,
                                         lambda top, item_id=item["item_id"]: top == item_id)
                        added.append((item, user))
                        row["item_id"] = item["item_id"]
                    elif kind == "remove":
                        item, user = added.pop(-2)
                        row = timed_edit(url, {"change": "remove", "item_ids": [item["item_id"]]}, user,
                                         lambda top, item_id=item["item_id"]: top is not None and top != item_id)
                        row["item_id"] = item["item_id"]
                    else:
                        item, _ = added[-1]
                        row = timed_edit(url, {"change": "update", "items": [
                            {"item_id": item["item_id"], **{k: v for k, v in item.items() if k != "item_id"},
                             "title": item["title"] + " [updated]"}]}, None, None)
                        row["item_id"] = item["item_id"]
                    rows.append(row)
                    time.sleep(args.pause)
                time.sleep(1)
            with httpx.Client(base_url=url, timeout=30) as client:  # what the live service answers last
                live = [top1(client, probe) for _, probe in added]
        finally:
            stop_server(server)
        newest = rows[-1]["bundle"]
        restarted = start_server(root, port)
        try:
            with httpx.Client(base_url=url, timeout=30) as client:
                meta = client.get("/metadata").json()
                kept = [top1(client, probe) for _, probe in added]
        finally:
            stop_server(restarted)
    load_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    latencies = np.asarray(load.latencies)
    return {
        "environment": machine("numpy", "faiss", "tensorflow"),
        "command": command("bench_catalogue"),
        "uptime_before": load_before,
        "uptime_after": load_after,
        "bundle": {"config": None if args.bundle else CONFIG, "source": str(args.bundle or "trained"),
                   "grown_by": args.grow,
                   "num_items": manifest["num_items"], "doc_features": manifest["doc_features"],
                   "index": manifest["index"]["factory"], "embedding_dim": manifest["embedding_dim"]},
        "clients": args.clients,
        "edits": rows,
        "load": {"requests": len(latencies), "failed": len(load.failures), "failures": load.failures[:10],
                 "p50_ms": round(float(np.percentile(latencies, 50)) * 1000, 1),
                 "p99_ms": round(float(np.percentile(latencies, 99)) * 1000, 1),
                 "versions_served": load.versions},
        "summary": {
            **summarise_adds(rows),
            "failed_requests": len(load.failures),
            # The restarted service opens the newest version and answers the probes of the items added
            # and kept as the live one did last.
            "restart_serves": meta["bundle"] == newest and kept == live,
            "restart_bundle": meta["bundle"], "newest_version": newest,
        },
    }


def summarise_adds(edits: list[dict]) -> dict:
    """The adds of a series of edits: how many, how many were served within ``TARGET_SECONDS`` of the
    admin call, the median and max seconds to served (of those served), and how many never were."""
    served = [row["served_after_seconds"] for row in edits if row["change"] == "add"]
    seen = [seconds for seconds in served if seconds is not None]
    return {
        "adds": len(served),
        "adds_served_within_target": sum(1 for seconds in seen if seconds <= TARGET_SECONDS),
        "served_after_seconds_median": round(float(np.median(seen)), 3) if seen else None,
        "served_after_seconds_max": max(seen, default=None),
        "never_served": len(served) - len(seen),
    }


def markdown(report: dict) -> str:
    summary, load, bundle = report["summary"], report["load"], report["bundle"]
    lines = [
        "# Live catalogue edits: time to serve a new item, failed requests under load",
        "",
        f"`{report['command']}` on {report['environment']['cpu']}, {report['environment']['cpus']} CPUs.",
        f"Load before: `{report['uptime_before']}`; after: `{report['uptime_after']}`.",
        "",
        f"Bundle: {bundle['source']} ({bundle['config'] or 'given'}), {bundle['num_items']} items"
        + (f" ({bundle['grown_by']} of them copies of its items added offline first)" if bundle.get("grown_by") else "")
        + f", doc inputs "
        f"{bundle['doc_features']}, index {bundle['index']}, dim {bundle['embedding_dim']}. "
        f"{report['clients']} client threads post /recommend (k = 10) throughout.",
        "",
        f"- adds served within {TARGET_SECONDS:g} s of the admin call: **{summary['adds_served_within_target']} of "
        f"{summary['adds']}** (median {summary['served_after_seconds_median']} s, max "
        f"{summary['served_after_seconds_max']} s; never served: {summary['never_served']})",
        f"- failed requests: **{summary['failed_requests']} of {load['requests']}** (p50 {load['p50_ms']} ms, "
        f"p99 {load['p99_ms']} ms over the whole series)",
        f"- restart on the same directory serves the newest version ({summary['restart_bundle']}) and answers "
        f"the kept items' probes as the live service did: **{summary['restart_serves']}**",
        "",
        *markdown_table(["#", "change", "item", "version", "admin call s", "server: served s", "server: persisted s",
                         "served after s", "items"],
                        [[i + 1, row["change"], row["item_id"], row["bundle"], row["admin_seconds"],
                          row["server_served_seconds"], row["server_persisted_seconds"],
                          "-" if row["served_after_seconds"] is None and row["change"] == "update"
                          else row["served_after_seconds"], row["num_items"]]
                         for i, row in enumerate(report["edits"])], "rllrrrrrr"),
        "",
        "Served after: from the admin call to the first answer of the prober (the item's probe request, "
        "k = 1, in a loop) naming the new item (add) or another item (remove). The server applies an edit to "
        "a copy of the served index in memory and swaps it in (server: served s), then writes the version, "
        "checks its fingerprints and moves the current pointer (server: persisted s, from the same start); "
        "the admin call returns after both. The server loads the doc model in the background "
        "at start; the series starts 2 s after /healthz answers.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", help=f"a feature-tower bundle to serve (default: train {CONFIG})")
    parser.add_argument("--edits", type=int, default=12, help="edits in the series (default: %(default)s)")
    parser.add_argument("--clients", type=int, default=4, help="load threads (default: %(default)s)")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds between edits (default: %(default)s)")
    parser.add_argument("--grow", type=int, default=0,
                        help="first add this many copies of the catalogue's items offline, to time edits on a "
                        "larger index (default: %(default)s)")
    parser.add_argument("--max-above", type=int, default=MAX_ABOVE,
                        help="a new item's probe excludes at most this many items its user ranks above it; a "
                        "larger catalogue needs more (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "bench_catalogue"), help="results stem (default: %(default)s)")
    args = parser.parse_args(argv)
    report = run(args)
    write_report(args.out, report, markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
