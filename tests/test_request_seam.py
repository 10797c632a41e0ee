"""Issue 33, the cost of a request: what the cheaper request path must keep.

A :class:`~prefetch.sources.http.transport.Route` holds one origin's pool and sends by target
(no URL parse or pool lookup per request): the request on the wire is the one :func:`send`
sends, byte for byte, through a proxy as well (a CONNECT tunnel for https, the absolute form for
http), and a pool the manager closed meanwhile is looked up again. The S3 bucket sends its
requests on it, signed by a signer that takes the request apart once: the same request line,
the same headers in the same order, the same signature as before.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
import urllib3

from prefetch import __version__
from prefetch.sources.http.transport import (
    Route,
    Sent,
    make_http_pool,
    send,
    watched_pools,
)
from prefetch.sources.s3.direct import (
    S3Bucket,
    StaticCredentials,
    StaticKeySigner,
    bucket_base_url,
    canonical_query,
    sign_v4,
)
from prefetch.support.errors import TlsError
from prefetch.support.settings import Proxies

from .fakes.forward_proxy import ForwardProxy
from .fakes.tlsserver import TLSThreadingHTTPServer
from .tls import TestCA

WHEN = datetime.datetime(2026, 12, 5, 4, 30, 59, 700_000, tzinfo=datetime.UTC)
KEYS = StaticCredentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "TOKEN")
BODY = bytes(range(256)) * 40
LISTING = (
    b'<?xml version="1.0" encoding="UTF-8"?>'
    b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
    b"<Name>bkt</Name><EncodingType>url</EncodingType><IsTruncated>false</IsTruncated>"
    b"<Contents><Key>m/a%20b</Key><Size>3</Size><ETag>&quot;abc&quot;</ETag></Contents>"
    b"</ListBucketResult>"
)


@dataclass
class Recorder:
    """What the server saw: each request line and its headers, in order, as sent."""

    seen: list[tuple[str, list[tuple[str, str]]]] = field(default_factory=list)


def _handler(recorder: Recorder) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            recorder.seen.append((self.requestline, list(self.headers.items())))
            body, headers = BODY, {"Content-Length": str(len(BODY))}
            if self.path.startswith("/slow"):
                time.sleep(1.5)  # past the read timeout the test gives
            if "list-type=2" in self.path:
                body, headers = LISTING, {"Content-Length": str(len(LISTING))}
            self.send_response(200)
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_HEAD = do_GET

    return Handler


@dataclass
class Server:
    url: str  #: scheme://host:port
    recorder: Recorder


def _serve(test_ca: TestCA | None, role: str = "s3") -> Iterator[Server]:
    recorder = Recorder()
    context = test_ca.server_context() if test_ca is not None else None
    httpd = TLSThreadingHTTPServer(("127.0.0.1", 0), _handler(recorder), context)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    port = httpd.server_address[1]
    url = test_ca.url(port, role) if test_ca is not None else f"http://127.0.0.1:{port}"
    try:
        yield Server(url, recorder)
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def plain() -> Iterator[Server]:
    yield from _serve(None)


@pytest.fixture
def tls(test_ca: TestCA) -> Iterator[Server]:
    yield from _serve(test_ca)


def _finish(answer: Sent) -> bytes:
    data = answer.read(1 << 20)
    answer.release()
    return data


# -- a route sends what send sends ---------------------------------------------------------------

HEADERS = {"Range": "bytes=0-99", "x-amz-checksum-mode": "ENABLED", "user-agent": "ua/1"}


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_route_puts_the_same_request_on_the_wire_as_send(
    scheme: str, plain: Server, tls: Server, test_ca: TestCA
) -> None:
    server = plain if scheme == "http" else tls
    pool = make_http_pool(4, proxies=Proxies({}), ca_certs=str(test_ca.ca_file))
    target = "/bkt/m/a%20b%2Bc/%C3%BC~.bin?partNumber=2"
    route = Route(pool, server.url)
    for timeout in (None, urllib3.Timeout(connect=5, read=7)):  # the pool's, or the caller's
        url = server.url + target
        assert _finish(send(pool, "GET", url, headers=HEADERS, timeout=timeout)) == BODY
        assert _finish(route.send("GET", target, headers=HEADERS, timeout=timeout)) == BODY
    old, new, old_timed, new_timed = server.recorder.seen
    assert new == old and new_timed == old_timed == old
    assert new[0] == f"GET {target} HTTP/1.1"
    assert [name for name, _ in new[1]][:2] == ["Host", "Accept-Encoding"]


def test_a_routes_read_timeout_is_the_callers_and_fails_as_sends(plain: Server) -> None:
    pool = make_http_pool(4, proxies=Proxies({}))
    timeout = urllib3.Timeout(connect=5, read=0.3)
    failed = []
    for request in (
        lambda: send(pool, "GET", f"{plain.url}/slow", headers={}, timeout=timeout),
        lambda: Route(pool, plain.url).send("GET", "/slow", headers={}, timeout=timeout),
    ):
        with pytest.raises(urllib3.exceptions.ReadTimeoutError) as timed_out:
            request()
        failed.append(str(timed_out.value))
    assert failed[0] == failed[1] and "read timeout=0.3" in failed[1]


def test_a_route_to_an_ipv6_literal_sends_what_send_sends() -> None:
    """The origin's host is taken apart once (brackets off for the pool, on in Host)."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")

    class V6Server(TLSThreadingHTTPServer):
        address_family = socket.AF_INET6

    recorder = Recorder()
    try:
        httpd = V6Server(("::1", 0), _handler(recorder))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://[::1]:{httpd.server_address[1]}"
        pool = make_http_pool(4, proxies=Proxies({}))
        assert _finish(send(pool, "GET", f"{url}/v6", headers={})) == BODY
        assert _finish(Route(pool, url).send("GET", "/v6", headers={})) == BODY
    finally:
        httpd.shutdown()
        httpd.server_close()
    old, new = recorder.seen
    assert new == old and ("Host", url.split("://", 1)[1]) in new[1]


