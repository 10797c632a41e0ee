"""The one HTTP layer of the sources: status table, Retry-After, redaction, body reader, proxies."""

from __future__ import annotations

import email.utils
import http.server
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3

from prefetch.sources.http.transport import (
    BodyReader,
    ProxyRouter,
    error_class,
    http_client_response,
    make_http_pool,
    no_proxy_matches,
    parse_retry_after,
    redact_url,
    status_error,
)
from prefetch.support import settings
from prefetch.support.errors import (
    AccessDeniedError,
    NotFoundError,
    RepoNotFoundError,
    RevisionNotFoundError,
    SourceChangedError,
    SourceError,
    TransientSourceError,
)

# -- the status table ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "code", "credentials", "expected"),
    [
        (401, None, True, AccessDeniedError),
        (401, None, False, AccessDeniedError),
        (403, None, True, AccessDeniedError),
        (404, None, True, NotFoundError),
        (410, None, True, NotFoundError),
        (408, None, True, TransientSourceError),
        (412, None, True, SourceChangedError),
        (416, None, True, SourceChangedError),
        (429, None, True, TransientSourceError),
        (500, None, True, TransientSourceError),
        (503, "RepoNotFound", True, TransientSourceError),  # a retryable status wins
        (400, None, True, SourceError),
        (200, None, True, SourceError),  # a ranged GET answered without a range
        (403, "GatedRepo", True, AccessDeniedError),
        (401, "GatedRepo", False, AccessDeniedError),
        (404, "RepoNotFound", True, RepoNotFoundError),
        (401, "RepoNotFound", True, RepoNotFoundError),  # the token cannot see it
        (401, "RepoNotFound", False, AccessDeniedError),  # private, gated or absent: log in
        (404, "RevisionNotFound", True, RevisionNotFoundError),
        (404, "EntryNotFound", True, NotFoundError),
        (404, "SomethingNew", True, NotFoundError),  # an unknown code: the status decides
    ],
)
def test_each_status_and_hub_error_code_maps_to_its_error_class(
    status: int, code: str | None, credentials: bool, expected: type[SourceError]
) -> None:
    assert error_class(status, code, credentials=credentials) is expected


def test_a_throttled_answer_carries_the_servers_retry_after() -> None:
    error = status_error(429, "GET x: rate limited", retry_after="7")
    assert isinstance(error, TransientSourceError) and error.retry_after == 7.0
    denied = status_error(403, "GET x: refused", hint="use a token")
    assert type(denied) is AccessDeniedError and denied.hint == "use a token"


def test_retry_after_is_read_in_seconds_and_as_an_http_date() -> None:
    assert parse_retry_after("3") == 3.0 and parse_retry_after(" 0.5 ") == 0.5
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    assert parse_retry_after("-4") == 0.0
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 < (parse_retry_after(later) or 0) <= 31
    earlier = email.utils.formatdate(time.time() - 300, usegmt=True)
    assert parse_retry_after(earlier) == 0.0


def test_a_signed_url_loses_its_credentials_and_signature_in_messages() -> None:
    url = (
        "https://user:secret@cdn.example.com:8443/repos/ab/blob?Expires=1700000000"
        "&Signature=c2lnbmF0dXJl&Key-Pair-Id=K2ABCDEF"
    )
    assert redact_url(url) == "https://cdn.example.com:8443/repos/ab/blob"
    # a token in the path is masked by the package's one redaction too
    leaked = redact_url("https://mirror.example/hf_abcdefghijklmnopqrstuv/x")
    assert "hf_abcdefghijklmnopqrstuv" not in leaked and leaked.endswith("/x")


# -- the body reader, against a server on 127.0.0.1 ----------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    #: path -> (headers, body chunks, wait before closing); set by the test
    routes: dict[str, tuple[dict[str, str], list[bytes], threading.Event | None]] = {}

    def do_GET(self) -> None:
        headers, chunks, hold = self.routes[self.path]
        self.send_response(206)
        for key, value in headers.items():
            self.send_header(key, value)
        if "Content-Length" not in headers:
            self.send_header("Connection", "close")
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(chunk)
            self.wfile.flush()
        if hold is not None:
            hold.wait(10)
        if "Content-Length" not in headers:
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        _Handler.routes = {}


def _open(
    base: str, path: str, length: int, *, length_known: bool, closed: list[bool]
) -> BodyReader:
    pool = urllib3.PoolManager(retries=False)
    resp = pool.request("GET", base + path, preload_content=False, decode_content=False)

    def finish(reusable: bool) -> None:
        closed.append(reusable)
        resp.release_conn() if reusable else resp.close()

    return BodyReader(
        resp,
        f"GET {path}",
        length,
        raw=http_client_response(resp),
        socket_owner=resp,
        on_close=finish,
        length_known=length_known,
    )


def _read_all(reader: BodyReader, size: int = 1 << 16) -> bytes:
    buf = bytearray(size)
    out = bytearray()
    while n := reader.readinto(memoryview(buf)):
        out += buf[:n]
    return bytes(out)


def test_the_reader_reads_the_range_exactly_and_hands_the_connection_back(server: str) -> None:
    body = bytes(range(256)) * 40
    _Handler.routes["/exact"] = (
        {"Content-Length": str(len(body))},
        [body[:1000], body[1000:]],
        None,
    )
    closed: list[bool] = []
    reader = _open(server, "/exact", len(body), length_known=True, closed=closed)
    assert reader._raw is not None  # the http.client response: no copy through urllib3
    assert _read_all(reader, 4096) == body
    assert reader.readinto(memoryview(bytearray(10))) == 0  # nothing past the range
    reader.close()
    assert closed == [True]


