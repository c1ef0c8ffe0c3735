"""The HTTP service under hostile clients: slow and oversized requests, bodies that cannot
be parsed, broken bundles, the admin endpoint off loopback, and large batches beside small ones.

Sockets go only to 127.0.0.1 servers started here; every wait is bounded."""

import asyncio
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import uvicorn
from test_service import ROOT, call, free_port, serve_in_thread, world  # noqa: F401  (the module fixture: two small bundles)

import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow)
from retrieval import cli
from retrieval.serving import Bundle, BundleError
from retrieval.serving.http import (
    MAX_EXCLUDED,
    ServiceLimits,
    check_admin_exposure,
    create_app,
    is_loopback,
)
from retrieval.serving.http.limits import admin_host_allowed

TOKEN = "s3cret-token-0123456789"
# TensorFlow's native runtime logs (absl) at import: "I0000 00:00:17... port.cc:153] oneDNN ..." and the like.
TF_STARTUP_LOG = re.compile(r"^(WARNING: All log messages before absl::InitializeLog|[IWE]\d{4} \d\d:\d\d:)")
FAST = ServiceLimits(request_read_timeout=1.0, keep_alive_timeout=1.0, max_header_bytes=2048, max_headers=20)


@pytest.fixture(scope="module", params=["httptools", "h11"])
def bounded(request, world):  # noqa: F811
    """(port, limits) of a server with short bounds, under each HTTP parser."""
    server, thread, port = serve_in_thread(create_app(world["bundle-a"], limits=FAST), FAST, request.param)
    yield port, FAST
    server.should_exit = True
    thread.join(timeout=10)


def _send_then_wait(port: int, data: bytes, cap: float = 10.0) -> tuple[bytes, float]:
    """Send ``data``, then read until the server closes; (everything read, seconds until closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=cap) as sock:
        started = time.monotonic()
        if data:
            sock.sendall(data)
        received = b""
        while time.monotonic() - started < cap:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            received += chunk
        return received, time.monotonic() - started


def _status_and_json(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


# --- read timeout, header bounds, idle connections ------------------------------------------------


def test_partial_header_is_answered_408_and_closed_within_the_read_timeout(bounded):
    port, limits = bounded
    raw, seconds = _send_then_wait(port, b"POST /recommend HTTP/1.1\r\nHost: x\r\nContent-Ty")
    assert seconds < limits.request_read_timeout + 2.0, f"connection held {seconds:.1f} s"
    status, body = _status_and_json(raw)
    assert status == 408 and "not received within 1 s" in body["error"]


def test_partial_body_is_closed_within_the_read_timeout(bounded):
    port, limits = bounded
    head = b"POST /recommend HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    raw, seconds = _send_then_wait(port, head + b'{"query": ')
    assert seconds < limits.request_read_timeout + 2.0, f"connection held {seconds:.1f} s"
    assert _status_and_json(raw)[0] == 408


def test_slowloris_drip_does_not_extend_the_deadline(bounded):
    """One header byte every 0.2 s: each byte would reset an idle timer, not the read deadline."""
    port, limits = bounded
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        started, closed = time.monotonic(), False
        while time.monotonic() - started < 10:
            try:
                sock.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            sock.settimeout(0.2)
            try:
                if sock.recv(4096) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed = True
                break
        assert closed and time.monotonic() - started < limits.request_read_timeout + 2.0


def test_a_connection_that_never_speaks_is_closed(bounded):
    port, limits = bounded
    raw, seconds = _send_then_wait(port, b"")
    assert raw == b"" and seconds < limits.keep_alive_timeout + 2.0


def test_idle_keep_alive_is_closed_after_a_response(bounded):
    port, limits = bounded
    raw, seconds = _send_then_wait(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 200") and seconds < limits.keep_alive_timeout + 2.0


def test_oversized_headers_get_431_and_are_closed(bounded):
    port, limits = bounded
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (limits.max_header_bytes + 100) + b"\r\n\r\n"
    raw, seconds = _send_then_wait(port, request)
    status, body = _status_and_json(raw)
    assert status == 431 and "over 2048 bytes" in body["error"] and seconds < 2.0


def test_an_endless_header_is_cut_before_it_completes(bounded):
    """A header that never ends must not grow the server's buffer past the bound."""
    port, limits = bounded
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nX-Endless: ")
        sent, refused = 0, False
        try:
            while sent < 50 * limits.max_header_bytes:
                sock.sendall(b"a" * 1024)
                sent += 1024
        except (BrokenPipeError, ConnectionResetError):
            refused = True
        if not refused:
            sock.settimeout(5)
            refused = sock.recv(4096).startswith(b"HTTP/1.1 431")
    assert refused