class _CountingManager(urllib3.PoolManager):
    lookups = 0

    def connection_from_host(self, *args: Any, **kwargs: Any) -> Any:
        self.lookups += 1
        return super().connection_from_host(*args, **kwargs)


def test_a_route_looks_its_pool_up_once_and_again_only_after_it_was_closed(
    plain: Server,
) -> None:
    """The pool is held, not looked up per request. A manager of one pool that made one for
    another host (urllib3 2 drops the held one from its store, open) does not break the route;
    nor does a held pool closed and dropped (what urllib3 1 did to the pools it evicted): the
    route looks the origin's pool up again."""
    manager = _CountingManager(num_pools=1, retries=False)
    route = Route(watched_pools(manager), plain.url)
    for _ in range(3):
        assert _finish(route.send("GET", "/a", headers={})) == BODY
    assert manager.lookups == 1
    held = manager.connection_from_url(plain.url)  # the pool the route holds
    other = plain.url.replace("127.0.0.1", "localhost")  # another pool key, the same server
    assert _finish(send(manager, "GET", f"{other}/b", headers={})) == BODY  # drops the held one
    assert _finish(route.send("GET", "/c", headers={})) == BODY
    assert manager.lookups == 3  # the two above, none by the route
    held.close()
    assert _finish(route.send("GET", "/d", headers={})) == BODY
    assert manager.lookups == 4  # looked up again, once
    assert [line for line, _ in plain.recorder.seen] == [
        f"GET /{p} HTTP/1.1" for p in ("a", "a", "a", "b", "c", "d")
    ]


def test_a_route_to_an_http_origin_through_a_proxy_sends_the_absolute_form_there(
    plain: Server,
) -> None:
    with ForwardProxy() as proxy:
        pool = make_http_pool(4, proxies=Proxies({"http": proxy.url}, ""))
        assert _finish(Route(pool, plain.url).send("GET", "/x?y=1", headers={})) == BODY
        assert proxy.through(plain.url) == 1 and proxy.methods["GET"] == 1
        assert plain.recorder.seen[0][0] == "GET /x?y=1 HTTP/1.1"  # the proxy forwarded it
        bypassing = make_http_pool(4, proxies=Proxies({"http": proxy.url}, "127.0.0.1"))
        assert _finish(Route(bypassing, plain.url).send("GET", "/z", headers={})) == BODY
        assert proxy.through(plain.url) == 1  # NO_PROXY: direct


