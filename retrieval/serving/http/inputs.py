"""Hostile-input handling of the HTTP app: what a request may carry and how it is read.

The request bodies' pydantic models (``RecommendRequest``, ``SimilarRequest``, ``ItemsRequest``,
``ExplainRequest``, ``ReloadRequest``, ``CatalogueRequest``),
reading a body under a byte limit (413), parsing it into a JSON object (400)
and validating it (422), the middleware refusing too many headers (431), and
the ``{"error": ...}`` replies these failures get.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from retrieval.serving.http.limits import MAX_BATCH, MAX_EXCLUDED, MAX_K
from retrieval.serving.item_filters import parse_filters
from retrieval.serving.request_checks import checked_id, checked_id_lists, checked_ids, checked_k, encodes_as_utf8

Body = TypeVar("Body", bound=BaseModel)


def _request_k(value: Any) -> int:
    """``k`` as every entry point reads it (``retrieval.serving.request_checks.checked_k``: true is not 1, nor
    10.0 or "10" ten), and at most ``MAX_K``: a bound on the reply, whatever the catalogue."""
    k = checked_k(value, MAX_K + 1)
    if k > MAX_K:
        raise ValueError(f"k must be at most {MAX_K} over HTTP, got {value}")
    return k


def _bounded_ids(value: Any, name: str, bound: int) -> Any:
    """A request's list of ids through the shared rule (``checked_ids``: ints are their decimal
    strings), left to the field's ``max_length`` (which names the bound) when it holds more than
    ``bound``, so an oversized list is refused before any id is read."""
    if isinstance(value, list) and len(value) > bound:
        return value
    return checked_ids(value, name)


def _filters(value: Any) -> Any:
    """A request's ``filters`` as ``ItemFilters`` (``retrieval.serving.item_filters.parse_filters``: its shape;
    the bundle checks the columns), None for none."""
    return parse_filters(value)


class RecommendRequest(BaseModel):
    """Body of ``POST /recommend``: exactly one of ``query`` and ``queries``; ids and ``k`` follow
    ``retrieval.serving.request_checks`` (an int id is its decimal string, for items as for users)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    query: dict[str, Any] | None = None
    queries: list[dict[str, Any]] | None = Field(None, min_length=1, max_length=MAX_BATCH)
    k: int = 10
    exclude_item_ids: Any = None  # checked in _one_shape: its shape depends on query / queries
    # Strict: "false" or 0 must not silently turn the exclusion off (or on).
    exclude_seen: bool = Field(True, strict=True)
    # How the histories the queries send are ordered; required when one sends a non-empty history
    # (the service checks: a history pasted in time order must not be read as newest first, silently).
    history_order: Literal["newest_first", "oldest_first"] | None = None
    # One for every query of the request: ``retrieval.serving.item_filters`` (its shape checked here).
    filters: Any = None

    _k = field_validator("k", mode="before")(_request_k)
    _filters = field_validator("filters", mode="before")(_filters)

    @model_validator(mode="after")
    def _one_shape(self) -> RecommendRequest:
        if (self.query is None) == (self.queries is None):
            raise ValueError("give exactly one of 'query' (one object) and 'queries' (a list of objects)")
        excluded = self.exclude_item_ids
        if excluded is None:
            return self
        # Sizes first, so that a huge list is refused before its ids are read.
        sizes = [("exclude_item_ids", excluded)]
        if self.queries is not None and isinstance(excluded, list):
            sizes += [(f"exclude_item_ids[{position}]", inner) for position, inner in enumerate(excluded)]
        for where, items in sizes:
            if isinstance(items, list) and len(items) > MAX_EXCLUDED:
                raise ValueError(f"{where} holds {len(items)} ids, more than {MAX_EXCLUDED}")
        if self.query is not None:
            object.__setattr__(self, "exclude_item_ids", checked_ids(excluded, "exclude_item_ids"))
        elif self.queries is not None:  # always here: exactly one of the two is set (checked above)
            object.__setattr__(self, "exclude_item_ids",
                               checked_id_lists(excluded, len(self.queries), "exclude_item_ids"))
        return self

    def batch(self) -> tuple[list[dict[str, Any]], list[list[str]]]:
        """(queries, per-query exclusions), for a single query too."""
        if self.query is not None:
            return [self.query], [list(self.exclude_item_ids or [])]
        assert self.queries is not None  # _one_shape: exactly one of query and queries is set
        return list(self.queries), [list(items) for items in (self.exclude_item_ids or [[]] * len(self.queries))]


class SimilarRequest(BaseModel):
    """Body of ``POST /similar``: one catalogue item id, ``k``, ``exclude_item_ids`` and ``filters`` as
    ``/recommend`` takes them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    item_id: str
    k: int = 10
    exclude_item_ids: list[str] = Field([], max_length=MAX_EXCLUDED)
    filters: Any = None  # as /recommend takes them

    _k = field_validator("k", mode="before")(_request_k)
    _filters = field_validator("filters", mode="before")(_filters)

    @field_validator("item_id", mode="before")
    @classmethod
    def _item_id(cls, value: Any) -> str:
        return checked_id(value, "item_id")

    @field_validator("exclude_item_ids", mode="before")
    @classmethod
    def _excluded(cls, value: Any) -> Any:
        return _bounded_ids(value, "exclude_item_ids", MAX_EXCLUDED)


class ItemsRequest(BaseModel):
    """Body of ``POST /items``: the item ids whose display features to send, at most ``MAX_EXCLUDED``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    item_ids: list[str] = Field(max_length=MAX_EXCLUDED)

    @field_validator("item_ids", mode="before")
    @classmethod
    def _ids(cls, value: Any) -> Any:
        return _bounded_ids(value, "item_ids", MAX_EXCLUDED)