def test_too_many_headers_get_431(bounded):
    port, limits = bounded
    headers = b"".join(b"X-H%d: v\r\n" % i for i in range(limits.max_headers + 1))
    raw, _ = _send_then_wait(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    status, body = _status_and_json(raw)
    assert status == 431 and "more than 20" in body["error"]


def test_malformed_http_gets_json_400(bounded):
    port, _ = bounded
    raw, _ = _send_then_wait(port, b"NOT HTTP AT ALL\r\n\r\n")
    status, body = _status_and_json(raw)
    assert status == 400 and body["error"].startswith("invalid HTTP request")


# --- bodies that cannot be parsed, limits on lists ---------------------------------------------------


def test_deeply_nested_json_is_400_and_keeps_the_connection(bounded):
    port, _ = bounded
    deep = b'{"query": {"user_id": "user01"}, "k": ' + b"[" * 60_000 + b"]" * 60_000 + b"}"
    head = b"POST /recommend HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    good = json.dumps({"query": {"user_id": "user01"}, "k": 3}).encode()
    limits = ServiceLimits(max_body_bytes=1 << 20)
    assert len(deep) < limits.max_body_bytes
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        replies = []
        for body in (deep, good):  # the same connection: the 400 must not drop keep-alive
            sock.sendall(head % len(body) + body)
            reply = b""
            while b"\r\n\r\n" not in reply or len(reply.partition(b"\r\n\r\n")[2]) < int(
                reply.lower().split(b"content-length: ")[1].split(b"\r\n")[0]
            ):
                chunk = sock.recv(65536)
                assert chunk, f"connection closed after {len(replies)} replies"
                reply += chunk
            replies.append(_status_and_json(reply))
    (status, body), (good_status, good_body) = replies
    assert status == 400 and body["error"] == "request body is not valid JSON: nested too deeply"
    assert good_status == 200 and len(good_body["item_ids"]) == 3


def test_nesting_that_parses_is_a_422_not_a_500(world):  # noqa: F811
    app = create_app(world["bundle-a"])
    deep = "[" * 500 + "]" * 500
    bodies = [f'{{"query": {{"user_id": {deep}}}}}', f'{{"queries": [{{"user_id": "u"}}], "exclude_item_ids": {deep}}}']
    for body in bodies:
        response = call(app, "POST", "/recommend", content=body.encode())
        assert response.status_code == 422, response.text
        assert len(response.json()["error"]) < 300  # the value is not echoed whole


def test_inner_exclusion_lists_are_capped(world):  # noqa: F811
    app = create_app(world["bundle-a"])
    too_many = [f"x{i}" for i in range(MAX_EXCLUDED + 1)]
    response = call(app, "POST", "/recommend", json={
        "queries": [{"user_id": "user01"}, {"user_id": "user02"}], "exclude_item_ids": [[], too_many]})
    assert response.status_code == 422
    assert f"exclude_item_ids[1] holds {MAX_EXCLUDED + 1} ids, more than {MAX_EXCLUDED}" in response.json()["error"]
    at_cap = call(app, "POST", "/recommend", json={
        "queries": [{"user_id": "user01"}], "exclude_item_ids": [too_many[:MAX_EXCLUDED]]})
    assert at_cap.status_code == 200, at_cap.text


# --- broken bundles ---------------------------------------------------------------------------------


def _break(directory: Path, how: str) -> None:
    manifest = directory / "manifest.json"
    if how == "truncated index.faiss":
        data = (directory / "index.faiss").read_bytes()
        (directory / "index.faiss").write_bytes(data[: len(data) // 2])
    elif how == "garbage index.faiss":
        (directory / "index.faiss").write_bytes(b"SECRET-FILE-BYTES " * 40)
    elif how == "empty index.faiss":
        (directory / "index.faiss").write_bytes(b"")
    elif how == "corrupt manifest":
        manifest.write_text('{"format_version": 1, "query_features": ["user_id"')
    elif how == "manifest without files":
        data = json.loads(manifest.read_text())
        del data["files"]
        manifest.write_text(json.dumps(data))
    elif how == "missing SavedModel":
        shutil.rmtree(directory / json.loads(manifest.read_text())["files"]["query_model"])
    elif how == "corrupt SavedModel":
        model = directory / json.loads(manifest.read_text())["files"]["query_model"]
        (model / "saved_model.pb").write_bytes(b"SECRET-FILE-BYTES " * 10)
    elif how == "truncated item_ids.parquet":
        data = (directory / "item_ids.parquet").read_bytes()
        (directory / "item_ids.parquet").write_bytes(data[: len(data) // 2])
    elif how == "missing index.json":
        (directory / "index.json").unlink()
    elif how == "query feature the model lacks":
        data = json.loads(manifest.read_text())
        data["query_features"] = ["user_id", "age"]
        manifest.write_text(json.dumps(data))
    else:
        raise ValueError(how)


BREAKS = ["truncated index.faiss", "garbage index.faiss", "empty index.faiss", "corrupt manifest",
          "manifest without files", "missing SavedModel", "corrupt SavedModel", "truncated item_ids.parquet",
          "missing index.json", "query feature the model lacks"]


@pytest.fixture
def broken(world, tmp_path, request):  # noqa: F811
    directory = tmp_path / "broken"
    shutil.copytree(world["bundle-a"], directory)
    _break(directory, request.param)
    return directory


@pytest.mark.parametrize("broken", BREAKS, indirect=True)
def test_every_broken_bundle_is_one_clean_line_and_exit_2(broken, capsys):
    code = cli.main(["serve", "--bundle", str(broken), "--port", str(free_port())])
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {broken}: "), captured.err
    assert "SECRET" not in captured.err and "Traceback" not in captured.err
    with pytest.raises(BundleError):
        Bundle.load(broken)


@pytest.mark.parametrize("broken", ["truncated index.faiss"], indirect=True)
def test_retrieval_serve_on_a_truncated_index_exits_2_with_one_line(broken):
    """The issue's case, as a user runs it: one line from us, after only TensorFlow's C++ start-up log
    (its import prints those on a machine without a GPU, whatever the bundle). The fingerprint check
    refuses the file before FAISS reads it."""
    result = subprocess.run([sys.executable, "-m", "retrieval.cli", "serve", "--bundle", str(broken),
                             "--port", str(free_port())], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    ours = [line for line in result.stderr.strip().splitlines() if not TF_STARTUP_LOG.match(line)]
    assert ours == [f"error: {broken}: index.faiss: content differs from the manifest's fingerprint"], result.stderr


@pytest.mark.parametrize("broken", ["garbage index.faiss", "corrupt SavedModel"], indirect=True)
def test_failed_reload_does_not_echo_file_bytes(world, broken):  # noqa: F811
    app = create_app(world["bundle-a"])
    response = call(app, "POST", "/admin/reload", json={"bundle": str(broken)})
    assert response.status_code == 422
    error = response.json()["error"]
    assert "still serving 'bundle-a'" in error and "content differs from the manifest's fingerprint" in error
    assert "SECR" not in error and "0x" not in error, error


# --- the admin endpoint off loopback ------------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.5", "::1", "[::1]", "localhost"])
def test_loopback_hosts_need_no_token(host):
    assert is_loopback(host)
    check_admin_exposure(host, admin=True, admin_token=None)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "10.0.0.1", "example.com", ""])
def test_non_loopback_host_with_admin_needs_a_token(host):
    assert not is_loopback(host)
    with pytest.raises(ValueError, match="not a loopback address: /admin/reload needs a token"):
        check_admin_exposure(host, admin=True, admin_token=None)
    check_admin_exposure(host, admin=True, admin_token=TOKEN)
    check_admin_exposure(host, admin=False, admin_token=None)


def test_short_tokens_are_refused():
    with pytest.raises(ValueError, match="at least 16 characters"):
        check_admin_exposure("0.0.0.0", admin=True, admin_token="short")


def test_serve_refuses_to_start_off_loopback_without_a_token(world, capsys, monkeypatch):  # noqa: F811
    """Refused before the bundle loads or anything binds (so the non-loopback address is never opened)."""
    monkeypatch.delenv("RETRIEVAL_ADMIN_TOKEN", raising=False)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: pytest.fail("would have bound"))
    code = cli.main(["serve", "--bundle", str(world["bundle-a"]), "--host", "0.0.0.0"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "--admin-token or RETRIEVAL_ADMIN_TOKEN" in lines[0]


def test_admin_token_from_the_environment_lets_serve_start(world, monkeypatch):  # noqa: F811
    started = {}
    monkeypatch.setenv("RETRIEVAL_ADMIN_TOKEN", TOKEN)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: started.update(host=self.config.host))
    assert cli.main(["serve", "--bundle", str(world["bundle-a"]), "--host", "0.0.0.0"]) == 0
    assert started == {"host": "0.0.0.0"}


def test_reload_requires_the_token_when_one_is_set(world):  # noqa: F811
    app = create_app(world["bundle-a"], admin_token=TOKEN)
    target = {"bundle": str(world["bundle-b"])}
    for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": TOKEN}):
        response = call(app, "POST", "/admin/reload", json=target, headers=headers)
        assert response.status_code == 401 and "admin token" in response.json()["error"]
    assert call(app, "GET", "/healthz").json()["bundle"] == "bundle-a"
    response = call(app, "POST", "/admin/reload", json=target, headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200 and response.json()["bundle"] == "bundle-b"


def test_metadata_shows_no_server_paths(world):  # noqa: F811
    app = create_app(world["bundle-a"])
    text = call(app, "GET", "/metadata").text
    assert str(world["bundle-a"].parent) not in text and "/tmp" not in text
    assert json.loads(text)["bundle"] == "bundle-a"


def test_limits_are_serve_flags_with_their_defaults():
    parser_defaults = {}
    for action in cli.serve_parser()._actions:
        parser_defaults[action.dest] = action.default
    for name, default in ServiceLimits().__dict__.items():
        assert parser_defaults[name] == default
    with pytest.raises(ValueError, match="request_read_timeout must be a positive number"):
        ServiceLimits(request_read_timeout=0)


# --- large batches beside small requests ------------------------------------------------------------


def test_large_batches_run_one_at_a_time_in_chunks_beside_small_requests(world, monkeypatch):  # noqa: F811
    """Batches over bulk_queries go through a one-thread lane, bulk_chunk queries per search; a single
    query is answered while that lane is busy (it does not queue behind it)."""
    limits = ServiceLimits(bulk_queries=16, bulk_chunk=8, bulk_workers=1)
    app = create_app(world["bundle-a"], limits=limits)
    bundle = app.state.holder.current
    original = bundle.recommend_embedded
    calls, running, peak, lock = [], [0], [0], threading.Lock()

    def slow(embeddings, known_ids, k=10, exclude_item_ids=None, **seen):
        calls.append(len(embeddings))
        if len(embeddings) == 1:
            return original(embeddings, known_ids, k, exclude_item_ids, **seen)
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        try:
            time.sleep(0.05)  # a big chunk takes a while
            return original(embeddings, known_ids, k, exclude_item_ids, **seen)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(bundle, "recommend_embedded", slow)
    users = [f"user{u % 60:02d}" for u in range(64)]
    big = {"queries": [{"user_id": u} for u in users], "k": 5}

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://in-process", timeout=60) as client:
            batches = [asyncio.create_task(client.post("/recommend", json=big)) for _ in range(3)]
            await asyncio.sleep(0.1)
            started = time.perf_counter()
            single = await client.post("/recommend", json={"query": {"user_id": "user07"}, "k": 5})
            single_seconds = time.perf_counter() - started
            done_before_single = sum(task.done() for task in batches)
            return single, single_seconds, done_before_single, await asyncio.gather(*batches)

    single, single_seconds, done_before_single, replies = asyncio.run(go())
    assert single.status_code == 200 and done_before_single == 0
    assert single_seconds < 0.5 * 3 * 8 * 0.05, single_seconds  # well under the three batches' time
    expected = Bundle.load(world["bundle-a"]).recommend_batch([{"user_id": u} for u in users], 5)
    for reply in replies:
        assert reply.status_code == 200
        assert [r["item_ids"] for r in reply.json()["results"]] == [r.item_ids for r in expected]
    big_calls = [n for n in calls if n > 1]
    assert big_calls == [8] * (3 * 8)  # every batch in chunks of bulk_chunk
    assert peak[0] == 1  # one bulk search at a time
    np.testing.assert_array_equal(sorted(set(calls)), [1, 8])


def test_the_bulk_lane_runs_below_the_server_priority(world, monkeypatch):  # noqa: F811
    """The OS gives a core to a small request's thread before the bulk lane's (Linux: nice per thread)."""
    import os

    app = create_app(world["bundle-a"], limits=ServiceLimits(bulk_queries=4, bulk_nice=5))
    bundle = app.state.holder.current
    original, seen = bundle.recommend_embedded, {}

    def record(embeddings, known_ids, k=10, exclude_item_ids=None, **exclusions):
        seen[len(embeddings)] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        return original(embeddings, known_ids, k, exclude_item_ids, **exclusions)

    monkeypatch.setattr(bundle, "recommend_embedded", record)
    assert call(app, "POST", "/recommend", json={"query": {"user_id": "user01"}}).status_code == 200
    big = {"queries": [{"user_id": "user01"}] * 8}
    assert call(app, "POST", "/recommend", json=big).status_code == 200
    assert seen == {1: os.getpriority(os.PRIO_PROCESS, 0), 8: os.getpriority(os.PRIO_PROCESS, 0) + 5}
    with pytest.raises(ValueError, match="bulk_nice must be an integer from 0 to 19"):
        ServiceLimits(bulk_nice=20)


# --- values that would reach a 500 -------------------------------------------------------------------


@pytest.mark.parametrize("limit", ["%C2%B2", "%D9%A3", "%EF%BC%95", "1e2", "-5", "+5", " 5", "0"])
def test_a_users_limit_takes_ascii_digits_only(world, limit):  # noqa: F811
    """str.isdigit is true for a superscript two (int() refuses it), an Arabic-Indic three and a
    fullwidth five (int() reads them): all are a 422 naming the value, as are signs and blanks."""
    response = call(app := create_app(world["bundle-a"]), "GET", f"/users?limit={limit}")
    assert response.status_code == 422, response.text
    assert response.json()["error"].startswith("limit must be an integer from 1 to 1000, got ")
    assert call(app, "GET", "/users?limit=3").json()["user_ids"] == call(app, "GET", "/users").json()["user_ids"][:3]


LONE = '"\\ud800"'  # a JSON escape of a lone surrogate: valid JSON, not Unicode text


@pytest.mark.parametrize(
    "path, body, where",
    [
        ("/items", '{"item_ids": ["item001", ' + LONE + "]}", "item_ids.1"),
        ("/recommend", '{"query": {"user_id": ' + LONE + "}}", "query.user_id"),
        ("/recommend", '{"queries": [{"user_id": "user01"}, {"user_id": "x' + LONE[1:] + "}]}", "queries.1.user_id"),
        ("/recommend", '{"query": {"user_id": "user01"}, "exclude_item_ids": [' + LONE + "]}", "exclude_item_ids.0"),
        ("/similar", '{"item_id": ' + LONE + "}", "item_id"),
        ("/recommend", '{"query": {' + LONE + ': "user01"}}', "query.'\\ud800'"),
    ],
)
def test_a_lone_surrogate_anywhere_in_a_body_is_a_422_naming_its_field(world, path, body, where):  # noqa: F811
    app = create_app(world["bundle-a"])
    response = call(app, "POST", path, content=body.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    reason = "not valid Unicode text (a lone surrogate, e.g. from a \\ud800 escape)"
    assert response.json() == {"error": f"{where}: {reason}"}


def test_a_surrogate_in_raw_utf8_bytes_is_named_too(world):  # noqa: F811
    """Python's JSON reader decodes UTF-8 with surrogatepass: the three bytes of an encoded surrogate
    become one, as the escape does."""
    response = call(create_app(world["bundle-a"]), "POST", "/items", content=b'{"item_ids": ["\xed\xa0\x80"]}')
    assert response.status_code == 422 and response.json()["error"].startswith("item_ids.0: not valid Unicode")


# --- the admin surface against cross-site requests ------------------------------------------------------


@pytest.mark.parametrize(
    "headers, status, reason",
    [
        ({"content-type": "text/plain"}, 415, "Content-Type: application/json, got 'text/plain'"),
        ({"content-type": "application/x-www-form-urlencoded"}, 415, "got 'application/x-www-form-urlencoded'"),
        ({"content-type": ""}, 415, "got none"),
        ({"content-type": "application/json", "origin": "http://evil.example"}, 403, "Origin 'http://evil.example'"),
        ({"content-type": "text/plain", "origin": "null"}, 403, "another origin are refused, got Origin 'null'"),
        ({"content-type": "application/json", "origin": "http://127.0.0.1:9999"}, 403, "another origin"),
        ({"content-type": "application/json", "host": "rebound.evil.example:8000"}, 403,
         "Host header, got 'rebound.evil.example:8000'"),
        ({"content-type": "application/json", "host": "rebound.evil.example:8000",
          "origin": "http://rebound.evil.example:8000"}, 403, "must name the server's address (127.0.0.1)"),
    ],
)
def test_admin_reload_refuses_what_a_page_on_another_site_can_send(world, headers, status, reason):  # noqa: F811
    """A cross-site form or no-cors fetch sends text/plain (or a form type) with its own Origin; a DNS
    name pointed at 127.0.0.1 still sends its own Host. None of them swaps the bundle."""
    app = create_app(world["bundle-a"])
    body = json.dumps({"bundle": str(world["bundle-b"])}).encode()
    response = call(app, "POST", "/admin/reload", content=body, headers=headers)
    assert response.status_code == status and reason in response.json()["error"], response.text
    assert call(app, "GET", "/healthz").json()["bundle"] == "bundle-a"


@pytest.mark.parametrize("headers", [
    {"content-type": "application/json"},
    {"content-type": "Application/JSON; charset=utf-8", "origin": "http://127.0.0.1:8000"},
    {"content-type": "application/json", "host": "localhost:8000", "origin": "http://localhost:8000"},
    {"content-type": "application/json", "host": "[::1]:8000"},
])
def test_admin_reload_from_the_server_itself_is_taken(world, headers):  # noqa: F811
    app = create_app(world["bundle-a"])
    body = json.dumps({"bundle": str(world["bundle-b"])}).encode()
    response = call(app, "POST", "/admin/reload", content=body, headers=headers)
    assert response.status_code == 200 and response.json()["bundle"] == "bundle-b", response.text


@pytest.mark.parametrize(
    "bound, host_header, allowed",
    [
        ("127.0.0.1", "127.0.0.1:8000", True), ("127.0.0.1", "localhost", True), ("127.0.0.1", "[::1]:80", True),
        ("127.0.0.1", "LOCALHOST.:8000", True), ("::1", "127.0.0.1:8000", True),
        ("127.0.0.1", "evil.example:8000", False), ("127.0.0.1", "192.168.1.20:8000", False),
        ("127.0.0.1", None, False), ("127.0.0.1", "", False),
        ("192.168.1.20", "192.168.1.20:8000", True), ("192.168.1.20", "evil.example", False),
        ("192.168.1.20", "localhost:8000", False), ("recs.internal", "Recs.Internal:8000", True),
        ("recs.internal", "other.internal", False), ("fe80::1", "[fe80::1]:8000", True),
        ("0.0.0.0", "anything.example:8000", True), ("::", "10.1.2.3", True), ("0.0.0.0", None, False),
    ],
)
def test_admin_host_must_name_the_bound_address(bound, host_header, allowed):
    assert admin_host_allowed(bound, host_header) is allowed


def test_serve_checks_admin_hosts_against_its_host_flag(world, monkeypatch):  # noqa: F811
    seen = {}
    monkeypatch.setenv("RETRIEVAL_ADMIN_TOKEN", TOKEN)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: seen.update(host=self.config.app.state.admin_host))
    assert cli.main(["serve", "--bundle", str(world["bundle-a"]), "--host", "192.168.1.20"]) == 0
    assert seen == {"host": "192.168.1.20"}
    app = create_app(world["bundle-a"], admin_token=TOKEN, host="192.168.1.20")
    target = json.dumps({"bundle": str(world["bundle-b"])}).encode()
    auth = {"content-type": "application/json", "authorization": f"Bearer {TOKEN}"}
    refused = call(app, "POST", "/admin/reload", content=target, headers={**auth, "host": "127.0.0.1:8000"})
    assert refused.status_code == 403
    taken = call(app, "POST", "/admin/reload", content=target, headers={**auth, "host": "192.168.1.20:8000"})
    assert taken.status_code == 200 and taken.json()["bundle"] == "bundle-b"
