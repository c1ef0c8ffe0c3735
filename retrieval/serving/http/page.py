"""The web page at ``GET /``: one static HTML file with an inline script over the JSON endpoints.

``page.html`` (package data, next to this module) needs no build step: it reads ``/metadata`` and
``/users``, asks ``/users/{id}/items`` for a user's training items, ``/recommend`` for the top-k,
``/explain`` for the click that explains each, ``/items`` for display features, ``/items/search``
for items by title and ``/similar`` for an item's neighbours, and puts every string into the page
as text (``textContent``), never as markup.

``page_headers`` gives it a Content-Security-Policy that runs only that inline script (by its
hash), lets it talk only to the server that sent it and loads nothing from elsewhere: a string
that found its way into the markup still could not run or send anything.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

PAGE_PATH = "/"
PAGE_FILE = "page.html"
_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)


def page_html() -> str:
    """The page's HTML, as shipped in the package."""
    return resources.files("retrieval.serving.http").joinpath(PAGE_FILE).read_text(encoding="utf-8")


def page_headers(html: str) -> dict[str, str]:
    """Response headers for ``html``: a CSP allowing exactly its inline scripts (by SHA-256), revalidated on
    every load (``no-cache``), no content sniffing."""
    hashes = " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()}'"
        for body in _SCRIPT.findall(html)
    ) or "'none'"
    policy = (f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; "
              "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return {"content-security-policy": policy, "x-content-type-options": "nosniff", "cache-control": "no-cache"}
