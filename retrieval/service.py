"""HTTP JSON service over a bundle: an ASGI app (Starlette) that uvicorn runs.

``retrieval serve --bundle artifacts/<run>`` starts it (``retrieval/cli.py``).
Endpoints (request and response bodies are JSON):

``POST /recommend``
    One query::

        {"query": {"user_id": "196"}, "k": 10, "exclude_item_ids": ["242"]}
        -> {"bundle": "<run>", "item_ids": [...], "scores": [...], "fallback": null}

    or a batch (``exclude_item_ids`` then holds one list per query)::

        {"queries": [{"user_id": "196"}, {"user_id": "nobody"}], "k": 10,
         "exclude_item_ids": [["242"], []]}
        -> {"bundle": "<run>", "results": [{"item_ids", "scores", "fallback"}, ...]}

    A query carries the bundle's ``query_features`` (``GET /metadata``).
    ``fallback`` is ``"popular"`` when the towers know nothing about the
    query (an ID-only tower and an unseen user id): the most popular items,
    scores null; ``"features"`` when a feature tower embedded an unseen user id
    from the query's other features; null otherwise.
    Excluded ids the catalogue does not hold are ignored.
``GET /healthz``
    ``{"status": "ok", "bundle": "<run>", "num_items": n}``.
``GET /metadata``
    Bundle version, query features, index factory, tuned search parameters
    and their measured recall, library versions (no server paths).
``POST /admin/reload`` (unless the app was made with ``admin=False``)
    ``{"bundle": "artifacts/<new run>"}``: loads the new bundle completely,
    then swaps it in with one reference assignment. Requests already running
    finish on the bundle they started with; none is dropped. If loading
    fails, the old bundle keeps serving and the reply says why (without
    quoting the files). With an admin token, the request must carry
    ``Authorization: Bearer <token>`` (401 otherwise); ``retrieval serve``
    requires one whenever it binds a non-loopback address with admin on
    (``check_admin_exposure``).

Bad requests get a 4xx and ``{"error": "<reason>"}``: 400 for a body that is
not a JSON object (nested too deeply to parse included), 401 for a missing or
wrong admin token, 408 for a request not received within
``request_read_timeout``, 413 for a body over ``max_body_bytes``, 422 for a
well-formed body with wrong fields or values, 431 for too many or too large
headers, 404/405 for unknown paths and methods.

Hostile clients are bounded by ``ServiceLimits`` (one ``retrieval serve``
flag per field): header bytes and count, the time from a request's first
byte to its last body byte, idle keep-alive (also before the first request),
open connections. uvicorn has settings for some of these; the rest live in
``BoundedHttpToolsProtocol`` / ``BoundedH11Protocol`` (uvicorn's protocols
plus a read deadline) that ``server_config`` wires in.

Small requests stay fast while large batches run: a batch of more than
``bulk_queries`` queries (or a body too large to parse on the event loop) is
answered in a separate lane of ``bulk_workers`` threads, ``bulk_chunk``
queries at a time, yielding the interpreter between chunks; single queries
never queue behind it. Its reply is the same JSON.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import http
import ipaddress
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import faiss
import h11
import uvicorn
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

if TYPE_CHECKING:  # retrieval.serving loads TensorFlow: imported where a bundle is loaded, so that
    # `retrieval reload` and `retrieval serve --help` (which read ServiceLimits) start fast.
    from retrieval.serving import Bundle, Recommendations

log = logging.getLogger("retrieval.service")

MAX_K = 1000
MAX_BATCH = 1024
MAX_EXCLUDED = 10_000
MAX_BODY_BYTES = 4 * 1024 * 1024
# Bodies up to this size are parsed on the event loop (well under a millisecond); larger ones in the bulk lane.
INLINE_PARSE_BYTES = 64 * 1024
ADMIN_TOKEN_ENV = "RETRIEVAL_ADMIN_TOKEN"
MIN_ADMIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class ServiceLimits:
    """Bounds on what one client may hold; ``retrieval serve --<field-with-dashes>`` sets each.

    The help text of each field is the flag's help (``field(metadata={"help": ...})``).
    """

    max_body_bytes: int = dataclasses.field(
        default=MAX_BODY_BYTES, metadata={"help": "larger request bodies get 413 (Content-Length or streamed)"}
    )
    max_header_bytes: int = dataclasses.field(
        default=16 * 1024, metadata={"help": "request line + headers larger than this get 431 and are closed"}
    )
    max_headers: int = dataclasses.field(default=100, metadata={"help": "requests with more headers get 431"})
    request_read_timeout: float = dataclasses.field(
        default=10.0,
        metadata={"help": "seconds from a request's first byte to its last body byte; slower ones get 408, closed"},
    )
    keep_alive_timeout: float = dataclasses.field(
        default=5.0, metadata={"help": "seconds an idle connection (before or between requests) stays open"}
    )
    max_connections: int = dataclasses.field(
        default=1000, metadata={"help": "open connections / running requests beyond this get 503 (uvicorn)"}
    )
    bulk_queries: int = dataclasses.field(
        default=16, metadata={"help": "batches of more queries run in the bulk lane, apart from small requests"}
    )
    bulk_chunk: int = dataclasses.field(
        default=8, metadata={"help": "queries the bulk lane answers at a time before yielding to other requests"}
    )
    bulk_workers: int = dataclasses.field(default=1, metadata={"help": "threads of the bulk lane"})
    bulk_nice: int = dataclasses.field(
        default=10, metadata={"help": "how many nice steps the bulk lane's threads run below the server (0-19)"}
    )

    def __post_init__(self) -> None:
        if not (isinstance(self.bulk_nice, int) and 0 <= self.bulk_nice <= 19):
            raise ValueError(f"ServiceLimits.bulk_nice must be an integer from 0 to 19, got {self.bulk_nice!r}")
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if spec.name == "bulk_nice":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"ServiceLimits.{spec.name} must be a positive number, got {value!r}")
            if spec.type == "int" and not isinstance(value, int):
                raise ValueError(f"ServiceLimits.{spec.name} must be an integer, got {value!r}")


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def check_admin_exposure(host: str, admin: bool, admin_token: str | None) -> None:
    """Raise ValueError unless ``/admin/reload`` is safe to serve on ``host``.

    Admin on a non-loopback address needs a token (reload loads any directory
    the server can read); a token, when given, must be at least
    MIN_ADMIN_TOKEN_CHARS characters.
    """
    if admin_token is not None and len(admin_token) < MIN_ADMIN_TOKEN_CHARS:
        raise ValueError(f"the admin token must have at least {MIN_ADMIN_TOKEN_CHARS} characters")
    if admin and admin_token is None and not is_loopback(host):
        raise ValueError(
            f"--host {host} is not a loopback address: /admin/reload needs a token there "
            f"(--admin-token or {ADMIN_TOKEN_ENV}), or turn it off with --no-admin"
        )


class RecommendRequest(BaseModel):
    """Body of ``POST /recommend``: exactly one of ``query`` and ``queries``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    query: dict[str, Any] | None = None
    queries: list[dict[str, Any]] | None = Field(None, min_length=1, max_length=MAX_BATCH)
    k: int = Field(10, ge=1, le=MAX_K)
    exclude_item_ids: list[Any] | None = Field(None, max_length=MAX_EXCLUDED)

    @model_validator(mode="after")
    def _one_shape(self) -> RecommendRequest:
        if (self.query is None) == (self.queries is None):
            raise ValueError("give exactly one of 'query' (one object) and 'queries' (a list of objects)")
        excluded = self.exclude_item_ids
        if excluded is None:
            return self
        if self.query is not None:
            if not all(isinstance(item, str) for item in excluded):
                raise ValueError("with 'query', exclude_item_ids must be a list of item id strings")
        elif self.queries is not None:  # always here: exactly one of the two is set (checked above)
            if len(excluded) != len(self.queries) or not all(
                isinstance(items, list) and all(isinstance(item, str) for item in items) for items in excluded
            ):
                raise ValueError(
                    f"with 'queries', exclude_item_ids must hold one list of item id strings per query "
                    f"({len(self.queries)})"
                )
            for position, items in enumerate(excluded):
                if len(items) > MAX_EXCLUDED:
                    raise ValueError(
                        f"exclude_item_ids[{position}] holds {len(items)} ids, more than {MAX_EXCLUDED}"
                    )
        return self

    def batch(self) -> tuple[list[dict[str, Any]], list[list[str]]]:
        """(queries, per-query exclusions), for a single query too."""
        if self.query is not None:
            return [self.query], [list(self.exclude_item_ids or [])]
        assert self.queries is not None  # _one_shape: exactly one of query and queries is set
        return list(self.queries), [list(items) for items in (self.exclude_item_ids or [[]] * len(self.queries))]


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    bundle: str = Field(min_length=1, description="Directory of the bundle to serve from now on.")


