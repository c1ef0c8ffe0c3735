"""The ASGI app of the HTTP service: routes, the bundle being served, the bulk lane.

``create_app`` builds the Starlette app (``/recommend``, ``/similar``, ``/users``,
``/users/{user_id}/items``, ``/items``, ``/items/search``, ``/explain``, ``/healthz``, ``/metadata``, ``/metrics``,
``/admin/reload``, ``/admin/catalogue`` and the web page at ``/``) over a ``BundleHolder``,
whose ``reload`` swaps a new bundle in with one reference assignment; large batches run in
the bulk lane (``_bulk_executor``) in chunks, apart from small requests; the
exception handlers turn errors into ``{"error": ...}`` replies.

Each route's work is a module-level ``answer_*`` function over a loaded Bundle (or the holder) and plain
values, callable without HTTP; the routes only parse the request, read what is served from
``request.app.state`` (``holder``, ``limits``, ``search_threads``, ``bulk_lane``, the admin address and
token) and write the reply.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import faiss
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from retrieval.common.errors import UserError
from retrieval.serving.http.inputs import (
    CatalogueRequest,
    ExplainRequest,
    ItemsRequest,
    RecommendRequest,
    ReloadRequest,
    SimilarRequest,
    _describe,
    _error,
    _HeaderCount,
    _parse_object,
    _query_count,
    _read_body,
    _validated,
    ascii_count,
)
from retrieval.serving.http.limits import INLINE_PARSE_BYTES, ServiceLimits, admin_host_allowed, same_origin
from retrieval.serving.http.metrics import METRICS_PATH, RequestMetrics, ServiceMetrics
from retrieval.serving.http.page import PAGE_PATH, page_headers, page_html

if TYPE_CHECKING:  # retrieval.serving.bundle loads TensorFlow: imported where a bundle is loaded, so that
    # `retrieval reload` and `retrieval serve --help` (which read ServiceLimits) start fast.
    from retrieval.serving.bundle import Bundle, Recommendations, Verify

log = logging.getLogger("retrieval.service")
# GET /users: how many known user ids a page's pick list gets by default, and at most.
DEFAULT_USER_LIST, MAX_USER_LIST = 100, 1000
# GET /items/search: ids a search answers by default and at most; the longest query text.
DEFAULT_SEARCH_RESULTS, MAX_SEARCH_RESULTS, MAX_SEARCH_TEXT = 20, 100, 200


class BundleHolder:
    """The bundle being served; ``reload`` replaces it with one reference assignment.

    A request reads ``current`` once and uses that object to the end, so a
    swap never changes the bundle under a running request, and the old bundle
    is freed when the last request using it finishes. ``load_seconds`` (None
    for a bundle loaded elsewhere) and ``served_since`` (Unix time it was
    swapped in) describe ``current`` for ``GET /metrics``. ``root`` is the
    bundle directory as given (to ``create_app`` or the last reload): the
    served bundle is its newest catalogue version (``current_version``), and
    ``edit`` publishes the next one beside it.
    """

    def __init__(self, bundle: Bundle, verify: Verify = "quick", load_seconds: float | None = None,
                 root: str | Path | None = None):
        self.current = bundle
        self.verify: Verify = verify
        self.load_seconds = load_seconds
        self.served_since = time.time()
        self.root = Path(root) if root is not None else bundle.directory
        self._reload_lock = asyncio.Lock()
        self._doc_model: tuple[Any, Any] | None = None  # (fingerprints of the doc model, its serving function)
        self._doc_model_lock = threading.Lock()

    async def reload(self, directory: str | Path) -> tuple[Bundle, Bundle]:
        """Load ``directory`` off the event loop (every check of ``Bundle.load`` at ``verify``), then swap;
        return (old, new). A bundle that fails a check raises here and the old one stays."""
        async with self._reload_lock:  # one reload at a time; requests are never blocked
            new, seconds = await run_in_threadpool(_timed_load, directory, self.verify)
            # All on the event loop, where /metrics reads them too: a scrape never sees half of the swap.
            old, self.current = self.current, new
            self.root = Path(directory)
            self.load_seconds, self.served_since = seconds, time.time()
            return old, new

    async def edit(self, change: str, items: Any) -> CatalogueEdit:
        """Apply a catalogue edit to the served bundle, serve it, then persist it as the next version
        of ``root``; return what happened (``CatalogueEdit``).

        1. In the thread pool: the edit is checked and applied to an in-memory copy of the served
           state (``prepare_edit``: new items embedded by the doc model and added to a copy of the
           index, the display table and disabled ids edited; ``Bundle.edited``: the rest shared).
        2. On the event loop, ONE reference assignment: the edit is served (a request sees the
           old or the new catalogue, never half).
        3. In the thread pool: the version is written beside the others, checked against its
           fingerprints, and only then ``root.catalogue/current`` moves to it (``publish_prepared``);
           a restart serves it from then on.

        One edit or reload at a time, each to its end (step 3 included): versions are written in
        the order the edits were served, and each edit starts from the persisted one before it. A
        failure in step 1 raises (nothing served, nothing written). A failure in step 3 puts the
        bundle served before the edit back (the served catalogue is always what a restart serves,
        or becomes it when the write finishes) and raises ``EditNotPersisted``.
        """
        async with self._reload_lock:
            started = time.perf_counter()
            prepared, pending = await run_in_threadpool(self._prepare, change, items)
            old, self.current = self.current, pending  # served from here on
            served = time.perf_counter() - started
            self.served_since = time.time()
            try:
                persisted = await run_in_threadpool(self._persist, prepared, pending)
            except Exception as error:
                self.current = old  # back to what the newest version on disk holds
                self.served_since = time.time()
                log.error("catalogue %s served as %s for %.3f s, then rolled back to %s: writing it failed: %r",
                          change, pending.version, time.perf_counter() - started - served, old.version, error)
                raise EditNotPersisted(pending.version, old.version, error) from error
            self.current = persisted
            self.load_seconds = time.perf_counter() - started
            return CatalogueEdit(old, persisted, served, self.load_seconds)

    def _prepare(self, change: Any, items: Any) -> tuple[Any, Bundle]:
        """The edit applied in memory to the served bundle: (``PreparedEdit``, the Bundle serving it)."""
        import pandas as pd

        from retrieval.bundle.catalogue import CatalogueModels, current_version, next_version, prepare_edit

        current = self.current
        if current_version(self.root).resolve() != current.directory.resolve():
            raise ValueError(f"the newest catalogue version of {self.root.name!r} is not the one served "
                             f"({current.version!r}): reload first, so the edit starts from what is served")
        changed = current.changed_files()
        if changed:  # the new version shares the served files: they must be those loaded and checked
            raise ValueError(f"the served bundle's files changed on disk since they were loaded "
                             f"({', '.join(changed)}): reload it first")
        models = CatalogueModels(self.doc_model(current), lambda query: current.embed([query]))
        prepared = prepare_edit(current.directory, change, pd.DataFrame.from_records(items),
                                run=next_version(self.root), models=models,
                                loaded=(current.index, current.item_display), row_of=current.row_of)
        return prepared, current.edited(prepared.manifest, prepared.index, prepared.display)

    def _persist(self, prepared: Any, pending: Bundle) -> Bundle:
        """Write ``prepared`` as the next version of ``root`` and move ``current`` to it; return
        ``pending`` watching the written files."""
        from retrieval.bundle.catalogue import publish_prepared
        from retrieval.bundle.manifest import read_manifest

        directory = publish_prepared(self.root, prepared)
        return pending.persisted(directory, read_manifest(directory))

    def doc_model(self, bundle: Bundle | None = None) -> Any:
        """The doc SavedModel's serving function of ``bundle`` (default: the served one), loaded once
        and kept while the edits keep the same doc model files (their fingerprints). ``retrieval
        serve`` calls it in the background at start, so the first edit does not wait for the load."""
        import tensorflow as tf

        bundle = self.current if bundle is None else bundle
        folder = bundle.manifest_model.files["doc_model"]
        fingerprint = {name: record for name, record in (bundle.manifest.get("fingerprints") or {}).get(
            "files", {}).items() if name.startswith(f"{folder}/")}
        with self._doc_model_lock:
            if self._doc_model is None or self._doc_model[0] != fingerprint:
                import retrieval.bundle.writer  # noqa: F401  (what an edit writes with, imported ahead of it)
                from retrieval.bundle.catalogue import input_tensor

                loaded = tf.saved_model.load(str(bundle.directory / folder)).signatures["serving_default"]
                # One call on an all-missing item: TensorFlow's first call of a function is slow.
                specs = bundle.manifest_model.doc_inputs or {}
                try:
                    loaded(**{name: input_tensor([None], specs[name], name)
                              for name in bundle.manifest_model.doc_features if name in specs})
                except Exception as error:  # only a warm-up: the edit itself reports a real problem
                    log.debug("doc model warm-up call failed: %r", error)
                self._doc_model = (fingerprint, loaded)
            return self._doc_model[1]


@dataclass(frozen=True)
class CatalogueEdit:
    """A live catalogue edit that was served and persisted (``BundleHolder.edit``)."""

    old: Bundle
    new: Bundle
    served_seconds: float  # from the start of the edit (its lock taken) to the swap
    persisted_seconds: float  # from the same start to ``current`` pointing at the written version


class EditNotPersisted(RuntimeError):
    """A live edit was served but its version could not be written: the bundle served before it is
    served again."""

    def __init__(self, version: str, restored: str, error: BaseException):
        reason = str(error) if isinstance(error, ValueError | OSError) else type(error).__name__
        super().__init__(f"the edit was served as {version!r} but writing that version failed ({reason}); "
                         f"{restored!r}, the newest version on disk, is served again")
        self.version, self.restored = version, restored


def _timed_load(directory: str | Path, verify: Verify) -> tuple[Bundle, float]:
    """``Bundle.load`` of ``directory``'s newest catalogue version (``current_version``: ``directory``
    itself when it was never edited) at ``verify``, and the seconds it took."""
    from retrieval.bundle.catalogue import current_version
    from retrieval.serving.bundle import Bundle

    started = time.perf_counter()
    bundle = Bundle.load(current_version(directory), verify=verify)
    return bundle, time.perf_counter() - started


def _count_parameter(request: Request, name: str, default: int, bound: int) -> int | JSONResponse:
    """The query parameter ``name`` as a count from 1 to ``bound`` (``default`` when absent), or the
    422 that names it: ASCII digits only (``ascii_count``), as ``Content-Length`` is read."""
    raw = request.query_params.get(name, str(default))
    count = ascii_count(raw)
    if count is None or not 1 <= count <= bound:
        return _error(422, f"{name} must be an integer from 1 to {bound}, got {ascii(raw[:40])}")
    return count


def _limit_search_threads(search_threads: int | None) -> None:
    if search_threads:
        # OpenMP thread counts are per calling thread: set it in the worker thread itself.
        faiss.omp_set_num_threads(search_threads)


# The answers: each route's work with no HTTP in it, callable on a loaded Bundle (or the holder) directly.
# A bad request raises HTTPException (the status and the reason), which the app's handler turns into
# ``{"error": reason}``; the body answers return the reply's JSON bytes, the others its status and object.


def answer_recommend(current: Bundle, payload: dict[str, Any] | bytes, chunk: int | None = None,
                     search_threads: int | None = 1) -> bytes:
    """The JSON reply to one /recommend body (bytes, or already parsed), computed in a worker thread;
    ``chunk`` queries are searched and written at a time (None: all at once)."""
    parsed = _validated(_parse_object(payload) if isinstance(payload, bytes) else payload, RecommendRequest)
    queries, excluded = parsed.batch()
    _limit_search_threads(search_threads)
    step = chunk or len(queries)
    pieces = []
    if parsed.history_order is None and current.sends_history(queries):
        raise HTTPException(422, f"a query sends a click history ({current.metadata()['history_input']!r}): "
                            f"say its order, history_order 'newest_first' (the most recent click first) "
                            f"or 'oldest_first' (time order, as a sequences file lists it)")
    try:
        for position, query in enumerate(queries):
            current.check_query(query, position)
        # One query-tower call for the whole batch (mostly outside the interpreter lock), then the
        # search and the JSON in slices, yielding the interpreter between them.
        allowed = current.allowed_rows(parsed.filters)  # RequestError naming a column the bundle lacks: 422
        embeddings, known = current.embed_with_known(queries, history_order=parsed.history_order or "newest_first")
        for start in range(0, len(queries), step):
            if start:
                time.sleep(0)  # let the small requests' threads take the interpreter between chunks
            window = slice(start, start + step)
            results = current.recommend_embedded(
                embeddings[window], known[window], parsed.k, excluded[window],
                queries=queries[window], exclude_seen=parsed.exclude_seen, allowed=allowed,
            )
            pieces.append(_dumps([_result(r) for r in results])[1:-1])
    except ValueError as error:
        raise HTTPException(422, str(error)) from None
    if parsed.query is not None:
        return _dumps({"bundle": current.version})[:-1] + b"," + pieces[0][1:-1] + b"}"
    return _dumps({"bundle": current.version})[:-1] + b',"results":[' + b",".join(pieces) + b"]}"


def answer_similar(current: Bundle, body: bytes, search_threads: int | None = 1) -> bytes:
    """The JSON reply to one /similar body, parsed and computed in a worker thread (an exclusion
    list of 10,000 ids is too large a body to parse on the event loop)."""
    parsed = _validated(_parse_object(body), SimilarRequest)
    _limit_search_threads(search_threads)
    try:
        result = current.similar_items(parsed.item_id, parsed.k, exclude_item_ids=parsed.exclude_item_ids,
                                       filters=parsed.filters)
    except ValueError as error:  # RequestError: an item id not in the catalogue
        raise HTTPException(422, str(error)) from None
    return _dumps({"bundle": current.version, "item_id": parsed.item_id, **_result(result)})


async def answer_healthz(current: Bundle) -> tuple[int, dict[str, Any]]:
    """(status, reply) of the health check of ``current``: 200 when it is healthy, 503 naming why not."""
    # The files on disk are still those loaded (the loaded copy keeps serving either way: a restart or a
    # reload would read the changed ones), then the probe query through the live query model and index:
    # a bundle that cannot answer it is not healthy.
    changed = await run_in_threadpool(current.changed_files)
    if changed:
        names = ", ".join(name.encode("utf-8", "backslashreplace").decode() for name in changed[:10])
        reason = (f"bundle files changed on disk since they were loaded: {names}"
                  f"{f' and {len(changed) - 10} more' if len(changed) > 10 else ''}; the loaded copy keeps "
                  "serving, a reload or restart would read the changed files")
        log.error("health check failed on %s: %s", current.version, reason)
        return 503, {"status": "failing", "bundle": current.version, "error": reason}
    problem = await run_in_threadpool(current.probe_problem)
    if problem:
        log.error("health check failed on %s: %s", current.version, problem)
        return 503, {"status": "failing", "bundle": current.version, "error": problem}
    return 200, {"status": "ok", "bundle": current.version, "num_items": len(current.index)}


def answer_metadata(current: Bundle) -> dict[str, Any]:
    return current.metadata()


def answer_users(current: Bundle, limit: int) -> dict[str, Any]:
    """The reply to GET /users: how many training users ``current`` knows and the first ``limit`` ids."""
    known = current.seen_items
    return {"bundle": current.version, "num_users": 0 if known is None else len(known),
            "user_ids": current.known_user_ids(limit)}


def answer_training_items(current: Bundle, user_id: str) -> bytes:
    """The JSON reply to GET /users/{user_id}/items; a 404 HTTPException for a user without any."""
    items, recent = current.training_items(user_id), current.recent_items(user_id)
    if items is None and recent is None:
        why = ("it was exported without training items (seen_items/)" if current.seen_items is None
               else f"it is not one of its {len(current.seen_items)} training users")
        # A long id is cut in the reply: the client sent it, so it need not come back whole.
        who = f"user {user_id[:80]!r}"
        raise HTTPException(404, f"{who} has no training items in bundle {current.version!r}: {why}")
    # The stored recent clicks, newest first, where the bundle keeps them (towers reading a history).
    return _dumps({"bundle": current.version, "user_id": user_id, "item_ids": items,
                   "recent_item_ids": recent})


def answer_items(current: Bundle, body: bytes) -> bytes:
    """The JSON reply to one /items body: the display features of the ids asked for."""
    parsed = _validated(_parse_object(body), ItemsRequest)
    features = current.item_features(parsed.item_ids)
    names = None if current.item_display is None else current.item_display.features
    return _dumps({"bundle": current.version, "features": names,
                   "items": [{"item_id": item, "features": values}
                             for item, values in zip(parsed.item_ids, features)]})


def answer_search(current: Bundle, text: str, limit: int) -> bytes:
    """The JSON reply to GET /items/search: at most ``limit`` items whose display text matches ``text``."""
    found = current.search_items(text, limit)
    return _dumps({"bundle": current.version, "q": text, "item_ids": found,
                   "items": [{"item_id": item, "features": values}
                             for item, values in zip(found, current.item_features(found))]})


def answer_explain(current: Bundle, body: bytes, search_threads: int | None = 1) -> bytes:
    """The JSON reply to one /explain body: for each item, the history items that brought it."""
    parsed = _validated(_parse_object(body), ExplainRequest)
    _limit_search_threads(search_threads)
    because = current.explain(parsed.item_ids, parsed.history)
    return _dumps({"bundle": current.version,
                   "explanations": [{"item_id": item, "because": reason}
                                    for item, reason in zip(parsed.item_ids, because)]})


async def answer_reload(holder: BundleHolder, parsed: ReloadRequest) -> tuple[int, dict[str, Any]]:
    """(status, reply) of a reload of ``parsed.bundle`` into ``holder``: a 422 naming why it was not
    loaded (the old bundle keeps serving)."""
    from retrieval.serving.bundle import BundleError

    started = time.perf_counter()
    try:
        old, new = await holder.reload(parsed.bundle)
    except Exception as error:  # whatever failed, the old bundle keeps serving
        log.warning("reload of %r failed: %r", parsed.bundle, error)
        # BundleError messages name the part and never quote its bytes; other errors by type only.
        reason = str(error) if isinstance(error, BundleError) else type(error).__name__
        still = holder.current.version
        return 422, {"error": f"bundle {parsed.bundle!r} not loaded, still serving {still!r}: {reason}"}
    log.info("reloaded: %s -> %s", old.version, new.version)
    return 200, {"bundle": new.version, "previous": old.version, "seconds": round(time.perf_counter() - started, 3)}


async def answer_catalogue(holder: BundleHolder, change: str, records: list[Any]) -> tuple[int, dict[str, Any]]:
    """(status, reply) of a catalogue edit (``BundleHolder.edit``). The reply comes once the edit is served
    AND persisted (a restart serves it): the new version, ``served_seconds`` (from the call to the swap:
    requests get the edit from then on) and ``seconds`` (to the version written, checked and made
    current). A refused edit is a 422 naming the problem; an edit served but not written (e.g. a
    full disk) a 500 saying so, with the bundle before it served again."""
    started = time.perf_counter()
    try:
        done = await holder.edit(change, records)
    except EditNotPersisted as error:
        return 500, {"error": f"catalogue {change} not persisted: {error}"}
    except Exception as error:  # whatever failed, the old bundle keeps serving
        log.warning("catalogue %s failed: %r", change, error)
        # Catalogue, run-directory and bundle errors name the items or the part, never file bytes.
        reason = str(error) if isinstance(error, ValueError | UserError) else type(error).__name__
        return 422, {"error": f"catalogue {change} not applied, still serving {holder.current.version!r}: "
                              f"{reason}"}
    old, new = done.old, done.new
    log.info("catalogue %s of %d items: %s -> %s (served after %.3f s, persisted after %.3f s)", change,
             len(records), old.version, new.version, done.served_seconds, done.persisted_seconds)
    return 200, {
        "bundle": new.version, "previous": old.version, "change": change, "items": len(records),
        "num_items": len(new.index) - new.metadata()["disabled_items"],
        "served_seconds": round(done.served_seconds, 3),
        "persisted_seconds": round(done.persisted_seconds, 3),
        "seconds": round(time.perf_counter() - started, 3),
    }


def admin_refusal(request: Request) -> JSONResponse | None:
    """Why an admin request is refused (403 Host or Origin, 401 token, 415 Content-Type), or None; the
    server's address and the expected ``Authorization`` value are read from ``request.app.state``."""
    host, expected_authorization = request.app.state.admin_host, request.app.state.admin_authorization
    host_header, origin = request.headers.get("host"), request.headers.get("origin")
    if not admin_host_allowed(host, host_header):
        return _error(403, f"admin requests must name the server's address ({host}) in their Host header, "
                           f"got {ascii((host_header or '')[:80])}")
    if not same_origin(origin, host_header):
        return _error(403, "admin requests from another origin are refused, "
                           f"got Origin {ascii((origin or '')[:80])}")
    if expected_authorization is not None and not hmac.compare_digest(
        request.headers.get("authorization", "").encode(), expected_authorization
    ):
        return JSONResponse(
            {"error": "admin token missing or wrong: send 'Authorization: Bearer <token>'"},
            status_code=401,
            headers={"www-authenticate": "Bearer"},
        )
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        return _error(415, f"admin requests must be sent as Content-Type: application/json, "
                           f"got {ascii(media_type[:80]) if media_type else 'none'}")
    return None


