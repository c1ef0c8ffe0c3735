"""Prometheus metrics of the HTTP service: ``GET /metrics`` in the text exposition format.

``ServiceMetrics`` holds one app's metrics in a registry of its own (never
prometheus_client's global one), so that several apps in one process count
apart; ``RequestMetrics`` is the ASGI middleware that counts and times every
request. The series:

``retrieval_requests_total{route, status}``
    Answered requests. ``route`` is the matched route's path template
    (``/recommend``, ...; a wrong method still names its route), ``other`` for
    every path no route has, so the label set stays bounded whatever clients
    send; ``status`` the HTTP status code. Scrapes of ``/metrics`` itself are
    not counted.
``retrieval_request_seconds{route}``
    Histogram of the time from a request's arrival in the app to its last
    response byte (``LATENCY_BUCKETS``).
``retrieval_bundle_info{bundle, format_version, created_at, embedding_dim, num_items, index_factory}``
    1 for the bundle being served (``Bundle.metadata``); after a hot swap only
    the new bundle's labels remain.
``retrieval_bundle_load_seconds``
    How long the served bundle took to load (absent when the app was handed
    an already loaded ``Bundle``).
``retrieval_bundle_loaded_timestamp_seconds``
    Unix time the served bundle was swapped in (for the first bundle: when
    the app took it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from retrieval.serving.http.app import BundleHolder

METRICS_PATH = "/metrics"
# The route label of a path no route has: one value, however many paths clients try.
OTHER_ROUTE = "other"
# Seconds: a single query answers in about a millisecond, a batch of 1,024 in a second or two.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BUNDLE_LABELS = ("bundle", "format_version", "created_at", "embedding_dim", "num_items", "index_factory")


class ServiceMetrics:
    """One app's metrics, in their own ``CollectorRegistry``; ``endpoint`` answers ``GET /metrics``."""

    def __init__(self, holder: BundleHolder):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "retrieval_requests", "Requests answered, by route template and HTTP status.",
            ["route", "status"], registry=self.registry,
        )
        self.latency = Histogram(
            "retrieval_request_seconds", "Seconds from a request's arrival to its last response byte, by route.",
            ["route"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.registry.register(_BundleCollector(holder))

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    async def endpoint(self, request: Request) -> Response:
        # On the event loop, as the reload's swap is: a scrape never sees half a swap.
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class RequestMetrics:
    """ASGI middleware: counts and times each HTTP request by its route template and status.

    Add it outside every middleware that answers on its own (``_HeaderCount``'s
    431s). Starlette's ``ServerErrorMiddleware`` stays outside any added
    middleware: an error it turns into a 500 passes here as an exception, and
    is counted as 500.
    """

    def __init__(self, app: ASGIApp, metrics: ServiceMetrics, routes: Sequence[BaseRoute]):
        self.app, self.metrics, self.routes = app, metrics, routes

    def route_of(self, scope: Scope) -> str:
        """The path template of the route ``scope`` goes to (also when only its method is wrong), else "other"."""
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is not Match.NONE:
                return str(getattr(route, "path", OTHER_ROUTE))
        return OTHER_ROUTE

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (route := self.route_of(scope)) == METRICS_PATH:  # scrapes are not counted
            await self.app(scope, receive, send)
            return
        status = 500  # an exception before the response started: ServerErrorMiddleware answers 500

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        started = time.perf_counter()
        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            self.metrics.observe(route, status, time.perf_counter() - started)


class _BundleCollector(Collector):
    """The served bundle's series, read from the holder at each scrape (so a swap replaces them whole)."""

    def __init__(self, holder: BundleHolder):
        self.holder = holder

    def collect(self) -> Iterator[Metric]:
        holder = self.holder
        metadata = holder.current.metadata()
        labels = {**metadata, "index_factory": metadata["index"]["factory"]}
        info = GaugeMetricFamily("retrieval_bundle_info", "1 for the bundle being served.", labels=BUNDLE_LABELS)
        info.add_metric(["" if labels[name] is None else str(labels[name]) for name in BUNDLE_LABELS], 1)
        yield info
        if holder.load_seconds is not None:
            yield GaugeMetricFamily(
                "retrieval_bundle_load_seconds", "Seconds the served bundle took to load.", value=holder.load_seconds
            )
        yield GaugeMetricFamily(
            "retrieval_bundle_loaded_timestamp_seconds", "Unix time the served bundle was swapped in.",
            value=holder.served_since,
        )