class BundleHolder:
    """The bundle being served; ``reload`` replaces it with one reference assignment.

    A request reads ``current`` once and uses that object to the end, so a
    swap never changes the bundle under a running request, and the old bundle
    is freed when the last request using it finishes.
    """

    def __init__(self, bundle: Bundle):
        self.current = bundle
        self._reload_lock = asyncio.Lock()

    async def reload(self, directory: str | Path) -> tuple[Bundle, Bundle]:
        """Load ``directory`` off the event loop, then swap; return (old, new)."""
        from retrieval.serving import Bundle

        async with self._reload_lock:  # one reload at a time; requests are never blocked
            new = await run_in_threadpool(Bundle.load, directory)
            old, self.current = self.current, new
            return old, new


def create_app(
    bundle: str | Path | Bundle,
    *,
    admin: bool = True,
    admin_token: str | None = None,
    limits: ServiceLimits | None = None,
    search_threads: int | None = 1,
) -> Starlette:
    """The ASGI app serving ``bundle`` (a directory or a loaded Bundle).

    Args:
      bundle: bundle directory, e.g. ``artifacts/<run>``, or a loaded Bundle.
      admin: expose ``POST /admin/reload``. It loads any directory the
        server can read: keep it on loopback, give a token, or turn it off
        (``check_admin_exposure`` says which host needs what).
      admin_token: when set, ``/admin/reload`` requires
        ``Authorization: Bearer <admin_token>``.
      limits: body, header and bulk-lane bounds (the connection-level ones
        apply when uvicorn runs the app through ``server_config``).
      search_threads: OpenMP threads one request's FAISS search may use
        (None = FAISS's default, every core). 1 suits single-query traffic:
        concurrent requests already spread over the cores, and a parallel
        region stalls at its barrier whenever another process holds a core.
    """
    from retrieval.serving import Bundle, BundleError

    limits = limits or ServiceLimits()
    holder = BundleHolder(bundle if isinstance(bundle, Bundle) else Bundle.load(bundle))
    bulk_lane = _bulk_executor(limits)
    expected_authorization = None if admin_token is None else f"Bearer {admin_token}".encode()

    def answer(current: Bundle, payload: dict[str, Any] | bytes, chunk: int | None) -> bytes:
        """The JSON reply to one /recommend body, computed in a worker thread."""
        parsed = _validated(_parse_object(payload) if isinstance(payload, bytes) else payload)
        queries, excluded = parsed.batch()
        if search_threads:
            # OpenMP thread counts are per calling thread: set it in the worker thread itself.
            faiss.omp_set_num_threads(search_threads)
        step = chunk or len(queries)
        pieces = []
        try:
            for position, query in enumerate(queries):
                current.check_query(query, position)
            # One query-tower call for the whole batch (mostly outside the interpreter lock), then the
            # search and the JSON in slices, yielding the interpreter between them.
            embeddings, known = current.embed_with_known(queries)
            for start in range(0, len(queries), step):
                if start:
                    time.sleep(0)  # let the small requests' threads take the interpreter between chunks
                window = slice(start, start + step)
                results = current.recommend_embedded(embeddings[window], known[window], parsed.k, excluded[window])
                pieces.append(_dumps([_result(r) for r in results])[1:-1])
        except ValueError as error:
            raise HTTPException(422, str(error)) from None
        if parsed.query is not None:
            return _dumps({"bundle": current.version})[:-1] + b"," + pieces[0][1:-1] + b"}"
        return _dumps({"bundle": current.version})[:-1] + b',"results":[' + b",".join(pieces) + b"]}"

    async def recommend(request: Request) -> Response:
        current = holder.current  # read once: a reload mid-request does not affect this request
        body = await _read_body(request, limits.max_body_bytes)
        payload = _parse_object(body) if len(body) <= INLINE_PARSE_BYTES else None
        if payload is not None and _query_count(payload) <= limits.bulk_queries:
            content = await run_in_threadpool(answer, current, payload, None)
        else:  # a large batch: its own bounded lane, in chunks, so small requests never wait behind it
            work = functools.partial(answer, current, body if payload is None else payload, limits.bulk_chunk)
            content = await asyncio.get_running_loop().run_in_executor(bulk_lane, work)
        return Response(content, media_type="application/json")

    async def healthz(request: Request) -> JSONResponse:
        current = holder.current
        return JSONResponse({"status": "ok", "bundle": current.version, "num_items": len(current.index)})

    async def metadata(request: Request) -> JSONResponse:
        return JSONResponse(holder.current.metadata())

    async def reload(request: Request) -> JSONResponse:
        if expected_authorization is not None and not hmac.compare_digest(
            request.headers.get("authorization", "").encode(), expected_authorization
        ):
            return JSONResponse(
                {"error": "admin token missing or wrong: send 'Authorization: Bearer <token>'"},
                status_code=401,
                headers={"www-authenticate": "Bearer"},
            )
        body = _parse_object(await _read_body(request, limits.max_body_bytes))
        try:
            parsed = ReloadRequest.model_validate(body)
        except ValidationError as error:
            return _error(422, _describe(error))
        started = time.perf_counter()
        try:
            old, new = await holder.reload(parsed.bundle)
        except Exception as error:  # whatever failed, the old bundle keeps serving
            log.warning("reload of %r failed: %r", parsed.bundle, error)
            # BundleError messages name the part and never quote its bytes; other errors by type only.
            reason = str(error) if isinstance(error, BundleError) else type(error).__name__
            still = holder.current.version
            return _error(422, f"bundle {parsed.bundle!r} not loaded, still serving {still!r}: {reason}")
        log.info("reloaded: %s -> %s", old.version, new.version)
        return JSONResponse(
            {"bundle": new.version, "previous": old.version, "seconds": round(time.perf_counter() - started, 3)}
        )

    routes = [
        Route("/recommend", recommend, methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metadata", metadata, methods=["GET"]),
    ]
    if admin:
        routes.append(Route("/admin/reload", reload, methods=["POST"]))
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
    app.state.holder = holder
    app.state.limits = limits
    return app


def server_config(
    app: ASGIApp, limits: ServiceLimits | None = None, *, http: str = "auto", **uvicorn_options: Any
) -> uvicorn.Config:
    """uvicorn's Config for ``app`` with ``limits`` applied at the connection level.

    uvicorn bounds idle keep-alive (``timeout_keep_alive``), open connections
    (``limit_concurrency``) and, with h11, header bytes; the bounded protocol
    classes add the rest for both parsers: header bytes (431), the read
    deadline (408, then close) and the idle timer for a connection that has
    not sent a byte yet.

    Args:
      app: the ASGI app (``create_app``).
      limits: the bounds; ServiceLimits() by default.
      http: "auto" (httptools when installed), "httptools" or "h11".
      **uvicorn_options: host, port, loop, log_level, access_log... as uvicorn.Config takes them.
    """
    limits = limits or ServiceLimits()
    if http == "auto":
        try:
            import httptools  # noqa: F401
        except ImportError:
            http = "h11"
        else:
            http = "httptools"
    bases: dict[str, type[BoundedHttpToolsProtocol | BoundedH11Protocol]] = {
        "httptools": BoundedHttpToolsProtocol,
        "h11": BoundedH11Protocol,
    }
    if http not in bases:
        raise ValueError(f"http must be one of auto, {', '.join(bases)}; got {http!r}")
    protocol = type(bases[http].__name__, (bases[http],), {"limits": limits})
    return uvicorn.Config(
        app,
        http=protocol,
        timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type]  # used as a float delay
        limit_concurrency=limits.max_connections,
        h11_max_incomplete_event_size=limits.max_header_bytes,
        **uvicorn_options,
    )