# The routes: each parses its request, reads what it serves from ``request.app.state`` (the holder, limits,
# search threads, bulk lane), calls its answer and writes the reply.


def _body_route(answer: Callable[..., bytes], *, searches: bool) -> Callable[[Request], Awaitable[Response]]:
    """A POST route that reads the body (at most ``limits.max_body_bytes``) and answers it with
    ``answer(bundle, body)`` in the thread pool (``search_threads`` passed on when ``searches``),
    against the bundle served when the request arrived."""

    async def handler(request: Request) -> Response:
        state = request.app.state
        current = state.holder.current  # read once: a reload mid-request does not affect this request
        body = await _read_body(request, state.limits.max_body_bytes)
        work = functools.partial(answer, search_threads=state.search_threads) if searches else answer
        return Response(await run_in_threadpool(work, current, body), media_type="application/json")

    return handler


similar = _body_route(answer_similar, searches=True)
items = _body_route(answer_items, searches=False)
explain = _body_route(answer_explain, searches=True)


async def recommend(request: Request) -> Response:
    state = request.app.state
    limits: ServiceLimits = state.limits
    current = state.holder.current  # read once: a reload mid-request does not affect this request
    body = await _read_body(request, limits.max_body_bytes)
    payload = _parse_object(body) if len(body) <= INLINE_PARSE_BYTES else None
    if payload is not None and _query_count(payload) <= limits.bulk_queries:
        content = await run_in_threadpool(answer_recommend, current, payload, None, state.search_threads)
    else:  # a large batch: its own bounded lane, in chunks, so small requests never wait behind it
        work = functools.partial(answer_recommend, current, body if payload is None else payload,
                                 limits.bulk_chunk, state.search_threads)
        content = await asyncio.get_running_loop().run_in_executor(state.bulk_lane, work)
    return Response(content, media_type="application/json")


