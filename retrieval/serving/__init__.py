"""Serving: top-k from an exported bundle, by query, in batch and over HTTP.

``bundle``: ``Bundle`` loads a bundle (checking it against its manifest) and answers
``recommend`` / ``similar_items`` for raw queries (it ranks, and composes ``integrity``: the load-time
checks of files, parts and probe query, and ``queries``: what a query may hold, its completion from the
user tables and its checks); its command line is ``python -m retrieval.serving`` (``retrieval recommend``).
``batch``: many users' top-k (or similar items) into one Parquet file,
block by block (``--out``). ``request_checks``: the rules of a request (ids, id lists, k, query keys)
that every entry point applies. ``http``: the HTTP JSON service and its web page (``retrieval serve``).

``from retrieval.serving import Bundle`` keeps working: the names below are imported from ``bundle``
on first use, because ``bundle`` loads TensorFlow and ``http`` (which ``retrieval serve --help`` and
``retrieval reload`` read) must not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from retrieval.serving.bundle import (
        Bundle,
        BundleError,
        HistoryOrder,
        Recommendations,
        RequestError,
        Verify,
        main,
        recommend,
        recommend_parser,
    )

__all__ = [
    "Bundle",
    "BundleError",
    "HistoryOrder",
    "Recommendations",
    "RequestError",
    "Verify",
    "main",
    "recommend",
    "recommend_parser",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from retrieval.serving import bundle

        return getattr(bundle, name)
    raise AttributeError(f"module 'retrieval.serving' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
