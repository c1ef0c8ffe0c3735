"""The ``retrieval`` command (``[project.scripts]`` in pyproject.toml).

    retrieval serve --bundle artifacts/<run> [--host 127.0.0.1] [--port 8000] [--admin-token T | --no-admin]
    retrieval reload --bundle artifacts/<new run> [--url http://127.0.0.1:8000] [--token T]

``serve`` runs the HTTP service of ``retrieval/service.py`` under uvicorn;
``reload`` asks a running service to swap to another bundle without
dropping requests (``POST /admin/reload``). Both read the admin token from
``RETRIEVAL_ADMIN_TOKEN`` when the flag is not given (a flag shows in ``ps``).
``serve`` takes one flag per ``ServiceLimits`` field (``--max-body-bytes``,
``--request-read-timeout``, ...; ``retrieval serve --help`` lists them with
their defaults). A bundle it cannot load, a non-loopback ``--host`` with
admin on and no token, a service ``reload`` cannot reach or that refuses the
bundle, is one line on stderr and exit status 2 (``retrieval.errors``;
``RETRIEVAL_DEBUG=1`` shows the traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

from retrieval.errors import UserError, entry_point

# retrieval.service loads TensorFlow only when a bundle is loaded: `retrieval reload` and --help start fast.
from retrieval.service import ADMIN_TOKEN_ENV, ServiceLimits


@entry_point
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="retrieval", description="Serve top-k retrieval from a bundle.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="HTTP JSON service over a bundle (uvicorn)")
    serve.add_argument("--bundle", required=True, help="bundle directory, e.g. artifacts/<run>")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default: %(default)s, loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--no-admin", action="store_true", help="disable POST /admin/reload")
    serve.add_argument(
        "--admin-token",
        help=f"require 'Authorization: Bearer <token>' on /admin/reload (default: ${ADMIN_TOKEN_ENV}); "
        "needed when --host is not loopback and admin is on",
    )
    serve.add_argument(
        "--search-threads", type=int, default=1, help="FAISS threads per request; 0 = every core (default: %(default)s)"
    )
    serve.add_argument(
        "--verify", default="quick", choices=["quick", "full"],
        help="check the bundle's files (at start and every reload) against its manifest's fingerprints: "
        "quick hashes files over 64 MiB by size and both ends, full hashes every file whole (default: %(default)s)",
    )
    serve.add_argument("--access-log", action="store_true", help="log every request (costs latency)")
    serve.add_argument(
        "--http", default="auto", choices=["auto", "httptools", "h11"],
        help="HTTP parser; auto = httptools when installed (default: %(default)s)",
    )
    serve.add_argument(
        "--loop", default="auto", choices=["auto", "uvloop", "asyncio"],
        help="event loop; auto = uvloop when installed (default: %(default)s)",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--gil-switch-interval", type=float, default=0.0005,
        help="seconds a Python thread may hold the interpreter while others wait (sys.setswitchinterval; "
        "Python's default 0.005 lets a large batch delay small requests by that much per hand-over; "
        "default: %(default)s)",
    )
    _add_limit_flags(serve)

    reload = commands.add_parser("reload", help="make a running service serve another bundle")
    reload.add_argument("--bundle", required=True, help="new bundle directory, as the server sees it")
    reload.add_argument("--url", default="http://127.0.0.1:8000", help="service base URL (default: %(default)s)")
    reload.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the load")
    reload.add_argument("--token", help=f"the server's admin token (default: ${ADMIN_TOKEN_ENV})")

    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    return _reload(args)


def _add_limit_flags(serve: argparse.ArgumentParser) -> None:
    """One flag per ServiceLimits field, e.g. --request-read-timeout for request_read_timeout."""
    for field in dataclasses.fields(ServiceLimits):
        kind = int if field.type == "int" else float
        serve.add_argument(
            "--" + field.name.replace("_", "-"), type=kind, default=field.default,
            help=f"{field.metadata['help']} (default: %(default)s)",
        )


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow loads)
    from retrieval.service import check_admin_exposure, create_app, server_config

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    token = args.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port} is not a TCP port (0 to 65535)")
    try:  # both check the flags' values: their ValueError is a bad command line
        limits = ServiceLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServiceLimits)})
        check_admin_exposure(args.host, not args.no_admin, token)
    except ValueError as error:
        raise UserError(str(error)) from error
    app = create_app(
        args.bundle, admin=not args.no_admin, admin_token=token, limits=limits,
        search_threads=args.search_threads or None, verify=args.verify,
    )
    sys.setswitchinterval(args.gil_switch_interval)
    config = server_config(
        app, limits, http=args.http, host=args.host, port=args.port, access_log=args.access_log,
        log_level=args.log_level, loop=args.loop,
    )
    uvicorn.Server(config).run()
    return 0


def _reload(args: argparse.Namespace) -> int:
    if not args.url.startswith(("http://", "https://")):
        raise UserError(f"--url {args.url!r} is not an http:// or https:// URL")
    headers = {"Content-Type": "application/json"}
    token = args.token or os.environ.get(ADMIN_TOKEN_ENV)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(
        args.url.rstrip("/") + "/admin/reload",
        data=json.dumps({"bundle": args.bundle}).encode(),
        headers=headers,
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            print(response.read().decode())
    except urllib.error.HTTPError as error:
        raise UserError(f"{args.url} refused the reload: {error.code} {error.read().decode()}") from None
    except urllib.error.URLError as error:
        raise UserError(f"cannot reach {args.url}: {error.reason}") from None
    except TimeoutError:
        raise UserError(f"{args.url} did not answer within --timeout {args.timeout:g} s") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