async def healthz(request: Request) -> JSONResponse:
    status, reply = await answer_healthz(request.app.state.holder.current)
    return JSONResponse(reply, status_code=status)


async def metadata(request: Request) -> JSONResponse:
    return JSONResponse(answer_metadata(request.app.state.holder.current))


async def users(request: Request) -> JSONResponse:
    current = request.app.state.holder.current
    limit = _count_parameter(request, "limit", DEFAULT_USER_LIST, MAX_USER_LIST)
    if isinstance(limit, JSONResponse):
        return limit
    return JSONResponse(answer_users(current, limit))


async def training_items(request: Request) -> Response:
    current = request.app.state.holder.current  # read once: a reload mid-request does not affect this request
    user_id = request.path_params["user_id"]
    return Response(await run_in_threadpool(answer_training_items, current, user_id),
                    media_type="application/json")


async def search_items(request: Request) -> Response:
    current = request.app.state.holder.current
    text = request.query_params.get("q", "")
    limit = _count_parameter(request, "limit", DEFAULT_SEARCH_RESULTS, MAX_SEARCH_RESULTS)
    if isinstance(limit, JSONResponse):
        return limit
    if len(text) > MAX_SEARCH_TEXT:
        return _error(422, f"q must be at most {MAX_SEARCH_TEXT} characters, got {len(text)}")
    return Response(await run_in_threadpool(answer_search, current, text, limit),
                    media_type="application/json")


