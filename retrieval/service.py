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
    and their measured recall, library versions.
``POST /admin/reload`` (unless the app was made with ``admin=False``)
    ``{"bundle": "artifacts/<new run>"}``: loads the new bundle completely,
    then swaps it in with one reference assignment. Requests already running
    finish on the bundle they started with; none is dropped. If loading
    fails, the old bundle keeps serving and the reply says why.

Bad requests get a 4xx and ``{"error": "<reason>"}``: 400 for a body that is
not a JSON object, 413 for a body over ``max_body_bytes``, 422 for a
well-formed body with wrong fields or values, 404/405 for unknown paths and
methods.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import faiss
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from retrieval.serving import Bundle, Recommendations

log = logging.getLogger("retrieval.service")

MAX_K = 1000
MAX_BATCH = 1024
MAX_EXCLUDED = 10_000
MAX_BODY_BYTES = 4 * 1024 * 1024

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
        else:
            if len(excluded) != len(self.queries) or not all(
                isinstance(items, list) and all(isinstance(item, str) for item in items) for items in excluded
            ):
                raise ValueError(
                    f"with 'queries', exclude_item_ids must hold one list of item id strings per query "
                    f"({len(self.queries)})"
                )
        return self

    def batch(self) -> tuple[list[dict[str, Any]], list[list[str]]]:
        """(queries, per-query exclusions), for a single query too."""
        if self.query is not None:
            return [self.query], [list(self.exclude_item_ids or [])]
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
        async with self._reload_lock:  # one reload at a time; requests are never blocked
            new = await run_in_threadpool(Bundle.load, directory)
            old, self.current = self.current, new
            return old, new


def create_app(
    bundle: str | Path | Bundle,
    *,
    admin: bool = True,
    max_body_bytes: int = MAX_BODY_BYTES,
    search_threads: int | None = 1,
) -> Starlette:
    """The ASGI app serving ``bundle`` (a directory or a loaded Bundle).

    Args:
      bundle: bundle directory, e.g. ``artifacts/<run>``, or a loaded Bundle.
      admin: expose ``POST /admin/reload``. It loads any directory the
        server can read, so keep it off when the port is reachable by
        untrusted clients (``retrieval serve`` binds 127.0.0.1 by default).
      max_body_bytes: larger request bodies get 413.
      search_threads: OpenMP threads one request's FAISS search may use
        (None = FAISS's default, every core). 1 suits single-query traffic:
        concurrent requests already spread over the cores, and a parallel
        region stalls at its barrier whenever another process holds a core.
    """
    holder = BundleHolder(bundle if isinstance(bundle, Bundle) else Bundle.load(bundle))

    def search(current: Bundle, queries, k, excluded):
        if search_threads:
            # OpenMP thread counts are per calling thread: set it in the worker thread itself.
            faiss.omp_set_num_threads(search_threads)
        return current.recommend_batch(queries, k, excluded)

    async def recommend(request: Request) -> JSONResponse:
        current = holder.current  # read once: a reload mid-request does not affect this request
        body = await _json_body(request)
        try:
            parsed = RecommendRequest.model_validate(body)
        except ValidationError as error:
            return _error(422, _describe(error))
        queries, excluded = parsed.batch()
        try:
            for position, query in enumerate(queries):
                current.check_query(query, position)
            results = await run_in_threadpool(search, current, queries, parsed.k, excluded)
        except ValueError as error:
            return _error(422, str(error))
        if parsed.query is not None:
            return JSONResponse({"bundle": current.version, **_result(results[0])})
        return JSONResponse({"bundle": current.version, "results": [_result(r) for r in results]})

    async def healthz(request: Request) -> JSONResponse:
        current = holder.current
        return JSONResponse({"status": "ok", "bundle": current.version, "num_items": len(current.index)})

    async def metadata(request: Request) -> JSONResponse:
        return JSONResponse(holder.current.metadata())

    async def reload(request: Request) -> JSONResponse:
        body = await _json_body(request)
        try:
            parsed = ReloadRequest.model_validate(body)
        except ValidationError as error:
            return _error(422, _describe(error))
        started = time.perf_counter()
        try:
            old, new = await holder.reload(parsed.bundle)
        except Exception as error:  # whatever failed, the old bundle keeps serving
            return _error(
                422, f"bundle {parsed.bundle!r} not loaded, still serving {holder.current.version!r}: {error}"
            )
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
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
        max_body_size=max_body_bytes,
    )
    app.state.holder = holder
    return app


async def _json_body(request: Request) -> Any:
    try:
        body = await request.json()
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise HTTPException(400, f"request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise HTTPException(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


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
    return _error(error.status_code, str(error.detail))


async def _server_error(request: Request, error: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return _error(500, f"internal error: {type(error).__name__}")