def test_a_route_through_request_sends_the_url_as_written() -> None:
    """A client that is not urllib3's (and the forwarding-proxy case, which goes the same way)
    gets the origin as the caller wrote it plus the target: no default port written out (a
    forwarding proxy would put it in the Host header, which the signature does not cover)."""
    asked: list[tuple[str, str, dict[str, Any]]] = []

    class Canned:
        def request(self, method: str, url: str, **kwargs: Any) -> Any:
            asked.append((method, url, kwargs))
            return urllib3.HTTPResponse(body=b"", status=204, preload_content=False)

    route = Route(Canned(), "http://s3.example/")
    answer = route.send("HEAD", "/bkt/k%20?partNumber=1", headers={"a": "b"}, timeout=3.0)
    assert answer.status == 204
    assert asked == [
        ("HEAD", "http://s3.example/bkt/k%20?partNumber=1",
         {"headers": {"a": "b"}, "preload_content": False, "redirect": False, "retries": False,
          "decode_content": False, "timeout": 3.0}),
    ]  # fmt: skip


def test_a_route_to_an_https_origin_through_a_proxy_tunnels(tls: Server, test_ca: TestCA) -> None:
    with ForwardProxy() as proxy:
        proxies = Proxies({"https": proxy.url}, "")
        pool = make_http_pool(4, proxies=proxies, ca_certs=str(test_ca.ca_file))
        route = Route(pool, tls.url)
        for _ in range(2):
            assert _finish(route.send("GET", "/t", headers={})) == BODY
        assert proxy.methods == {"CONNECT": 1}  # one tunnel, reused; no request seen in it
        target = tls.url.split("://", 1)[1]
        deadline = time.monotonic() + 10  # the relay counts the bytes after it passed them on
        while proxy.tunneled[target] <= 2 * len(BODY) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.tunneled[target] > 2 * len(BODY)


def test_a_route_refused_by_tls_says_what_send_says(tls: Server, tmp_path: Path) -> None:
    other = TestCA.create(tmp_path)  # a CA that did not sign the server's certificate
    pool = make_http_pool(4, proxies=Proxies({}), ca_certs=str(other.ca_file))
    with pytest.raises(TlsError) as by_send:
        send(pool, "GET", f"{tls.url}/x", headers={})
    with pytest.raises(TlsError) as by_route:
        Route(pool, tls.url).send("GET", "/x", headers={})
    assert str(by_route.value) == str(by_send.value)
    assert "certificate verify failed" in str(by_route.value)


# -- the S3 bucket on its route --------------------------------------------------------------------


def _what_was_sent_before(
    url: str, method: str, headers: dict[str, str], region: str
) -> dict[str, str]:
    """The headers the bucket sent before issue 33 round 2: sign_v4 of the whole URL, then the
    user agent."""
    signed = sign_v4(method, url, KEYS, region, now=WHEN, headers=headers)
    return {**signed, "user-agent": f"model-prefetch/{__version__}"}


