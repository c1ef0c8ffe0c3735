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
``POST /similar``
    The items nearest one catalogue item's embedding (``Bundle.similar_items``),
    never the item itself nor ``exclude_item_ids``; ``k`` as for ``/recommend``::

        {"item_id": "242", "k": 10, "exclude_item_ids": ["302"]}
        -> {"bundle": "<run>", "item_id": "242", "item_ids": [...], "scores": [...], "fallback": null}

    An item id the catalogue does not hold is a 422 naming it.
``GET /users/{user_id}/items``
    A training user's items (index order)::

        -> {"bundle": "<run>", "user_id": "196", "item_ids": [...]}

    404 ``{"error": ...}`` for a user not in training or a bundle without ``seen_items/``.
    ``GET /users?limit=100`` lists up to 1000 training user ids and ``num_users``.
``POST /items``
    The catalogue's display features (``item_features.parquet``, ``retrieval.bundle.display_features``)::

        {"item_ids": ["242", "x"]}
        -> {"bundle": "<run>", "features": ["title", ...],
            "items": [{"item_id": "242", "features": {"title": ...}}, {"item_id": "x", "features": null}]}

    ``features`` null throughout for a bundle without the table (ids only).
``GET /``
    A web page over these endpoints (``retrieval.serving.http.page``): a user's training items
    beside its top-k with item features, an item's similar items on a click.
``GET /healthz``
    ``{"status": "ok", "bundle": "<run>", "num_items": n}``; 503 ``{"status": "failing", ...,
    "error": ...}`` when a bundle file on disk is no longer the one loaded (``Bundle.changed_files``,
    named; the loaded copy keeps serving) or the probe query gives other items than at export.
``GET /metadata``
    Bundle version, query features, index factory, tuned search parameters
    and their measured recall, library versions (no server paths).
``GET /metrics``
    Prometheus text exposition (``retrieval.serving.http.metrics``): requests by
    route template and status, their latency, and the bundle being served.
``POST /admin/reload`` (unless the app was made with ``admin=False``)
    ``{"bundle": "artifacts/<new run>"}``: loads the new bundle completely,
    then swaps it in with one reference assignment. Requests already running
    finish on the bundle they started with; none is dropped. If loading
    fails, the old bundle keeps serving and the reply says why (without
    quoting the files). The request must name the bound address in its
    ``Host`` header and carry no foreign ``Origin`` (403 otherwise:
    ``admin_host_allowed``, ``same_origin``), and be sent as
    ``Content-Type: application/json`` (415). With an admin token, it must carry
    ``Authorization: Bearer <token>`` (401 otherwise); ``retrieval serve``
    requires one whenever it binds a non-loopback address with admin on
    (``check_admin_exposure``).

Bad requests get a 4xx and ``{"error": "<reason>"}``: 400 for a body that is
not a JSON object (nested too deeply to parse included), 401 for a missing or
wrong admin token, 403 for an admin request with a foreign Host or Origin, 415 for one
not sent as JSON, 408 for a request not received within
``request_read_timeout``, 413 for a body over ``max_body_bytes``, 422 for a
well-formed body with wrong fields or values (a lone surrogate in any string among them), 431 for too many or too large
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

The package's modules: ``limits`` (request bounds, ``ServiceLimits``, admin
exposure), ``inputs`` (request models, body reading and parsing), ``connection``
(uvicorn protocols with a read deadline, ``server_config``), ``metrics``
(``/metrics``: the per-app registry and the middleware counting requests),
``page`` (the web page at ``/`` and its headers),
``app`` (``create_app``, the bundle holder and the bulk lane).
"""

from retrieval.serving.http.app import BundleHolder, create_app
from retrieval.serving.http.connection import BoundedH11Protocol, BoundedHttpToolsProtocol, server_config
from retrieval.serving.http.inputs import RecommendRequest, ReloadRequest, SimilarRequest
from retrieval.serving.http.limits import (
    ADMIN_TOKEN_ENV,
    INLINE_PARSE_BYTES,
    MAX_BATCH,
    MAX_BODY_BYTES,
    MAX_EXCLUDED,
    MAX_K,
    MIN_ADMIN_TOKEN_CHARS,
    ServiceLimits,
    check_admin_exposure,
    is_loopback,
)

__all__ = [
    "ADMIN_TOKEN_ENV",
    "INLINE_PARSE_BYTES",
    "MAX_BATCH",
    "MAX_BODY_BYTES",
    "MAX_EXCLUDED",
    "MAX_K",
    "MIN_ADMIN_TOKEN_CHARS",
    "BoundedH11Protocol",
    "BoundedHttpToolsProtocol",
    "BundleHolder",
    "RecommendRequest",
    "ReloadRequest",
    "ServiceLimits",
    "SimilarRequest",
    "check_admin_exposure",
    "create_app",
    "is_loopback",
    "server_config",
]