class _ReadDeadline:
    """What both bounded protocols add to uvicorn's: a request read deadline and a raw JSON rejection."""

    limits: ClassVar[ServiceLimits] = ServiceLimits()
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any
    # Typed as uvicorn types it (Config.timeout_keep_alive: int) so the bases agree; server_config
    # passes limits.keep_alive_timeout, a float, which call_later takes as it is.
    timeout_keep_alive: int
    timeout_keep_alive_task: asyncio.TimerHandle | None
    timeout_keep_alive_handler: Callable[[], None]
    _deadline: asyncio.TimerHandle | None = None

    def _start_idle_timer(self) -> None:
        # uvicorn arms its keep-alive timer only after a response; a connection that never sends a
        # byte would stay open for ever.
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def _arm_deadline(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.limits.request_read_timeout, self._deadline_passed)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _deadline_passed(self) -> None:
        self._deadline = None
        log.info("closing a connection whose request took over %g s to arrive", self.limits.request_read_timeout)
        self._reject(408, f"request not received within {self.limits.request_read_timeout:g} s")

    def _reject(self, status: int, reason: str) -> None:
        """Answer ``status`` with ``{"error": reason}`` (unless a response already started) and close."""
        self._cancel_deadline()
        if self.transport.is_closing():
            return
        started = False
        if self.cycle is not None and not self.cycle.response_complete:
            started = self.cycle.response_started
            self.cycle.disconnected = True  # the app, if it is waiting for the body, gets http.disconnect
            self.cycle.message_event.set()
        if not started:
            body = json.dumps({"error": reason}).encode()
            self.transport.write(
                f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
                + body
            )
        self.transport.close()