@pytest.mark.parametrize(
    ("sent", "error", "message"),
    [
        (b"x" * 90, TransientSourceError, "ended 10 bytes before the end of the range"),
        (b"x" * 107, SourceChangedError, "longer than the range"),
    ],
)
def test_a_body_without_length_must_end_exactly_where_the_range_does(
    server: str, sent: bytes, error: type[SourceError], message: str
) -> None:
    _Handler.routes["/chunk"] = ({}, [sent], None)
    closed: list[bool] = []
    reader = _open(server, "/chunk", 100, length_known=False, closed=closed)
    with pytest.raises(error, match=message):
        _read_all(reader)
    reader.close()
    assert closed == [False]  # a connection that misbehaved is never reused


def test_abort_wakes_a_read_blocked_in_another_thread(server: str) -> None:
    hold = threading.Event()
    _Handler.routes["/stall"] = ({"Content-Length": "100"}, [b"y" * 10], hold)
    closed: list[bool] = []
    reader = _open(server, "/stall", 100, length_known=True, closed=closed)
    assert reader.readinto(memoryview(bytearray(10))) == 10
    outcome: list[BaseException | int] = []
    started = threading.Event()

    def blocked_read() -> None:
        started.set()
        try:
            outcome.append(reader.readinto(memoryview(bytearray(100))))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=blocked_read, daemon=True)
    thread.start()
    started.wait(5)
    time.sleep(0.2)  # let the read block on the socket (the assertion below does not time it)
    reader.abort()
    thread.join(10)
    hold.set()
    assert not thread.is_alive(), "abort() did not wake the blocked read"
    assert len(outcome) == 1 and isinstance(outcome[0], SourceError)
    reader.close()
    assert closed == [False]


def test_abort_shuts_the_socket_down_for_good(server: str) -> None:
    hold = threading.Event()
    _Handler.routes["/later"] = ({"Content-Length": "50"}, [b"z" * 5], hold)
    closed: list[bool] = []
    reader = _open(server, "/later", 50, length_known=True, closed=closed)
    raw = reader._raw
    assert raw is not None
    sock = getattr(getattr(raw.fp, "raw", None), "_sock", None)  # http.client's own socket
    assert isinstance(sock, socket.socket)
    reader.abort()
    hold.set()
    with pytest.raises(OSError):
        sock.send(b"more")  # shut down for writing too: nothing else goes over it
    reader.close()


# -- proxies -------------------------------------------------------------------------------------


def _router(environ: dict[str, str]) -> ProxyRouter:
    pool = make_http_pool(4, proxies=settings.proxies(environ))
    assert isinstance(pool, ProxyRouter)
    return pool


def test_requests_go_through_the_schemes_proxy_unless_no_proxy_names_the_host() -> None:
    router = _router(
        {"HTTPS_PROXY": "http://proxy.invalid:3128", "NO_PROXY": "internal.example, .corp.test"}
    )
    via_proxy = router.manager_for("https://huggingface.co/x")
    assert isinstance(via_proxy, urllib3.ProxyManager)
    assert via_proxy.proxy is not None and via_proxy.proxy.host == "proxy.invalid"
    direct = router.manager_for("https://internal.example/x")
    assert not isinstance(direct, urllib3.ProxyManager)
    assert router.manager_for("https://a.corp.test/x") is direct
    assert router.manager_for("https://bucket.internal.example/x") is direct  # a subdomain
    assert router.manager_for("http://huggingface.co/x") is direct  # no HTTP_PROXY
    assert isinstance(router.manager_for("https://notinternal.example/x"), urllib3.ProxyManager)


def test_without_proxies_the_pool_is_a_plain_pool_manager() -> None:
    pool = make_http_pool(4, proxies=settings.proxies({}))
    assert type(pool) is urllib3.PoolManager


@pytest.mark.parametrize(
    ("host", "no_proxy", "bypassed"),
    [
        ("a.example", "*", True),
        ("a.example", "a.example", True),
        ("A.Example", ".a.example", True),
        ("x.a.example", "a.example", True),
        ("ba.example", "a.example", False),
        ("a.example", "", False),
        ("127.0.0.1", "localhost,127.0.0.1", True),
    ],
)
def test_no_proxy_matches_a_name_and_its_subdomains(
    host: str, no_proxy: str, bypassed: bool
) -> None:
    assert no_proxy_matches(host, no_proxy) is bypassed


def test_credentials_go_only_to_their_origin() -> None:
    """The seam's redirect rule: credentials (the Hub's token) reach only the origin they are
    for; a redirect or next-page link to another host, scheme or port never gets them."""
    from prefetch.sources.http.transport import send

    sent: list[tuple[str, dict[str, str]]] = []

    class Canned:
        def request(self, method: str, url: str, **kwargs: Any) -> Any:
            sent.append((url, kwargs["headers"]))

            class Answer:
                status = 200
                headers: dict[str, str] = {}

            return Answer()

    token = {"Authorization": "Bearer hf_secret"}
    origin = "https://hub.example"
    for url in [
        "https://hub.example/api/models/a/b",
        "https://HUB.example:443/x",
        "https://cdn.example/blob",
        "http://hub.example/x",
        "https://hub.example:8443/x",
        "https://hub.example.evil/x",
    ]:
        send(Canned(), "GET", url, headers={"Range": "bytes=0-1"}, credentials=token,
             credentials_origin=origin)  # fmt: skip
    given = [url for url, headers in sent if "Authorization" in headers]
    assert given == ["https://hub.example/api/models/a/b", "https://HUB.example:443/x"]
    assert all(headers["Range"] == "bytes=0-1" for _, headers in sent)