class ExplainRequest(BaseModel):
    """Body of ``POST /explain``: recommended item ids and the click history (newest first) to explain them by."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    item_ids: list[str] = Field(max_length=MAX_K)
    history: list[str] = Field(max_length=MAX_EXCLUDED)

    @field_validator("item_ids", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        return _bounded_ids(value, "item_ids", MAX_K)

    @field_validator("history", mode="before")
    @classmethod
    def _history(cls, value: Any) -> Any:
        return _bounded_ids(value, "history", MAX_EXCLUDED)


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    bundle: str = Field(min_length=1, description="Directory of the bundle to serve from now on.")


class CatalogueRequest(BaseModel):
    """``POST /admin/catalogue``: one catalogue edit (``retrieval.bundle.catalogue``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    change: Literal["add", "remove", "update"]
    items: list[dict[str, Any]] | None = Field(
        None, min_length=1, max_length=MAX_BATCH,
        description="The items: item_id and, to add or update, the doc model's inputs and display features.")
    item_ids: list[str | int] | None = Field(
        None, min_length=1, max_length=MAX_BATCH, description="remove: the ids (or items holding only item_id).")

    @model_validator(mode="after")
    def _one_list(self) -> CatalogueRequest:
        if (self.items is None) == (self.item_ids is None):
            raise ValueError("give the items (items) or, to remove, their ids (item_ids): one of the two")
        if self.item_ids is not None and self.change != "remove":
            raise ValueError(f"item_ids is for remove; {self.change} takes items (objects with item_id and features)")
        return self

    def records(self) -> list[dict[str, Any]]:
        """The items as rows (``item_ids`` as rows holding only ``item_id``)."""
        if self.items is not None:
            return self.items
        return [{"item_id": checked_id(item, f"item_ids[{position}]")}
                for position, item in enumerate(self.item_ids or ())]


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
        count = ascii_count(declared.strip())
        if count is None:
            raise HTTPException(400, "Content-Length is not a byte count", headers={"connection": "close"})
        if count > limit:
            raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def ascii_count(text: str) -> int | None:
    """``text`` as a non-negative integer when it is ASCII digits only, else None.

    ``str.isdigit`` is true for superscripts and other scripts' digits that ``int`` refuses
    (``"\u00b2"``) or reads (``"\u0663"``): a query parameter or header takes 0-9 only.
    """
    return int(text) if text.isascii() and text.isdigit() else None


def _parse_object(body: bytes) -> dict[str, Any]:
    """A JSON object from ``body``, or 400; a string in it that is not Unicode text (a lone
    surrogate, which JSON's ``\\ud800`` escape can carry) is a 422 naming where it is."""
    try:
        payload = json.loads(body)
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise HTTPException(400, f"request body is not valid JSON: {error}") from None
    except RecursionError:
        raise HTTPException(400, "request body is not valid JSON: nested too deeply") from None
    if not isinstance(payload, dict):
        raise HTTPException(400, f"request body must be a JSON object, got {type(payload).__name__}")
    where = None if _only_text(body) else _not_text(payload, "")
    if where is not None:
        raise HTTPException(
            422, f"{where or 'body'}: not valid Unicode text (a lone surrogate, e.g. from a \\ud800 escape)"
        )
    return payload


def _only_text(body: bytes) -> bool:
    """Whether every string ``json.loads(body)`` gives is Unicode text, read off the bytes alone: an
    ASCII body read as UTF-8 without a ``\\u`` escape holds no lone surrogate (they come from a
    ``\\ud800`` escape, from surrogate bytes that ``json.loads`` lets through, or from UTF-16/32), so
    the walk of ``_not_text`` over every string (a 200-item history: 200 paths formatted) is skipped."""
    return body.isascii() and b"\\u" not in body and json.detect_encoding(body) == "utf-8"


def _not_text(value: Any, where: str) -> str | None:
    """The path (``queries.3.user_id``, as pydantic names fields) of a string, key or value,
    that cannot be encoded as UTF-8 in ``value``; None when there is none."""
    stack = [(value, where)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and not encodes_as_utf8(value):
                return where
        elif isinstance(value, dict):
            for key, item in value.items():
                inner = f"{where}.{key}" if where else str(key)
                if not key.isascii() and not encodes_as_utf8(key):
                    return (f"{where}." if where else "") + ascii(key)
                stack.append((item, inner))
        elif isinstance(value, list):
            stack.extend((item, f"{where}.{position}" if where else str(position))
                         for position, item in reversed(list(enumerate(value))))
    return None


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
        message = message.removeprefix("Value error, ")  # a validator's own message says what is wrong
        problems.append(f"{where}: {message}")
    return "; ".join(problems)