async def page(request: Request) -> HTMLResponse:
    text, headers = request.app.state.page
    return HTMLResponse(text, headers=headers)


async def _admin_body(request: Request) -> dict[str, Any] | JSONResponse:
    """An admin request's JSON object body, or the JSONResponse refusing the request (``admin_refusal``)."""
    refusal = admin_refusal(request)
    if refusal is not None:
        return refusal
    return _parse_object(await _read_body(request, request.app.state.limits.max_body_bytes))


async def reload(request: Request) -> JSONResponse:
    body = await _admin_body(request)
    if isinstance(body, JSONResponse):
        return body
    try:
        parsed = ReloadRequest.model_validate(body)
    except ValidationError as error:
        return _error(422, _describe(error))
    status, reply = await answer_reload(request.app.state.holder, parsed)
    return JSONResponse(reply, status_code=status)


async def catalogue(request: Request) -> JSONResponse:
    """Apply a catalogue edit (``answer_catalogue``)."""
    body = await _admin_body(request)
    if isinstance(body, JSONResponse):
        return body
    try:
        parsed = CatalogueRequest.model_validate(body)
        records = parsed.records()
    except (ValidationError, ValueError) as error:
        return _error(422, _describe(error) if isinstance(error, ValidationError) else str(error))
    status, reply = await answer_catalogue(request.app.state.holder, parsed.change, records)
    return JSONResponse(reply, status_code=status)