def test_the_bucket_sends_the_request_it_sent_before_byte_for_byte(plain: Server) -> None:
    """A ranged pinned GET, a part HEAD and a listing page with static keys: the request line
    and every header, in order, as the path through ``send`` and ``sign_v4`` put them."""
    pool = make_http_pool(4, proxies=Proxies({}))
    base = bucket_base_url("bkt", plain.url, "eu-west-1")
    bucket = S3Bucket(
        "bkt", base_url=lambda region: bucket_base_url("bkt", plain.url, region),
        region="eu-west-1", signer=StaticKeySigner(KEYS, clock=lambda: WHEN), http=pool,
        on_error=lambda what, answer: AssertionError(what),
    )  # fmt: skip
    ranged = {"Range": "bytes=0-99", "If-Match": '"0123abc"', "x-amz-checksum-mode": "ENABLED"}
    _finish(bucket.send("GET", "m/a b+c/ü~.bin", headers=ranged))
    bucket.send("HEAD", "m/w.bin", headers={}, query="partNumber=1").release()
    page = bucket.list_objects_v2(Bucket="bkt", Prefix="m/a b")
    assert [o["Key"] for o in page["Contents"]] == ["m/a b"]
    listing = canonical_query(
        {"list-type": "2", "prefix": "m/a b", "max-keys": "1000", "encoding-type": "url"}
    )
    expected = [
        ("GET", "/bkt/m/a%20b%2Bc/%C3%BC~.bin", ranged),
        ("HEAD", "/bkt/m/w.bin?partNumber=1", {}),
        ("GET", f"/bkt?{listing}", {}),
    ]
    host = plain.url.split("://", 1)[1]
    for (line, got), (method, target, headers) in zip(plain.recorder.seen, expected, strict=True):
        before = _what_was_sent_before(plain.url + target, method, headers, "eu-west-1")
        before_sent = [("Host", host), ("Accept-Encoding", "identity"), *before.items()]
        assert line == f"{method} {target} HTTP/1.1"
        assert got == before_sent
        names = [name.lower() for name, _ in got]
        assert names == [
            "host", "accept-encoding", *(n.lower() for n in headers), "x-amz-content-sha256",
            "x-amz-date", "x-amz-security-token", "authorization", "user-agent",
        ]  # fmt: skip
    assert base == f"{plain.url}/bkt/"


def test_a_signer_that_is_not_static_is_asked_for_the_whole_url(plain: Server) -> None:
    """botocore's signer takes the URL: the one the bucket sent before (base URL, encoded key,
    query), and its headers go out as it returned them."""
    asked: list[str] = []

    class Recording:
        def sign(
            self, method: str, url: str, region: str, headers: Any
        ) -> dict[str, str]:  # fmt: skip
            asked.append(f"{method} {url} {region}")
            return {"authorization": "by-botocore", **headers}

    pool = make_http_pool(4, proxies=Proxies({}))
    bucket = S3Bucket(
        "bkt", base_url=lambda _region: f"{plain.url}/bkt/", region="us-west-2",
        signer=Recording(), http=pool, on_error=lambda what, answer: AssertionError(what),
    )  # fmt: skip
    _finish(bucket.send("GET", "m/a b.bin", headers={"Range": "bytes=0-1"}, query="partNumber=3"))
    assert asked == [f"GET {plain.url}/bkt/m/a%20b.bin?partNumber=3 us-west-2"]
    assert ("authorization", "by-botocore") in [
        (k.lower(), v) for k, v in plain.recorder.seen[0][1]
    ]


# -- the static signer ----------------------------------------------------------------------------


def test_the_static_signer_signs_as_sign_v4_at_every_second_it_keeps_the_date_of() -> None:
    """X-Amz-Date is formatted once per second (and the signing key once per day): a clock
    stepping 0.4 s across second, minute and day boundaries signs, at each step, what sign_v4
    signs at that time (sign_v4 is botocore's signature, see test_s3_direct.py)."""
    start = datetime.datetime(2026, 12, 5, 23, 59, 58, 100_000, tzinfo=datetime.UTC)
    now = [start]
    signer = StaticKeySigner(KEYS, clock=lambda: now[0])
    url = "https://bkt.s3.eu-west-1.amazonaws.com/m/a%20b.bin?partNumber=1"
    headers = {"Range": "bytes=0-9", "x-amz-checksum-mode": "ENABLED"}
    dates = []
    for step in range(10):
        now[0] = start + datetime.timedelta(seconds=0.4 * step)
        got = signer.sign("GET", url, "eu-west-1", headers)
        assert got == sign_v4("GET", url, KEYS, "eu-west-1", now=now[0], headers=headers)
        parts = signer.sign_parts(
            "GET", "bkt.s3.eu-west-1.amazonaws.com", "/m/a%20b.bin", "partNumber=1",
            "eu-west-1", headers,
        )  # fmt: skip
        assert parts == got
        dates.append(got["x-amz-date"])
    assert dates[0] == "20261205T235958Z" and dates[-1] == "20261206T000001Z"
    assert sorted(set(dates)) == [
        "20261205T235958Z", "20261205T235959Z", "20261206T000000Z", "20261206T000001Z"
    ]  # fmt: skip
