"""Connection-level bounds of the HTTP service: uvicorn's protocols plus a read deadline.

``server_config`` builds uvicorn's Config with ``ServiceLimits`` applied at
the connection level; ``BoundedHttpToolsProtocol`` / ``BoundedH11Protocol``
(uvicorn's two HTTP parsers, through ``_ReadDeadline``) add what uvicorn does
not bound itself: header bytes (431), the time from a request's first byte to
its last body byte (408, then close), and the idle timer of a connection that
has not sent a byte yet.
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
from collections.abc import Callable
from typing import Any, ClassVar

import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from retrieval.serving.http.limits import ServiceLimits

log = logging.getLogger("retrieval.service")


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