def create_app(
    bundle: str | Path | Bundle,
    *,
    admin: bool = True,
    admin_token: str | None = None,
    host: str = "127.0.0.1",
    limits: ServiceLimits | None = None,
    search_threads: int | None = 1,
    verify: Verify = "quick",
) -> Starlette:
    """The ASGI app serving ``bundle`` (a directory or a loaded Bundle).

    Args:
      bundle: bundle directory, e.g. ``artifacts/<run>``, or a loaded Bundle.
      admin: expose ``POST /admin/reload`` and ``POST /admin/catalogue``. The
        first loads any directory the server can read, the second writes
        catalogue versions beside the bundle (``retrieval.bundle.catalogue``):
        keep them on loopback, give a token, or turn them off
        (``check_admin_exposure`` says which host needs what).
      admin_token: when set, the admin routes require
        ``Authorization: Bearer <admin_token>``.
      host: the address the server is bound to. Admin routes refuse (403) a
        ``Host`` header that does not name it (``admin_host_allowed``) and an
        ``Origin`` other than the server itself (``same_origin``), then check
        the token (401), then require ``Content-Type: application/json`` (415):
        a page on another site can neither post to them (a cross-site form or
        ``no-cors`` fetch sends ``text/plain`` and its own Origin) nor reach
        them through a DNS name it controls.
      limits: body, header and bulk-lane bounds (the connection-level ones
        apply when uvicorn runs the app through ``server_config``).
      search_threads: OpenMP threads one request's FAISS search may use
        (None = FAISS's default, every core). 1 suits single-query traffic:
        concurrent requests already spread over the cores, and a parallel
        region stalls at its barrier whenever another process holds a core.
      verify: how ``Bundle.load`` checks the files of ``bundle`` and of every
        reload against the manifest's fingerprints: "quick" (files over 64 MiB
        by size and both ends) or "full" (every file hashed whole).
    """
    from retrieval.serving.bundle import Bundle

    limits = limits or ServiceLimits()
    if isinstance(bundle, Bundle):
        holder = BundleHolder(bundle, verify)
    else:
        loaded, seconds = _timed_load(bundle, verify)
        holder = BundleHolder(loaded, verify, load_seconds=seconds, root=bundle)
    metrics = ServiceMetrics(holder)
    page_text = page_html()
    routes = [
        Route(PAGE_PATH, page, methods=["GET"]),
        Route("/recommend", recommend, methods=["POST"]),
        Route("/similar", similar, methods=["POST"]),
        Route("/users", users, methods=["GET"]),
        Route("/users/{user_id:path}/items", training_items, methods=["GET"]),
        Route("/items", items, methods=["POST"]),
        Route("/items/search", search_items, methods=["GET"]),
        Route("/explain", explain, methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metadata", metadata, methods=["GET"]),
        Route(METRICS_PATH, metrics.endpoint, methods=["GET"]),
    ]
    if admin:
        routes.append(Route("/admin/reload", reload, methods=["POST"]))
        routes.append(Route("/admin/catalogue", catalogue, methods=["POST"]))
    app = Starlette(
        routes=routes,
        # Starlette types every handler as taking a plain Exception, so a handler for a subclass
        # (HTTPException here) does not match its Callable type although Starlette calls it correctly.
        exception_handlers={
            HTTPException: _http_error,  # type: ignore[dict-item]
            ClientDisconnect: _client_gone,  # type: ignore[dict-item]
            Exception: _server_error,
        },
    )
    app.add_middleware(_HeaderCount, max_headers=limits.max_headers)
    app.add_middleware(RequestMetrics, metrics=metrics, routes=routes)  # added last, so outermost: counts the 431s
    # What the routes read (``request.app.state``): nothing of a request's answer lives in a closure.
    app.state.holder = holder
    app.state.metrics = metrics
    app.state.limits = limits
    app.state.admin_host = host
    app.state.admin_authorization = None if admin_token is None else f"Bearer {admin_token}".encode()
    app.state.search_threads = search_threads
    app.state.bulk_lane = _bulk_executor(limits)
    app.state.page = (page_text, page_headers(page_text))
    return app


def _bulk_executor(limits: ServiceLimits) -> ThreadPoolExecutor:
    """The bulk lane: its own ``bulk_workers`` threads, each ``bulk_nice`` steps below the server.

    A thread of its own (not the shared pool) because the lowered priority must stay with bulk work:
    the OS then gives a core to a small request's thread first (Linux sets nice per thread).
    """

    def lower_priority() -> None:
        if limits.bulk_nice and hasattr(os, "setpriority"):
            try:
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + limits.bulk_nice)
            except OSError as error:  # not permitted here: the lane still runs, at the server's priority
                log.warning("bulk lane keeps the server's priority: %s", error)

    return ThreadPoolExecutor(limits.bulk_workers, thread_name_prefix="bulk", initializer=lower_priority)


def _dumps(value: Any) -> bytes:
    """JSON as Starlette's JSONResponse writes it."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


def _result(result: Recommendations) -> dict[str, Any]:
    return {"item_ids": result.item_ids, "scores": result.scores, "fallback": result.fallback}


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    return JSONResponse({"error": str(error.detail)}, status_code=error.status_code, headers=error.headers)


async def _client_gone(request: Request, error: ClientDisconnect) -> Response:
    return Response(status_code=400)  # never sent: the client is gone


async def _server_error(request: Request, error: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return _error(500, f"internal error: {type(error).__name__}")