class BoundedHttpToolsProtocol(_ReadDeadline, HttpToolsProtocol):
    """uvicorn's httptools protocol plus header-size, read-deadline and first-idle bounds."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0  # bytes received while a head is incomplete (httptools buffers a partial header)
        self._parsed_head_bytes = 0  # request line + headers of the current request, as parsed
        self._in_body = False
        self._head_too_large = False
        self._start_idle_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._in_body:
            self._head_bytes += len(data)
        super().data_received(data)
        if not self._in_body and (self._head_bytes > self.limits.max_header_bytes or self._head_too_large):
            self._reject(431, f"request line and headers over {self.limits.max_header_bytes} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._parsed_head_bytes = 0
        self._arm_deadline()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count_head(self, size: int) -> None:
        self._parsed_head_bytes += size
        if self._parsed_head_bytes > self.limits.max_header_bytes:
            self._head_too_large = True
            raise ValueError("head too large")  # stops the parser; data_received answers 431

    def on_headers_complete(self) -> None:
        self._head_bytes, self._in_body = 0, True
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        self._cancel_deadline()
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        if self._head_too_large:
            self._reject(431, f"request line and headers over {self.limits.max_header_bytes} bytes")
        else:
            self._reject(400, f"invalid HTTP request: {msg}")


class BoundedH11Protocol(_ReadDeadline, H11Protocol):
    """uvicorn's h11 protocol plus header-size, read-deadline and first-idle bounds."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_idle_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._arm_deadline()
            # h11 bounds only an incomplete head (max_incomplete_event_size); a complete one arriving
            # in one read is measured here.
            limit = self.limits.max_header_bytes
            pending = self.conn.trailing_data[0] + data[: limit + 4]
            end = pending.find(b"\r\n\r\n")
            if (end if end >= 0 else len(pending)) > limit:
                self._reject(431, f"request line and headers over {limit} bytes")
                return
        super().data_received(data)
        state = self.conn.their_state
        if state not in (h11.IDLE, h11.SEND_BODY) or (state is h11.IDLE and not self.conn.trailing_data[0]):
            self._cancel_deadline()  # the request is in (or nothing of the next one is)

    def send_400_response(self, msg: str) -> None:
        self._reject(400, f"invalid HTTP request: {msg}")


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


