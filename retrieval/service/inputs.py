"""Hostile-input handling of the HTTP app: what a request may carry and how it is read.

The request bodies' pydantic models (``RecommendRequest``, ``SimilarRequest``, ``ItemsRequest``,
``ExplainRequest``, ``ReloadRequest``),
reading a body under a byte limit (413), parsing it into a JSON object (400)
and validating it (422), the middleware refusing too many headers (431), and
the ``{"error": ...}`` replies these failures get.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from retrieval.service.limits import MAX_BATCH, MAX_EXCLUDED, MAX_K

Body = TypeVar("Body", bound=BaseModel)


class RecommendRequest(BaseModel):
    """Body of ``POST /recommend``: exactly one of ``query`` and ``queries``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    query: dict[str, Any] | None = None
    queries: list[dict[str, Any]] | None = Field(None, min_length=1, max_length=MAX_BATCH)
    k: int = Field(10, ge=1, le=MAX_K, strict=True)  # strict: true is not 1, nor 10.0 or "10" ten
    exclude_item_ids: list[Any] | None = Field(None, max_length=MAX_EXCLUDED)
    # Strict: "false" or 0 must not silently turn the exclusion off (or on).
    exclude_seen: bool = Field(True, strict=True)
    # How the histories the queries send are ordered; required when one sends a non-empty history
    # (the service checks: a history pasted in time order must not be read as newest first, silently).
    history_order: Literal["newest_first", "oldest_first"] | None = None

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


class SimilarRequest(BaseModel):
    """Body of ``POST /similar``: one catalogue item id, ``k`` and ``exclude_item_ids`` as ``/recommend`` takes them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    item_id: str = Field(strict=True)
    k: int = Field(10, ge=1, le=MAX_K, strict=True)  # strict: true is not 1, nor 10.0 or "10" ten
    exclude_item_ids: list[str] = Field([], max_length=MAX_EXCLUDED)


class ItemsRequest(BaseModel):
    """Body of ``POST /items``: the item ids whose display features to send, at most ``MAX_EXCLUDED``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    item_ids: list[str] = Field(max_length=MAX_EXCLUDED)


class ExplainRequest(BaseModel):
    """Body of ``POST /explain``: recommended item ids and the click history (newest first) to explain them by."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    item_ids: list[str] = Field(max_length=MAX_K)
    history: list[str] = Field(max_length=MAX_EXCLUDED)


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    bundle: str = Field(min_length=1, description="Directory of the bundle to serve from now on.")


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


def _validated(payload: dict[str, Any], model: type[Body]) -> Body:
    """``payload`` as a ``model`` (``RecommendRequest``, ``SimilarRequest``), or 422 naming every wrong field."""
    try:
        return model.model_validate(payload)
    except ValidationError as error:
        raise HTTPException(422, _describe(error)) from None


def _query_count(payload: dict[str, Any]) -> int:
    """How many queries a (not yet validated) /recommend body asks for."""
    queries = payload.get("queries")
    return len(queries) if isinstance(queries, list) else 1


def _error(status: int, reason: str) -> JSONResponse:
    return JSONResponse({"error": reason}, status_code=status)


def _describe(error: ValidationError) -> str:
    problems = []
    for problem in error.errors():
        where = ".".join(str(part) for part in problem["loc"]) or "body"
        message = "unknown field" if problem["type"] == "extra_forbidden" else problem["msg"]
        problems.append(f"{where}: {message}")
    return "; ".join(problems)
