"""Request limits and admin exposure of the HTTP service.

The bounds on what one request may ask for (``MAX_K``, ``MAX_BATCH``,
``MAX_EXCLUDED``, body sizes), ``ServiceLimits`` (what one client may hold;
``retrieval serve`` has one flag per field), the check that
``/admin/reload`` is not exposed off loopback without a token
(``is_loopback``, ``check_admin_exposure``), and which ``Host`` and ``Origin``
headers an admin request may carry (``admin_host_allowed``, ``same_origin``). Nothing here loads a bundle, so
``retrieval reload`` and ``retrieval serve --help`` start fast.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass

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


WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


def _hostname(host_header: str) -> str:
    """The host name of a ``Host`` header (``[::1]:8000`` -> ``::1``, ``Example.COM.:80`` -> ``example.com``)."""
    host = host_header.strip().lower()
    if host.startswith("["):
        host = host[1 : host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    return host.rstrip(".")


def admin_host_allowed(bound_host: str, host_header: str | None) -> bool:
    """Whether an admin request's ``Host`` header names the address the server is bound to.

    A page on another site can make a browser send requests to a loopback server
    by pointing its own DNS name at 127.0.0.1 (DNS rebinding); the ``Host`` header
    then still carries that name. On loopback the name must be a loopback one
    (``localhost``, 127.0.0.0/8, ``::1``); bound to one address, that address (or,
    for a host name, that name); on every interface (``0.0.0.0``, ``::``) any,
    as a token is required there (``check_admin_exposure``). No header: refused.
    """
    if host_header is None or not host_header.strip():
        return False
    if bound_host.strip() in WILDCARD_HOSTS:
        return True
    name = _hostname(host_header)
    if is_loopback(bound_host):
        return is_loopback(name)
    bound = _hostname(bound_host) if bound_host.startswith("[") else bound_host.strip().lower().rstrip(".")
    try:
        return ipaddress.ip_address(name) == ipaddress.ip_address(bound)
    except ValueError:
        return name == bound


def same_origin(origin: str | None, host_header: str | None) -> bool:
    """Whether a request's ``Origin`` header (sent by browsers) is the server itself: absent (a
    command-line client), or ``http(s)://`` plus exactly the ``Host`` header. ``null`` (a sandboxed
    page or a file) and every other site are foreign."""
    if origin is None:
        return True
    scheme, _, netloc = origin.strip().lower().partition("://")
    return scheme in ("http", "https") and host_header is not None and netloc == host_header.strip().lower()