class _HeaderCount:
    """ASGI middleware: 431 for a request with more than ``max_headers`` headers."""

    def __init__(self, app: ASGIApp, max_headers: int):
        self.app, self.max_headers = app, max_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and len(scope["headers"]) > self.max_headers:
            response = _error(431, f"{len(scope['headers'])} headers, more than {self.max_headers}")
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 (and the connection closed) as soon as it passes ``limit`` bytes."""
    too_large = HTTPException(413, f"request body over {limit} bytes", headers={"connection": "close"})
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise HTTPException(400, "Content-Length is not a byte count", headers={"connection": "close"})
        if int(declared) > limit:
            raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_object(body: bytes) -> dict[str, Any]:
    """A JSON object from ``body``, or 400."""
    try:
        payload = json.loads(body)
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise HTTPException(400, f"request body is not valid JSON: {error}") from None
    except RecursionError:
        raise HTTPException(400, "request body is not valid JSON: nested too deeply") from None
    if not isinstance(payload, dict):
        raise HTTPException(400, f"request body must be a JSON object, got {type(payload).__name__}")
    return payload


def _validated(payload: dict[str, Any]) -> RecommendRequest:
    try:
        return RecommendRequest.model_validate(payload)
    except ValidationError as error:
        raise HTTPException(422, _describe(error)) from None


def _query_count(payload: dict[str, Any]) -> int:
    """How many queries a (not yet validated) /recommend body asks for."""
    queries = payload.get("queries")
    return len(queries) if isinstance(queries, list) else 1


def _dumps(value: Any) -> bytes:
    """JSON as Starlette's JSONResponse writes it."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


def _result(result: Recommendations) -> dict[str, Any]:
    return {"item_ids": result.item_ids, "scores": result.scores, "fallback": result.fallback}


def _error(status: int, reason: str) -> JSONResponse:
    return JSONResponse({"error": reason}, status_code=status)


def _describe(error: ValidationError) -> str:
    problems = []
    for problem in error.errors():
        where = ".".join(str(part) for part in problem["loc"]) or "body"
        message = "unknown field" if problem["type"] == "extra_forbidden" else problem["msg"]
        problems.append(f"{where}: {message}")
    return "; ".join(problems)


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    return JSONResponse({"error": str(error.detail)}, status_code=error.status_code, headers=error.headers)


async def _client_gone(request: Request, error: ClientDisconnect) -> Response:
    return Response(status_code=400)  # never sent: the client is gone


async def _server_error(request: Request, error: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return _error(500, f"internal error: {type(error).__name__}")
